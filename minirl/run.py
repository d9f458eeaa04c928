"""A run: generate → score → train → push adapter → repeat, readable top to bottom in `Run._loop`.

`Run(cfg).run()` blocks; `Run(cfg).start()` runs in a background thread (a notebook kernel stays responsive)
with `pause()`, `resume()`, `stop()` and `wait()`. Every event goes to `out_dir/metrics.jsonl`; checkpoints go to
`out_dir/checkpoints` (see `checkpoint.py`), and `Run(cfg, resume=True)` continues from the latest one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import data as D
from . import lifecycle
from .checkpoint import (Checkpoint, atomic_text, check_out_dir, clear_run, lock_out_dir, mark_run, past_steps,
                         restore, resume_point, save_adapter, save_checkpoint)
from .config import Config, ConfigError, parse_cores
from .envs import resolve_env
from .episodes import make_runner
from .evaluation import evaluate
from .generators import Generator, make_generator, pick_backend
from .metrics import MetricsLog, rollout_metrics, sample_rows, step_summary
from .models import cpu_dtype_warning, resolve_model
from .rewards import Scorer, check_columns
from .rewards.scorer import failure_kinds
from .rollout import Pipeline
from .sync import SyncStats, SyncVerificationError, Verification, make_probe, verify
from .tasks import TASKS
from .trackers import check_tracker, make_tracker, scalars
from .trainer import Trainer
from .types import Episode, SamplingParams, ScoredGroup


def cpu_split(cfg: Config) -> tuple[str | None, int]:
    """On CPU: the cores vLLM's worker is bound to, and the trainer's torch thread count."""
    n = os.cpu_count() or 1
    gen = None if cfg.gen_devices == "auto" else cfg.gen_devices
    if cfg.train_devices != "auto":
        train = len(parse_cores(cfg.train_devices))
    elif cfg.max_async_steps == 0 or n == 1:
        train = n  # synchronous: the two sides take turns, each may use every core
    else:
        train = max(1, n // 2)
        gen = gen or (f"0-{n - train - 1}" if n - train > 1 else "0")
    return gen, train


def pick_async_steps(cfg: Config, backend: str, cuda_devices: int) -> tuple[int, str]:
    """(K, why) for `max_async_steps`; 'auto' by the rule measured with `minirl bench pipeline` and `minirl bench
    learning` (README, "Measured here"):
    - generation and training on GPUs of their own (vLLM, 2+ GPUs): 1. Each device would idle while the other
      works; ahead by one step both stay busy. Reasoned, not measured: no GPU run yet.
    - otherwise (one device shared by both phases, e.g. a CPU): 0. On 2 cores K = 1 splits the cores. Per step it
      lost on the long-tail workload (0.90x) and tied or won on the demo's first steps (1.05-1.18x), where
      generation and training take about as long; over whole demo runs its 30 steps took longer (training grows
      during a run, and on its one core it becomes the slower side), and it reached 0.70 held-out accuracy later
      on one seed of two and on the other got there where the synchronous run never did. It paid where rewards
      wait (a judge with 0.5 s latency per call: 1.20-1.33x), which a config cannot tell in advance: set
      max_async_steps=1 there. The bound behind it
      (`bench pipeline`'s `overlap_ceiling`): an asynchronous step takes at least its slower side's time on that
      side's share of the machine.
    """
    k = cfg.max_async_steps
    if k != "auto":
        return int(k), f"max_async_steps={k}"
    if backend in ("vllm", "vllm-server") and cuda_devices >= 2:
        return 1, f"auto: vLLM with {cuda_devices} GPUs, generation and training on devices of their own"
    return 0, ("auto: generation and training share " + ("one GPU" if cuda_devices else "the CPU cores")
               + ": synchronous (set max_async_steps=1 when rewards wait, e.g. a remote judge)")


class Run:
    """`resume=True` continues the run in out_dir from its latest checkpoint (the log is appended to);
    `overwrite=True` replaces the run in out_dir. Without either, a run refuses an out_dir that holds one."""

    def __init__(self, config: Config | None = None, *, data: Any = None, eval_data: Any = None,
                 rewards: Sequence[str | Callable] | None = None, env: Any = None, resume: bool = False,
                 overwrite: bool = False, **overrides: Any):
        self.cfg = (config or Config()).replace(**overrides) if overrides else (config or Config())
        self._reward_refs = list(rewards) if rewards is not None else list(self.cfg.rewards)
        # --- environments (minirl/envs.py, minirl/episodes.py): `env` is a class or factory (one Env per
        # episode), a built-in task's name or 'module:Class' (also `cfg.env`). Its first reward is "env" (the
        # summed step rewards); the arithmetic default reward is not added to it.
        self._env = None
        if env is not None or self.cfg.env is not None:
            env_name, self._env = resolve_env(env if env is not None else self.cfg.env)
            if rewards is None and self._reward_refs == Config().rewards:
                self._reward_refs = []
            self._reward_refs = ["env", *[r for r in self._reward_refs if r != "env"]]
            self.cfg = self.cfg.replace(env=env_name)
            rewards = self._reward_refs
        # --- end environments
        if rewards is not None:
            self.cfg = self.cfg.replace(rewards=[r if isinstance(r, str) else r.__name__ for r in rewards])
        self._data, self._eval_data = data, eval_data
        self.resuming, self.overwrite = resume, overwrite
        self.out = Path(self.cfg.out_dir)
        self.history: list[dict] = []
        self.summary: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._thread: threading.Thread | None = None
        self.trainer: Trainer | None = None
        self.generator: Generator | None = None
        self.rollouts: Any = None  # the generator, or (env runs) the episode runner on it
        self.tracker = None
        self.on_step: list[Callable[[dict], None]] = []
        self.on_eval: list[Callable[[dict], None]] = []  # {"step", "done", "total"} as it goes, then the eval event
        k, self.async_why = pick_async_steps(self.cfg, pick_backend(self.cfg.backend, torch.cuda.is_available())[0]
                                             if self.cfg.backend == "auto" else self.cfg.backend,
                                             torch.cuda.device_count() if torch.cuda.is_available() else 0)
        self.cfg = self.cfg.replace(max_async_steps=k)
        self._use_pipeline = k > 0
        self.checkpoint: Checkpoint | None = None  # the one this run resumed from
        self.start_step = self.next_step = 0  # first step this process trains; steps done so far
        self._between_steps = True  # the trainer's state is a whole number of steps (a checkpoint may be taken)
        self._claimed = False  # out_dir is this run's to write (set once everything before the loop worked)
        self._lock = None  # held while this run writes into out_dir
        self._acc_before: float | None = None
        self._cpu_before: tuple[int, set[int] | None] | None = None  # (torch threads, cores) before set-up, on CPU

    # --- set-up --------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Check out_dir and every input, load the model and the generator, then claim out_dir. Everything that
        can fail on a bad input fails before the model loads; a failure writes nothing into out_dir."""
        check_out_dir(self.out, self.resuming, self.overwrite)
        lifecycle.sweep_stale()  # shared-memory files and folders that a killed run of ours could not remove
        if self.resuming:
            self.checkpoint, self.cfg = resume_point(self.out, self.cfg, self.SAFE_KNOBS)
            self.start_step = self.next_step = self.checkpoint.step if self.checkpoint else 0
        try:
            self.load()
            self._claim()
        except BaseException:
            self.close()
            raise

    def load(self) -> None:
        """Check the inputs (rewards, data, tracker, model) and load the model, the prompts and the generator, from
        the checkpoint being resumed if any. Writes nothing: `setup` is out_dir's checks, `load`, then the claim."""
        c = self.cfg
        check_tracker(c.report_to)
        self.scorer = Scorer.from_config(self._reward_refs, c.reward_weights, c.reward_timeout_s, c.scale_adv_by_std,
                                         c.reward_workers, c.reward_clip, c.reward_memory_mb)
        data = self._data if self._data is not None else c.data
        eval_data = self._eval_data if self._eval_data is not None else c.eval_data
        if self._env is not None and isinstance(data, str) and data == "arithmetic" and c.env in TASKS:
            data, held = TASKS[c.env].splits(c.eval_size, c.seed)  # a built-in env task's own rows
            eval_data = held if eval_data is None else eval_data
        builtin = isinstance(data, str) and data == "arithmetic"
        data = data if builtin else D.load_rows(data, c.prompt_column)  # the rows' own errors come first
        cols = [k for k in (D.arithmetic_rows(1, 0) if builtin else data)[0] if k != c.prompt_column]
        if self._env is not None:  # an episode's reward keywords: its transcript and env reward
            cols += list(Episode((), (), 0).columns())
        for name, fn in self.scorer.rewards:
            check_columns(fn, name, cols)
        self.splits = D.make_splits(data, eval_data,
                                    prompt_column=c.prompt_column, eval_fraction=c.eval_fraction,
                                    eval_size=c.eval_size, seed=c.seed)
        if self.checkpoint and self.checkpoint.state.get("data") != self.splits.fingerprint:
            raise ConfigError(f"the data differs from the data {str(self.out)!r} was trained on (its checkpoint "
                              "records another fingerprint); resume with the same data, or start a new run")
        if not self.splits.eval:
            print(f"minirl: {self.splits.note}: held-out accuracy is not measured", flush=True)
        self.scorer.start()  # reward workers up before the model loads: a reward that cannot reach them fails now
        self.backend, self.backend_why = pick_backend(c.backend, torch.cuda.is_available())
        if c.inflight != "continue" and self.backend != "vllm":
            raise ValueError(f"inflight={c.inflight!r} needs the vLLM engine (backend='vllm'); the transformers "
                             "backend finishes in-flight sequences on their adapter (inflight='continue')")
        resolve_model(c.model)  # a model that cannot be found fails here, within seconds
        if not torch.cuda.is_available() and (note := cpu_dtype_warning(c.dtype)):
            print(note, flush=True)
        if torch.cuda.is_available():
            gen_devices = None if c.gen_devices == "auto" else c.gen_devices.replace("cuda:", "")
            train_device = "cuda" if c.train_devices == "auto" else c.train_devices
        else:
            gen_devices, train_threads = cpu_split(c)
            self._cpu_before = (torch.get_num_threads(),
                                os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None)
            torch.set_num_threads(train_threads)
            train_device = "cpu"
        self.trainer = Trainer(c, device=train_device)
        tok = self.trainer.tokenizer
        sp = self.splits
        if self._env is None:
            self.train_prompts = D.to_prompts(sp.train, tok, c.prompt_column, c.system_prompt, c.max_prompt_tokens,
                                              indices=sp.train_ids)
            self.eval_prompts = D.to_prompts(sp.eval, tok, c.prompt_column, c.system_prompt, c.max_prompt_tokens,
                                             indices=sp.eval_ids)
        if self.checkpoint is not None:
            restore(self.checkpoint, self.trainer)
            self.trainer.reconfigure(c)
        self.generator, self.sync, self._sync_why = make_generator(c, self.trainer, self.backend,
                                                                   self._use_pipeline, gen_devices)
        # what samples the groups: the generator, or (env runs) the episode runner on it (minirl/episodes.py)
        self.rollouts = self.generator
        if self._env is not None:  # its episodes open with reset(row); an eval row's index follows the train rows'
            self.rollouts = make_runner(self.generator, self._env, tok, c.max_turns, c.max_episode_tokens)
            self.train_prompts = self.rollouts.prompts(sp.train, c.prompt_column, c.max_prompt_tokens,
                                                       indices=sp.train_ids)
            first = 1 + max(sp.train_ids, default=-1)  # (the runner finds each prompt's row by its index)
            self.eval_prompts = self.rollouts.prompts(sp.eval, c.prompt_column, c.max_prompt_tokens,
                                                      indices=[first + i for i in range(len(sp.eval))])
        if not torch.cuda.is_available() and c.train_devices != "auto" and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, parse_cores(c.train_devices))  # this (trainer) thread; after the engine spawned
        if self.checkpoint is not None:
            self.sync.push(self.trainer, self.generator)  # the generator serves the restored policy
        position = self.checkpoint.state["data_position"] if self.checkpoint else 0
        self.stream = D.PromptStream(self.train_prompts, c.seed, position)
        self._probe, self._verified = None, None
        if c.verify_sync and self.sync.transport != "shared":  # "shared": the generator runs on the trainer's model
            prompt = self.train_prompts[0].token_ids  # room: the engine's max_model_len is prompt + max_tokens
            n = min(32, c.max_prompt_tokens + c.max_tokens - len(prompt))
            self._probe = make_probe(self.trainer.model, prompt, n, c.seed, tok.all_special_ids, len(tok))
            self._verified = self._verify()  # before any push: the engine serves the trainer's (restored) policy

    def _claim(self) -> None:
        """Make out_dir this run's: replace an old run (overwrite), or continue its log (resume)."""
        c = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = lock_out_dir(self.out)
        if self.overwrite:
            clear_run(self.out)
        mark_run(self.out)
        self.tracker = make_tracker(c.report_to, self.out, c.to_dict(), self.resuming)
        info = dict(config=c.to_dict(), backend=self.backend, backend_why=self.backend_why, async_why=self.async_why,
                    transport=self.sync.transport, transport_why=self._sync_why, reward_versions=self.scorer.versions,
                    train_prompts=len(self.train_prompts), eval_prompts=len(self.eval_prompts), eval=self.splits.note,
                    **({"servers": self.generator.servers()} if hasattr(self.generator, "servers") else {}))
        if self.resuming:
            self.history, self._acc_before = past_steps(self.out, self.start_step)
        self.log = MetricsLog(self.out / "metrics.jsonl", append=self.resuming)
        if hasattr(self.generator, "on_event"):  # vLLM servers: down, restarted
            self.generator.on_event = lambda kind, **kw: self.log.log("server", kind=kind, **kw)
        self._claimed = True
        if self.resuming:
            self.log.log("resume", step=self.start_step, version=self.trainer.version,
                         checkpoint=str(self.checkpoint.path) if self.checkpoint else None, **info)
        else:
            atomic_text(self.out / "config.yaml", c.to_yaml())
            self.log.log("start", **info)

    def close(self) -> None:
        """Close what `load` opened (after a failed set-up, or an evaluation without a run: `minirl eval`)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()
        scorer, self.scorer = getattr(self, "scorer", None), None
        if scorer is not None:
            scorer.close()
        for name in ("generator", "sync", "tracker"):
            obj = getattr(self, name, None)
            setattr(self, name, None)
            if obj is not None:
                obj.close()
        self._restore_cpu()

    def _restore_cpu(self) -> None:
        """Give this thread back the torch thread count and cores it had before set-up: the next run in this
        process (a notebook's, a benchmark's next variant) must not inherit this run's split."""
        before, self._cpu_before = self._cpu_before, None
        if before is not None:
            torch.set_num_threads(before[0])
            if before[1] is not None:
                os.sched_setaffinity(0, before[1])

    def _sampling(self, step: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(c.temperature, c.top_p, c.top_k, c.max_tokens, seed=c.seed * 100_003 + step)

    # --- the loop ------------------------------------------------------------------------------------------
    def _loop(self, pipeline: bool) -> dict[str, Any]:
        c, log = self.cfg, self.log
        if self.history or self._acc_before is not None:  # resumed: measured before the first step already
            acc0 = self._acc_before
        else:
            acc0 = self._evaluate(0)
        self.summary["eval_accuracy_before"] = acc0
        self._pos0 = self.stream.position
        batches = self._pipeline_batches() if pipeline else self._sync_batches()
        t_prev = time.perf_counter()
        for step, scored, gen in batches:
            self.scorer.watch(scored)  # a reward failing every call for steps in a row stops the run, with the fix
            stale = [self.trainer.version - v for g in scored for x in g.group.completions for v in x.sampled_versions]
            gen.update({"staleness/mean": _mean(stale), "staleness/max": max(stale, default=None)})
            t1 = time.perf_counter()
            self._between_steps = False
            tm = self.trainer.step(scored)
            t2 = time.perf_counter()
            sync = self._push(scored)
            t3 = time.perf_counter()
            self._between_steps, self.next_step = True, step + 1
            if pipeline:
                self.pipeline.signal_version()
                self.pipeline.timeline.add_train(t1, t3)
            else:
                self.log.log("timeline", side="train", start=t1 - self._t_start, end=t3 - self._t_start)
            dt, t_prev = t3 - t_prev, t3
            rec = {"step": step, **rollout_metrics(scored, c.max_tokens), **tm, **gen,
                   "reward/failure_kinds": failure_kinds(scored),
                   "throughput/train_tok_s": tm.get("train/tokens", 0) / max(t2 - t1, 1e-9),
                   **sync.metrics(), "time/step_s": dt, "prompt_ids": [g.group.prompt.index for g in scored]}
            rec.setdefault("busy/train", (t3 - t1) / dt)
            if "busy/gen" not in rec:
                rec["busy/gen"] = gen["time/gen_s"] / dt
            self.history.append(log.log("step", **rec))
            if self.tracker is not None:
                self.tracker.log(scalars(rec), step)
            self._log_samples(step, scored)
            for cb in self.on_step:
                cb(rec)
            if c.eval_every and (step + 1) % c.eval_every == 0 and step + 1 < c.steps:
                t_eval = time.perf_counter()
                self._evaluate(step + 1)
                t_prev += time.perf_counter() - t_eval  # the next step's time/step_s leaves the evaluation out
            if c.checkpoint_every and (step + 1) % c.checkpoint_every == 0 and step + 1 < c.steps:
                self._checkpoint()
        if pipeline:
            self._close_pipeline()
        acc1 = self._evaluate(self.next_step)
        self.summary.update({
            **step_summary(self.history), "backend": self.backend, "backend_why": self.backend_why,
            "transport": self.sync.transport, "max_async_steps": c.max_async_steps, "async_why": self.async_why,
            "eval_accuracy_after": acc1, "eval_size": len(self.eval_prompts), "eval": self.splits.note,
            **({"resumed_from_step": self.start_step} if self.resuming else {}),
            **(self.generator.stats() if hasattr(self.generator, "stats") else {}),  # vLLM servers: count, restarts
        })
        return self.summary

    def _evaluate(self, step: int) -> float | None:
        """Held-out greedy accuracy after `step` steps, logged (and sent to the tracker); None without eval data."""
        if not self.eval_prompts:
            return None

        def progress(done: int, total: int) -> None:
            for cb in self.on_eval:
                cb({"step": step, "done": done, "total": total})
        t0 = time.perf_counter()
        acc = evaluate(self.rollouts, self.eval_prompts, self.scorer, self.cfg.max_tokens, progress)
        rec = self.log.log("eval", step=step, version=self.trainer.version, accuracy=acc,
                           seconds=time.perf_counter() - t0)
        if self.tracker is not None:
            self.tracker.log({"eval/accuracy": acc}, step)
        for cb in self.on_eval:
            cb(rec)
        return acc

    def _checkpoint(self) -> None:
        """A checkpoint after `next_step` steps (nothing when this process trained none, or the step is saved)."""
        if self.next_step == self.start_step or getattr(self, "_saved_step", None) == self.next_step:
            return
        c = self.cfg
        state = {"step": self.next_step, "version": self.trainer.version, "data": self.splits.fingerprint,
                 "data_position": self._pos0 + (self.next_step - self.start_step) * c.prompts_per_step,
                 "config": c.to_dict()}
        path = save_checkpoint(self.out, self.trainer, state, c.keep_checkpoints)
        self.log.log("checkpoint", step=self.next_step, version=self.trainer.version, path=path and str(path),
                     **({} if path else {"skipped": "the adapter holds non-finite values"}))
        self._saved_step = self.next_step

    def _sync_batches(self):
        """Synchronous source: generate the step's groups now, with the current policy, then score them."""
        c = self.cfg
        for step in range(self.start_step, c.steps):
            self._running.wait()
            if self._stop.is_set():
                return
            t0 = time.perf_counter()
            groups = self.rollouts.generate(self.stream.take(c.prompts_per_step), c.group_size, self._sampling(step))
            t_gen = time.perf_counter() - t0
            scored = self.scorer.score_groups(groups)  # every call of the step at once
            n_tok = sum(len(x.token_ids) for g in groups for x in g.completions)
            self.log.log("timeline", side="gen", start=t0 - self._t_start, end=t0 + t_gen - self._t_start)
            yield step, scored, {"time/gen_s": t_gen, "throughput/gen_tok_s": n_tok / max(t_gen, 1e-9),
                                 "staleness/dropped_groups": 0, "buffer/depth": 0}

    def _pipeline_batches(self):
        """Asynchronous source: take the step's batch from the rollout buffer (generated up to K versions ago).
        A resumed run regenerates what the interrupted one had generated ahead (see `checkpoint.py`)."""
        c = self.cfg
        batches = {s: self.stream.take(c.prompts_per_step) for s in range(self.start_step, c.steps)}  # as sync
        self.pipeline = Pipeline(self.rollouts, self.scorer, batches.__getitem__, self._sampling, c.group_size,
                                 c.prompts_per_step, c.steps, c.max_async_steps, first_step=self.start_step)
        tl = self.pipeline.timeline
        t_prev = tl.now()
        for step in range(self.start_step, c.steps):
            self._running.wait()
            if self._stop.is_set():
                return
            t_wait = tl.now()
            groups = self.pipeline.take(step)
            if groups is None:
                return
            kept, dropped = self.pipeline.filter_stale(groups, self.trainer.version, c.max_staleness)
            now = tl.now()
            n_tok = self.pipeline.gen_tokens.pop(step, 0)
            gen_s = self.pipeline.gen_seconds.pop(step, now - t_prev)
            yield step, kept, {"time/wait_s": now - t_wait, "staleness/dropped_groups": dropped,
                               "buffer/depth": self.pipeline.buffer.depth, "time/gen_s": gen_s,
                               "throughput/gen_tok_s": n_tok / max(gen_s, 1e-9),
                               "busy/gen": tl.busy("gen", t_prev, now),
                               "busy/train": tl.busy("train", t_prev, now)}
            t_prev = now

    def _close_pipeline(self) -> None:
        p, self.pipeline = getattr(self, "pipeline", None), None
        if p is None:
            return
        p.close()
        for side in ("gen", "train"):
            for a, b in getattr(p.timeline, side):
                self.log.log("timeline", side=side, start=a, end=b)
        self.log.log("accounting", **p.accounting)
        self.summary["accounting"] = dict(p.accounting)

    def _push(self, scored: list[ScoredGroup]) -> SyncStats:
        if not self.trainer.adapter_is_finite():  # never serve (or save) a broken adapter
            raise RuntimeError(f"the adapter has non-finite weights after step version {self.trainer.version} "
                               "(the optimizer diverged): lower lr or max_grad_norm")
        stats = self.sync.push(self.trainer, self.generator)
        if self._probe is None:
            return stats
        self._verified = self._verify()
        least = min(self._verified.values(), key=lambda v: (v.verified, -v.new_diff), default=None)
        return dataclasses.replace(stats, verification=least)

    def _verify(self) -> dict[str, Verification]:
        """`sync.verify` on the run's probe, for the generator or each vLLM server that is up (one restarting gets
        the adapter when it is back, checked at the next push), the servers all at once (each scores the probe on
        its own cores). Returns each one's check (by url), the next check's `previous`; the trainer's probe
        logprobs at the last check are the previous adapter's (nothing is recomputed, training is not disturbed).
        A failure names its server (the first in order, when several fail)."""
        want = self.trainer.logprobs(*self._probe, self.cfg.temperature)
        dtype = str(next(self.trainer.model.parameters()).dtype)
        targets = [t for t in getattr(self.generator, "replicas", None) or [self.generator]
                   if getattr(t, "alive", True)]

        def check(target) -> Verification:
            key = getattr(target, "url", "")
            try:
                return verify(target, self._probe, want, self.trainer.version, (self._verified or {}).get(key),
                              self.cfg.temperature, dtype)
            except SyncVerificationError as e:
                raise SyncVerificationError(f"{key}: {e}" if key else str(e)) from e
        if len(targets) <= 1:
            return {getattr(t, "url", ""): check(t) for t in targets}
        pool = ThreadPoolExecutor(len(targets), thread_name_prefix="minirl-verify")
        try:
            futures = [pool.submit(check, t) for t in targets]
            return {t.url: f.result() for t, f in zip(targets, futures)}
        finally:  # a failure or Ctrl-C does not wait for the other servers' checks (closing the run ends them)
            pool.shutdown(wait=False, cancel_futures=True)

    def _log_samples(self, step: int, scored: list[ScoredGroup]) -> None:
        self.log.log("samples", step=step, samples=sample_rows(scored, self.cfg.log_samples),
                     reward_versions=self.scorer.versions)

    # --- lifecycle -----------------------------------------------------------------------------------------
    def run(self, pipeline: bool | None = None) -> dict[str, Any]:
        """Set up, train, evaluate, save. Blocks; returns the summary (also written to summary.json).
        `pipeline`: use the asynchronous pipeline (default: when max_async_steps > 0). With K = 0 the pipeline
        reproduces the synchronous loop exactly."""
        self._t_start = time.perf_counter()
        if pipeline is None:
            pipeline = self._use_pipeline
        if self.trainer is not None and pipeline != self._use_pipeline:
            raise RuntimeError("run(pipeline=...) must match the set-up; call it before setup()")
        self._use_pipeline = pipeline
        try:
            if self.trainer is None:
                self.setup()
            return self._loop(pipeline)
        except BaseException as e:
            self.error = e
            if hasattr(self, "log"):
                self.log.log("error", error=repr(e), traceback=traceback.format_exc())
            raise
        finally:
            self._finish()

    def _finish(self) -> None:
        """Save and close everything, however the run ended. A failure here is logged and never hides the run's own
        error, and never keeps the next step from closing what it closes."""
        closing = [("pipeline", self._close_pipeline),
                   ("checkpoint, adapter and summary", lambda: self._claimed and self._save_final()),
                   ("generator", lambda: self.generator is not None and self.generator.close()),
                   ("sync", lambda: getattr(self, "sync", None) is not None and self.sync.close()),
                   ("reward workers", lambda: getattr(self, "scorer", None) is not None and self.scorer.close()),
                   ("tracker", lambda: self.tracker is not None and self.tracker.close()),
                   ("torch threads and cores", self._restore_cpu)]
        failed: list[BaseException] = []
        for what, fn in closing:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - closing goes on; the first such error is raised below
                failed.append(e)
                if hasattr(self, "log"):
                    self.log.log("error", error=f"while closing the {what}: {e!r}", traceback=traceback.format_exc())
        if hasattr(self, "log"):
            self.log.log("end", summary=self.summary)
            self.log.close()
        if self._lock is not None:
            self._lock.close()  # out_dir is free for the next run
        if failed and self.error is None:  # the run itself went well: its closing failure must not pass silently
            self.error = failed[0]
            raise failed[0]

    def _save_final(self) -> None:
        """At the end, on stop or on an error: a checkpoint (unless the error struck mid-step: then the last one
        stands), the adapter and the summary, each written atomically. Saved even on a crash, so nothing is lost;
        but a non-finite adapter is never saved."""
        if self._between_steps:
            self._checkpoint()
        if self.trainer.adapter_is_finite():
            save_adapter(self.trainer, self.out / "adapter")
            self.summary["adapter"] = str(self.out / "adapter")
        else:
            self.summary["adapter"] = None
            self.summary["adapter_not_saved"] = "non-finite weights"
        atomic_text(self.out / "summary.json", json.dumps(self.summary, indent=2))

    def start(self) -> "Run":
        """Run in a background thread; the caller (a notebook kernel) stays free."""
        def target() -> None:
            try:
                self.run()
            except BaseException:  # noqa: BLE001 - kept in self.error, re-raised by wait()
                pass
        self._thread = threading.Thread(target=target, name="minirl-run", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.summary

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def stop(self, timeout: float | None = 60) -> None:
        self._stop.set()
        self._running.set()
        if getattr(self, "pipeline", None) is not None:
            self.pipeline.interrupt()
        if self._thread is not None:
            self._thread.join(timeout)

    SAFE_KNOBS = ("lr", "temperature", "max_staleness", "top_p", "kl_coef", "tis_cap", "clip_low", "clip_high")

    def set(self, **knobs: Any) -> None:
        """Change safe knobs mid-run (from the next step): lr, temperature, max_staleness, ... The new values are
        validated first; a rejected change leaves the run's config as it was."""
        bad = sorted(set(knobs) - set(self.SAFE_KNOBS))
        if bad:
            raise ValueError(f"{bad} cannot change mid-run; safe knobs are {self.SAFE_KNOBS}")
        self.cfg = self.cfg.replace(**knobs)  # validates: raises ConfigError and keeps the old config
        if self.trainer is not None:
            self.trainer.reconfigure(self.cfg)
        if hasattr(self, "log"):
            self.log.log("set", **knobs)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else None

"""A run: generate → score → train → push adapter → repeat, readable top to bottom in `Run._loop`.

`Run(cfg).run()` blocks; `Run(cfg).start()` runs in a background thread (a notebook kernel stays responsive)
with `pause()`, `resume()`, `stop()` and `wait()`. Every event goes to `out_dir/metrics.jsonl`.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import data as D
from .config import Config, parse_cores
from .envs import resolve_env
from .episodes import make_runner
from .generators import Generator, make_generator, pick_backend
from .metrics import MetricsLog, rollout_metrics
from .rewards import Scorer, check_columns
from .rewards.scorer import failure_kinds
from .rollout import Pipeline
from .sync import SyncStats, verify
from .tasks import TASKS
from .trainer import Trainer
from .types import Episode, Prompt, SamplingParams, ScoredGroup


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


def evaluate(generator: Generator, prompts: Sequence[Prompt], scorer: Scorer, max_tokens: int) -> float:
    """Greedy accuracy on held-out prompts: the mean of the *first* reward function (the reward is the metric)."""
    if not prompts:
        return float("nan")
    groups = generator.generate(prompts, 1, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    name = scorer.rewards[0][0]
    scores = [scorer.score_group(g, names=[name]).per_reward[name][0] for g in groups]
    return sum(0.0 if v is None else v for v in scores) / len(scores)  # a failed score counts as wrong


class Run:
    def __init__(self, config: Config | None = None, *, data: Any = None, eval_data: Any = None,
                 rewards: Sequence[str | Callable] | None = None, env: Any = None, **overrides: Any):
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
        self.on_step: list[Callable[[dict], None]] = []
        self._use_pipeline = self.cfg.max_async_steps > 0

    # --- set-up --------------------------------------------------------------------------------------------
    def setup(self) -> None:
        c = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        self.scorer = Scorer.from_config(self._reward_refs, c.reward_weights, c.reward_timeout_s, c.scale_adv_by_std,
                                         c.reward_workers, c.reward_clip, c.reward_memory_mb)
        if self._data is None and c.data == "arithmetic" and c.env in TASKS:  # a built-in env task's own rows
            train_rows, eval_rows = TASKS[c.env].splits(c.eval_size, c.seed)
        elif self._data is None and c.data == "arithmetic":
            train_rows, eval_rows = D.arithmetic_splits(c.eval_size, c.seed)
        else:
            train_rows = D.load_rows(self._data if self._data is not None else c.data)
            eval_rows = D.load_rows(self._eval_data) if self._eval_data is not None else []
        cols = [k for k in train_rows[0] if k != c.prompt_column]
        if self._env is not None:  # an episode's reward keywords: its transcript and env reward
            cols += list(Episode((), (), 0).columns())
        for name, fn in self.scorer.rewards:
            check_columns(fn, name, cols)
        self.scorer.start()  # reward workers up before the model loads: a reward that cannot reach them fails now
        self.backend, self.backend_why = pick_backend(c.backend, torch.cuda.is_available())
        if c.inflight != "continue" and self.backend != "vllm":
            raise ValueError(f"inflight={c.inflight!r} needs the vLLM engine (backend='vllm'); the transformers "
                             "backend finishes in-flight sequences on their adapter (inflight='continue')")
        if torch.cuda.is_available():
            gen_devices = None if c.gen_devices == "auto" else c.gen_devices.replace("cuda:", "")
            train_device = "cuda" if c.train_devices == "auto" else c.train_devices
        else:
            gen_devices, train_threads = cpu_split(c)
            torch.set_num_threads(train_threads)
            train_device = "cpu"
        self.trainer = Trainer(c, device=train_device)
        tok = self.trainer.tokenizer
        if self._env is None:
            self.train_prompts = D.to_prompts(train_rows, tok, c.prompt_column, c.system_prompt, c.max_prompt_tokens)
            self.eval_prompts = D.to_prompts(eval_rows[: c.eval_size], tok, c.prompt_column, c.system_prompt,
                                             c.max_prompt_tokens, start_index=len(train_rows))
        self.generator, self.sync, self._sync_why = make_generator(c, self.trainer, self.backend,
                                                                   self._use_pipeline, gen_devices)
        # what samples the groups: the generator, or (env runs) the episode runner on it (minirl/episodes.py)
        self.rollouts = self.generator
        if self._env is not None:
            self.rollouts = make_runner(self.generator, self._env, tok, c.max_turns, c.max_episode_tokens)
            self.train_prompts = self.rollouts.prompts(train_rows, c.prompt_column, c.max_prompt_tokens)
            self.eval_prompts = self.rollouts.prompts(eval_rows[: c.eval_size], c.prompt_column, c.max_prompt_tokens,
                                                      start_index=len(train_rows))
        if not torch.cuda.is_available() and c.train_devices != "auto" and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, parse_cores(c.train_devices))  # this (trainer) thread; after the engine spawned
        self.stream = D.prompt_stream(self.train_prompts, c.seed)
        self.log = MetricsLog(self.out / "metrics.jsonl")
        self.log.log("start", config=c.to_dict(), backend=self.backend, backend_why=self.backend_why,
                     transport=self.sync.transport,
                     transport_why=self._sync_why,
                     reward_versions=self.scorer.versions)
        c.to_yaml(self.out / "config.yaml")
        self._probe = None

    def _sampling(self, step: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(c.temperature, c.top_p, c.top_k, c.max_tokens, seed=c.seed * 100_003 + step)

    # --- the loop ------------------------------------------------------------------------------------------
    def _loop(self, pipeline: bool) -> dict[str, Any]:
        c, log = self.cfg, self.log
        acc0 = evaluate(self.rollouts, self.eval_prompts, self.scorer, c.max_tokens)
        log.log("eval", step=0, version=0, accuracy=acc0)
        self.summary["eval_accuracy_before"] = acc0
        step_times: list[float] = []
        batches = self._pipeline_batches() if pipeline else self._sync_batches()
        t_prev = time.perf_counter()
        for step, scored, gen in batches:
            stale = [self.trainer.version - v for g in scored for x in g.group.completions for v in x.sampled_versions]
            gen.update({"staleness/mean": _mean(stale), "staleness/max": max(stale, default=None)})
            t1 = time.perf_counter()
            tm = self.trainer.step(scored)
            t2 = time.perf_counter()
            sync = self._push(scored)
            t3 = time.perf_counter()
            if pipeline:
                self.pipeline.signal_version()
                self.pipeline.timeline.add_train(t1, t3)
            else:
                self.log.log("timeline", side="train", start=t1 - self._t_start, end=t3 - self._t_start)
            dt, t_prev = t3 - t_prev, t3
            step_times.append(dt)
            rec = {"step": step, **rollout_metrics(scored, c.max_tokens), **tm, **gen,
                   "reward/failure_kinds": failure_kinds(scored),
                   "throughput/train_tok_s": tm.get("train/tokens", 0) / max(t2 - t1, 1e-9),
                   "sync/ms": sync.ms, "sync/bytes": sync.bytes, "time/step_s": dt}
            rec.setdefault("busy/train", (t3 - t1) / dt)
            if "busy/gen" not in rec:
                rec["busy/gen"] = gen["time/gen_s"] / dt
            self.history.append(log.log("step", **rec))
            self._log_samples(step, scored)
            for cb in self.on_step:
                cb(rec)
            if c.eval_every and (step + 1) % c.eval_every == 0 and step + 1 < c.steps:
                log.log("eval", step=step + 1, version=self.trainer.version,
                        accuracy=evaluate(self.rollouts, self.eval_prompts, self.scorer, c.max_tokens))
        if pipeline:
            self._close_pipeline()
        acc1 = evaluate(self.rollouts, self.eval_prompts, self.scorer, c.max_tokens)
        log.log("eval", step=len(step_times), version=self.trainer.version, accuracy=acc1)
        rewards = [h["reward/mean"] for h in self.history]
        k = max(1, min(5, len(rewards) // 4)) if rewards else 1
        self.summary.update({
            "steps": len(step_times), "backend": self.backend, "backend_why": self.backend_why,
            "transport": self.sync.transport,
            "max_async_steps": c.max_async_steps,
            "median_step_s": statistics.median(step_times) if step_times else None,
            "eval_accuracy_after": acc1, "eval_size": len(self.eval_prompts),
            "reward_first": _mean(rewards[:k]), "reward_last": _mean(rewards[-k:]),
        })
        return self.summary

    def _sync_batches(self):
        """Synchronous source: generate the step's groups now, with the current policy, then score them."""
        c = self.cfg
        for step in range(c.steps):
            self._running.wait()
            if self._stop.is_set():
                return
            t0 = time.perf_counter()
            groups = self.rollouts.generate(D.take(self.stream, c.prompts_per_step), c.group_size, self._sampling(step))
            t_gen = time.perf_counter() - t0
            scored = [self.scorer.score_group(g) for g in groups]
            n_tok = sum(len(x.token_ids) for g in groups for x in g.completions)
            self.log.log("timeline", side="gen", start=t0 - self._t_start, end=t0 + t_gen - self._t_start)
            yield step, scored, {"time/gen_s": t_gen, "throughput/gen_tok_s": n_tok / max(t_gen, 1e-9),
                                 "staleness/dropped_groups": 0, "buffer/depth": 0}

    def _pipeline_batches(self):
        """Asynchronous source: take the step's batch from the rollout buffer (generated up to K versions ago)."""
        c = self.cfg
        batches = [D.take(self.stream, c.prompts_per_step) for _ in range(c.steps)]  # fixed order, as sync
        self.pipeline = Pipeline(self.rollouts, self.scorer, lambda s: batches[s], self._sampling, c.group_size,
                                 c.prompts_per_step, c.steps, c.max_async_steps)
        tl = self.pipeline.timeline
        t_prev = tl.now()
        for step in range(c.steps):
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
        if self.cfg.verify_sync and self.sync.transport != "shared" and self.generator.name != "hf":
            if self._probe is None:  # a fixed probe: the first prompt and its first completion
                g = scored[0].group
                self._probe = (g.prompt.token_ids, g.completions[0].token_ids or (self.trainer.tokenizer.eos_token_id,))
            want = self.trainer.logprobs(*self._probe, self.cfg.temperature)
            verify(self.generator, *self._probe, want, self.trainer.version, self.cfg.temperature)
        return stats

    def _log_samples(self, step: int, scored: list[ScoredGroup]) -> None:
        rows = []
        for g in scored[: self.cfg.log_samples]:
            c = g.group.completions[0]
            rows.append({"prompt": g.group.prompt.text, "columns": g.group.prompt.columns, "completion": c.text,
                         "reward": g.rewards[0],
                         "per_reward": {k: v[0] for k, v in g.per_reward.items()},
                         "advantage": g.advantages[0], "failures": [f.__dict__ for f in g.failures]})
        self.log.log("samples", step=step, samples=rows, reward_versions=self.scorer.versions)

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
        def save() -> None:
            if self.trainer is None:
                return
            if not self.trainer.adapter_is_finite():
                self.summary["adapter"] = None
                self.summary["adapter_not_saved"] = "non-finite weights"
                return
            self.trainer.save_adapter(self.out / "adapter")  # saved even on a crash: nothing is lost
            self.summary["adapter"] = str(self.out / "adapter")
            (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2))
        closing = [("pipeline", self._close_pipeline), ("adapter and summary", save),
                   ("generator", lambda: self.generator is not None and self.generator.close()),
                   ("sync", lambda: getattr(self, "sync", None) is not None and self.sync.close()),
                   ("reward workers", lambda: getattr(self, "scorer", None) is not None and self.scorer.close())]
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
        if failed and self.error is None:  # the run itself went well: its closing failure must not pass silently
            self.error = failed[0]
            raise failed[0]

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


def eval_cli(cfg: Config, adapter: str | None = None) -> dict[str, Any]:
    """`minirl eval`: greedy held-out accuracy of the base model, or of a saved adapter on top of it."""
    run = Run(cfg.replace(steps=0))
    run.setup()
    try:
        if adapter:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file
            set_peft_model_state_dict(run.trainer.model, load_file(str(Path(adapter) / "adapter_model.safetensors")))
            run.trainer.version = 1
            run.sync.push(run.trainer, run.generator)
        acc = evaluate(run.rollouts, run.eval_prompts, run.scorer, cfg.max_tokens)
        return {"model": cfg.model, "adapter": adapter, "eval_size": len(run.eval_prompts), "accuracy": acc,
                "backend": run.backend}
    finally:
        run.generator.close()
        run.sync.close()
        run.log.close()


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else None

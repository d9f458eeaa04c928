"""A run: generate → score → train → push adapter → repeat, readable top to bottom in `Run._loop`.

`Run(cfg).run()` blocks; `Run(cfg).start()` runs in a background thread (a notebook kernel stays responsive)
with `pause()`, `resume()`, `stop()` and `wait()`. Every event goes to `out_dir/metrics.jsonl`; checkpoints go to
`out_dir/checkpoints` (see `checkpoint.py`), and `Run(cfg, resume=True)` continues from the latest one.

The rooms around it: `placement.py` (where each side runs, K), `parts.py` (rewards, data, trainer, generator,
sync), `sync_check.py` (the check after every push), `run_dir.py` (out_dir: claim, checkpoints, summary).
"""
from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from . import data as D
from .checkpoint import Checkpoint, resume_point
from .config import Config
from .evaluation import evaluate
from .metrics import rollout_metrics, sample_rows, step_summary
from .parts import RunParts, build_parts, resolve_rewards
from .placement import CpuThreads, cuda_device_count, place
from .rewards.scorer import failure_kinds
from .rollout import Pipeline
from .run_dir import RunDir
from .sync import SyncStats
from .sync_check import SyncCheck
from .trackers import scalars
from .types import SamplingParams, ScoredGroup


def _part(name: str) -> property:
    return property(lambda self: getattr(self.parts, name) if self.parts is not None else None)


class Run:
    """`resume=True` continues the run in out_dir from its latest checkpoint (the log is appended to);
    `overwrite=True` replaces the run in out_dir. Without either, a run refuses an out_dir that holds one."""

    def __init__(self, config: Config | None = None, *, data: Any = None, eval_data: Any = None,
                 rewards: Sequence[str | Callable] | None = None, env: Any = None, resume: bool = False,
                 overwrite: bool = False, **overrides: Any):
        cfg = (config or Config()).replace(**overrides) if overrides else (config or Config())
        cfg, self._reward_refs, self._env = resolve_rewards(cfg, rewards, env)
        self.placement = place(cfg, cuda_device_count())  # a bad device string fails here, before anything loads
        self.cfg = cfg.replace(max_async_steps=self.placement.max_async_steps)
        self._data, self._eval_data = data, eval_data
        self.resuming = resume
        self.dir = RunDir(self.cfg.out_dir, resume, overwrite)
        self.out = self.dir.out
        self.parts: RunParts | None = None
        self.history: list[dict] = []
        self.summary: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._stop, self._running = threading.Event(), threading.Event()
        self._running.set()
        self._thread: threading.Thread | None = None
        self.on_step: list[Callable[[dict], None]] = []
        self.on_eval: list[Callable[[dict], None]] = []  # {"step", "done", "total"} as it goes, then the eval event
        self._use_pipeline = self.placement.max_async_steps > 0
        self.checkpoint: Checkpoint | None = None  # the one this run resumed from
        self.start_step = self.next_step = 0  # first step this process trains; steps done so far
        self._between_steps = True  # the trainer's state is a whole number of steps (a checkpoint may be taken)
        self._acc_before: float | None = None
        self._cpu = CpuThreads()
        self.pipeline: Pipeline | None = None
        self._check: SyncCheck | None = None

    trainer, generator, sync, scorer, rollouts = (_part(n) for n in ("trainer", "generator", "sync", "scorer",
                                                                     "rollouts"))
    splits, train_prompts, eval_prompts = (_part(n) for n in ("splits", "train_prompts", "eval_prompts"))
    backend = property(lambda self: self.placement.backend)
    backend_why = property(lambda self: self.placement.backend_why)
    async_why = property(lambda self: self.placement.async_why)
    log = property(lambda self: self.dir.log)
    tracker = property(lambda self: self.dir.tracker)

    # --- set-up --------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Check out_dir and every input, load the model and the generator, then claim out_dir. Everything that
        can fail on a bad input fails before the model loads; a failure writes nothing into out_dir."""
        self.dir.check()
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
        """Check the inputs and load the model, the prompts and the generator, from the checkpoint being resumed
        if any (`parts.build_parts`), then check the sync once. Writes nothing."""
        c = self.cfg
        print(self.placement.line(), flush=True)
        self.parts = build_parts(c, self._reward_refs, self._env, self._data, self._eval_data, self.placement,
                                 self._cpu, self.checkpoint)
        position = self.checkpoint.state["data_position"] if self.checkpoint else 0
        self.stream = D.PromptStream(self.train_prompts, c.seed, position)
        if c.verify_sync and self.sync.transport != "shared":  # "shared": the generator runs on the trainer's model
            self._check = SyncCheck.for_run(c, self.trainer, self.train_prompts[0].token_ids)
            self._check(self.trainer, self.generator)  # before any push: the engine serves the (restored) policy

    def _claim(self) -> None:
        gen = self.generator
        info = dict(config=self.cfg.to_dict(), backend=self.backend, backend_why=self.backend_why,
                    async_why=self.async_why, placement=self.placement.to_dict(), transport=self.sync.transport,
                    transport_why=self.parts.sync_why, reward_versions=self.scorer.versions,
                    train_prompts=len(self.train_prompts), eval_prompts=len(self.eval_prompts), eval=self.splits.note,
                    **({"servers": gen.servers()} if hasattr(gen, "servers") else {}))
        if self.resuming:
            info["checkpoint"] = str(self.checkpoint.path) if self.checkpoint else None
        self.history, self._acc_before = self.dir.claim(self.cfg, self.start_step, self.trainer.version, info)
        if hasattr(gen, "on_event"):  # vLLM servers: down, restarted
            gen.on_event = lambda kind, **kw: self.log.log("server", kind=kind, **kw)

    def close(self) -> None:
        """Close what `load` opened (after a failed set-up, or an evaluation without a run: `minirl eval`)."""
        self.dir.release()
        parts, self.parts = self.parts, None
        if parts is not None:
            parts.close()
        self.dir.close_tracker()
        self._cpu.restore()

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
            "placement": self.placement.to_dict(),
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
        """A checkpoint after `next_step` steps (nothing when this process trained none)."""
        if self.next_step == self.start_step:
            return
        c = self.cfg
        self.dir.checkpoint(self.trainer, {
            "step": self.next_step, "version": self.trainer.version, "data": self.splits.fingerprint,
            "data_position": self._pos0 + (self.next_step - self.start_step) * c.prompts_per_step,
            "config": c.to_dict()}, c.keep_checkpoints)

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
        p, self.pipeline = self.pipeline, None
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
        if self._check is None:
            return stats
        return dataclasses.replace(stats, verification=self._check(self.trainer, self.generator))

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
            if self.log is not None:
                self.log.log("error", error=repr(e), traceback=traceback.format_exc())
            raise
        finally:
            self._finish()

    def _finish(self) -> None:
        """Save and close everything, however the run ended. A failure here is logged and never hides the run's own
        error, and never keeps the next step from closing what it closes."""
        parts = self.parts
        closing = [("pipeline", self._close_pipeline),
                   ("checkpoint, adapter and summary", lambda: self.dir.claimed and self._save_final()),
                   ("generator", lambda: parts is not None and parts.generator is not None and parts.generator.close()),
                   ("sync", lambda: parts is not None and parts.sync is not None and parts.sync.close()),
                   ("reward workers", lambda: parts is not None and parts.scorer.close()),
                   ("tracker", self.dir.close_tracker),
                   ("torch threads and cores", self._cpu.restore)]
        failed: list[BaseException] = []
        for what, fn in closing:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - closing goes on; the first such error is raised below
                failed.append(e)
                if self.log is not None:
                    self.log.log("error", error=f"while closing the {what}: {e!r}", traceback=traceback.format_exc())
        if self.log is not None:
            self.log.log("end", summary=self.summary)
            self.log.close()
        self.dir.release()
        if failed and self.error is None:  # the run itself went well: its closing failure must not pass silently
            self.error = failed[0]
            raise failed[0]

    def _save_final(self) -> None:
        """At the end, on stop or on an error: a checkpoint (unless the error struck mid-step: then the last one
        stands), the adapter and the summary, each written atomically. Saved even on a crash, so nothing is lost;
        but a non-finite adapter is never saved."""
        if self._between_steps:
            self._checkpoint()
        self.dir.save_final(self.trainer, self.summary)

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
        if self.pipeline is not None:
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
        if self.log is not None:
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

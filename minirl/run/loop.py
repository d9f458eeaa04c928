"""A run: generate → score → train → push adapter → repeat, readable top to bottom in `Run._loop`.

`Run(cfg).run()` blocks; `Run(cfg).start()` runs in a background thread (a notebook kernel stays responsive)
with `pause()`, `resume()`, `stop()` and `wait()`. Every event goes to `out_dir/metrics.jsonl`; checkpoints go to
`out_dir/checkpoints` (see `checkpoint.py`), and `Run(cfg, resume=True)` continues from the latest one.

The rooms around it: `placement.py` (where each side runs, K), `build.py` (rewards, data, trainer, generator,
sync), `sync/check.py` (the check after every push), `run/folder.py` (out_dir: claim, checkpoints, summary).
"""
from __future__ import annotations

import dataclasses
import inspect
import time
import traceback
from functools import partial
from typing import Any, Callable, Sequence

from minirl.config import Config
from minirl.core.hacking import HackingWatch, line
from minirl.core.metrics import LogTail, rollout_metrics, sample_rows, step_summary
from minirl.data import rows as D
from minirl.generation.factory import engine_gap
from minirl.pipeline.rollout import Pipeline
from minirl.rewards.advantages import AdvantageSettings, step_advantages
from minirl.rewards.scorer import failure_kinds
from minirl.run.background import Background, attempt
from minirl.run.build import RunParts, build_parts, resolve_rewards, sampling_params
from minirl.run.checkpoint import Checkpoint, resume_point
from minirl.run.evaluation import eval_options, evaluate
from minirl.run.export import export_merged
from minirl.run.folder import RunDir
from minirl.run.placement import CpuThreads, device_facts
from minirl.run.plan import RunPlan, place_run, plan_run
from minirl.run.trackers import scalars
from minirl.sync.base import SyncStats
from minirl.sync.check import SyncCheck
from minirl.types import RunStatus, ScoredGroup

MAIN_GUARD = ('minirl: your script starts a run at import time; put it under `if __name__ == "__main__":` '
              '(spawned processes re-import the main script)')


def check_main_guard() -> None:
    """Exit with one line (MAIN_GUARD) when a run starts from the top level of a main script that a spawned process
    re-imports: the trainer initialises CUDA, so vLLM starts its processes with spawn, which runs the user's script
    again as `__mp_main__`; unguarded, each child would start a run of its own. (The transformers generator process
    is a fresh interpreter that never runs the script.) A run started by a spawned child's target function (not at
    the script's top level) is allowed."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise SystemExit(MAIN_GUARD)
        frame = frame.f_back


def _part(name: str) -> property:
    return property(lambda self: getattr(self.parts, name) if self.parts is not None else None)


class Run(Background):
    """`resume=True` continues the run in out_dir from its latest checkpoint (the log is appended to);
    `overwrite=True` replaces the run in out_dir. Without either, a run refuses an out_dir that holds one."""

    def __init__(self, config: Config | None = None, *, data: Any = None, eval_data: Any = None,
                 rewards: Sequence[str | Callable] | None = None, env: Any = None, resume: bool = False,
                 overwrite: bool = False, **overrides: Any):
        check_main_guard()  # a spawned child re-importing an unguarded script: one line, not a traceback storm
        super().__init__()
        cfg = (config or Config()).replace(**overrides) if overrides else (config or Config())
        cfg, self._reward_refs, self._env = resolve_rewards(cfg, rewards, env)
        self.devices = device_facts()  # GPU count, memory, capability: the placement and the plan follow them
        self.placement = place_run(cfg, self.devices)  # a bad device string fails here, before anything loads
        if gap := engine_gap(cfg, self.placement.backend):  # QLoRA on an engine that holds the 16-bit base
            print(gap, flush=True)
            cfg = cfg.replace(verify_sync=False)
        self.cfg = cfg.replace(max_async_steps=self.placement.max_async_steps,  # 3+ GPUs: servers, one per GPU
                               num_servers=self.placement.num_servers or cfg.num_servers)
        self._data, self._eval_data = data, eval_data
        self.resuming = resume
        self.dir = RunDir(self.cfg.out_dir, resume, overwrite)
        self.out = self.dir.out
        self.parts: RunParts | None = None
        self.history: list[dict] = []
        self.on_step: list[Callable[[dict], None]] = []
        self.on_eval: list[Callable[[dict], None]] = []  # {"step", "done", "total"} as it goes, then the eval event
        self.checkpoint: Checkpoint | None = None  # the one this run resumed from
        self.start_step = self.next_step = 0  # first step this process trains; steps done so far
        self._between_steps = True  # the trainer's state is a whole number of steps (a checkpoint may be taken)
        self._acc_before: float | None = None
        self._cpu = CpuThreads()
        self.pipeline: Pipeline | None = None
        self._check: SyncCheck | None = None
        self._tail: LogTail | None = None
        self._watch, self._evals = HackingWatch(), []  # the reward-hacking watch and this process's eval events

    trainer, generator, sync, scorer, rollouts = (_part(n) for n in ("trainer", "generator", "sync", "scorer",
                                                                     "rollouts"))
    splits, train_prompts, eval_prompts = (_part(n) for n in ("splits", "train_prompts", "eval_prompts"))
    backend, backend_why, async_why = (property(lambda self, n=n: getattr(self.placement, n))
                                       for n in ("backend", "backend_why", "async_why"))
    log, tracker = property(lambda self: self.dir.log), property(lambda self: self.dir.tracker)

    def memory_plan(self) -> RunPlan:
        """The memory plan this run checks before it loads (each device for what the placement puts on it), from
        the model's config.json alone; `minirl plan` prints the same."""
        return plan_run(self.cfg, self.devices, self.placement)

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
        self.parts = build_parts(c, self._reward_refs, self._env, self._data, self._eval_data, self.placement,
                                 self._cpu, self.checkpoint, self.devices)
        position = self.checkpoint.state["data_position"] if self.checkpoint else 0
        self.stream = D.PromptStream(self.train_prompts, c.seed, position, shuffle=c.shuffle)
        if c.verify_sync and self.sync.transport != "shared":  # "shared": the generator runs on the trainer's model
            self._check = SyncCheck.for_run(c, self.trainer, self.train_prompts[0].token_ids)
            self._check(self.trainer, self.generator)  # before any push: the engine serves the (restored) policy

    def _claim(self) -> None:
        info = dict(config=self.cfg.to_dict(), backend=self.backend, backend_why=self.backend_why,
                    async_why=self.async_why, placement=self.placement.to_dict(), **self.parts.describe(),
                    **({"checkpoint": self.checkpoint and str(self.checkpoint.path)} if self.resuming else {}))
        self.history, self._acc_before = self.dir.claim(self.cfg, self.start_step, self.trainer.version, info)
        print(self.placement.line() + "\n" + self.parts.plan.line(), flush=True)
        self.generator.on_event = lambda kind, **kw: self.log.log("server", kind=kind, **kw)  # servers: down, restarted

    def close(self) -> None:
        """Close what `load` opened (after a failed set-up, or an evaluation without a run: `minirl eval`)."""
        self.dir.release()
        parts, self.parts = self.parts, None
        failed = parts.close() if parts is not None else []
        self.dir.close_tracker()
        self._cpu.restore()
        if failed:
            raise failed[0][1]

    # --- the loop ------------------------------------------------------------------------------------------
    def _loop(self) -> dict[str, Any]:
        c, log = self.cfg, self.log
        if self.history or self._acc_before is not None:  # resumed: measured before the first step already
            acc0 = self._acc_before
        else:
            acc0 = self._evaluate(0)
        self.summary["eval_accuracy_before"] = acc0
        self._pos0 = self.stream.position
        t_prev, settings = time.perf_counter(), AdvantageSettings.from_config(c)
        for step, scored, gen in self._batches():
            scored = step_advantages(scored, settings)  # the step's advantages: made here, once
            self.scorer.watch(scored)  # a reward failing every call for steps in a row stops the run, with the fix
            t1 = time.perf_counter()
            self._between_steps = False
            slept = {}
            if sleeper := self.parts.sleeper:  # one GPU shared with vLLM: the engine sleeps while the trainer works
                sleeper.sleep()
                slept["time/sleep_s"] = time.perf_counter() - t1
            tm = self.trainer.step(scored)
            if sleeper:
                t_wake = time.perf_counter()
                sleeper.wake()  # before the push: a woken engine gets the new adapter and its check
                slept["time/wake_s"] = time.perf_counter() - t_wake
            t2 = time.perf_counter()
            sync = self._push(scored)
            t3 = time.perf_counter()
            self._between_steps, self.next_step = True, step + 1
            self.pipeline.timeline.add_train(t1, t3)
            if c.max_async_steps:  # generation goes on with the new adapter while this step is logged
                self.pipeline.signal_version()
            dt, t_prev = t3 - t_prev, t3
            rec = {"step": step, **rollout_metrics(scored, c.max_tokens), **tm, **gen,
                   "reward/failure_kinds": failure_kinds(scored),
                   "throughput/train_tok_s": tm.get("train/tokens", 0) / max(t2 - t1, 1e-9),
                   **sync.metrics(), **slept, "time/step_s": dt,
                   "prompt_ids": [g.group.prompt.index for g in scored],
                   **({"reward/checks": self.scorer.checks} if self.scorer.checks else {})}
            self.history.append(log.log("step", **rec))
            if self.tracker is not None:
                self.tracker.log(scalars(rec), step)
            rows = sample_rows(scored, c.log_samples, self.trainer.xrays)  # with their token X-rays
            samples = log.log("samples", step=step, samples=rows, reward_versions=self.scorer.versions)
            if self.tracker is not None and rows:
                self.tracker.samples(rows, step)
            for cb in self.on_step:
                cb(rec)
            if c.eval_every and (step + 1) % c.eval_every == 0 and step + 1 < c.steps:
                t_eval = time.perf_counter()
                self._evaluate(step + 1)
                t_prev += time.perf_counter() - t_eval  # the next step's time/step_s leaves the evaluation out
            self._doctor(samples)
            if c.checkpoint_every and (step + 1) % c.checkpoint_every == 0 and step + 1 < c.steps:
                self._checkpoint()
            if not c.max_async_steps:  # synchronous: the next step's generation starts after evaluation
                self.pipeline.signal_version()
        self._close_pipeline()
        acc1 = self._evaluate(self.next_step)
        self._doctor(None)
        self.summary.update({
            **step_summary(self.history), "backend": self.backend, "backend_why": self.backend_why,
            "transport": self.sync.transport, "max_async_steps": c.max_async_steps, "async_why": self.async_why,
            "eval_accuracy_after": acc1, "eval_size": len(self.eval_prompts), "eval": self.splits.note,
            **({"resumed_from_step": self.start_step} if self.resuming else {}),
            "placement": self.placement.to_dict(),
            **self.generator.stats(),  # vLLM servers: count, restarts
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
        res = evaluate(self.rollouts, self.eval_prompts, self.scorer, self.cfg.max_tokens, progress,
                       **eval_options(self.cfg, step))
        rec = self.log.log("eval", step=step, version=self.trainer.version, **res.fields(),
                           seconds=time.perf_counter() - t0)
        self.log.log("eval_problems", step=step, problems=list(res.problems))  # per prompt: for `minirl.compare`
        self._evals.append(rec)
        when = "before" if step == 0 else "after"
        self.summary[f"eval_{when}"] = fields = res.fields()
        self.summary[f"eval_accuracy_{when}_se"] = fields.get("accuracy_se")  # beside eval_accuracy_{when}
        if self.tracker is not None:
            self.tracker.log(res.scalars(), step)
        for cb in self.on_eval:
            cb(rec)
        return res.accuracy

    def _doctor(self, samples: dict | None) -> None:
        """The reward-hacking watch (core/hacking.py): each warning that starts now, a "doctor" event and one
        printed line, once per episode of its condition."""
        for rec in self._watch.update(self.history, self._evals, samples):
            self.log.log("doctor", **rec)
            print(line(rec), flush=True)

    def _checkpoint(self) -> None:
        """A checkpoint after `next_step` steps (nothing when this process trained none)."""
        if self.next_step == self.start_step:
            return
        c = self.cfg
        self.dir.checkpoint(self.trainer, {
            "step": self.next_step, "version": self.trainer.version, "data": self.splits.fingerprint,
            "data_position": self._pos0 + (self.next_step - self.start_step) * c.prompts_per_step,
            "config": c.to_dict()}, c.keep_checkpoints)

    def _batches(self):
        """The steps' batches from the rollout buffer, each generated up to K versions ago (K = 0: by the current
        policy: the synchronous loop; the pipeline's own cost per step: BENCHMARKS.md). A resumed
        run regenerates what the interrupted one had generated ahead (see `checkpoint.py`)."""
        c = self.cfg
        batches = {s: self.stream.take(c.prompts_per_step) for s in range(self.start_step, c.steps)}
        refill = partial(D.refill_prompts, self.train_prompts, c.seed) if c.dynamic_sampling else None
        self.pipeline = Pipeline(self.rollouts, self.scorer, batches.__getitem__, partial(sampling_params, c),
                                 c.group_size, c.prompts_per_step, c.steps, c.max_async_steps, self.start_step,
                                 refill, c.max_resample_rounds, AdvantageSettings.from_config(c).informative)
        return self.pipeline.batches(lambda: self.trainer.version, c.max_staleness, self._go)

    def _close_pipeline(self) -> None:
        p, self.pipeline = self.pipeline, None
        if p is None:
            return
        p.close()
        for side, (a, b) in p.timeline.intervals():
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

    # --- lifecycle -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Set up, train, evaluate, save. Blocks; returns the summary (also written to summary.json)."""
        try:
            if self.trainer is None:
                self.setup()
            return self._loop()
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
        failed = attempt("pipeline", self._close_pipeline) + attempt(
            "checkpoint, adapter and summary", lambda: self.dir.claimed and self._save_final())
        failed += self.parts.close() if self.parts is not None else []  # generator, sync, reward workers
        failed += attempt("tracker", self.dir.close_tracker) + attempt("torch threads and cores", self._cpu.restore)
        for what, e in failed:
            if self.log is not None:
                self.log.log("error", error=f"while closing the {what}: {e!r}",
                             traceback="".join(traceback.format_exception(e)))
        if self.log is not None:
            self.log.log("end", summary=self.summary)
            self.log.close()
        self.dir.release()
        if failed and self.error is None:  # the run itself went well: its closing failure must not pass silently
            self.error = failed[0][1]
            raise self.error

    def _save_final(self) -> None:
        """At the end, on stop or on an error: a checkpoint (unless the error struck mid-step: then the last one
        stands), the adapter and the summary (after an error: the steps made so far and `stopped_after_step`), each
        written atomically. Saved even on a crash, so nothing is lost;
        but a non-finite adapter is never saved."""
        if self._between_steps:
            self._checkpoint()
        if "steps" not in self.summary and self.history:  # ended early: the steps made (a resume's old ones too),
            last = [e for e in self._evals if e["step"] > 0]  # not a summary without them over the finished run's
            self.summary.update(step_summary(self.history), stopped_after_step=self.history[-1]["step"] + 1,
                                **({"eval_accuracy_last": last[-1]["accuracy"], "eval_last_step": last[-1]["step"]}
                                   if last else {}))
        self.dir.save_final(self.trainer, self.summary)

    def _interrupt(self) -> None:
        if self.pipeline is not None:
            self.pipeline.interrupt()

    # --- as the dashboard sees it (`types.RunView`) ------------------------------------------------------------
    controllable = True

    def status(self) -> RunStatus:
        state = ("failed" if self.error is not None else ("paused" if self.paused else "running") if self.running
                 else "finished" if "steps" in self.summary else "not started")
        return RunStatus(state, self.error, self.cfg.steps, tuple(map(str, self.cfg.rewards)),
                         self.out / "metrics.jsonl", {"lr": self.cfg.lr, "temperature": self.cfg.temperature})

    def events(self) -> list[dict]:
        """This run's log as written so far (read incrementally; never an older run's file in out_dir), with the
        step records it holds in memory where they are ahead of the file."""
        mine = [{"event": "step", **h} for h in self.history]
        if self.log is None or not (self.out / "metrics.jsonl").exists():
            return mine
        if self._tail is None:
            self._tail = LogTail(self.out / "metrics.jsonl")
        self._tail.poll()
        events = self._tail.events
        if len(mine) > sum(e.get("event") == "step" for e in events):
            events = [e for e in events if e.get("event") != "step"] + mine
        return events

    def timeline(self) -> dict | None:
        return self.pipeline.timeline.snapshot() if self.pipeline is not None else None

    SAFE_KNOBS = ("lr", "temperature", "max_staleness", "top_p", "kl_coef", "tis_cap", "clip_low", "clip_high")

    def export(self, out: str) -> dict:
        """The adapter merged into the base model, a transformers folder with the tokenizer at `out` (export.py)."""
        return export_merged(self.out, out)

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

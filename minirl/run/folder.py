"""The run folder (out_dir) as one run sees it: checked before anything loads, claimed (locked, replaced on
overwrite, its log opened) once everything loaded, and left with a checkpoint, the adapter and summary.json
however the run ends. The files and their atomic writes are `checkpoint.py`'s.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from minirl.config import Config
from minirl.core import lifecycle
from minirl.core.metrics import MetricsLog
from minirl.run.checkpoint import (
    atomic_text,
    check_out_dir,
    clear_run,
    lock_out_dir,
    mark_run,
    past_steps,
    save_adapter,
    save_checkpoint,
)
from minirl.run.trackers import make_tracker
from minirl.types import Checkpointable


class RunDir:
    """`resume`: continue the run in `out`; `overwrite`: replace it; neither: refuse a folder that holds one."""

    def __init__(self, out: str | Path, resume: bool, overwrite: bool):
        self.out, self.resume, self.overwrite = Path(out), resume, overwrite
        self.log: MetricsLog | None = None
        self.tracker = None
        self._lock = None
        self._saved_step: int | None = None

    def check(self) -> None:
        """Before anything loads: refuse a bad out_dir in one line; remove what killed runs left in shared memory."""
        check_out_dir(self.out, self.resume, self.overwrite)
        lifecycle.sweep_stale()

    def claim(self, cfg: Config, step: int, version: int, info: dict[str, Any]) -> tuple[list[dict], float | None]:
        """Make out_dir this run's: replace an old run (overwrite), or continue its log (resume). Returns the step
        events kept from before `step` and the accuracy measured before training (resume), else ([], None)."""
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock = lock_out_dir(self.out)
        if self.overwrite:
            clear_run(self.out)
        mark_run(self.out)  # --overwrite deletes run files only in a folder carrying this
        self.tracker = make_tracker(cfg.report_to, self.out, cfg.to_dict(), self.resume)
        kept = past_steps(self.out, step) if self.resume else ([], None)
        self.log = MetricsLog(self.out / "metrics.jsonl", append=self.resume)
        if self.resume:
            self.log.log("resume", step=step, version=version, **info)
        else:
            atomic_text(self.out / "config.yaml", cfg.to_yaml())
            self.log.log("start", **info)
        return kept

    @property
    def claimed(self) -> bool:
        return self.log is not None

    def checkpoint(self, trainer: Checkpointable, state: dict, keep: int) -> None:
        """A checkpoint after `state['step']` steps (nothing when that step is saved already), logged."""
        if self._saved_step == state["step"]:
            return
        path = save_checkpoint(self.out, trainer, state, keep)
        self.log.log("checkpoint", step=state["step"], version=trainer.version, path=path and str(path),
                     **({} if path else {"skipped": "the adapter holds non-finite values"}))
        self._saved_step = state["step"]

    def save_final(self, trainer: Checkpointable, summary: dict) -> None:
        """The adapter (never a non-finite one) and summary.json, each written atomically."""
        if trainer.adapter_is_finite():
            save_adapter(trainer, self.out / "adapter")
            summary["adapter"] = str(self.out / "adapter")
        else:
            summary["adapter"] = None
            summary["adapter_not_saved"] = "non-finite weights"
        atomic_text(self.out / "summary.json", json.dumps(summary, indent=2))

    def close_tracker(self) -> None:
        tracker, self.tracker = self.tracker, None
        if tracker is not None:
            tracker.close()

    def release(self) -> None:
        """Free out_dir for the next run."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()

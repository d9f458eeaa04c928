"""A run read after the fact: its folder, its metrics.jsonl or its step records, as the dashboard reads a live one
(`types.RunView`): never running, no controls, its events read from the file as it grows."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from minirl.core.metrics import LogTail, load_events, log_path
from minirl.types import RunStatus


class SavedRun:
    """`source`: a run folder, its metrics.jsonl, or a list of events / step records."""
    controllable = False

    def __init__(self, source: str | Path | Sequence[dict]):
        self.source = source
        self.on_step: list[Callable[[dict], None]] = []  # a saved run takes no steps
        self.log_path = log_path(source) if isinstance(source, (str, Path)) else None
        self._tail = LogTail(self.log_path) if self.log_path is not None else None

    def status(self) -> RunStatus:
        return RunStatus("saved", log_path=self.log_path)

    def events(self) -> list[dict]:
        if self._tail is None:
            return load_events(self.source)
        self._tail.poll()
        return self._tail.events

    def timeline(self) -> dict | None:
        return None

    def _refuse(self, *_: Any, **__: Any) -> None:
        raise RuntimeError("a saved run has no controls: start a minirl.Run to pause, resume, stop or set it")

    pause = resume = stop = set = _refuse

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        summary = self.log_path.parent / "summary.json" if self.log_path is not None else None
        return json.loads(summary.read_text()) if summary is not None and summary.is_file() else {}

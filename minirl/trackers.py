"""Optional experiment trackers (`report_to`): every step's metrics, under the names of metrics.jsonl, also go to
trackio or TensorBoard. metrics.jsonl stays the record; a tracker is a view of it.

Names: a step event's numeric fields as they are (`reward/mean`, `loss`, ...); an eval event's accuracy as
`eval/accuracy`. The x axis is the step event's `step` (0-based), an eval's its `step` (steps done).
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Protocol

from .config import ConfigError

PACKAGES = {"trackio": "trackio", "tensorboard": "tensorboard"}


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_tracker(report_to: str | None) -> None:
    """Fail before the model loads when the tracker's package is missing."""
    if report_to and importlib.util.find_spec(PACKAGES[report_to]) is None:
        raise ConfigError(f"report_to={report_to!r} needs the {PACKAGES[report_to]} package: "
                          f"pip install 'minirl[{report_to}]' (or drop report_to)")


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of an event (lists, strings and None are not metrics a tracker plots)."""
    return {k: float(v) for k, v in rec.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step"}


class TensorBoardTracker:
    """Event files in out_dir/tensorboard (`tensorboard --logdir out_dir/tensorboard`)."""

    def __init__(self, out: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class TrackioTracker:
    """A local trackio run (project 'minirl', named after out_dir; `trackio show --project minirl`), in trackio's
    own folder (TRACKIO_DIR). No dashboard server is started and nothing is sent anywhere unless trackio's own
    settings (TRACKIO_SPACE_ID, TRACKIO_SERVER_URL) ask for it. A resumed run continues the same trackio run."""

    def __init__(self, out: Path, config: dict, resume: bool):
        import trackio
        self.run = trackio.init(project="minirl", name=str(out), config=config, resume="allow" if resume else "never",
                                embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def make_tracker(report_to: str | None, out: Path, config: dict, resume: bool) -> Tracker | None:
    if report_to is None:
        return None
    check_tracker(report_to)
    if report_to == "tensorboard":
        return TensorBoardTracker(out)
    return TrackioTracker(out, config, resume)

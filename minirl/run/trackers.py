"""Optional experiment trackers (`report_to`): every step's metrics, under the names of metrics.jsonl, also go to
trackio, TensorBoard or Weights & Biases. metrics.jsonl stays the record; a tracker is a view of it.

Names: a step event's numeric fields as they are (`reward/mean`, `loss`, ...); an eval event's accuracy as
`eval/accuracy` (its standard error `eval/accuracy_se`, ...). The x axis is the step event's `step` (0-based), an
eval's its `step` (steps done). Each step's logged completions (`log_samples`, the "samples" event) go as a table
named `samples`: a W&B table, a trackio table, a TensorBoard text (a markdown table) at that step.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Protocol

from minirl.config import ConfigError

PACKAGES = {"trackio": "trackio", "tensorboard": "tensorboard", "wandb": "wandb"}


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def samples(self, rows: list[dict], step: int) -> None: ...

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


def sample_table(rows: list[dict]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of a "samples" event's completions (`metrics.sample_rows`): prompt, completion, reward,
    advantage, then each reward function's value as reward/<name> (None: it failed)."""
    names = list(dict.fromkeys(n for r in rows for n in r.get("per_reward") or {}))
    columns = ["prompt", "completion", "reward", "advantage", *(f"reward/{n}" for n in names)]
    return columns, [[r["prompt"], r["completion"], r["reward"], r["advantage"],
                      *((r.get("per_reward") or {}).get(n) for n in names)] for r in rows]


def _markdown(columns: list[str], data: list[list[Any]]) -> str:
    """A markdown table (TensorBoard's text plugin renders one); `|` escaped, line breaks as <br>."""
    def cell(v: Any) -> str:
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in data])


class TensorBoardTracker:
    """Event files in out_dir/tensorboard (`tensorboard --logdir out_dir/tensorboard`)."""

    def __init__(self, out: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def samples(self, rows: list[dict], step: int) -> None:
        self.writer.add_text("samples", _markdown(*sample_table(rows)), step)
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

    def samples(self, rows: list[dict], step: int) -> None:
        import trackio
        columns, data = sample_table(rows)
        self.run.log({"samples": trackio.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class WandbTracker:
    """A Weights & Biases run (project 'minirl' unless WANDB_PROJECT says otherwise, named after out_dir), its
    files in out_dir/wandb. W&B's own settings decide where it goes: `WANDB_MODE=offline` keeps it on the machine
    (`wandb sync out_dir/wandb/offline-run-*` uploads it later). The run id is derived from out_dir, so a resumed
    run continues the same W&B run."""

    def __init__(self, out: Path, config: dict, resume: bool):
        import wandb
        run_id = "minirl-" + hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "minirl"), name=str(out), id=run_id,
                              dir=str(out), config=config, resume="allow" if resume else None,
                              settings=wandb.Settings(console="off", x_disable_stats=True))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def samples(self, rows: list[dict], step: int) -> None:
        import wandb
        columns, data = sample_table(rows)
        self.run.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        """Finish the run; then W&B's service process (wandb-core) ends too, unless another W&B run of this process
        (the user's own) still uses it."""
        import wandb
        self.run.finish()
        if wandb.run is None:
            wandb.teardown()


def make_tracker(report_to: str | None, out: Path, config: dict, resume: bool) -> Tracker | None:
    if report_to is None:
        return None
    check_tracker(report_to)
    if report_to == "tensorboard":
        return TensorBoardTracker(out)
    if report_to == "wandb":
        return WandbTracker(out, config, resume)
    return TrackioTracker(out, config, resume)

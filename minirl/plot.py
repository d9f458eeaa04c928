"""Static plots from a run's history or its saved JSONL log (the live dashboard builds on the same data)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


def reward_curve(history: Sequence[dict], path: str | Path) -> Path:
    from matplotlib.figure import Figure  # no pyplot: works in scripts and never changes a notebook's backend

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.add_subplot()
    ax.plot([h["step"] for h in history], [h["reward/mean"] for h in history], marker=".", label="reward/mean")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)

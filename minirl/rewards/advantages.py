"""Advantages from rewards: centred within each group, scaled by the group's std, the step's, or not at all.

Where this departs from the GRPO paper: dividing by the group std is optional (Dr. GRPO drops it), and may use the
std of the whole step's rewards instead ("batch", as TRL's scale_rewards="batch"). Failed rewards (`None`) are left
out of the baseline and get advantage 0.
"""
from __future__ import annotations

import torch


def _mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and population std, in float64."""
    t = torch.tensor(xs, dtype=torch.float64)
    return t.mean().item(), t.std(unbiased=False).item()


def group_advantages(rewards: list[float | None], scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """Group-relative advantages. `None` rewards (failed or skipped samples) are excluded from the baseline
    and get advantage 0. A group with fewer than two valid samples, or with zero spread, gets all zeros."""
    valid = [r for r in rewards if r is not None]
    if len(valid) < 2:
        return [0.0] * len(rewards)
    mean, std = _mean_std(valid)
    if std < eps:
        return [0.0] * len(rewards)
    scale = std + eps if scale_by_std else 1.0
    return [0.0 if r is None else (r - mean) / scale for r in rewards]


def batch_scale(rewards: list[list[float | None]], eps: float = 1e-6) -> float:
    """The divisor of `scale_rewards="batch"`: the std (population) of every valid reward of the step's groups,
    plus eps. Each group's advantages stay centred on its own mean; only the scale is the batch's."""
    valid = [r for g in rewards for r in g if r is not None]
    if len(valid) < 2:
        return 1.0
    return _mean_std(valid)[1] + eps

"""Advantages from rewards, computed once per step: `step_advantages` over the step's groups is the only place
they are made (the run loop calls it on each batch before training; the reward lab on its preview).

Each group is centred on the mean of its valid rewards, then divided by its own std ('group', GRPO), by the std of
every valid reward of the step ('batch', TRL's scale_rewards="batch") or by nothing ('none', Dr. GRPO). Where this
departs from the GRPO paper: the std division is optional and may be the step's. A failed reward (`None`) is left
out of its group's baseline and gets advantage 0; a group without spread (`informative` false: fewer than two valid
rewards, or all equal) gets all zeros at every scale. Dynamic sampling (the pipeline) replaces such groups, and the
trainer leaves zero-advantage samples out of the loss unless the KL term or `train_zero_adv` wants them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from minirl.types import RewardFailure, ScoredGroup

EPS = 1e-6


def _mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and population std, in float64."""
    t = torch.tensor(xs, dtype=torch.float64)
    return t.mean().item(), t.std(unbiased=False).item()


def informative(rewards: Sequence[float | None], eps: float = EPS) -> bool:
    """Whether a group's rewards can teach: at least two valid ones, with a spread (std) of at least `eps`."""
    valid = [r for r in rewards if r is not None]
    return len(valid) >= 2 and _mean_std(valid)[1] >= eps


def group_advantages(rewards: Sequence[float | None], scale_by_std: bool = True, eps: float = EPS) -> list[float]:
    """One group's advantages: centred on its valid mean, divided by its std + eps when `scale_by_std`. `None`
    rewards are out of the baseline and get 0; a group that is not `informative` gets all zeros."""
    if not informative(rewards, eps):
        return [0.0] * len(rewards)
    mean, std = _mean_std([r for r in rewards if r is not None])
    scale = std + eps if scale_by_std else 1.0
    return [0.0 if r is None else (r - mean) / scale for r in rewards]


def batch_scale(groups: Sequence[Sequence[float | None]], eps: float = EPS) -> float:
    """The divisor of scale_rewards="batch": the population std of every valid reward of the step's groups, + eps."""
    valid = [r for g in groups for r in g if r is not None]
    if len(valid) < 2:
        return 1.0
    return _mean_std(valid)[1] + eps


def step_advantages(groups: Sequence[ScoredGroup], scale_rewards: str) -> list[ScoredGroup]:
    """The step's groups with their advantages set (module docstring): `scale_rewards` is 'group', 'batch' or
    'none'. A group whose advantages come out non-finite (cannot happen with clipped rewards) is never trained on:
    its rewards become None and its advantages 0, with one failure per sample saying why."""
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r}: use 'group', 'batch' or 'none'")
    divisor = batch_scale([g.rewards for g in groups]) if scale_rewards == "batch" else 1.0
    out = []
    for g in groups:
        adv = group_advantages(g.rewards, scale_by_std=scale_rewards == "group")
        if scale_rewards == "batch":
            adv = [a / divisor for a in adv]
        if all(math.isfinite(a) for a in adv):
            out.append(dataclasses.replace(g, advantages=tuple(adv)))
        else:
            bad = tuple(RewardFailure("advantage", i, f"non-finite advantage {a}") for i, a in enumerate(adv)
                        if not math.isfinite(a))
            out.append(dataclasses.replace(g, rewards=(None,) * len(adv), advantages=(0.0,) * len(adv),
                                           failures=g.failures + bad))
    return out

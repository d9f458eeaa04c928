"""Advantages from rewards, computed once per step: `step_advantages` over the step's groups is the only place
they are made (the run loop calls it on each batch before training; the reward lab on its preview), with the
config's choices (`AdvantageSettings.from_config`). Three stages, each a field of the config:

1. What the estimator sees (`reward_normalization`): 'sum', each sample's weighted sum of its rewards (the scorer's
   total, as TRL's default 'sum_then_normalize'); or 'per-reward' (GDPO, TRL's multi_objective_aggregation=
   'normalize_then_sum'): each weighted reward function's values centred on the group's mean and divided by their
   group std (+ eps; a function without spread in the group adds 0), then weighted and summed.
2. The baseline (`advantage_estimator`): 'group' subtracts the group's mean (GRPO); 'rloo' the mean of the *other*
   samples, r_i - mean_{j!=i} r_j = n/(n-1) (r_i - mean) over the group's n valid samples (RLOO, Ahmadian et al.
   2024; TRL's RLOOTrainer, SkyRL, verl); 'reinforce++' subtracts the group's mean and divides by the std of those
   centred values over the whole step (REINFORCE++-baseline, Hu et al. 2025: verl's reinforce_plus_plus_baseline,
   OpenRLHF's reinforce_baseline; not the plain REINFORCE++, which has no group baseline).
3. The divisor (`scale_rewards`): the group's reward std ('group', GRPO), the std of every valid reward of the step
   ('batch', TRL's scale_rewards="batch") or nothing ('none', Dr. GRPO; plain RLOO). 'reinforce++' is batch-scaled
   by definition: it takes only 'batch', meaning its own divisor (the step's std of the *centred* values).

Where this departs from the papers: every std is the population std of the valid samples, + 1e-6 (TRL: unbiased,
+ 1e-4; verl whitens token-weighted, unbiased, rsqrt(var + 1e-8)); REINFORCE++'s whitening weighs each sample once,
not each token, and skips the re-centring (the step's mean of group-centred values is 0 already). TRL's
normalize_then_sum is 'per-reward' with scale_rewards 'batch', which the config picks when scale_rewards is unset.
RLOO here may also be divided by a std (scale_rewards 'group' / 'batch'; TRL and SkyRL do not; TRL's
normalize_advantages=True, a whitening over the batch, is 'reinforce++' here when every group has the same number
of valid samples: the n/(n-1) cancels in the division).

A failed reward (`None` total) is left out of its group's baseline and of every std, and gets advantage 0; with
'per-reward' too (a sample whose weighted reward failed has no total; TRL would keep its other rewards). A group
whose estimator input has no spread (`informative` false: fewer than two valid values, or all equal) gets all zeros
with every estimator and scale. Dynamic sampling (the pipeline) replaces such groups, judged by the same input
(`AdvantageSettings.informative`), and the trainer leaves zero-advantage samples out of the loss unless the KL term
or `train_zero_adv` wants them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from minirl.config.presets import ADVANTAGE_ESTIMATORS, REWARD_NORMALIZATIONS, SCALE_REWARDS
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


def rloo_advantages(rewards: Sequence[float | None], eps: float = EPS) -> list[float]:
    """One group's leave-one-out advantages r_i - mean_{j!=i} r_j over its n valid rewards (= n/(n-1) times the
    group-centred ones). `None` rewards are out of every baseline and get 0; a group that is not `informative` gets
    all zeros."""
    n = sum(r is not None for r in rewards)
    factor = n / (n - 1) if n >= 2 else 0.0  # fewer than two valid: not informative, all zeros anyway
    return [a * factor for a in group_advantages(rewards, scale_by_std=False, eps=eps)]


def batch_scale(groups: Sequence[Sequence[float | None]], eps: float = EPS) -> float:
    """The divisor of scale_rewards="batch": the population std of every valid reward of the step's groups, + eps
    (1 with fewer than two). REINFORCE++ passes its group-centred values here instead of the rewards."""
    valid = [r for g in groups for r in g if r is not None]
    if len(valid) < 2:
        return 1.0
    return _mean_std(valid)[1] + eps


def per_reward_totals(group: ScoredGroup, eps: float = EPS) -> tuple[float | None, ...]:
    """'per-reward' normalisation (GDPO): each weighted reward function's values over the group's valid samples,
    centred on their mean and divided by their std + eps (0 without spread), weighted and summed. A sample whose
    total is None (a weighted reward failed) stays None. Needs the weights the scorer records (`reward_weights`)."""
    weighted = {n: w for n, w in group.reward_weights.items() if w != 0}
    if not weighted or any(n not in group.per_reward for n in weighted):
        raise ValueError("reward_normalization='per-reward' needs each reward's values and weight: score the groups "
                         "with minirl.rewards.Scorer (ScoredGroup.per_reward, ScoredGroup.reward_weights)")
    keep = [r is not None and all(group.per_reward[n][i] is not None for n in weighted)
            for i, r in enumerate(group.rewards)]
    out = [0.0 if k else None for k in keep]
    for name, w in weighted.items():
        z = group_advantages([v if k else None for v, k in zip(group.per_reward[name], keep)], eps=eps)
        out = [None if o is None else o + w * zi for o, zi in zip(out, z)]
    return tuple(out)


@dataclass(frozen=True)
class AdvantageSettings:
    """How a step's advantages are made (module docstring): the config's advantage_estimator, scale_rewards (as its
    recipe resolves it) and reward_normalization."""
    estimator: str = "group"
    scale_rewards: str = "group"
    reward_normalization: str = "sum"

    def __post_init__(self) -> None:
        for name, value, choices in (("advantage_estimator", self.estimator, ADVANTAGE_ESTIMATORS),
                                     ("scale_rewards", self.scale_rewards, SCALE_REWARDS),
                                     ("reward_normalization", self.reward_normalization, REWARD_NORMALIZATIONS)):
            if value not in choices:
                raise ValueError(f"{name}={value!r}: use {', '.join(map(repr, choices))}")
        if self.estimator == "reinforce++" and self.scale_rewards != "batch":
            raise ValueError(f"advantage_estimator='reinforce++' divides by the step's std of its centred values: "
                             f"scale_rewards must be 'batch' (got {self.scale_rewards!r})")

    @classmethod
    def from_config(cls, cfg: Any) -> "AdvantageSettings":
        """A `Config`'s settings, scale_rewards as its `recipe` resolves it."""
        return cls(cfg.advantage_estimator, cfg.recipe.scale_rewards, cfg.reward_normalization)

    def inputs(self, group: ScoredGroup) -> tuple[float | None, ...]:
        """What the estimator sees of a group: its totals ('sum') or its per-reward normalised totals."""
        return per_reward_totals(group) if self.reward_normalization == "per-reward" else group.rewards

    def informative(self, group: ScoredGroup) -> bool:
        """Whether the group's advantages can be non-zero (dynamic sampling keeps it): its inputs have spread."""
        return informative(self.inputs(group))


def step_advantages(groups: Sequence[ScoredGroup], settings: AdvantageSettings | str) -> list[ScoredGroup]:
    """The step's groups with their advantages set (module docstring). `settings`: an `AdvantageSettings`, or a
    scale_rewards string ('group', 'batch', 'none') for the group estimator on summed rewards. A group whose
    advantages come out non-finite (cannot happen with clipped rewards) is never trained on: its rewards become
    None and its advantages 0, with one failure per sample saying why."""
    s = AdvantageSettings(scale_rewards=settings) if isinstance(settings, str) else settings
    inputs = [s.inputs(g) for g in groups]
    if s.estimator == "rloo":
        centred = [rloo_advantages(x) for x in inputs]
    else:
        centred = [group_advantages(x, scale_by_std=False) for x in inputs]
    if s.estimator == "reinforce++":  # the step's std of the centred values, every valid sample once
        step = batch_scale([[None if r is None else a for a, r in zip(c, x)] for c, x in zip(centred, inputs)])
    else:
        step = batch_scale(inputs) if s.scale_rewards == "batch" else 1.0
    out = []
    for g, x, c in zip(groups, inputs, centred):
        own = s.scale_rewards == "group" and informative(x)  # else c is all zeros, or the divisor is the step's
        divisor = _mean_std([r for r in x if r is not None])[1] + EPS if own else step
        adv = [a / divisor for a in c]
        if all(math.isfinite(a) for a in adv):
            out.append(dataclasses.replace(g, advantages=tuple(adv)))
        else:
            bad = tuple(RewardFailure("advantage", i, f"non-finite advantage {a}") for i, a in enumerate(adv)
                        if not math.isfinite(a))
            out.append(dataclasses.replace(g, rewards=(None,) * len(adv), advantages=(0.0,) * len(adv),
                                           failures=g.failures + bad))
    return out

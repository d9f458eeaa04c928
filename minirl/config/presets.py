"""The loss's vocabulary as the config knows it: the allowed values of its fields, the `loss_type` presets and
`resolve`, the pure function that gives a config's loss settings. The loss (`minirl.training.loss`) reads these;
the config imports nothing of it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

AGGREGATIONS = ("token-mean", "seq-mean", "constant")
IMPORTANCE_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
OBJECTIVES = ("ppo-clip", "cispo")  # the policy-gradient term (`minirl.training.loss`)
ADVANTAGE_ESTIMATORS = ("group", "rloo", "reinforce++")
REWARD_NORMALIZATIONS = ("sum", "per-reward")

# `loss_type` presets: the Config fields each name sets (a field the user set wins). TRL's names; where two mean
# the same here, they map to the same settings: TRL's 'bnpo' and 'dapo' differ only in whether tokens are counted
# per device micro-batch or over the whole step, and minirl's weights are always over the whole step. 'cispo' is
# TRL's: token-mean over the step, group scaling; its clip range is behav_clip's only (CISPO's own IS-weight bounds
# are cispo_min / cispo_max).
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(loss_agg="seq-mean", scale_rewards="group", clip_low=0.2, clip_high=0.2, importance_level="token",
                 objective="ppo-clip"),
    "dr_grpo": dict(loss_agg="constant", scale_rewards="none", clip_low=0.2, clip_high=0.2, importance_level="token",
                    objective="ppo-clip"),
    "dapo": dict(loss_agg="token-mean", scale_rewards="group", clip_low=0.2, clip_high=0.28, importance_level="token",
                 objective="ppo-clip"),
    "bnpo": dict(loss_agg="token-mean", scale_rewards="group", clip_low=0.2, clip_high=0.28, importance_level="token",
                 objective="ppo-clip"),
    "gspo": dict(loss_agg="seq-mean", scale_rewards="group", clip_low=3e-4, clip_high=4e-4,
                 importance_level="sequence", objective="ppo-clip"),
    "cispo": dict(loss_agg="token-mean", scale_rewards="group", clip_low=0.2, clip_high=0.28,
                  importance_level="token", objective="cispo"),
}
DEFAULT_PRESET = "dapo"  # what the fields left unset follow when loss_type is None
LOSS_FIELDS = ("loss_agg", "scale_rewards", "clip_low", "clip_high", "importance_level", "objective")


@dataclass(frozen=True)
class Recipe:
    """The loss settings a config resolves to (`Config.recipe`): each field as the user set it, else the preset's."""
    loss_agg: str
    scale_rewards: str
    clip_low: float
    clip_high: float
    importance_level: str
    objective: str
    preset: str
    """The preset the unset fields came from: `loss_type`, or DEFAULT_PRESET when it is None."""
    scale_rewards_by: str | None = None
    """When an unset scale_rewards follows the advantage settings rather than the preset: which one
    ('advantage_estimator rloo', ...; `scale_by_advantages`)."""


def scale_by_advantages(advantage_estimator: str = "group",
                        reward_normalization: str = "sum") -> tuple[str, str] | None:
    """What an unset scale_rewards is under these advantage settings, and which setting says so; None: the preset's.
    As their users expect: 'none' for RLOO (TRL's RLOOTrainer and SkyRL scale by no std), 'batch' for REINFORCE++
    (it is batch-normalised) and for per-reward normalisation (TRL's normalize_then_sum normalises over the batch)."""
    if advantage_estimator == "rloo":
        return "none", "advantage_estimator rloo"
    if advantage_estimator == "reinforce++":
        return "batch", "advantage_estimator reinforce++"
    if reward_normalization == "per-reward":
        return "batch", "reward_normalization per-reward"
    return None


def resolve(loss_type: str | None, given: Mapping[str, Any], advantage_estimator: str = "group",
            reward_normalization: str = "sum") -> Recipe:
    """The `Recipe` of a config whose `loss_type` is `loss_type` and whose LOSS_FIELDS are `given` (None = unset);
    an unset scale_rewards follows the advantage settings where `scale_by_advantages` says so. A pure function: the
    config stores only what the user set, and every reader resolves the rest through it."""
    preset = loss_type or DEFAULT_PRESET
    values = {**PRESETS[preset]}
    by = scale_by_advantages(advantage_estimator, reward_normalization) if given.get("scale_rewards") is None else None
    if by is not None:
        values["scale_rewards"] = by[0]
    return Recipe(**{k: values[k] if given.get(k) is None else given[k] for k in LOSS_FIELDS}, preset=preset,
                  scale_rewards_by=by[1] if by else None)


# The demo (`minirl demo`): GRPO on the built-in arithmetic task with the embedded model, sized for 2 CPU cores
# (its time: BENCHMARKS.md). `minirl bench learning` runs this same config.
# token_budget=512: on CPU smaller micro-batches cost no time and much less memory (BENCHMARKS.md, "Memory").
DEMO = dict(steps=30, prompts_per_step=8, group_size=8, max_tokens=24, temperature=1.0, lr=5e-4, eval_size=64,
            checkpoint_every=2, token_budget=512, out_dir="runs/demo")

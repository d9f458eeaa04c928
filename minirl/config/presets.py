"""The loss's vocabulary as the config knows it: the allowed values of its fields and the `loss_type` presets (the
Config fields each name sets). The loss (`minirl.training.loss`) reads these; the config imports nothing of it."""
from __future__ import annotations

AGGREGATIONS = ("token-mean", "seq-mean", "constant")
IMPORTANCE_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")

# `loss_type` presets: the Config fields each name sets (a field the user set explicitly wins). TRL's names; where
# two mean the same here, they map to the same settings: TRL's 'bnpo' and 'dapo' differ only in whether tokens are
# counted per device micro-batch or over the whole step, and minirl's weights are always over the whole step.
PRESETS: dict[str, dict[str, object]] = {
    "grpo": dict(loss_agg="seq-mean", scale_rewards="group", clip_low=0.2, clip_high=0.2, importance_level="token"),
    "dr_grpo": dict(loss_agg="constant", scale_rewards="none", clip_low=0.2, clip_high=0.2, importance_level="token"),
    "dapo": dict(loss_agg="token-mean", scale_rewards="group", clip_low=0.2, clip_high=0.28, importance_level="token"),
    "bnpo": dict(loss_agg="token-mean", scale_rewards="group", clip_low=0.2, clip_high=0.28, importance_level="token"),
    "gspo": dict(loss_agg="seq-mean", scale_rewards="group", clip_low=3e-4, clip_high=4e-4,
                 importance_level="sequence"),
}

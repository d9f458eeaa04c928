"""`Config`'s methods, apart from its fields (`fields.py` holds the fields and their docstrings, the config
reference): the check run after construction, the loss recipe the fields resolve to, and the conversions."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Self

from minirl.config.io import from_dict, from_yaml, to_yaml, translate_aliases
from minirl.config.presets import LOSS_FIELDS, Recipe, resolve
from minirl.config.validate import validate


class ConfigMethods:
    """Mixed into the frozen `Config` dataclass: every method reads its fields, none writes them."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def recipe(self) -> Recipe:
        """The loss settings this config resolves to: the loss fields as set, the rest from `loss_type`'s preset (an
        unset scale_rewards may follow the advantage settings instead: `presets.scale_by_advantages`)."""
        return resolve(self.loss_type, {k: getattr(self, k) for k in LOSS_FIELDS}, self.advantage_estimator,
                       self.reward_normalization)

    @property
    def scale_adv_by_std(self) -> bool:
        """The old name: whether advantages are divided by the group std (scale_rewards == 'group')."""
        return self.recipe.scale_rewards == "group"

    @property
    def max_model_len(self) -> int:
        """The longest sequence a generation engine must hold: the prompt plus the completion, or with an `env` the
        whole episode (its later turns follow the opening prompt)."""
        return self.max_prompt_tokens + (self.max_episode_tokens if self.env else self.max_tokens)

    def validate(self) -> None:
        """Raise one `ConfigError` naming the field and the fix for a bad setting (`validate.py`)."""
        validate(self)

    # --- conversions ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def to_yaml(self, path: str | Path | None = None) -> str:
        return to_yaml(self, path)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """A Config from a mapping; an unknown field is one ConfigError with the closest known name."""
        return from_dict(cls, d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Self:
        """Read a YAML file of `field: value` lines; every problem is one ConfigError naming the file."""
        return from_yaml(cls, path)

    def replace(self, **kw: Any) -> Self:
        """A copy with `kw` changed (old field names accepted). The loss fields left to the preset stay so: they
        follow a new loss_type."""
        return dataclasses.replace(self, **translate_aliases(kw))

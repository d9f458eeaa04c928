"""The data that flows through a run: small frozen dataclasses with named fields.

prompt ─► Generator ─► Group (G Completions) ─► Scorer ─► ScoredGroup ─► Trainer (Batch)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """How a generator samples. `seed` makes a request's samples reproducible (per prompt and visit)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 48
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids after the chat template, its text, and the other dataset columns."""
    index: int
    token_ids: tuple[int, ...]
    text: str
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Completion:
    """One sampled completion. Every token carries its behaviour logprob (the log-probability it was sampled
    with, temperature applied) and the policy version that produced it."""
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" (EOS / stop string) or "length" (cut by max_tokens)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True)
class Group:
    """G completions of one prompt: the unit of advantage computation. `temperature`: what they were sampled at
    (the trainer takes their logprobs at it, even if the run's temperature changed since)."""
    prompt: Prompt
    completions: tuple[Completion, ...]
    temperature: float = 1.0

    @property
    def oldest_version(self) -> int:
        return min((v for c in self.completions for v in c.versions), default=0)


@dataclass(frozen=True)
class RewardFailure:
    """A reward function that raised, timed out, or returned something that is not a finite number."""
    reward: str
    sample: int
    reason: str


@dataclass(frozen=True)
class ScoredGroup:
    """A group after scoring. `rewards[i]` is None when sample i is excluded (a failed or skipped reward);
    excluded samples get advantage 0 and take no part in the group's baseline or the loss."""
    group: Group
    rewards: tuple[float | None, ...]
    per_reward: dict[str, tuple[float | None, ...]]
    advantages: tuple[float, ...]
    failures: tuple[RewardFailure, ...] = ()
    reward_versions: dict[str, str] = field(default_factory=dict)  # reward name -> source hash

    @property
    def included(self) -> tuple[bool, ...]:
        return tuple(r is not None for r in self.rewards)

    @property
    def zero_advantage(self) -> bool:
        return all(a == 0.0 for a in self.advantages)

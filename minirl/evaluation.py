"""Held-out evaluation: greedy accuracy, the first reward function being the metric."""
from __future__ import annotations

from typing import Callable, Sequence

from .rewards import Scorer
from .types import Prompt, RolloutSource, SamplingParams


def evaluate(generator: RolloutSource, prompts: Sequence[Prompt], scorer: Scorer, max_tokens: int,
             progress: Callable[[int, int], None] | None = None, chunk: int = 16) -> float:
    """Greedy accuracy on held-out prompts: the mean of the *first* reward function (the reward is the metric).
    Generated `chunk` prompts at a time, calling `progress(done, total)` after each."""
    if not prompts:
        return float("nan")
    name = scorer.rewards[0][0]
    scores: list[float | None] = []
    for i in range(0, len(prompts), chunk):
        groups = generator.generate(prompts[i:i + chunk], 1, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        scores += [sg.per_reward[name][0] for sg in scorer.score_groups(groups, names=[name])]
        if progress is not None:
            progress(len(scores), len(prompts))
    return sum(0.0 if v is None else v for v in scores) / len(scores)  # a failed score counts as wrong

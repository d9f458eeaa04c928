"""Held-out evaluation: greedy accuracy (the first reward function being the metric) and each reward's greedy mean;
with `samples` = k > 0 also k sampled completions per prompt, giving mean@k and pass@k of each reward.

pass@k is Chen et al.'s (2021) unbiased estimator 1 - C(n - c, k) / C(n, k) over n samples of which c pass; here
n = k samples are drawn, where it is exactly "at least one of the k passes", averaged over prompts. A sample
passes when its reward is positive (> 0); a failed reward neither counts nor passes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import comb
from typing import Callable, Sequence

from minirl.config import Config
from minirl.rewards import Scorer
from minirl.types import Prompt, RolloutSource, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c passed (Chen et al. 2021, eq. 1)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: `accuracy` (greedy, first reward), `greedy` (each reward's greedy mean), and with k > 0
    sampled completions per prompt, `mean_at_k` and `pass_at_k` per reward."""
    accuracy: float
    greedy: dict[str, float] = field(default_factory=dict)
    k: int = 0
    mean_at_k: dict[str, float] = field(default_factory=dict)
    pass_at_k: dict[str, float] = field(default_factory=dict)

    def fields(self) -> dict:
        """What the eval event and summary.json record."""
        out: dict = {"accuracy": self.accuracy, "greedy": self.greedy}
        if self.k:
            out.update(k=self.k, mean_at_k=self.mean_at_k, pass_at_k=self.pass_at_k)
        return out

    def scalars(self) -> dict[str, float]:
        """The tracker's names (`minirl.core.metrics.METRICS`: eval/...)."""
        out = {"eval/accuracy": self.accuracy, **{f"eval/greedy/{n}": v for n, v in self.greedy.items()}}
        out.update({f"eval/mean@k/{n}": v for n, v in self.mean_at_k.items()})
        out.update({f"eval/pass@k/{n}": v for n, v in self.pass_at_k.items()})
        return out


def _scores(generator: RolloutSource, prompts: Sequence[Prompt], scorer: Scorer, n: int, params: SamplingParams,
            chunk: int, progress: Callable[[int], None]) -> list[dict[str, list[float | None]]]:
    """Each prompt's rewards by name, one value per completion (None: the reward failed)."""
    out = []
    for i in range(0, len(prompts), chunk):
        groups = generator.generate(prompts[i:i + chunk], n, params)
        out += [{name: list(v) for name, v in sg.per_reward.items()} for sg in scorer.score_groups(groups)]
        progress(min(i + chunk, len(prompts)))
    return out


def eval_options(cfg: Config, step: int) -> dict:
    """`evaluate`'s keywords from a Config: eval_samples, eval_temperature, the run's stop strings, min_p and
    repetition penalty (the held-out samples are drawn as training draws), seeded by the run's seed and `step`."""
    return dict(samples=cfg.eval_samples, temperature=cfg.eval_temperature, seed=cfg.seed * 100_003 + 7_919 + step,
                base=SamplingParams(stop=tuple(cfg.stop), min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty))


def evaluate(generator: RolloutSource, prompts: Sequence[Prompt], scorer: Scorer, max_tokens: int,
             progress: Callable[[int, int], None] | None = None, chunk: int = 16, samples: int = 0,
             temperature: float = 1.0, base: SamplingParams | None = None, seed: int = 0) -> EvalResult:
    """Greedy accuracy on held-out prompts: the mean of the *first* reward function (the reward is the metric); a
    failed score counts as wrong. `samples` = k > 0: also k completions per prompt at `temperature` (seeded by
    `seed`). `base`: the run's other sampling settings (stop strings, min_p, repetition penalty). Generated `chunk`
    prompts at a time, calling `progress(done, total)` (sampled prompts count after the greedy ones)."""
    if not prompts:
        return EvalResult(float("nan"))
    names = [n for n, _ in scorer.rewards]
    total = len(prompts) * (2 if samples else 1)
    report = (lambda done: progress(done, total)) if progress is not None else (lambda done: None)
    base = base or SamplingParams()
    greedy_p = replace(base, temperature=0.0, max_tokens=max_tokens, seed=None)
    greedy = _scores(generator, prompts, scorer, 1, greedy_p, chunk, report)
    means = {n: sum(0.0 if s[n][0] is None else s[n][0] for s in greedy) / len(greedy) for n in names}
    if not samples:
        return EvalResult(means[names[0]], means)
    sampled_p = replace(base, temperature=temperature, max_tokens=max_tokens, seed=seed)
    sampled = _scores(generator, prompts, scorer, samples, sampled_p, chunk,
                      lambda done: report(len(prompts) + done))
    mean_k = {n: sum(sum(0.0 if v is None else v for v in s[n]) / samples for s in sampled) / len(sampled)
              for n in names}
    pass_k = {n: sum(pass_at_k(samples, sum(v is not None and v > 0 for v in s[n]), samples) for s in sampled)
              / len(sampled) for n in names}
    return EvalResult(means[names[0]], means, samples, mean_k, pass_k)

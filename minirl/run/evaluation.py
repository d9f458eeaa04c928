"""Held-out evaluation: greedy accuracy (the first reward function being the metric) and each reward's greedy mean;
with `samples` = k > 0 also k sampled completions per prompt, giving mean@k and pass@k of each reward. Each figure
is a mean over the eval prompts with its standard error across them (`minirl.core.stats`: sample std / sqrt(n))
and 95 % interval; each prompt's own scores are kept (`EvalResult.problems`) for paired comparisons (`compare`).

pass@k is Chen et al.'s (2021) unbiased estimator 1 - C(n - c, k) / C(n, k) over n samples of which c pass; here
n = k samples are drawn, where it is exactly "at least one of the k passes", averaged over prompts. A sample
passes when its reward is positive (> 0); a failed reward neither counts nor passes.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from math import comb
from typing import Callable, Sequence

from minirl.config import Config
from minirl.core.stats import interval95, mean_se
from minirl.rewards import Scorer
from minirl.types import Prompt, RolloutSource, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c passed (Chen et al. 2021, eq. 1)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def problem_id(p: Prompt) -> str:
    """A held-out problem's identity across runs: a hash of its text and its other columns (the answer), not of its
    tokens (two models' runs on the same problems pair up)."""
    key = json.dumps([p.text, p.columns], sort_keys=True, default=str)
    return hashlib.sha1(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: `accuracy` (greedy, first reward), `greedy` (each reward's greedy mean), and with k > 0
    sampled completions per prompt, `mean_at_k` and `pass_at_k` per reward. `se`: each figure's standard error
    across the prompts, by its tracker name less `eval/` ("accuracy", "greedy/<reward>", "mean@k/<reward>",
    "pass@k/<reward>"); `problems`: per prompt {"index", "id", "scores"}, the scores under the same names."""
    accuracy: float
    greedy: dict[str, float] = field(default_factory=dict)
    k: int = 0
    mean_at_k: dict[str, float] = field(default_factory=dict)
    pass_at_k: dict[str, float] = field(default_factory=dict)
    se: dict[str, float | None] = field(default_factory=dict)
    problems: tuple[dict, ...] = ()

    @classmethod
    def from_problems(cls, names: Sequence[str], k: int, problems: Sequence[dict]) -> "EvalResult":
        """The means and standard errors of the prompts' scores (`names`: the rewards, the first being accuracy's)."""
        keys = dict.fromkeys(key for p in problems for key in p["scores"])
        stats = {key: mean_se([p["scores"][key] for p in problems]) for key in keys}
        by = {key: m for key, (m, _) in stats.items()}
        return cls(by["accuracy"], {n: by[f"greedy/{n}"] for n in names}, k,
                   {n: by[f"mean@k/{n}"] for n in names} if k else {},
                   {n: by[f"pass@k/{n}"] for n in names} if k else {},
                   {key: se for key, (_, se) in stats.items()}, tuple(problems))

    def _of(self, prefix: str, values: dict[str, float]) -> dict[str, float | None]:
        return {n: self.se.get(f"{prefix}/{n}") for n in values}

    def fields(self) -> dict:
        """What the eval event and summary.json record: the means, their standard errors (`*_se`, None for one
        prompt), `n` prompts, and `ci95`: each figure's 95 % interval [lo, hi] by its name less `eval/` (Wilson's
        for 0/1 scores: `core.stats.interval95`)."""
        out: dict = {"accuracy": self.accuracy, "accuracy_se": self.se.get("accuracy"), "n": len(self.problems),
                     "greedy": self.greedy, "greedy_se": self._of("greedy", self.greedy)}
        if self.k:
            out.update(k=self.k, mean_at_k=self.mean_at_k, mean_at_k_se=self._of("mean@k", self.mean_at_k),
                       pass_at_k=self.pass_at_k, pass_at_k_se=self._of("pass@k", self.pass_at_k))
        out["ci95"] = {key[5:]: list(ci) for key in self._means()
                       if (ci := interval95([p["scores"][key[5:]] for p in self.problems])) is not None}
        return out

    def _means(self) -> dict[str, float]:
        out = {"eval/accuracy": self.accuracy, **{f"eval/greedy/{n}": v for n, v in self.greedy.items()}}
        out.update({f"eval/mean@k/{n}": v for n, v in self.mean_at_k.items()})
        out.update({f"eval/pass@k/{n}": v for n, v in self.pass_at_k.items()})
        return out

    def scalars(self) -> dict[str, float]:
        """The tracker's names (`minirl.core.metrics.METRICS`: eval/...), each mean's standard error as `<name>_se`."""
        out = {}
        for key, v in self._means().items():
            out[key] = v
            if (se := self.se.get(key[5:])) is not None:
                out[f"{key}_se"] = se
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
    scores = [{f"greedy/{n}": 0.0 if s[n][0] is None else s[n][0] for n in names} for s in greedy]
    for sc in scores:
        sc["accuracy"] = sc[f"greedy/{names[0]}"]
    if samples:
        sampled_p = replace(base, temperature=temperature, max_tokens=max_tokens, seed=seed)
        sampled = _scores(generator, prompts, scorer, samples, sampled_p, chunk,
                          lambda done: report(len(prompts) + done))
        for sc, s in zip(scores, sampled):
            for n in names:
                sc[f"mean@k/{n}"] = sum(0.0 if v is None else v for v in s[n]) / samples
                sc[f"pass@k/{n}"] = pass_at_k(samples, sum(v is not None and v > 0 for v in s[n]), samples)
    problems = [{"index": p.index, "id": problem_id(p), "scores": sc} for p, sc in zip(prompts, scores)]
    return EvalResult.from_problems(names, samples, problems)

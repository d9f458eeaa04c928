"""Means with their standard error, the one convention every figure of minirl's uses (evaluations, `compare`, the
learning benchmarks): se = the sample standard deviation (n - 1 in the denominator) / sqrt(n), and the 95 % interval
mean +- 1.96 se (the normal approximation). For a 0/1 score (greedy accuracy) this is sqrt(p (1 - p) / (n - 1)),
a little above the binomial sqrt(p (1 - p) / n); both agree to within 1 / (2n) relative. An evaluation's interval of
0/1 scores is Wilson's instead (`interval95`): the normal one is [0, 0] at 0 of 32 and leaves [0, 1] near the ends.
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

Z95 = 1.96  # the normal distribution's two-sided 95 % quantile


def mean_se(xs: Sequence[float]) -> tuple[float, float | None]:
    """(mean, standard error) of the values; the standard error is None for fewer than two (nan mean for none)."""
    if not xs:
        return float("nan"), None
    mean = statistics.fmean(xs)
    return mean, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None)


def ci95(mean: float, se: float | None) -> tuple[float, float] | None:
    """The 95 % interval mean +- 1.96 se (None without a standard error)."""
    if se is None or not math.isfinite(mean):
        return None
    return mean - Z95 * se, mean + Z95 * se


def wilson95(p: float, n: int) -> tuple[float, float]:
    """Wilson's score interval for a proportion p of n 0/1 scores: never outside [0, 1], and not empty at p = 0 or
    1 (0 of 32 -> [0, 0.107])."""
    z2 = Z95 * Z95
    centre, half = p + z2 / (2 * n), Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z2 / n)), min(1.0, (centre + half) / (1 + z2 / n))


def interval95(xs: Sequence[float]) -> tuple[float, float] | None:
    """The 95 % interval of the mean of `xs`: Wilson's when every value is 0 or 1 (an accuracy), else mean +- 1.96 se;
    None for fewer than two values (as `mean_se`'s standard error)."""
    if len(xs) < 2:
        return None
    if all(x in (0, 1) for x in xs):
        return wilson95(statistics.fmean(xs), len(xs))
    return ci95(*mean_se(xs))

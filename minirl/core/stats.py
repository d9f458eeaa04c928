"""Means with their standard error, the one convention every figure of minirl's uses (evaluations, `compare`, the
learning benchmarks): se = the sample standard deviation (n - 1 in the denominator) / sqrt(n), and the 95 % interval
mean +- 1.96 se (the normal approximation). For a 0/1 score (greedy accuracy) this is sqrt(p (1 - p) / (n - 1)),
a little above the binomial sqrt(p (1 - p) / n); both agree to within 1 / (2n) relative.
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

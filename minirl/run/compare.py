"""`minirl.compare(run_a, run_b)`: two runs' evaluations on the same held-out problems, paired problem by problem.

Each evaluation saves every prompt's scores (an `eval_problems` event in metrics.jsonl, `evaluation.EvalResult`).
The difference b - a is taken per problem and averaged; its standard error is the sample std of those differences
/ sqrt(n) (`minirl.core.stats`), usually far below either run's own, as what makes a problem hard is shared. The
95 % interval is the normal one, mean +- 1.96 se. Problems pair by identity (a hash of text and answer), not order.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from minirl.core.metrics import load_events
from minirl.core.stats import ci95, mean_se
from minirl.types import RunView

Source = str | Path | Sequence[dict] | RunView


@dataclass(frozen=True)
class Comparison:
    """run_b minus run_a on `metric` ("accuracy", "greedy/<reward>", "mean@k/<reward>", "pass@k/<reward>") over
    the `n` problems both evaluated, at steps `step_a` and `step_b`: each run's mean, the mean paired difference
    `diff`, its standard error `se` (None for one problem) and 95 % interval `ci95`."""
    metric: str
    n: int
    step_a: int
    step_b: int
    mean_a: float
    mean_b: float
    diff: float
    se: float | None
    ci95: tuple[float, float] | None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ci95"] = list(self.ci95) if self.ci95 else None
        return d

    def __repr__(self) -> str:
        se = f" ± {self.se:.4f} (se), 95% interval [{self.ci95[0]:+.4f}, {self.ci95[1]:+.4f}]" if self.ci95 else ""
        return (f"Comparison({self.metric}, {self.n} problems paired, steps {self.step_a} / {self.step_b}: "
                f"a {self.mean_a:.4f}, b {self.mean_b:.4f}, b - a {self.diff:+.4f}{se})")


def problem_scores(run: Source, metric: str = "accuracy", step: int | None = None,
                   name: str = "run") -> tuple[int, dict[tuple[str, int], float]]:
    """(step, {(problem id, occurrence): score}) of one evaluation of a run (`step`: the one after that many steps;
    None: the last); ValueError in one line when the run has none or lacks `metric`."""
    evals = [e for e in load_events(run) if e.get("event") == "eval_problems"]
    if not evals:
        raise ValueError(f"{name}: no per-problem eval scores in its log (eval_problems events); runs from before "
                         "they were saved cannot be paired: evaluate the adapter again with this version")
    if step is None:
        ev = max(evals, key=lambda e: e["step"])
    else:
        ev = next((e for e in reversed(evals) if e["step"] == step), None)
        if ev is None:
            raise ValueError(f"{name}: no evaluation after {step} steps (it has: {sorted({e['step'] for e in evals})})")
    seen: Counter = Counter()
    out = {}
    for p in ev["problems"]:
        if metric not in p["scores"]:
            raise ValueError(f"{name}: no {metric!r} per problem (it has: {', '.join(p['scores'])})")
        out[(p["id"], seen[p["id"]])] = p["scores"][metric]
        seen[p["id"]] += 1
    return ev["step"], out


def compare(run_a: Source, run_b: Source, metric: str = "accuracy", step: int | None = None) -> Comparison:
    """run_b minus run_a on `metric`, paired over the held-out problems (each run's last evaluation, or the ones
    after `step` steps). `run_a`, `run_b`: out_dirs (or metrics.jsonl files, or a live `Run`). Refuses in one
    line when the two runs evaluated different problems."""
    step_a, a = problem_scores(run_a, metric, step, "run_a")
    step_b, b = problem_scores(run_b, metric, step, "run_b")
    if set(a) != set(b):
        raise ValueError(f"the runs evaluated different problems ({len(a)} and {len(b)}, {len(set(a) & set(b))} in "
                         "common): compare runs evaluated on the same eval_data (same eval_size and seed)")
    keys = sorted(a)
    diff, se = mean_se([b[k] - a[k] for k in keys])
    return Comparison(metric, len(keys), step_a, step_b, mean_se([a[k] for k in keys])[0],
                      mean_se([b[k] for k in keys])[0], diff, se, ci95(diff, se))

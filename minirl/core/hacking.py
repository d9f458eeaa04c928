"""The reward-hacking watch: the trained reward rising while what it stands for does not. Pure functions over a run's
step and eval records (`run.history`, the log's events), so synthetic histories test them; the doctor shows their
alerts, the run logs each one once (`HackingWatch`).

The rule, in two lines: over the last `WINDOW` steps each series is fitted by least squares, value = a + slope x
step; a series *rises* when slope > T x se(slope), and *keeps up* when slope > se. The watch speaks when the
trained reward (`reward/mean`) rises while (a) a check (a reward of weight 0, `reward/checks`) does not keep up
(flat or falling), (b) the held-out accuracy rose by less than one standard error between two evaluations at least
`WINDOW` steps apart, (c) the completion length rises too, (d) the share of completions repeating a run of 4
tokens (`length/repeat_frac`) rises too.
A check whose value is the same at every step of the window (always passed, always failed) carries no trend and is
left out. One warning per *episode* of a condition: it is repeated only after the condition has been off for a
whole window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

WINDOW = 10  # steps in each trend fit (and between the two evaluations compared)
T = 3.0      # a slope beyond T standard errors is a rise: a flat noisy series passes it about 1 % of the time (t, 8 df)
TOP_SAMPLES = 5  # top-rewarded samples failing a check, shown with its alert


@dataclass(frozen=True)
class Trend:
    """A least-squares line through (step, value) points: slope per step and its standard error."""
    slope: float
    se: float
    n: int
    constant: bool  # every value the same

    @property
    def rises(self) -> bool:
        return self.slope > 0 and self.slope > T * self.se

    def __str__(self) -> str:
        return f"{self.slope:+.3g} ± {self.se:.2g} per step"


def trend(xs: Sequence[float], ys: Sequence[float]) -> Trend | None:
    """The least-squares slope of ys over xs and its standard error (sqrt(residual variance / Sxx), n - 2 degrees
    of freedom); None for fewer than 3 points or a single x."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    ssr = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return Trend(slope, math.sqrt(max(ssr, 0.0) / (n - 2) / sxx), n, max(ys) == min(ys))


def _num(v) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _fit(records: Sequence[dict], key: str) -> Trend | None:
    pts = [(h.get("step", i), _num(h.get(key))) for i, h in enumerate(records)]
    pts = [(x, y) for x, y in pts if y is not None and _num(x) is not None]
    return trend([x for x, _ in pts], [y for _, y in pts])


def checks_of(history: Sequence[dict]) -> list[str]:
    """The checks named by the step records (`reward/checks`), in order of first appearance."""
    names: dict[str, None] = {}
    for h in history:
        for n in h.get("reward/checks") or ():
            names[str(n)] = None
    return list(names)


@dataclass(frozen=True)
class Finding:
    """A condition seen at one step: `key` names the condition (one episode each), `code` the kind."""
    key: str
    code: str
    title: str
    detail: str
    check: str | None = None


def findings_at(steps: Sequence[dict], evals: Sequence[dict] = (), checks: Sequence[str] = ()) -> list[Finding]:
    """The conditions that hold over the last WINDOW of `steps` (records in step order), evaluated now."""
    win = steps[-WINDOW:]
    r = _fit(win, "reward/mean")
    if r is None or r.n < WINDOW or not r.rises:
        return []
    span = f"steps {win[0].get('step')}-{win[-1].get('step')}"
    out = []
    for name in checks:
        c = _fit(win, f"reward/{name}")
        if c is None or c.constant or c.slope > c.se:
            continue
        how = "falls" if c.slope < -T * c.se else "stays flat"
        out.append(Finding(f"check:{name}", "hacking_check", f"reward rises while check {name!r} {how} ({span})",
                           f"The trained reward moves {r}, the check {name!r} (weight 0: logged, not trained on) "
                           f"{c}. The policy may be gaining reward by a way the check rejects: look at the "
                           "top-rewarded samples that fail it, then fix the reward (or give the check a weight).",
                           name))
    for key, code, metric, what, advice in (
            ("length", "hacking_length", "length/mean", ("completion length", "the mean completion length"),
             "Longer answers may be what pays (the classic length exploit): check that the reward does not favour "
             "length, or add a length penalty (overlong_penalty) or a check."),
            ("repeats", "hacking_format", "length/repeat_frac",
             ("repeated text", "the share of completions repeating a run of 4 tokens"),
             "Repetition may be what pays (padding, a phrase the reward counts): look at the samples, then fix the "
             "reward or add a check.")):
        fit = _fit(win, metric)
        if fit is not None and fit.rises:
            out.append(Finding(key, code, f"{what[0]} climbs with the reward ({span})",
                               f"The reward moves {r}, {what[1]} {fit}{' tokens' if key == 'length' else ''}. "
                               + advice))
    f = eval_finding(steps, evals)
    return out + ([f] if f is not None else [])


def accuracy_se(e: dict) -> float | None:
    """An eval event's standard error: its own `accuracy_se`, else sqrt(p (1 - p) / n) (binomial; an upper bound for
    scores in [0, 1]) from its `n` prompts; None when it holds neither."""
    se, p, n = _num(e.get("accuracy_se")), _num(e.get("accuracy")), _num(e.get("n"))
    if se is not None:
        return se
    if p is None or not n:
        return None
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def eval_finding(steps: Sequence[dict], evals: Sequence[dict]) -> Finding | None:
    """(b): at the latest evaluation E (until the next one: one episode across evaluations that agree), against the
    latest one B at least WINDOW steps before it: the reward rose
    over the steps between them while the held-out accuracy rose by less than one standard error. E at 1 (every
    eval prompt right) cannot rise: skipped."""
    last_step = steps[-1].get("step") if steps else None
    ev = [e for e in evals if _num(e.get("accuracy")) is not None and _num(e.get("step")) is not None
          and last_step is not None and e["step"] <= last_step + 1]  # measured after a step so far
    if not ev:
        return None
    e1 = ev[-1]
    e0 = next((e for e in reversed(ev[:-1]) if e["step"] <= e1["step"] - WINDOW), None)
    if e0 is None or e1["accuracy"] >= 1:
        return None
    r = _fit([h for h in steps if e0["step"] <= h.get("step", -1) < e1["step"]], "reward/mean")
    s0, s1 = accuracy_se(e0), accuracy_se(e1)
    if r is None or not r.rises or s0 is None or s1 is None:
        return None
    gain, se = e1["accuracy"] - e0["accuracy"], math.hypot(s0, s1)
    if gain > se:
        return None
    how = "falls" if gain < -se else "stays flat"
    return Finding("eval", "hacking_eval", f"reward rises while the held-out accuracy {how} "
                   f"(steps {e0['step']}-{e1['step']})",
                   f"The trained reward moves {r}; eval accuracy went {e0['accuracy']:.3g} → {e1['accuracy']:.3g} "
                   f"(± {se:.2g}). What the reward pays for may not be what it stands for: compare the samples with "
                   "the held-out answers, then fix the reward.")


def episodes(steps: Sequence[dict], evals: Sequence[dict] = (),
             checks: Sequence[str] | None = None) -> Iterator[tuple[int, Finding]]:
    """(step, finding) once per episode of each condition, in order: each step is judged on the records up to it;
    a condition counts again only after it has been off for WINDOW steps."""
    steps = [h for h in steps if h.get("event", "step") == "step"]
    checks = checks_of(steps) if checks is None else list(checks)
    last_on: dict[str, int] = {}
    for i in range(len(steps)):
        upto = steps[i].get("step", i) + 1
        for f in findings_at(steps[:i + 1], [e for e in evals if e.get("step", 0) <= upto], checks):
            if f.key not in last_on or i - last_on[f.key] > WINDOW:
                yield steps[i].get("step", i), f
            last_on[f.key] = i


def failing_samples(samples_events: Sequence[dict], check: str, k: int = TOP_SAMPLES) -> list[dict]:
    """The k top-rewarded logged samples that fail `check` (its value None or <= 0), best first:
    {step, reward, check, value, completion}."""
    rows = []
    for e in samples_events:
        for x in e.get("samples") or ():
            per = x.get("per_reward") if isinstance(x, dict) else None
            if not isinstance(per, dict) or check not in per or _num(x.get("reward")) is None:
                continue
            v = _num(per[check])
            if v is None or v <= 0:
                rows.append({"step": e.get("step"), "reward": x["reward"], "check": check, "value": v,
                             "completion": str(x.get("completion", ""))[:300]})
    return sorted(rows, key=lambda r: -r["reward"])[:k]


class HackingWatch:
    """The run's side: after each step, the warnings that start at it (a "doctor" event each), with the
    top-rewarded samples failing the check for a check's warning."""

    def __init__(self) -> None:
        self.recent: list[dict] = []  # the last WINDOW "samples" events
        self._last_on: dict[str, int] = {}

    def update(self, steps: Sequence[dict], evals: Sequence[dict], samples_event: dict | None = None) -> list[dict]:
        if samples_event is not None:
            self.recent = (self.recent + [samples_event])[-WINDOW:]
        if not steps:
            return []
        i = len(steps) - 1
        out = []
        for f in findings_at(steps, evals, checks_of(steps)):
            if f.key not in self._last_on or i - self._last_on[f.key] > WINDOW:
                rec = {"code": f.code, "level": "warn", "title": f.title, "detail": f.detail,
                       "at_step": steps[-1].get("step")}
                if f.check is not None:
                    rec.update(check=f.check, samples=failing_samples(self.recent, f.check))
                out.append(rec)
            self._last_on[f.key] = i
        return out


def line(rec: dict) -> str:
    """A "doctor" event as the one line a run prints."""
    more = (f"; {len(rec['samples'])} top-rewarded samples failing it in this doctor event of metrics.jsonl"
            if rec.get("samples") else "")
    return f"minirl doctor (step {rec.get('at_step')}): {rec['title']}{more}"

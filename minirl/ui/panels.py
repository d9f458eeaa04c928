"""The dashboard's panels, drawn with matplotlib `Figure` objects (no pyplot: a notebook's backend and global state
are never touched), from a `View` of a run: live (the widget) or from its saved log (`render`, `minirl.plot`)."""
from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from minirl.core.metrics import load_events
from minirl.core.stats import ci95

GEN_COLOR, TRAIN_COLOR = "#1f77b4", "#ff7f0e"


@dataclass
class View:
    """Everything the panels draw, gathered from a Run (live) or a list of log events (after the run)."""
    steps: list[dict]
    samples: list[dict]  # "samples" events, oldest first
    timeline: dict[str, list[tuple[float, float]]]
    evals: list[dict]
    total_steps: int | None = None
    reward_names: tuple[str, ...] = ()

    @classmethod
    def from_events(cls, events: Sequence[dict], live_timeline: dict | None = None) -> "View":
        starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
        if len(starts) > 1:  # a log appended to by several runs: show the latest
            events = events[starts[-1]:]
        steps = [e for e in events if e.get("event") == "step"]
        samples = [e for e in events if e.get("event") == "samples"]
        evals = [e for e in events if e.get("event") == "eval"]
        tl, seg, offset = {"gen": [], "train": []}, {"gen": [], "train": []}, 0.0
        for e in events:  # each resumed part's seconds count from its own start: shown after the part before
            if e.get("event") == "resume":
                tl = {side: tl[side] + seg[side] for side in tl}
                offset = max((b for ivs in tl.values() for _, b in ivs), default=offset)
                seg = {"gen": [], "train": []}
            elif e.get("event") == "timeline" and e.get("side") in seg:
                seg[e["side"]].append(_shifted((e["start"], e["end"]), offset))
        if live_timeline:  # the asynchronous pipeline writes its timeline at the end; live, read it from memory
            for side in ("gen", "train"):
                if len(live_timeline.get(side, ())) > len(seg[side]):
                    seg[side] = [_shifted(iv, offset) for iv in live_timeline[side]]
        tl = {side: tl[side] + seg[side] for side in tl}
        start = next((e for e in events if e.get("event") == "start"), {})
        cfg = start.get("config") or {}
        names = tuple(cfg.get("rewards") or ())
        return cls(steps, samples, tl, evals, cfg.get("steps"), names)




PANELS = ("reward", "eval", "reward_hist", "length", "loss", "policy", "is_weight", "staleness", "throughput",
          "groups", "sync", "memory", "episodes", "timeline")
EPISODE_PANELS = ("episodes",)  # drawn only for environment runs (their steps carry `episode/*` metrics)


def _xy(steps: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for h in steps:
        v = h.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(h.get("step", len(xs)))
            ys.append(v)
    return xs, ys


def _line(ax, steps, key, label=None, **kw) -> bool:
    xs, ys = _xy(steps, key)
    if xs:
        ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=label or key, **kw)
    return bool(xs)


def _finish(ax, title: str, legend: bool = True, ylabel: str | None = None, int_x: bool = True) -> None:
    ax.set_title(title, fontsize=9, loc="left")
    if int_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=7)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, loc="best", framealpha=0.6)


def _empty(ax, text: str = "no data yet") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=8, color="0.5", transform=ax.transAxes)


Interval = tuple[float, float]


def eval_lines(evals: Sequence[dict]) -> list[tuple[str, list[int], list[float], str, list[Interval | None]]]:
    """The eval panel's lines, (label, steps, values, style, 95 % intervals): greedy accuracy, then with
    eval_samples each reward's mean@k and pass@k (k from the events). Each interval is the eval's own (the event's
    `ci95`: Wilson's for 0/1 scores, `core.stats.interval95`); a log from before `ci95` was recorded falls back to
    mean +- 1.96 se; None where the event has neither (one prompt)."""
    def band(e: dict, name: str, y: float, se) -> Interval | None:
        ci = (e.get("ci95") or {}).get(name)
        if isinstance(ci, (list, tuple)) and len(ci) == 2:
            return float(ci[0]), float(ci[1])
        return ci95(y, se) if isinstance(se, (int, float)) else None

    def series(name, get, get_se) -> tuple[list[int], list[float], list[Interval | None]]:
        pts = [(e, get(e)) for e in evals]
        pts = [(e, y) for e, y in pts if isinstance(y, (int, float)) and math.isfinite(y)]
        return [e["step"] for e, _ in pts], [y for _, y in pts], [band(e, name, y, get_se(e)) for e, y in pts]
    out = []
    xs, ys, bands = series("accuracy", lambda e: e.get("accuracy"), lambda e: e.get("accuracy_se"))
    if xs:
        out.append(("greedy accuracy", xs, ys, "s-", bands))
    k = next((e["k"] for e in reversed(evals) if e.get("k")), None)
    names = list(dict.fromkeys(n for e in evals for n in (e.get("pass_at_k") or {})))
    for n in names:
        for key, what, style in (("mean_at_k", "mean", "o--"), ("pass_at_k", "pass", "^:")):
            xs, ys, bands = series(f"{what}@k/{n}", lambda e: (e.get(key) or {}).get(n),
                                   lambda e: (e.get(f"{key}_se") or {}).get(n))
            if xs:
                out.append((f"{what}@{k} {n}", xs, ys, style, bands))
    return out


# panels that are only lines: name -> (title, [(metric, label, plot kwargs)])
LINE_PANELS = {
    "loss": ("loss", [("loss", "loss", {})]),
    "is_weight": ("importance weights", [("is_weight/mean", "IS weight mean", {}),
                                         ("is_weight/truncated_frac", "truncated frac", {}),
                                         ("logprob_mismatch", "|logprob mismatch|", {})]),
    "throughput": ("tokens / s", [("throughput/gen_tok_s", "generate", {"color": GEN_COLOR}),
                                  ("throughput/train_tok_s", "train", {"color": TRAIN_COLOR})]),
    "sync": ("adapter sync (ms)", [("sync/ms", "sync ms", {"color": "purple"})]),
    "memory": ("peak memory per step (MB)", [("mem/rss_mb", "resident (RSS)", {"color": "k"}),
                                             ("mem/cuda_mb", "CUDA", {"color": "green"})]),
}


def draw_panel(ax, name: str, v: View) -> None:
    s = v.steps
    if name == "reward":
        _line(ax, s, "reward/mean", "mean", lw=2, color="k")
        names = v.reward_names or tuple(sorted({k[7:] for h in s for k in h
                                                if k.startswith("reward/") and k[7:] not in ("mean", "std", "failures")}))
        if len(names) > 1:
            for nm in names:
                _line(ax, s, f"reward/{nm}", nm, lw=1)
        ev = [e for e in v.evals if isinstance(e.get("accuracy"), (int, float))]
        if ev:
            ax.plot([e["step"] - 0.5 for e in ev], [e["accuracy"] for e in ev], "s", color="green", ms=5,
                    label="eval accuracy")
        if not s and not ev:
            _empty(ax)
        _finish(ax, "reward")
    elif name == "eval":
        lines = eval_lines(v.evals)
        for label, xs, ys, style, bands in lines:
            (line,) = ax.plot(xs, ys, style, label=label, ms=4)
            band = [(x, ci) for x, ci in zip(xs, bands) if ci is not None]
            if band:  # the eval's own 95 % interval across the prompts (Wilson's for an accuracy)
                ax.fill_between([x for x, _ in band], [lo for _, (lo, _) in band], [hi for _, (_, hi) in band],
                                color=line.get_color(), alpha=0.15, lw=0)
        if not lines:
            _empty(ax, "no evaluation yet")
        banded = any(ci is not None for x in lines for ci in x[4])
        _finish(ax, "held-out evaluation (bands: 95% intervals)" if banded else "held-out evaluation")
    elif name == "reward_hist":
        latest = v.samples[-3:]
        vals = [x.get("reward") for e in latest for x in e.get("samples", [])]
        vals = [x for x in vals if isinstance(x, (int, float)) and math.isfinite(x)]
        if vals:
            ax.hist(vals, bins=min(10, max(3, len(set(vals)) * 2)), color="#4c72b0", edgecolor="white")
            steps_txt = f"{latest[0].get('step')}–{latest[-1].get('step')}" if len(latest) > 1 else latest[0].get("step")
            _finish(ax, f"reward histogram, steps {steps_txt}", legend=False, int_x=False)
        else:
            _empty(ax)
            _finish(ax, "reward histogram", legend=False, int_x=False)
    elif name == "length":
        _line(ax, s, "length/mean", "mean")
        _line(ax, s, "length/max", "max", ls="--")
        if s:
            ax2 = ax.twinx()
            xs, ys = _xy(s, "length/truncated_frac")
            ax2.fill_between(xs, ys, step="mid", alpha=0.15, color="red", label="truncated frac")
            ax2.set_ylim(0, 1.05)
            ax2.tick_params(labelsize=7, colors="red")
        else:
            _empty(ax)
        _finish(ax, "length (tokens); red: frac cut")
    elif name == "policy":
        ok = _line(ax, s, "entropy", "entropy")
        ok |= _line(ax, s, "clip_frac", "clip frac")
        ok |= _line(ax, s, "kl_behav", "KL(behav)")
        if any("kl_ref" in h and h["kl_ref"] for h in s):
            _line(ax, s, "kl_ref", "KL(ref)")
        if not ok:
            _empty(ax)
        _finish(ax, "entropy / clip / KL")
    elif name == "staleness":
        ok = _line(ax, s, "staleness/mean", "mean")
        ok |= _line(ax, s, "staleness/max", "max", ls="--")
        xs, ys = _xy(s, "staleness/dropped_groups")
        if any(ys):
            ax.bar(xs, ys, color="red", alpha=0.4, label="dropped groups")
        if not ok:
            _empty(ax)
        _finish(ax, "staleness (versions)")
    elif name == "groups":
        ok = _line(ax, s, "groups/zero_adv_frac", "zero-advantage groups")
        xs, ys = _xy(s, "reward/failures")
        if any(ys):
            ax.bar(xs, [min(1.0, y / max(ys)) for y in ys], color="red", alpha=0.4, label="reward failures (rel.)")
        if not ok:
            _empty(ax)
        ax.set_ylim(-0.02, 1.05)
        _finish(ax, "groups that teach nothing")
    elif name in LINE_PANELS:
        title, lines = LINE_PANELS[name]
        if not any([_line(ax, s, key, label, **kw) for key, label, kw in lines]):  # a list: draw every line
            _empty(ax)
        _finish(ax, title)
    elif name == "episodes":
        ok = _line(ax, s, "episode/turns", "turns / episode", color="k")
        ok |= _line(ax, s, "episode/tool_calls", "tool calls / episode")
        ok |= _line(ax, s, "episode/tool_errors", "tool errors / episode", color="red")
        ok |= _line(ax, s, "episode/truncated_frac", "truncated frac", ls="--")
        if not ok:
            _empty(ax, "no episodes (single-turn run)")
        _finish(ax, "episodes: turns, tools")
    elif name == "timeline":
        draw_timeline(ax, v.timeline)
    else:
        raise ValueError(f"unknown panel {name!r}; panels are {PANELS}")


def _shifted(iv: tuple[float, float], offset: float) -> tuple[float, float]:
    return iv[0] + offset, iv[1] + offset


def draw_timeline(ax, timeline: dict[str, Sequence[tuple[float, float]]], title: str = "pipeline timeline") -> None:
    """Busy intervals of generator and trainer as horizontal bars: gaps are waiting."""
    rows = [("train", TRAIN_COLOR), ("gen", GEN_COLOR)]
    any_bar = False
    end = 0.0
    for y, (side, color) in enumerate(rows):
        spans = [(a, b - a) for a, b in timeline.get(side, ()) if b is not None and b >= a]
        if spans:
            any_bar = True
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color)
            end = max(end, max(a + w for a, w in spans))
    ax.set_yticks([0, 1], ["train", "generate"], fontsize=8)
    ax.set_xlabel("seconds", fontsize=7)
    if any_bar:
        busy = {side: sum(b - a for a, b in timeline.get(side, ())) / end for side, _ in rows if end > 0}
        title += f"  (busy: generate {busy.get('gen', 0):.0%}, train {busy.get('train', 0):.0%})"
        ax.set_xlim(0, end * 1.01)
    else:
        _empty(ax)
    ax.set_ylim(-0.6, 1.6)
    _finish(ax, title, legend=False, int_x=False)


@functools.lru_cache(maxsize=None)
def _figure_class():

    class DashboardFigure(Figure):
        """A plain matplotlib Figure that also shows itself in a notebook (no pyplot, no inline backend needed)."""

        def _repr_png_(self) -> bytes:
            return png_bytes(self)
    return DashboardFigure


def figure(source: Any, panels: Sequence[str] = PANELS, width: float = 14.0, dpi: int = 80):
    """A matplotlib Figure with the dashboard's panels (no pyplot: safe in notebooks, threads and scripts)."""
    Figure = _figure_class()

    v = source if isinstance(source, View) else View.from_events(load_events(source))
    episodes = any("episode/turns" in h for h in v.steps)
    small = [p for p in panels if p != "timeline" and (episodes or p not in EPISODE_PANELS)]
    cols = min(5, max(1, len(small)))
    nrows = math.ceil(len(small) / cols) if small else 0
    tl = "timeline" in panels
    height = 2.5 * nrows + (1.6 if tl else 0) + 0.2
    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    gs = fig.add_gridspec(nrows + (1 if tl else 0), cols, height_ratios=[2.5] * nrows + ([1.6] if tl else []))
    for i, p in enumerate(small):
        _draw_or_say(fig.add_subplot(gs[i // cols, i % cols]), p, v)
    if tl:
        _draw_or_say(fig.add_subplot(gs[nrows, :]), "timeline", v)
    return fig


def _draw_or_say(ax, name: str, v: View) -> None:
    """One panel; data it cannot draw (absurd values) leaves a note in the panel, not a broken dashboard."""
    try:
        draw_panel(ax, name, v)
    except Exception as e:  # noqa: BLE001 - one panel must not take the others (or the run's report) down
        ax.clear()
        _empty(ax, f"cannot draw: {type(e).__name__}: {e}"[:80])
        ax.set_title(name, fontsize=9)


def render(source: Any, path: str | Path | None = None, panels: Sequence[str] = PANELS, dpi: int = 80):
    """The dashboard's panels from a saved run (`out_dir`, its `metrics.jsonl`, a Run, or a history list).
    Returns the Figure (a notebook displays it); with `path`, also writes a PNG there."""
    fig = figure(source, panels, dpi=dpi)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    return fig


plot = render  # `minirl.dashboard.plot(log)`: the same thing under the name people look for


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()

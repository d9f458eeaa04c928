"""The live dashboard (ipywidgets + matplotlib), the doctor, and the same panels rendered from a saved log.

    dash = Dashboard(run)      # widgets: status, doctor alerts, panels, samples, controls
    run.start(); dash          # refreshes every ~2 s from the kernel's event loop; training never waits on it
    render("runs/x/metrics.jsonl", "dashboard.png")   # the same panels after the run, from the JSONL log
    doctor(run.history)        # the alerts alone, a pure function of the per-step records

Drawing happens on the kernel thread only: the run thread's `on_step` callback just marks the view dirty.
matplotlib is used through `Figure` objects (no pyplot), so nothing changes a notebook's backend or global state.
"""
from __future__ import annotations

import functools
import html
import io
import json
import math
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

GEN_COLOR, TRAIN_COLOR = "#1f77b4", "#ff7f0e"


# --- reading a run: history, samples, timeline, evals ---------------------------------------------------------

class LogTail:
    """Incremental reader of a JSONL log that another thread is appending to: only complete lines are read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._pos = 0
        self._buf = b""
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        """Read what was appended since the last call; return the new events."""
        try:
            if self.path.stat().st_size < self._pos:  # truncated: a new run rewrote the log
                self._pos, self._buf, self.events = 0, b"", []
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._pos += len(chunk)
        data = self._buf + chunk
        lines = data.split(b"\n")
        self._buf = lines.pop()  # an incomplete last line waits for the next poll
        new = []
        for line in lines:
            if line.strip():
                try:
                    new.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        self.events.extend(new)
        return new


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
        tl: dict[str, list[tuple[float, float]]] = {"gen": [], "train": []}
        for e in events:
            if e.get("event") == "timeline" and e.get("side") in tl:
                tl[e["side"]].append((e["start"], e["end"]))
        if live_timeline:  # the asynchronous pipeline writes its timeline at the end; live, read it from memory
            for side in ("gen", "train"):
                if len(live_timeline.get(side, ())) > len(tl[side]):
                    tl[side] = list(live_timeline[side])
        start = next((e for e in events if e.get("event") == "start"), {})
        cfg = start.get("config") or {}
        names = tuple(cfg.get("rewards") or ())
        return cls(steps, samples, tl, evals, cfg.get("steps"), names)


def load_events(source: Any) -> list[dict]:
    """Events from a path (metrics.jsonl or its run folder), a Run, or a list (events or step records)."""
    if hasattr(source, "history") and hasattr(source, "out"):  # a Run
        p = Path(source.out) / "metrics.jsonl"
        return read_events(p) if p.exists() else [{"event": "step", **h} for h in source.history]
    if isinstance(source, (str, Path)):
        return read_events(source)
    return [e if "event" in e else {"event": "step", **e} for e in source]


def read_events(path: str | Path) -> list[dict]:
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"{p}: no metrics log here; give a run's out_dir or its metrics.jsonl")
    tail = LogTail(p)
    tail.poll()
    return tail.events


# --- the doctor ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alert:
    """One flagged symptom: `code` is stable (tests, docs), `title` short, `detail` says what it means and what to do."""
    code: str
    level: str  # "warn" or "error"
    title: str
    detail: str
    step: int | None = None


def _series(history: Sequence[dict], key: str) -> list[float]:
    out = []
    for h in history:
        v = h.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def _early_recent(xs: list[float], k: int = 3) -> tuple[float, float]:
    """Mean of the first and the last k values (k at most a third of the series)."""
    k = max(1, min(k, len(xs) // 3))
    return statistics.fmean(xs[:k]), statistics.fmean(xs[-k:])


def doctor(history: Sequence[dict], *, min_steps: int = 6) -> list[Alert]:
    """Classic failure signs in a run's per-step records (`run.history` or the log's step events).

    Pure: the same records give the same alerts. Trend rules compare the first and the last few steps, and
    only speak once there are `min_steps` steps; point rules (reward failures, sync spikes) speak at once."""
    hist = [h for h in history if h.get("event", "step") == "step"]
    alerts: list[Alert] = []
    last = hist[-1].get("step") if hist else None
    n = len(hist)

    def add(code: str, level: str, title: str, detail: str) -> None:
        alerts.append(Alert(code, level, title, detail, last))

    # reward failures: any in the last steps
    fails = _series(hist[-5:], "reward/failures")
    if sum(fails) > 0:
        add("reward_failures", "error", f"{int(sum(fails))} reward call(s) failed in the last {len(fails)} steps",
            "A reward raised, timed out or returned a non-number; those samples are left out of the loss. "
            "The samples panel and the log's 'samples' events show the reason; fix the reward or raise "
            "reward_timeout_s.")

    # sync time spikes: the latest push much slower than usual
    sync = _series(hist, "sync/ms")
    if len(sync) >= 4:
        base = statistics.median(sync[:-1])
        if sync[-1] > max(3 * base, base + 50):
            add("sync_spike", "warn", f"adapter sync took {sync[-1]:.0f} ms (usual {base:.0f} ms)",
                "Pushing the adapter to the generator suddenly got slow: the generator waits meanwhile. Look for "
                "a full tmpfs/disk, memory pressure, or another process on the same device.")

    if n < min_steps:
        return alerts

    ent = _series(hist, "entropy")
    if len(ent) >= min_steps:
        e0, e1 = _early_recent(ent)
        if e1 < 0.3 * e0 or e1 < 0.02:
            add("entropy_collapse", "warn", f"entropy collapsed: {e0:.3g} → {e1:.3g}",
                "The policy has become nearly deterministic, so groups stop producing different answers and "
                "learning stalls. Lower lr, raise temperature, or use clip-higher (clip_high) / fewer ppo_epochs.")

    ln = _series(hist, "length/mean")
    tr = _series(hist, "length/truncated_frac")
    if len(ln) >= min_steps:
        l0, l1 = _early_recent(ln)
        t1 = _early_recent(tr)[1] if len(tr) >= min_steps else 0.0
        t0 = _early_recent(tr)[0] if len(tr) >= min_steps else 0.0
        if (l1 > 1.5 * l0 and t1 >= 0.3) or (t1 >= 0.5 and t1 > t0 + 0.2):
            add("length_runaway", "warn", f"completions are running long: mean {l0:.0f} → {l1:.0f} tokens, "
                f"{t1:.0%} cut by max_tokens",
                "Cut completions get a reward for a text that never finished. Raise max_tokens, add a length or "
                "format reward, or check that the reward does not favour longer answers.")
        elif l0 >= 4 and l1 < 0.4 * l0:
            add("length_collapse", "warn", f"completions are collapsing: mean {l0:.0f} → {l1:.1f} tokens",
                "The policy found that very short answers pay (or avoid penalties). Check the reward for "
                "a loophole (e.g. empty answers scoring), and consider a lower lr.")

    mm = _series(hist, "logprob_mismatch")
    if len(mm) >= min_steps:
        m0, m1 = _early_recent(mm)
        if m1 > 0.2 or (m1 > 0.05 and m1 > 2 * m0):
            add("mismatch_growing", "warn", f"trainer/generator logprob mismatch grew: {m0:.3g} → {m1:.3g}",
                "The generator samples from a different distribution than the trainer computes (stale adapter, "
                "numerics, top_p/top_k). Importance weights then get truncated more; check sync, keep tis_cap, "
                "and compare dtypes of the two sides.")

    za = _series(hist, "groups/zero_adv_frac")
    if len(za) >= min_steps:
        z0, z1 = _early_recent(za)
        if z1 >= 0.8 or (z1 >= 0.5 and z1 > z0 + 0.25):
            r = _series(hist[-3:], "reward/mean")
            why = ""
            if r:
                rm = statistics.fmean(r)
                hi = max(_series(hist, "reward/mean") or [1.0])
                if rm > 0 and rm >= 0.8 * hi:
                    why = " Rewards are near their best: the task may be solved or too easy; use harder prompts."
                elif rm <= 0.2 * hi or rm <= 0:
                    why = " Rewards are low: the task may be too hard; use easier prompts or a denser reward."
                else:
                    why = (" Rewards are middling, so groups are all-right or all-wrong: the policy is getting "
                           "deterministic (see entropy); raise temperature.")
            add("zero_advantage", "warn", f"{z1:.0%} of groups have zero advantage (was {z0:.0%})",
                "All completions of such a group got the same reward, so they teach nothing: the step is "
                "wasted compute." + why + " A larger group_size also helps.")
    return alerts


# --- panels -------------------------------------------------------------------------------------------------

PANELS = ("reward", "reward_hist", "length", "loss", "policy", "is_weight", "staleness", "throughput",
          "groups", "sync", "timeline")


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
    from matplotlib.ticker import MaxNLocator
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


# panels that are only lines: name -> (title, [(metric, label, plot kwargs)])
LINE_PANELS = {
    "loss": ("loss", [("loss", "loss", {})]),
    "is_weight": ("importance weights", [("is_weight/mean", "IS weight mean", {}),
                                         ("is_weight/truncated_frac", "truncated frac", {}),
                                         ("logprob_mismatch", "|logprob mismatch|", {})]),
    "throughput": ("tokens / s", [("throughput/gen_tok_s", "generate", {"color": GEN_COLOR}),
                                  ("throughput/train_tok_s", "train", {"color": TRAIN_COLOR})]),
    "sync": ("adapter sync (ms)", [("sync/ms", "sync ms", {"color": "purple"})]),
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
    elif name == "reward_hist":
        latest = v.samples[-3:]
        vals = [x.get("reward") for e in latest for x in e.get("samples", [])]
        vals = [x for x in vals if isinstance(x, (int, float))]
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
    elif name == "timeline":
        draw_timeline(ax, v.timeline)
    else:
        raise ValueError(f"unknown panel {name!r}; panels are {PANELS}")


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
    from matplotlib.figure import Figure

    class DashboardFigure(Figure):
        """A plain matplotlib Figure that also shows itself in a notebook (no pyplot, no inline backend needed)."""

        def _repr_png_(self) -> bytes:
            return png_bytes(self)
    return DashboardFigure


def figure(source: Any, panels: Sequence[str] = PANELS, width: float = 14.0, dpi: int = 80):
    """A matplotlib Figure with the dashboard's panels (no pyplot: safe in notebooks, threads and scripts)."""
    Figure = _figure_class()

    v = source if isinstance(source, View) else View.from_events(load_events(source))
    small = [p for p in panels if p != "timeline"]
    cols = min(5, max(1, len(small)))
    nrows = math.ceil(len(small) / cols) if small else 0
    tl = "timeline" in panels
    height = 2.5 * nrows + (1.6 if tl else 0) + 0.2
    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    gs = fig.add_gridspec(nrows + (1 if tl else 0), cols, height_ratios=[2.5] * nrows + ([1.6] if tl else []))
    for i, p in enumerate(small):
        draw_panel(fig.add_subplot(gs[i // cols, i % cols]), p, v)
    if tl:
        draw_panel(fig.add_subplot(gs[nrows, :]), "timeline", v)
    return fig


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


# --- HTML pieces (shared by the widget and by notebooks) ----------------------------------------------------

def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return html.escape(str(x))


def alerts_html(alerts: Sequence[Alert]) -> str:
    if not alerts:
        return "<div style='color:#2a7d2a;font-size:12px'>doctor: no warning signs</div>"
    items = []
    for a in alerts:
        color = "#b00020" if a.level == "error" else "#a15c00"
        items.append(f"<div style='border-left:4px solid {color};padding:2px 8px;margin:2px 0;font-size:12px'>"
                     f"<b style='color:{color}'>{html.escape(a.title)}</b><br>{html.escape(a.detail)}</div>")
    return "".join(items)


def samples_html(samples_events: Sequence[dict], limit: int = 6, width: int = 90) -> str:
    """The most recent logged completions with their scores, newest first."""
    rows = []
    for e in reversed(samples_events):
        for x in e.get("samples", []):
            rows.append((e.get("step"), x))
            if len(rows) >= limit:
                break
        if len(rows) >= limit:
            break
    if not rows:
        return "<i style='font-size:12px'>samples appear after the first step</i>"

    def cut(t: str) -> str:
        t = " ".join(str(t).split())
        return html.escape(t if len(t) <= width else t[: width - 1] + "…")

    head = ("<tr><th>step</th><th>prompt</th><th>completion</th><th>reward</th><th>per reward</th>"
            "<th>adv</th><th>failures</th></tr>")
    body = []
    for step, x in rows:
        per = ", ".join(f"{k}={_fmt(v)}" for k, v in (x.get("per_reward") or {}).items())
        fails = "; ".join(f"{f.get('reward')}: {f.get('reason')}" for f in x.get("failures") or [])
        body.append(f"<tr><td>{step}</td><td>{cut(x.get('prompt', ''))}</td><td><code>{cut(x.get('completion', ''))}"
                    f"</code></td><td>{_fmt(x.get('reward'))}</td><td>{per}</td><td>{_fmt(x.get('advantage'))}</td>"
                    f"<td style='color:#b00020'>{html.escape(fails)}</td></tr>")
    return ("<table style='font-size:11px;border-collapse:collapse' border='1' cellpadding='3'>"
            f"{head}{''.join(body)}</table>")


# --- the live widget ----------------------------------------------------------------------------------------

class Dashboard:
    """Live view of a Run in a notebook. Display it (`dash` as a cell's last line, or `display(dash)`).

    It refreshes every `every` seconds from the kernel's event loop while the run is alive, redrawing only after
    a new step. `refresh()` draws now; `wait()` blocks the cell until the run ends while keeping the view live
    (optional: without it the kernel stays free); `close()` stops the timer."""

    def __init__(self, run: Any, every: float = 2.0, panels: Sequence[str] = PANELS, samples: int = 6,
                 controls: bool = True, dpi: int = 80):
        import ipywidgets as W

        self.run, self.every, self.panels, self.n_samples, self.dpi = run, every, tuple(panels), samples, dpi
        self._dirty = threading.Event()
        self._dirty.set()
        self._task = None
        self._tail: LogTail | None = None
        self._last_steps = -1
        self._t0 = time.time()
        self.refreshes = 0
        self.alerts: list[Alert] = []
        if hasattr(run, "on_step"):
            run.on_step.append(self._mark)  # the run thread only sets a flag

        self.status = W.HTML()
        self.doctor_box = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(width="100%", max_width="1150px"))
        self.samples_box = W.HTML()
        children = [self.status, self.doctor_box, self.image]
        if controls and hasattr(run, "pause"):
            children.append(self._controls(W))
        children.append(W.HTML("<b style='font-size:12px'>recent samples</b>"))
        children.append(self.samples_box)
        self.widget = W.VBox(children)
        self.refresh(force=True)
        self._start_timer()

    # controls: pause / resume / stop and the safe knobs
    def _controls(self, W):
        cfg = self.run.cfg
        b_pause = W.Button(description="pause", icon="pause", layout=W.Layout(width="90px"))
        b_resume = W.Button(description="resume", icon="play", layout=W.Layout(width="90px"))
        b_stop = W.Button(description="stop", icon="stop", button_style="danger", layout=W.Layout(width="90px"))
        self.lr = W.FloatLogSlider(value=cfg.lr, base=10, min=-6, max=-2, step=0.1, description="lr",
                                   readout_format=".1e", continuous_update=False)
        self.temperature = W.FloatSlider(value=cfg.temperature, min=0.1, max=2.0, step=0.05,
                                         description="temperature", continuous_update=False)
        self.message = W.HTML()

        def act(fn, msg):
            def handler(_):
                try:
                    fn()
                    self.message.value = f"<span style='font-size:12px'>{msg}</span>"
                except Exception as e:  # noqa: BLE001 - shown, never raised into the widget machinery
                    self.message.value = f"<span style='color:#b00020'>{html.escape(repr(e))}</span>"
                self._dirty.set()
            return handler

        b_pause.on_click(act(self.run.pause, "paused after the current step"))
        b_resume.on_click(act(self.run.resume, "resumed"))
        b_stop.on_click(act(lambda: threading.Thread(target=self.run.stop, daemon=True).start(),
                            "stopping: the adapter and log are saved"))
        self.lr.observe(lambda ch: act(lambda: self.run.set(lr=ch["new"]), f"lr → {ch['new']:.2e}")(None), "value")
        self.temperature.observe(lambda ch: act(lambda: self.run.set(temperature=ch["new"]),
                                                f"temperature → {ch['new']:.2f}")(None), "value")
        return W.VBox([W.HBox([b_pause, b_resume, b_stop, self.message]), W.HBox([self.lr, self.temperature])])

    def _mark(self, _rec: dict) -> None:
        self._dirty.set()

    # data
    def _events(self) -> list[dict]:
        out = getattr(self.run, "out", None)
        opened = getattr(self.run, "log", None) is not None or not hasattr(self.run, "start")
        if out is not None and opened and (Path(out) / "metrics.jsonl").exists():  # never an old run's log
            if self._tail is None:
                self._tail = LogTail(Path(out) / "metrics.jsonl")
            self._tail.poll()
            return self._tail.events
        if hasattr(self.run, "start"):  # a Run that has not opened its log yet
            return [{"event": "step", **h} for h in getattr(self.run, "history", [])]
        return load_events(self.run)

    def view(self) -> View:
        events = self._events()
        pipe = getattr(self.run, "pipeline", None)
        live = None
        if pipe is not None and getattr(pipe, "timeline", None) is not None:
            live = pipe.timeline.snapshot()
        v = View.from_events(events, live)
        if len(getattr(self.run, "history", ())) > len(v.steps):  # the run's memory is ahead of the file
            v.steps = [dict(h) for h in self.run.history]
        cfg = getattr(self.run, "cfg", None)
        if cfg is not None:
            v.total_steps = cfg.steps
            v.reward_names = tuple(cfg.rewards)
        return v

    def _state(self) -> str:
        r = self.run
        if getattr(r, "error", None) is not None:
            return f"<b style='color:#b00020'>failed: {html.escape(repr(r.error))}</b> (run.wait() shows the traceback)"
        if getattr(r, "running", False):
            if r.paused:
                return "<b style='color:#a15c00'>paused</b>"
            return "<b style='color:#2a7d2a'>running</b>"
        if getattr(r, "summary", None) and "steps" in r.summary:
            return "<b>finished</b>"
        return "<b>not started</b> (call run.start())" if hasattr(r, "start") else "<b>from log</b>"

    def refresh(self, force: bool = False) -> bool:
        """Redraw if something changed (or `force`). Returns whether it drew. Runs on the caller's thread."""
        if not (force or self._dirty.is_set()):
            self.status.value = self._status_html(None)
            return False
        self._dirty.clear()
        v = self.view()
        self.alerts = doctor(v.steps)
        self.status.value = self._status_html(v)
        self.doctor_box.value = alerts_html(self.alerts)
        fig = figure(v, self.panels, dpi=self.dpi)
        self.image.value = png_bytes(fig)
        self.samples_box.value = samples_html(v.samples, self.n_samples)
        self._last_steps = len(v.steps)
        self.refreshes += 1
        return True

    def _status_html(self, v: View | None) -> str:
        n = self._last_steps if v is None else len(v.steps)
        total = getattr(getattr(self.run, "cfg", None), "steps", None) or (v.total_steps if v else None)
        last = (v.steps[-1] if v and v.steps else None)
        parts = [self._state(), f"step {max(n, 0)}" + (f" / {total}" if total else "")]
        if last:
            parts.append(f"reward {_fmt(last.get('reward/mean'))}")
            if last.get("time/step_s") is not None:
                parts.append(f"{last['time/step_s']:.1f} s/step")
        parts.append(f"{time.time() - self._t0:.0f} s since the dashboard opened")
        out = getattr(self.run, "out", None)
        if out is not None:
            parts.append(f"log: <code>{html.escape(str(Path(out) / 'metrics.jsonl'))}</code>")
        return "<div style='font-size:13px'>" + " · ".join(parts) + "</div>"

    # timer on the kernel's event loop
    def _start_timer(self) -> None:
        import asyncio
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no event loop (a script): call refresh() yourself
        self._task = loop.create_task(self._poll())

    async def _poll(self) -> None:
        import asyncio
        idle_after_end = 0
        while True:
            await asyncio.sleep(self.every)
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - a drawing error must not kill the timer silently
                self.status.value = f"<span style='color:#b00020'>dashboard error: {html.escape(repr(e))}</span>"
            idle_after_end = idle_after_end + 1 if self._finished() else 0
            if idle_after_end >= 2 and not self._dirty.is_set():  # run over and its last state drawn
                self.refresh(force=True)
                return

    def _finished(self) -> bool:
        r = self.run
        if not hasattr(r, "start"):
            return True  # a log, not a run
        if getattr(r, "running", False):
            return False
        return getattr(r, "error", None) is not None or "steps" in (getattr(r, "summary", None) or {})

    def start_timer(self) -> None:
        """(Re)start the periodic refresh on the kernel's event loop (it stops itself once a run has ended)."""
        if self._task is None or self._task.done():
            self._start_timer()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the run ends, refreshing the view meanwhile; returns the summary (raises the run's error).

        While a cell blocks here the kernel is busy, so the buttons and sliders act only once it ends (the view
        still updates). Interrupt the kernel to stop waiting: the run goes on in the background."""
        t0 = time.time()
        try:
            while getattr(self.run, "running", False):
                if timeout is not None and time.time() - t0 > timeout:
                    break
                self.refresh()
                time.sleep(min(self.every, 0.5) if self._dirty.is_set() else self.every / 4)
        except KeyboardInterrupt:
            print("stopped waiting; the run goes on in the background (the dashboard, run.pause(), run.stop() "
                  "work again now that the kernel is free)")
            raise
        self.refresh(force=True)
        return self.run.wait(0) if hasattr(self.run, "wait") else {}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if hasattr(self.run, "on_step") and self._mark in self.run.on_step:
            self.run.on_step.remove(self._mark)

    def _repr_mimebundle_(self, **kw):  # ipywidgets' own repr (used by display() and a cell's last value)
        return self.widget._repr_mimebundle_(**kw)

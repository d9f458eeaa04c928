"""The live dashboard widget (ipywidgets): status, doctor alerts, the panels, recent samples and controls.

    dash = Dashboard(run)      # widgets: status, doctor alerts, panels, samples, controls
    run.start(); dash          # refreshes every ~2 s from the kernel's event loop; training never waits on it
    render("runs/x/metrics.jsonl", "dashboard.png")   # the same panels after the run, from the JSONL log
    doctor(run.history)        # the alerts alone, a pure function of the per-step records

Drawing happens on the kernel thread only: the run thread's `on_step` callback just marks the view dirty.
matplotlib is used through `Figure` objects (no pyplot), so nothing changes a notebook's backend or global state.
"""
from __future__ import annotations

import asyncio
import html
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import ipywidgets as W

from minirl.core.hacking import WINDOW, failing_samples
from minirl.types import RunView
from minirl.ui.doctor import Alert, doctor
from minirl.ui.panels import PANELS, View, figure, png_bytes
from minirl.ui.saved import SavedRun
from minirl.ui.xray import choices, xray

# --- HTML pieces (shared by the widget and by notebooks) ----------------------------------------------------

def _fmt(x: Any) -> str:
    """A value from metrics.jsonl as HTML text: a float in 3 digits, anything else escaped (the log is a file
    anyone could have written: no value from it reaches the notebook as markup)."""
    if isinstance(x, float):
        return f"{x:.3g}"
    return html.escape(str(x), quote=True)


def alerts_html(alerts: Sequence[Alert]) -> str:
    if not alerts:
        return "<div style='color:#2a7d2a;font-size:12px'>doctor: no warning signs</div>"
    items = []
    for a in alerts:
        color = "#b00020" if a.level == "error" else "#a15c00"
        items.append(f"<div style='border-left:4px solid {color};padding:2px 8px;margin:2px 0;font-size:12px'>"
                     f"<b style='color:{color}'>{html.escape(a.title)}</b><br>{html.escape(a.detail)}</div>")
    return "".join(items)


def failing_html(alerts: Sequence[Alert], samples_events: Sequence[dict], width: int = 90) -> str:
    """For each check a reward-hacking warning names: the top-rewarded logged samples of the last WINDOW steps that
    fail it (a small table under the doctor's alerts); "" when there are none."""
    checks = list(dict.fromkeys(a.check for a in alerts if a.check))
    rows = [r for c in checks for r in failing_samples(samples_events[-WINDOW:], c)]
    if not rows:
        return ""
    body = "".join(f"<tr><td>{_fmt(r['step'])}</td><td>{_fmt(r['check'])}</td><td>{_fmt(r['reward'])}</td>"
                   f"<td>{_fmt(r['value'])}</td><td><code>{_cut(r['completion'], width)}</code></td></tr>" for r in rows)
    return ("<div style='font-size:12px;margin-top:4px'><b>top-rewarded samples failing a check</b></div>"
            "<table style='font-size:11px;border-collapse:collapse' border='1' cellpadding='3'><tr><th>step</th>"
            f"<th>check</th><th>reward</th><th>check value</th><th>completion</th></tr>{body}</table>")


def _cut(t: str, width: int) -> str:
    t = " ".join(str(t).split())
    return html.escape(t if len(t) <= width else t[: width - 1] + "…", quote=True)


def samples_html(samples_events: Sequence[dict], limit: int = 6, width: int = 90) -> str:
    """The most recent logged completions with their scores, newest first."""
    rows = []
    for e in reversed(samples_events):
        samples = e.get("samples") if isinstance(e, dict) else None
        for x in samples if isinstance(samples, list) else []:
            if not isinstance(x, dict):
                continue
            rows.append((e.get("step"), x))
            if len(rows) >= limit:
                break
        if len(rows) >= limit:
            break
    if not rows:
        return "<i style='font-size:12px'>samples appear after the first step</i>"

    def cut(t: str) -> str:
        return _cut(t, width)

    head = ("<tr><th>step</th><th>prompt</th><th>completion</th><th>reward</th><th>per reward</th>"
            "<th>adv</th><th>failures</th></tr>")
    body = []
    for step, x in rows:
        per_reward = x.get("per_reward")
        per = ", ".join(f"{_fmt(k)}={_fmt(v)}" for k, v in (per_reward.items() if isinstance(per_reward, dict) else ()))
        failures = x.get("failures")
        fails = "; ".join(f"{f.get('reward')}: {f.get('reason')}" for f in
                          (failures if isinstance(failures, list) else []) if isinstance(f, dict))
        body.append(f"<tr><td>{_fmt(step)}</td><td>{cut(x.get('prompt', ''))}</td><td><code>{cut(x.get('completion', ''))}"
                    f"</code></td><td>{_fmt(x.get('reward'))}</td><td>{per}</td><td>{_fmt(x.get('advantage'))}</td>"
                    f"<td style='color:#b00020'>{_fmt(fails)}</td></tr>")
    return ("<table style='font-size:11px;border-collapse:collapse' border='1' cellpadding='3'>"
            f"{head}{''.join(body)}</table>")


# --- the live widget ----------------------------------------------------------------------------------------

class Dashboard:
    """Live view of a Run in a notebook. Display it (`dash` as a cell's last line, or `display(dash)`).

    It refreshes every `every` seconds from the kernel's event loop while the run is alive, redrawing only after
    a new step. `refresh()` draws now; `wait()` blocks the cell until the run ends while keeping the view live
    (optional: without it the kernel stays free); `close()` stops the timer. `run`: a live `minirl.Run`, or a saved
    one (its out_dir, its metrics.jsonl or step records: read as a `SavedRun`)."""

    def __init__(self, run: RunView | str | Path | Sequence[dict], every: float = 2.0,
                 panels: Sequence[str] = PANELS, samples: int = 6, controls: bool = True, dpi: int = 80):

        self.run: RunView = SavedRun(run) if isinstance(run, (str, Path, list, tuple)) else run
        self.every, self.panels, self.n_samples, self.dpi = every, tuple(panels), samples, dpi
        self._dirty = threading.Event()
        self._dirty.set()
        self._task = None
        self._last_steps = -1
        self._t0 = time.time()
        self.refreshes = 0
        self.alerts: list[Alert] = []
        self.run.on_step.append(self._mark)  # the run thread only sets a flag

        self.status = W.HTML()
        self.doctor_box = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(width="100%", max_width="1150px"))
        self.samples_box = W.HTML()
        self._samples: list[dict] = []  # the "samples" events last drawn (the X-ray picker reads them)
        self.xray_pick = W.Dropdown(description="token X-ray", options=[("(pick a logged sample)", None)],
                                    layout=W.Layout(width="640px"), style={"description_width": "initial"})
        self.xray_box = W.HTML()
        self.xray_pick.observe(lambda _: self.show_xray(), "value")
        children = [self.status, self.doctor_box, self.image]
        if controls and self.run.controllable:
            children.append(self._controls(W))
        children.append(W.HTML("<b style='font-size:12px'>recent samples</b>"))
        children += [self.samples_box, self.xray_pick, self.xray_box]
        self.widget = W.VBox(children)
        self.refresh(force=True)
        self._start_timer()

    # controls: pause / resume / stop and the safe knobs
    def _controls(self, W):
        knobs = self.run.status().knobs
        b_pause = W.Button(description="pause", icon="pause", layout=W.Layout(width="90px"))
        b_resume = W.Button(description="resume", icon="play", layout=W.Layout(width="90px"))
        b_stop = W.Button(description="stop", icon="stop", button_style="danger", layout=W.Layout(width="90px"))
        self.lr = W.FloatLogSlider(value=knobs["lr"], base=10, min=-6, max=-2, step=0.1, description="lr",
                                   readout_format=".1e", continuous_update=False)
        self.temperature = W.FloatSlider(value=knobs["temperature"], min=0.1, max=2.0, step=0.05,
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
    def view(self) -> View:
        st = self.run.status()
        v = View.from_events(self.run.events(), self.run.timeline())
        if st.total_steps is not None:
            v.total_steps = st.total_steps
        if st.reward_names:
            v.reward_names = st.reward_names
        return v

    def _state(self) -> str:
        st = self.run.status()
        if st.state == "failed":
            return (f"<b style='color:#b00020'>failed: {html.escape(repr(st.error))}</b> "
                    "(run.wait() shows the traceback)")
        return {"paused": "<b style='color:#a15c00'>paused</b>", "running": "<b style='color:#2a7d2a'>running</b>",
                "finished": "<b>finished</b>", "not started": "<b>not started</b> (call run.start())",
                "saved": "<b>from log</b>"}[st.state]

    def refresh(self, force: bool = False) -> bool:
        """Redraw if something changed (or `force`). Returns whether it drew. Runs on the caller's thread."""
        if not (force or self._dirty.is_set()):
            self.status.value = self._status_html(None)
            return False
        self._dirty.clear()
        v = self.view()
        self.alerts = doctor(v.steps, evals=v.evals)
        self.status.value = self._status_html(v)
        self.doctor_box.value = alerts_html(self.alerts) + failing_html(self.alerts, v.samples)
        fig = figure(v, self.panels, dpi=self.dpi)
        self.image.value = png_bytes(fig)
        self.samples_box.value = samples_html(v.samples, self.n_samples)
        self._samples = v.samples
        opts = [("(pick a logged sample)", None)] + choices(v.samples)
        if [o[1] for o in opts] != [o[1] for o in self.xray_pick.options]:
            keep = self.xray_pick.value if self.xray_pick.value in [o[1] for o in opts] else None
            self.xray_pick.options, self.xray_pick.value = opts, keep
        self._last_steps = len(v.steps)
        self.refreshes += 1
        return True

    def show_xray(self, pick: tuple | None = None) -> str:
        """Show the token X-ray (`minirl.xray`) of a logged sample, (step, sample) as `xray_pick` offers them
        (default: its current value), under the samples; returns its HTML ('' for none)."""
        pick = self.xray_pick.value if pick is None else pick
        self.xray_box.value = "" if pick is None else xray(self._samples, *pick).html()
        return self.xray_box.value

    def _status_html(self, v: View | None) -> str:
        n = self._last_steps if v is None else len(v.steps)
        st = self.run.status()
        total = st.total_steps or (v.total_steps if v else None)
        last = (v.steps[-1] if v and v.steps else None)
        parts = [self._state(), f"step {max(n, 0)}" + (f" / {total}" if total else "")]
        if last:
            parts.append(f"reward {_fmt(last.get('reward/mean'))}")
            if isinstance(last.get("time/step_s"), (int, float)):
                parts.append(f"{last['time/step_s']:.1f} s/step")
        parts.append(f"{time.time() - self._t0:.0f} s since the dashboard opened")
        if st.log_path is not None:
            parts.append(f"log: <code>{html.escape(str(st.log_path))}</code>")
        return "<div style='font-size:13px'>" + " · ".join(parts) + "</div>"

    # timer on the kernel's event loop
    def _start_timer(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no event loop (a script): call refresh() yourself
        self._task = loop.create_task(self._poll())

    async def _poll(self) -> None:
        idle_after_end = 0
        while True:
            await asyncio.sleep(self.every)
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - a drawing error must not kill the timer silently
                self.status.value = f"<span style='color:#b00020'>dashboard error: {html.escape(repr(e))}</span>"
            idle_after_end = idle_after_end + 1 if self.run.status().ended else 0
            if idle_after_end >= 2 and not self._dirty.is_set():  # run over and its last state drawn
                self.refresh(force=True)
                return

    @property
    def timer(self):
        """The periodic refresh (an asyncio Task on the kernel's event loop; None where no loop runs): it ends by
        itself once the run has ended and its last state is drawn, so `await dash.timer` waits for that."""
        return self._task

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
            while self.run.status().state in ("running", "paused"):
                if timeout is not None and time.time() - t0 > timeout:
                    break
                self.refresh()
                time.sleep(min(self.every, 0.5) if self._dirty.is_set() else self.every / 4)
        except KeyboardInterrupt:
            print("stopped waiting; the run goes on in the background (the dashboard, run.pause(), run.stop() "
                  "work again now that the kernel is free)")
            raise
        self.refresh(force=True)
        return self.run.wait(0)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._mark in self.run.on_step:
            self.run.on_step.remove(self._mark)

    def _repr_mimebundle_(self, **kw):  # ipywidgets' own repr (used by display() and a cell's last value)
        return self.widget._repr_mimebundle_(**kw)

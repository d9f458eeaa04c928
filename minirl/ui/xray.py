"""The token X-ray: one logged completion token by token, as the loss saw it (the record: `core/xray.py`).

    x = minirl.xray("runs/demo")             # the last step's first logged sample; step=, sample= pick another
    x                                        # in a notebook: tokens coloured by advantage x weight, hover for the rest
    x.table()                                # one dict per token: ratio, IS weight, clip, mask, mismatch, version
    x.save_png("xray.png")                   # a static image: the tokens, then ratio and mismatch strips

Colours: green pushed up (positive advantage x weight), red pushed down, the stronger the larger |weight| in this
completion; grey: no loss term (not trained); blue: an episode's environment tokens (context). Underlined orange:
the clip bound; struck through: a mask or cap cut the token's term (`core.xray.MASK_CODES`).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from matplotlib.colors import to_hex, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minirl.core.metrics import load_events
from minirl.core.xray import TokenXray

UP, DOWN, ENV, IDLE = "#2ea043", "#d62728", "#cfe0fb", "#eeeeee"


def _pick(events: Sequence[dict], step: int | None, sample: int, where: str) -> tuple[dict, int | None]:
    """The samples row `sample` of step `step` (None: the last step whose samples carry an X-ray)."""
    logged = [e for e in events if e.get("event") == "samples" and any("xray" in r for r in e.get("samples") or ())]
    if step is not None:
        logged = [e for e in logged if e.get("step") == step]
    if not logged:
        at = "" if step is None else f" at step {step}"
        raise ValueError(f"{where}: no logged sample with a token X-ray{at}; runs log one per sample (log_samples > 0)"
                         " from this version on: give another step or a newer run")
    rows = logged[-1]["samples"]
    if not 0 <= sample < len(rows) or "xray" not in rows[sample]:
        raise ValueError(f"{where}: step {logged[-1].get('step')} logged {len(rows)} samples; give sample= in "
                         f"0..{len(rows) - 1}")
    return rows[sample], logged[-1].get("step")


def xray(source: Any, step: int | None = None, sample: int = 0) -> "XrayView":
    """The token X-ray of a logged sample. `source`: a run folder or its metrics.jsonl, a live `Run`, a list of
    events, a "samples" event, one of its rows, or a `TokenXray`. `step` (default: the last logged) and `sample`
    (the row in that step's "samples" event) pick the sample."""
    if isinstance(source, TokenXray):
        return XrayView(source, step, sample)
    if isinstance(source, dict) and "xray" in source:
        return XrayView(TokenXray.from_row(source["xray"]), step, sample, source)
    if isinstance(source, dict) and "samples" in source:
        source = [{"event": "samples", **source}]
    where = str(source) if isinstance(source, (str, Path)) else type(source).__name__
    row, at = _pick(load_events(source), step, sample, where)
    return XrayView(TokenXray.from_row(row["xray"]), at, sample, row)


def choices(samples_events: Sequence[dict], limit: int = 24) -> list[tuple[str, tuple[Any, int]]]:
    """(label, (step, sample)) of the logged samples that carry an X-ray, newest first (the dashboard's picker)."""
    out = []
    for e in reversed(samples_events):
        for i, r in enumerate(e.get("samples") or ()):
            if isinstance(r, dict) and "xray" in r:
                text = " ".join(str(r.get("completion", "")).split())
                adv = r.get("advantage")
                adv = f"{adv:+.2f}" if isinstance(adv, (int, float)) else "?"
                out.append((f"step {e.get('step')} · sample {i} · adv {adv} · {text[:40]}", (e.get("step"), i)))
                if len(out) >= limit:
                    return out
    return out


def _fmt(x: Any, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def versions(x: TokenXray) -> str:
    """Which policy sampled the completion and where the step's trainer stood, e.g. "sampled by policy version 28,
    trainer at version 29" (one step off-policy); a completion sampled across a weight update names its range."""
    vs = sorted({v for v, m in zip(x.version_T, x.loss_mask_T) if m}) or sorted(set(x.version_T))
    if not vs:
        return f"trainer at version {x.trainer_version}"
    by = f"{vs[0]}" if len(vs) == 1 else f"{vs[0]}-{vs[-1]}"
    return f"sampled by policy version{'s' if len(vs) > 1 else ''} {by}, trainer at version {x.trainer_version}"


def _shown(piece: str) -> str:
    return piece.replace("\n", "↵").replace("\t", "→") or "·"


@dataclass(frozen=True)
class XrayView:
    """A `TokenXray` with where it came from: `_repr_html_` (a notebook shows it), `table`, `save_png`, `save`."""
    record: TokenXray
    step: int | None = None
    sample: int = 0
    row: dict = field(default_factory=dict)  # the "samples" row: prompt, completion, reward, ...

    def table(self) -> list[dict[str, Any]]:
        """One dict per token (`TokenXray.table`)."""
        return self.record.table()

    def _scale(self) -> float:
        return max((abs(w) for w in self.record.weight_T), default=0.0) or 1.0

    @cached_property
    def _rows(self) -> list[dict[str, Any]]:
        return self.record.table()

    def hover(self, t: int) -> str:
        """Token `t`'s values as text (the HTML's tooltip)."""
        r = self._rows[t]
        lines = [f"#{t} id {r['token_id']} {r['piece']!r}  version {r['version']} "
                 f"(staleness {self.record.trainer_version - r['version']})"]
        if not r["loss_mask"]:
            lines.append("environment token: context, no loss term")
        elif not self.record.trained:
            lines.append(self.record.note)
        else:
            lines += [f"weight {_fmt(r['weight'], '+.3g')} (advantage x aggregation weight)",
                      f"ratio pi/pi_prox {_fmt(r['ratio'])}" + ("  CLIPPED" if r["clipped"] else ""),
                      f"IS weight {_fmt(r['is_weight'])}" + (f"  masked: {r['masked']}" if r["masked"] else ""),
                      f"mismatch trainer-behaviour {_fmt(r['mismatch'], '+.3g')}"]
        lines.append(f"logprob behaviour {_fmt(r['behav_logp'])}, trainer {_fmt(r['trainer_logp'])}")
        return "\n".join(lines)

    def colour(self, t: int) -> tuple[float, float, float, float]:
        """Token `t`'s RGBA colour: green / red by its weight's sign, opacity by |weight| (module docstring)."""
        x = self.record
        if not x.loss_mask_T[t]:
            return to_rgba(ENV)
        w = x.weight_T[t] if t < len(x.weight_T) else 0.0
        if not x.trained or not w:
            return to_rgba(IDLE)
        return to_rgba(UP if w > 0 else DOWN, 0.15 + 0.75 * abs(w) / self._scale())

    def html(self) -> str:
        x, spans = self.record, []
        for t, piece in enumerate(x.pieces_T):
            style = f"background:{to_hex(self.colour(t), keep_alpha=True)};border-right:1px solid #fff"
            if t < len(x.clipped_T) and x.clipped_T[t]:
                style += ";border-bottom:3px solid #e08000"
            if t < len(x.masked_T) and x.masked_T[t]:
                style += ";text-decoration:line-through"
            spans.append(f"<span style='{style}' title='{html.escape(self.hover(t), quote=True)}'>"
                         f"{html.escape(piece).replace(chr(10), '↵<br>') or '·'}</span>")
        r = self.row
        head = [f"step {self.step}" if self.step is not None else "", f"sample {self.sample}",
                f"reward {_fmt(r.get('reward'), '.3g')}" if r else "", f"advantage {_fmt(x.advantage, '+.3g')}",
                versions(x), x.note]
        cut = [t for t in range(len(x)) if t < len(x.masked_T) and x.masked_T[t]]
        counts = (f"{sum(x.clipped_T)} clipped, {len(cut)} masked/capped of {sum(x.loss_mask_T)} trained tokens"
                  if x.trained else "")
        legend = (f"<span style='background:{UP}99;padding:0 4px'>pushed up</span> "
                  f"<span style='background:{DOWN}99;padding:0 4px'>pushed down</span> "
                  f"<span style='background:{IDLE};padding:0 4px'>no loss term</span> "
                  f"<span style='background:{ENV};padding:0 4px'>environment</span> "
                  "<span style='border-bottom:3px solid #e08000'>clipped</span> "
                  "<span style='text-decoration:line-through'>masked / capped</span> (hover a token)")
        prompt = " ".join(str(r.get("prompt", "")).split())
        prompt = html.escape(prompt if len(prompt) <= 160 else prompt[:159] + "…")
        return (f"<div style='margin:6px 0'><div style='font-size:12px'><b>token X-ray</b> "
                f"{html.escape(' · '.join(h for h in head if h))}<br>{counts} &nbsp; {legend}</div>"
                + (f"<div style='font-size:11px;color:#666'>prompt: {prompt}</div>" if prompt else "")
                + "<div style='font-family:monospace;font-size:12px;line-height:1.7;white-space:pre-wrap'>"
                f"{''.join(spans)}</div></div>")

    _repr_html_ = html

    def __repr__(self) -> str:
        x = self.record
        return (f"XrayView(step={self.step}, sample={self.sample}, tokens={len(x)}, advantage={x.advantage}, "
                f"trained={x.trained}{', ' + repr(x.note) if x.note else ''})")

    def text(self) -> str:
        """The table as aligned text (the CLI's output without --out)."""
        x = self.record
        cols = ("t", "piece", "weight", "ratio", "clipped", "is_weight", "masked", "mismatch", "version")
        lines = [f"step {self.step} sample {self.sample}: advantage {_fmt(x.advantage, '+.3g')}, {versions(x)}"
                 + (f"; {x.note}" if x.note else ""),
                 "  ".join(f"{c:>10}" for c in cols)]
        for r in self._rows:
            vals = {**r, "piece": repr(r["piece"])[:10]}
            lines.append("  ".join(f"{_fmt(vals[c]):>10}" for c in cols))
        return "\n".join(lines)

    def figure(self, width: float = 12.0, cols: int = 16, dpi: int = 100):
        """A matplotlib Figure: the tokens in a grid coloured as in the HTML, then per-token strips of the ratio
        (orange: clipped) and of the trainer - behaviour mismatch."""
        x = self.record
        n = max(1, len(x))
        cols = min(cols, n)
        lines = math.ceil(n / cols)
        fig = Figure(figsize=(width, 0.45 * lines + 3.4), dpi=dpi, layout="constrained")
        grid, ratio_ax, mism_ax = fig.subplots(3, 1, height_ratios=[0.45 * lines + 0.4, 1.5, 1.5])
        grid.set_xlim(0, cols)
        grid.set_ylim(lines, 0)
        grid.axis("off")
        for t, piece in enumerate(x.pieces_T):
            col, line = t % cols, t // cols
            edge = "#e08000" if t < len(x.clipped_T) and x.clipped_T[t] else "none"
            grid.add_patch(Rectangle((col + 0.03, line + 0.08), 0.94, 0.84, facecolor=self.colour(t), edgecolor=edge,
                                     linewidth=1.5))
            label = _shown(piece)
            label = label if len(label) <= 9 else label[:8] + "…"
            struck = t < len(x.masked_T) and x.masked_T[t]
            grid.text(col + 0.5, line + 0.5, ("×" if struck else "") + label, ha="center", va="center", fontsize=8,
                      parse_math=False, color="#555" if struck else "black")
        title = f"token X-ray: step {self.step}, sample {self.sample}, advantage {_fmt(x.advantage, '+.3g')}"
        grid.set_title(title + (f" ({x.note})" if x.note else ""), fontsize=9, loc="left")
        idx = list(range(len(x)))
        for ax, vals, name, base in ((ratio_ax, x.ratio_T, "ratio pi/pi_prox", 1.0),
                                     (mism_ax, x.mismatch_T, "mismatch trainer - behaviour", 0.0)):
            if vals:
                colours = ["#e08000" if x.clipped_T[t] and base else "#1f77b4" for t in idx]
                ax.bar(idx, [v - base for v in vals], bottom=base, color=colours, width=0.8)
            else:
                ax.text(0.5, 0.5, "not trained", ha="center", va="center", transform=ax.transAxes, fontsize=8)
            ax.axhline(base, color="#999", lw=0.8)
            ax.set_ylabel(name, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.set_xlim(-0.6, max(len(x), 1) - 0.4)
        mism_ax.set_xlabel("token", fontsize=8)
        return fig

    def save_png(self, path: str | Path) -> Path:
        """Write `figure()` as a PNG at `path`; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.figure().savefig(path, format="png")
        return path

    def save(self, path: str | Path) -> Path:
        """A PNG (`.png`) or a standalone HTML page (`.html`) at `path`."""
        path = Path(path)
        if path.suffix == ".png":
            return self.save_png(path)
        if path.suffix not in (".html", ".htm"):
            raise ValueError(f"{path}: give a .png or .html file to save the token X-ray")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<!doctype html><meta charset='utf-8'><title>token X-ray</title>{self.html()}")
        return path


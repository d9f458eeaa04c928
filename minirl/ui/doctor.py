"""The doctor: classic failure signs of an RL run, read from its per-step records (a pure function), and the
reward-hacking watch's warnings (`core/hacking.py`)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from minirl.core.hacking import episodes
from minirl.core.metrics import load_events
from minirl.types import RunView


@dataclass(frozen=True)
class Alert:
    """One flagged symptom: `code` is stable (tests, docs), `title` short, `detail` says what it means and what to do."""
    code: str
    level: str  # "warn" or "error"
    title: str
    detail: str
    step: int | None = None
    check: str | None = None  # a reward-hacking warning about a check: its name


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


def doctor(history: Sequence[dict] | str | Path | RunView, *, min_steps: int = 6,
           evals: Sequence[dict] = ()) -> list[Alert]:
    """Classic failure signs in a run's per-step records (`run.history` or the log's step events; its "eval" events
    in `history` or `evals`), or in a finished run: its out_dir or metrics.jsonl (all its events, evaluations
    included), or a live `Run`.

    Pure: the same records give the same alerts. Trend rules compare the first and the last few steps, and
    only speak once there are `min_steps` steps; point rules (reward failures, sync spikes) speak at once. The
    reward-hacking watch's warnings come first, one per episode of each condition, at the step it began."""
    if isinstance(history, (str, Path)) or hasattr(history, "events"):  # a run folder, its log, or a Run
        history = load_events(history)
    hist = [h for h in history if h.get("event", "step") == "step"]
    evals = [*evals, *(h for h in history if h.get("event") == "eval")]
    alerts: list[Alert] = [Alert(f.code, "warn", f.title, f.detail, s, f.check) for s, f in episodes(hist, evals)]
    last = hist[-1].get("step") if hist else None
    n = len(hist)

    def add(code: str, level: str, title: str, detail: str) -> None:
        alerts.append(Alert(code, level, title, detail, last))

    # reward failures: any in the last steps
    fails = _series(hist[-5:], "reward/failures")
    if sum(fails) > 0:
        add("reward_failures", "error", f"{int(sum(fails))} reward call(s) failed in the last {len(fails)} steps",
            "A reward raised, crashed, timed out or returned a non-number (or one beyond reward_clip); those "
            "samples are left out of the loss. "
"The samples panel and the step's 'reward/failure_kinds' show why; fix the reward or raise "
            "reward_timeout_s.")

    # a step whose loss or gradients were not finite: skipped (no optimizer update)
    skipped = _series(hist[-5:], "train/skipped_nonfinite")
    if sum(skipped) > 0:
        add("nonfinite_step", "error", f"{int(sum(skipped))} step(s) skipped: non-finite loss or gradients",
            "The update was dropped and the adapter kept as it was. Look for infinite behaviour logprobs "
            "(top_p/top_k with tis_cap=None), an lr that is too high, or rewards near reward_clip.")

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
    collapsed = False
    if len(ent) >= min_steps:
        e0, e1 = _early_recent(ent)
        if e1 < 0.3 * e0 or e1 < 0.02:
            collapsed = True
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
                if rm <= 0.2 * hi or rm <= 0:
                    why = " Rewards are low: the task may be too hard; use easier prompts or a denser reward."
                elif collapsed:  # not the prompts: a near-deterministic policy gives each prompt one answer
                    why = (" The policy has become nearly deterministic (entropy collapsed), so a group's completions "
                           "agree, right or wrong: lower lr or raise temperature (the prompts need not be too easy).")
                elif rm >= 0.8 * hi:
                    why = " Rewards are near their best: the task may be solved or too easy; use harder prompts."
                else:
                    why = (" Rewards are middling, so groups are all-right or all-wrong: the policy is getting "
                           "deterministic (see entropy); raise temperature.")
            add("zero_advantage", "warn", f"{z1:.0%} of groups have zero advantage (was {z0:.0%})",
                "All completions of such a group got the same reward, so they teach nothing: the step is "
                "wasted compute." + why + " A larger group_size also helps, and dynamic_sampling: true replaces "
                "such groups within the step.")
    return alerts

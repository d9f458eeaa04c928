"""Reward functions and the scorer.

A reward is a plain function `(prompt, completion, **columns) -> float | None` (sync or async). `None` means
"skip this sample". Rewards combine by weight (weight 0 = logged only). A reward that raises, times out, or
returns NaN/inf/a non-number is a *failure*: recorded with its reason, its sample excluded from the group's
baseline and the loss, and the run goes on. Nothing is turned silently into 0.0.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..loss import group_advantages
from ..types import Group, RewardFailure, ScoredGroup
from .registry import resolve_reward, source_hash

# --- scoring --------------------------------------------------------------------------------------------------

@dataclass
class Scorer:
    """Runs the reward functions of a run off the generation loop, each call with a timeout."""
    rewards: list[tuple[str, Callable]]
    weights: list[float]
    timeout_s: float = 10.0
    scale_by_std: bool = True

    def __post_init__(self) -> None:
        self.versions = {n: source_hash(f) for n, f in self.rewards}

    @classmethod
    def from_config(cls, refs: Sequence[str | Callable], weights: Sequence[float] | None, timeout_s: float,
                    scale_by_std: bool = True) -> "Scorer":
        if not refs:
            raise ValueError("no reward functions: set `rewards` to at least one reward")
        resolved = [resolve_reward(r) for r in refs]
        return cls(resolved, list(weights) if weights else [1.0] * len(resolved), timeout_s, scale_by_std)

    def _call(self, fn: Callable, prompt: str, completion: str, columns: dict) -> Any:
        if inspect.iscoroutinefunction(fn):
            return asyncio.run(asyncio.wait_for(fn(prompt, completion, **columns), self.timeout_s))
        return fn(prompt, completion, **columns)

    def score_group(self, group: Group) -> ScoredGroup:
        cols = dict(group.prompt.columns)
        futs = {(name, i): _in_daemon_thread(self._call, fn, group.prompt.text, c.text, cols)
                for name, fn in self.rewards for i, c in enumerate(group.completions)}
        per: dict[str, list[float | None]] = {n: [None] * len(group.completions) for n, _ in self.rewards}
        failures: list[RewardFailure] = []
        bad = set()  # samples excluded by a failure of a weighted reward, or a skip
        _, hung = cf.wait(futs.values(), timeout=self.timeout_s)
        for (name, i), fut in futs.items():
            try:
                if fut in hung:
                    raise cf.TimeoutError
                v = fut.result()
            except (cf.TimeoutError, asyncio.TimeoutError):
                v, why = None, f"timeout after {self.timeout_s}s"
            except Exception as e:  # noqa: BLE001 - a faulty reward must never kill the run
                v, why = None, f"{type(e).__name__}: {e}"
            else:
                why = None
                if v is None:
                    pass  # an explicit skip
                elif isinstance(v, bool) or not isinstance(v, (int, float)):
                    v, why = None, f"returned {type(v).__name__} {v!r:.40}, expected a float or None"
                elif not math.isfinite(v):
                    v, why = None, f"returned non-finite {v}"
                else:
                    v = float(v)
            if why is not None:
                failures.append(RewardFailure(name, i, why))
            per[name][i] = v
        weights = dict(zip((n for n, _ in self.rewards), self.weights))
        totals: list[float | None] = []
        for i in range(len(group.completions)):
            vals = [(per[n][i], weights[n]) for n, _ in self.rewards if weights[n] != 0]
            if any(v is None for v, _ in vals):
                bad.add(i)
                totals.append(None)
            else:
                totals.append(sum(v * w for v, w in vals))
        adv = group_advantages(totals, self.scale_by_std)
        return ScoredGroup(group, tuple(totals), {n: tuple(v) for n, v in per.items()}, tuple(adv),
                           tuple(failures), dict(self.versions))


def _in_daemon_thread(fn: Callable, *args: Any) -> cf.Future:
    """Run one reward call in its own daemon thread: a call that never returns is abandoned after the timeout
    and cannot keep the process alive at exit (a pool's worker threads would)."""
    fut: cf.Future = cf.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered to the scorer, which records it
            fut.set_exception(e)
    threading.Thread(target=run, daemon=True, name="minirl-reward").start()
    return fut

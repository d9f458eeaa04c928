"""What isolating rewards in worker processes costs: start-up, per call, per group of G calls, and per step.

The reward is the arithmetic task's: a regex for the last integer, compared with the answer. Each mode scores the
same groups of G completions of ~600 characters; the figure is the median over the groups (wall clock):
  direct      a plain loop calling the function (no timeout, no isolation: the floor)
  in-process  RewardWorkers(workers=0): one daemon thread per call, per-call timeout
  workers=N   RewardWorkers(workers=N): N worker processes
The step figure is groups_per_step x the median group, against the demo's ~14 s step.
Then the per-call-timeout case: 8 calls of 0.3 s CPU each, 2 workers, timeout 1 s.

    python scripts/reward_overhead.py [--groups 400] [--workers 2 4]
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import time

from minirl.rewards.workers import RewardCall, RewardWorkers

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def correct(prompt: str, completion: str, answer: int, **_) -> float:
    return 1.0 if last_integer(completion) == int(answer) else 0.0


def cpu_300ms(prompt: str, completion: str, **_) -> float:
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    return 1.0


def groups(n: int, g: int) -> list[list[RewardCall]]:
    rng = random.Random(0)
    words = "first we add the tens then the units so that gives us a total of".split()
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append([RewardCall("correct", f"What is {a} + {b}?",
                               " ".join(rng.choice(words) for _ in range(120)) + f" {a + b + rng.randint(0, 1)}",
                               {"answer": a + b}) for _ in range(g)])
    return out


def median_ms(fn, items) -> float:
    times = []
    for item in items:
        t = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=14.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[2])
    a = ap.parse_args()
    gs = groups(a.groups, a.group_size)
    singles = [[g[0]] for g in gs]
    print(f"{a.groups} groups of {a.group_size} calls; medians, wall clock")
    direct = median_ms(lambda g: [correct(c.prompt, c.completion, **c.columns) for c in g], gs)
    print(f"{'direct':>12}: group {direct:7.3f} ms")
    for n in [0, *a.workers]:
        t = time.perf_counter()
        rw = RewardWorkers([("correct", correct)], n, timeout_s=10.0)
        start = time.perf_counter() - t
        with rw:
            rw.call_many(gs[0])  # warm
            group = median_ms(rw.call_many, gs)
            call = median_ms(rw.call_many, singles)
        step = a.groups_per_step * group / 1e3
        name = "in-process" if n == 0 else f"workers={n}"
        print(f"{name:>12}: start {start * 1e3:7.1f} ms | call {call:6.3f} ms | group {group:7.3f} ms "
              f"(+{group - direct:.3f} over direct) | per step {step * 1e3:6.2f} ms = "
              f"{100 * step / a.step_s:.3f} % of a {a.step_s:g} s step")
    with RewardWorkers([("cpu", cpu_300ms)], 2, timeout_s=1.0) as rw:
        t = time.perf_counter()
        out = rw.call_many([RewardCall("cpu", "", "")] * 8)
        print(f"8 calls of 0.3 s CPU, 2 workers, timeout 1 s: {sum(o.error is not None for o in out)}/8 timed out, "
              f"group took {time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()

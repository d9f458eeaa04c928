"""What `run_tests` costs per call: two checkouts of minirl (say main's and a branch's), interleaved.

Each round runs, for each checkout in turn, a fresh Python that loads that checkout's sandbox from its files (as a
reward worker does: no `import minirl`, no torch), makes one warm-up call, then `--calls` timed calls of each
workload, and reports their wall-clock seconds. Workloads (the completion is right in each):
  mbpp3      the built-in code task's shape: `def f(x)` and three `assert f(...) == ...`
  humaneval  one HumanEval-style test program, `def check(candidate)` with three asserts, entry_point "f"
The figures per checkout and workload: the median wall-clock time over all rounds' calls (with each round's
median), and the CPU time per call of the caller and every sandbox process, each round (less sensitive than wall
clock to other work on a shared machine).

    python scripts/bench_run_tests.py --old /tmp/sbx-main --new . [--rounds 4] [--calls 20] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

SOLUTION = "```python\ndef f(x):\n    return x * 7\n```"
MBPP = ["assert f(0) == 0", "assert f(4) == 28", "assert f(-2) == -14"]
CHECK = ("def check(candidate):\n    assert candidate(0) == 0\n    assert candidate(4) == 28\n"
         "    assert candidate(-2) == -14\n")

# Runs in the child: load the checkout's sandbox by path (old: minirl/rewards/sandbox.py; new: minirl/sandbox/).
CHILD = r'''
import importlib.util, json, os, resource, sys, time
root, calls = sys.argv[1], int(sys.argv[2])
package = os.path.join(root, "minirl", "sandbox")
if os.path.isdir(package):
    spec = importlib.util.spec_from_file_location("sbx", os.path.join(package, "__init__.py"),
                                                  submodule_search_locations=[package])
else:
    spec = importlib.util.spec_from_file_location("sbx", os.path.join(root, "minirl", "rewards", "sandbox.py"))
sbx = sys.modules["sbx"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sbx)
def cpu():  # this process and every sandbox process it waited for (each level reaps the one below)
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
workloads = json.loads(sys.stdin.read())
out, cpu_s = {}, {}
for name, (tests, entry_point) in workloads.items():
    first = sbx.run_tests(SOLUTION, tests, entry_point=entry_point)  # warm-up (and a check that it passes)
    assert first.all_passed, first
    times, c0 = [], cpu()
    for _ in range(calls):
        t = time.perf_counter()
        r = sbx.run_tests(SOLUTION, tests, entry_point=entry_point)
        times.append(time.perf_counter() - t)
        assert r.all_passed, r
    out[name], cpu_s[name] = times, (cpu() - c0) / calls
print(json.dumps({"isolation": sbx.isolation(), "seconds": out, "cpu_s": cpu_s}))
'''.replace("SOLUTION", repr(SOLUTION))


def commit(root: str) -> str:
    return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    return f"{model}, {os.cpu_count()} cores, avx512: {'avx512f' in open('/proc/cpuinfo').read()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="checkout to compare against (e.g. a worktree of main)")
    ap.add_argument("--new", default=".", help="checkout under test")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # the old harness split one string into characters: give it the program as a one-item list
    workloads = {"old": {"mbpp3": [MBPP, None], "humaneval": [[CHECK], "f"]},
                 "new": {"mbpp3": [MBPP, None], "humaneval": [CHECK, "f"]}}
    roots = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    times = {side: {w: [] for w in workloads[side]} for side in roots}
    round_medians = {side: {w: [] for w in workloads[side]} for side in roots}
    cpu = {side: {w: [] for w in workloads[side]} for side in roots}
    loads = [os.getloadavg()[0]]
    isolation = {}
    for r in range(args.rounds):
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):  # alternate who goes first
            got = subprocess.run([sys.executable, "-I", "-c", CHILD, roots[side], str(args.calls)],
                                 input=json.dumps(workloads[side]), capture_output=True, text=True, check=True)
            result = json.loads(got.stdout)
            isolation[side] = result["isolation"]
            for w, ts in result["seconds"].items():
                times[side][w] += ts
                round_medians[side][w].append(statistics.median(ts))
                cpu[side][w].append(result["cpu_s"][w])
        loads.append(os.getloadavg()[0])
    report = {
        "settings": {"rounds": args.rounds, "calls_per_round": args.calls, "timeout_s": 5, "memory_mb": 512,
                     "solution": SOLUTION, "mbpp3": MBPP, "humaneval": CHECK},
        "machine": machine(), "python": sys.version.split()[0], "load_avg_1min": loads,
        "checkouts": {side: {"path": roots[side], "commit": commit(roots[side]), "isolation": isolation[side]}
                      for side in roots},
        "ms_per_call": {side: {w: {"median": 1000 * statistics.median(ts), "mean": 1000 * statistics.fmean(ts),
                                   "p90": 1000 * statistics.quantiles(ts, n=10)[-1],
                                   "round_medians": [round(1000 * m, 1) for m in round_medians[side][w]],
                                   "cpu_ms_per_call": [round(1000 * c, 1) for c in cpu[side][w]]}
                               for w, ts in times[side].items()} for side in roots},
    }
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""A demo step of two commits, interleaved on one machine (issue 41: "a demo step <= 0.8x main's").

Each side is a worktree of one commit. A round runs, for each side, the demo's config (its own commit's `DEMO`:
8 prompts x 8 completions, 24 new tokens, token_budget 512, K = 0) for `--steps` steps with no evaluation, in a
subprocess with that worktree first on PYTHONPATH; round r uses seed r on both sides (the same prompts), and the
side that goes first rotates. A side's figure is the median over rounds of its steps' median `time/step_s`
(the first step of a run, which warms up, left out), with generation and training seconds beside it.

    python scripts/bench_demo_step.py --old /tmp/old --new /tmp/new --out DIR --rounds 3 --steps 6
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

CODE = """
import json
import minirl.training.trainer
from minirl.config import DEMO, Config
if {keep_heap}:  # the side that leaves glibc's mmap threshold dynamic (as before the memory plan's heap fix)
    minirl.training.trainer.fix_malloc_threshold = lambda *a, **k: False
from minirl.run.loop import Run
run = Run(Config(**{{**DEMO, "steps": {steps}, "eval_size": 0, "seed": {seed}, "out_dir": {out!r}}}), overwrite=True)
run.run()
keys = ("time/step_s", "time/gen_s", "time/train_s")
print("RESULT " + json.dumps([{{k: h.get(k) for k in keys}} for h in run.history]))
"""


def run_side(tree: Path, out: Path, steps: int, seed: int, keep_heap: bool = False) -> dict:
    t0, load = time.time(), os.getloadavg()[0]
    code = CODE.format(steps=steps, seed=seed, out=str(out), keep_heap=keep_heap)
    p = subprocess.run([sys.executable, "-c", code], cwd=tree,
                       env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{tree}: the run failed\n{p.stderr[-3000:]}")
    hist = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    steady = hist[1:]
    med = {k: statistics.median(h[k] for h in steady) for k in ("time/step_s", "time/gen_s", "time/train_s")}
    return {"steps": hist, "median": med, "wall_s": time.time() - t0, "load1_at_start": load}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, type=Path)
    ap.add_argument("--new", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--keep-heap-side", action="store_true",
                    help="a third side: the new commit with glibc's mmap threshold left dynamic (trainer.fix_malloc_threshold off)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    commit = {k: subprocess.run(["git", "-C", str(p), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() for k, p in (("old", a.old), ("new", a.new))}
    res = {"settings": {"commits": commit, "rounds": a.rounds, "steps": a.steps, "eval_size": 0, "K": 0,
                        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
           "rounds": []}
    sides = {"old": (a.old, False), "new": (a.new, False)}
    if a.keep_heap_side:
        sides["new_keep_heap"] = (a.new, True)
    names = list(sides)
    for r in range(a.rounds):
        got = {}
        for side in names[r % len(names):] + names[:r % len(names)]:  # the side that goes first rotates
            tree, keep_heap = sides[side]
            got[side] = run_side(tree, a.out / f"{side}_r{r}", a.steps, seed=r, keep_heap=keep_heap)
            print(side, r, got[side]["median"], flush=True)
        res["rounds"].append(got)
        summary = {side: {k: statistics.median(x[side]["median"][k] for x in res["rounds"])
                          for k in ("time/step_s", "time/gen_s", "time/train_s")} for side in names}
        for side in names[1:]:
            summary[f"{side}_over_old_step"] = summary[side]["time/step_s"] / summary["old"]["time/step_s"]
            summary[f"{side}_over_old_per_round"] = [x[side]["median"]["time/step_s"] / x["old"]["median"]["time/step_s"]
                                                     for x in res["rounds"]]
        res["summary"] = summary
        (a.out / "demo_step.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
    return res


if __name__ == "__main__":
    main()

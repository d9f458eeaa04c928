"""Time to accuracy of two commits, interleaved on one machine (issue 41's report).

Each side is a worktree of one commit; for every seed, each side runs the demo through its own
`minirl.benchmarks.learning.bench_learning` (K = 0, `--eval-size` held-out problems every `--eval-every` steps) in a
subprocess with that worktree first on PYTHONPATH. The side that goes first alternates by seed. The summary gives,
per side, the training seconds (evaluations excluded) to each target with how many seeds reached it, the area under
the accuracy-vs-training-seconds curve over the horizon every run covers (divided by it: the mean accuracy over that
time), the final accuracy and the median step, each with its standard error over seeds.

    python scripts/bench_time_to_accuracy.py --old /tmp/old --new /tmp/new --out DIR --seeds 0,1,2

Commits whose built-in task cannot hold out 256 problems (before the fix in minirl/data/rows.py it looped forever) get
the same problems from files: `--data train.jsonl --eval-data held.jsonl` (`--write-data DIR` writes the built-in
task's split for seed 0 with 256 held out: held.jsonl and the 531 problems left, train.jsonl).
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

from minirl.benchmarks.learning import accuracy_at_seconds, accuracy_over_time


def _run_side(tree: Path, out: Path, seed: int, eval_size: int, eval_every: int, overrides: dict) -> dict:
    code = ("import json,sys; from minirl.benchmarks.learning import bench_learning; "
            f"r = bench_learning({str(out)!r}, seeds=({seed},), ks=(0,), eval_size={eval_size}, "
            f"eval_every={eval_every}, **{overrides!r}); print(json.dumps(r['runs']['s{seed}_k0']['curve']))")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0, load = time.time(), os.getloadavg()[0]
    subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True)
    run = json.loads((out / "learning.json").read_text())["runs"][f"s{seed}_k0"]
    return {"curve": run["curve"], "step_s": run["step_s"], "wall_s": time.time() - t0,
            "load1_at_start": load}


def _to_target(points, target):
    return next((t for t, acc in points if acc >= target), None)


def _mean_se(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "se": None, "n": 0}
    se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None
    return {"mean": statistics.mean(xs), "se": se, "n": len(xs)}


def summarise(runs: dict, targets=(0.65, 0.70)) -> dict:
    horizon = min(sum(r["step_s"]) for side in runs.values() for r in side.values())
    out = {"horizon_s": horizon}
    for name, side in runs.items():
        pts = {s: accuracy_at_seconds(r["curve"], r["step_s"]) for s, r in side.items()}
        out[name] = {
            **{f"s_to_{t:.2f}": {**_mean_se([_to_target(p, t) for p in pts.values()]),
                                 "reached": sum(_to_target(p, t) is not None for p in pts.values()), "seeds": len(pts)}
               for t in targets},
            "mean_acc_over_horizon": _mean_se([accuracy_over_time(p, horizon) for p in pts.values()]),
            "final_acc": _mean_se([r["curve"][-1][1] for r in side.values()]),
            "median_step_s": _mean_se([statistics.median(r["step_s"]) for r in side.values()]),
            "train_s": _mean_se([sum(r["step_s"]) for r in side.values()]),
        }
    names = list(runs)
    if len(names) == 2:
        a, b = names
        common = [s for s in runs[a] if s in runs[b]]
        out[f"median_step_{b}_over_{a}"] = _mean_se(
            [statistics.median(runs[b][s]["step_s"]) / statistics.median(runs[a][s]["step_s"]) for s in common])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path)
    ap.add_argument("--new", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--data", help="a JSONL file of training rows (default: the demo's built-in task)")
    ap.add_argument("--eval-data", help="a JSONL file of held-out rows, the same for every seed and both sides")
    ap.add_argument("--write-data", type=Path, help="write the built-in task's split (seed 0) to DIR and exit")
    a = ap.parse_args(argv)
    if a.write_data:
        from minirl.data.rows import arithmetic_splits
        a.write_data.mkdir(parents=True, exist_ok=True)
        for name, rows in zip(("train", "held"), arithmetic_splits(a.eval_size, 0)):
            (a.write_data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {}
    if not (a.old and a.new and a.out):
        ap.error("--old, --new and --out are needed (or --write-data DIR)")
    a.out.mkdir(parents=True, exist_ok=True)
    res_path = a.out / "time_to_accuracy.json"
    res = json.loads(res_path.read_text()) if res_path.exists() else {"runs": {"old": {}, "new": {}}}
    overrides = {k: str(Path(v).resolve()) for k, v in (("data", a.data), ("eval_data", a.eval_data)) if v}
    res["settings"] = {"old": str(a.old), "new": str(a.new), "eval_size": a.eval_size, "eval_every": a.eval_every,
                       **overrides,
                       "commits": {k: subprocess.run(["git", "-C", str(p), "rev-parse", "--short", "HEAD"],
                                                     capture_output=True, text=True).stdout.strip()
                                   for k, p in (("old", a.old), ("new", a.new))},
                       "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    for i, seed in enumerate(int(s) for s in a.seeds.split(",")):
        for side in (("old", "new") if i % 2 == 0 else ("new", "old")):
            if str(seed) in res["runs"][side]:
                continue
            tree = a.old if side == "old" else a.new
            res["runs"][side][str(seed)] = _run_side(tree, a.out / f"{side}_s{seed}", seed, a.eval_size, a.eval_every,
                                                  overrides)
            res["summary"] = summarise(res["runs"])
            res_path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
    return res


if __name__ == "__main__":
    main()

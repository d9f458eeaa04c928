"""`minirl demo` as a user runs it, K = 0 against `max_async_steps: auto`, interleaved (K = 0, auto, auto, K = 0):
each run a fresh process; its wall time from the outside (process start to exit), the run's own log (start to end
event), the median step and held-out accuracy from summary.json. Runs already in OUT/demo_k.json are skipped.

    python scripts/bench_demo_k.py --out DIR                  # this checkout
    python scripts/bench_demo_k.py --out DIR --tree WT        # another commit's worktree (same venv)

Writes DIR/demo_k.json (BENCHMARKS.md, "`minirl demo` with `auto` (K = 1) against K = 0"). Run it alone."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ORDER = "0:a,auto:a,auto:b,0:b"  # K:label, in this order


def _cpu() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    return {"cpu": model, "avx512_bf16": "avx512_bf16" in info, "cores": os.cpu_count()}


def one(tree: Path, out: Path, k: str, rep: str, extra: list[str]) -> dict:
    d = out / f"k{k}_{rep}"
    load, t = os.getloadavg()[0], time.perf_counter()
    with open(f"{d}.log", "w") as log:  # the tree's minirl: `-c` puts the working folder first on sys.path
        rc = subprocess.run([sys.executable, "-c", "from minirl.cli import main; main()", "demo", "--out", str(d),
                             "--max-async-steps", k, "--overwrite", *extra], cwd=tree, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t
    s = json.loads((d / "summary.json").read_text())
    events = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    end = next(e["time"] for e in events if e.get("event") == "end")
    return dict(k=k, rep=rep, rc=rc, wall_s=round(wall, 1), run_s=end, load_at_start=load, K=s["max_async_steps"],
                async_why=s["async_why"], median_step_s=s["median_step_s"], acc_before=s["eval_accuracy_before"],
                acc_after=s["eval_accuracy_after"], acc_after_se=s["eval_accuracy_after_se"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--runs", default=ORDER, help=f"K:label pairs, run in this order (default {ORDER})")
    ap.add_argument("--demo-args", default="", help="more `minirl demo` flags for every run, e.g. '--task retry'")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "demo_k.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=a.tree, capture_output=True,
                            text=True).stdout.strip()
    for k, rep in (x.split(":") for x in a.runs.split(",")):
        if any((r["k"], r["rep"]) == (k, rep) for r in rows):
            continue
        rows.append(one(a.tree, a.out.resolve(), k, rep, shlex.split(a.demo_args)))
        path.write_text(json.dumps({"commit": commit, "command": "minirl demo --out DIR --max-async-steps K "
                                    f"--overwrite {a.demo_args}".strip(), **_cpu(), "rows": rows}, indent=1))
        r = rows[-1]
        print(f"K={k} ({rep}): wall {r['wall_s']} s, run {r['run_s']:.1f} s, median step {r['median_step_s']:.2f} s, "
              f"held-out {r['acc_before']:.3f} -> {r['acc_after']:.3f}", flush=True)


if __name__ == "__main__":
    main()

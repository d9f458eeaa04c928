"""Issue 55's learning table, one run at a time, resumable across machines.

Each item `SEED:NAME` (NAME a setting of `minirl.benchmarks.learning.SETTINGS`) runs
`bench_presets(WORK, presets=(NAME,), seeds=(SEED,), eval_size=256, eval_every=10, data=DATA/train.jsonl,
eval_data=DATA/held.jsonl)` in its own process (= `minirl bench learning --presets NAME --seeds SEED --eval-size 256
--eval-every 10` on those files), then copies WORK/NAME/learning.json to RECORD/NAME.json, which is committed: a
later session on a fresh machine copies the record back into WORK first, and `bench_learning` skips the runs it
holds (same config). DATA is the split of the time-to-accuracy runs (`bench_time_to_accuracy.py --write-data`),
written when missing. `touch WORK/STOP` ends the queue between runs.

    python scripts/bench_settings_queue.py 0:dapo-k1 1:rloo ...
    python scripts/bench_settings_queue.py --table [--json OUT]   # compare_presets against dapo, as markdown

dapo (the default, K = 0) is not rerun: its seeds 0-2 are the 88a5752 runs in
docs/measurements/time_to_accuracy_51543b3_vs_88a5752.json (same data and training code, evaluated every 5 steps;
the table compares at the steps every run has).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORD = REPO / "docs" / "measurements" / "issue55"
DAPO = REPO / "docs" / "measurements" / "time_to_accuracy_51543b3_vs_88a5752.json"
ORDER = ("dapo-k1", "grpo-k1", "cispo-k1", "gspo-k1", "dapo-epochs2", "grpo-epochs2", "cispo-epochs2",
         "gspo-epochs2", "rloo", "reinforce++", "dapo-entropy", "dapo-top-entropy")


def _cpu() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "AVX512-bf16" if "avx512_bf16" in flags else "AVX512" if "avx512f" in flags else "AVX2"
    return f"{platform.machine()}, {os.cpu_count()} cores, {isa}"


def run_item(work: Path, data: Path, seed: int, name: str, record: Path = RECORD) -> None:
    dest, rec = work / name / "learning.json", record / f"{name}.json"
    if rec.exists() and not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(rec, dest)
    kept = json.loads(rec.read_text()).get("provenance", {}) if rec.exists() else {}  # the benchmark rewrites
    # learning.json without it: each earlier seed's record comes from the committed file
    code = ("from minirl.benchmarks.learning import bench_presets; "
            f"bench_presets({str(work)!r}, presets=({name!r},), seeds=({seed},), eval_size=256, eval_every=10, "
            f"data={str(data / 'train.jsonl')!r}, eval_data={str(data / 'held.jsonl')!r})")
    t0 = time.time()
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    res = json.loads(dest.read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    res["provenance"] = {**kept, **res.get("provenance", {})}
    res["provenance"][f"s{seed}"] = {  # where and when each run was made
        "commit": commit, "machine": _cpu(), "finished_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "wall_s": round(time.time() - t0)}
    dest.write_text(json.dumps(res, indent=2))
    record.mkdir(parents=True, exist_ok=True)
    shutil.copy(dest, rec)


def table(out: Path | None) -> str:
    from minirl.benchmarks.learning import compare_presets
    old = json.loads(DAPO.read_text())["runs"]["new"]  # 88a5752: the default fields (= the dapo preset)
    dapo = {"runs": {f"s{s}_k0": {"curve": r["curve"], "step_s": r["step_s"], "after": r["curve"][-1][1],
                                  "gain": r["curve"][-1][1] - r["curve"][0][1]} for s, r in old.items()}}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "issue55-dapo.json"
    tmp.write_text(json.dumps(dapo))
    files = {"dapo": [tmp], **{n: [RECORD / f"{n}.json"] for n in ORDER if (RECORD / f"{n}.json").exists()}}
    res = compare_presets(files)
    if out:
        out.write_text(json.dumps(res, indent=2))

    def f(x):
        return "--" if x is None else f"{x:.3f}"

    def ms(d):
        return f"{d['mean']:.3f}" + (f" ± {d['se']:.3f}" if d.get("se") is not None else "")
    rows = ["| setting | seeds | held-out after 30 steps | per seed | curve mean, steps "
            f"{'/'.join(map(str, res['common_eval_steps']))} | after, minus dapo (paired) | curve mean, minus dapo "
            "(paired) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in res["settings"].items():
        runs = json.loads(files[name][0].read_text())["runs"]
        per = " / ".join(f(r["curve"][-1][1]) for _, r in sorted(runs.items()))
        rows.append(f"| {name} | {len(row['seeds'])} | {ms(row['after'])} | {per} | {ms(row['curve_mean'])} | "
                    f"{ms(row['after_minus_dapo']) if 'after_minus_dapo' in row else '--'} | "
                    f"{ms(row['curve_mean_minus_dapo']) if 'curve_mean_minus_dapo' in row else '--'} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("items", nargs="*", help="SEED:NAME, run in this order")
    ap.add_argument("--work", type=Path, default=Path("/work/bench"), help="run folders (large; not committed)")
    ap.add_argument("--record", type=Path, default=RECORD, help="where the learning.json files are kept (committed)")
    ap.add_argument("--table", action="store_true", help="print the table from RECORD and exit")
    ap.add_argument("--json", type=Path, help="with --table: also write compare_presets' result here")
    a = ap.parse_args()
    if a.table:
        print(table(a.json))
        return
    data = a.work / "D"
    if not (data / "held.jsonl").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "bench_time_to_accuracy.py"), "--write-data",
                        str(data)], check=True)
    for item in a.items:
        seed, name = item.split(":", 1)
        if (a.work / "STOP").exists():
            print("STOP found: ending the queue", flush=True)
            return
        print(f"== {time.strftime('%H:%M:%S')} {item}", flush=True)
        run_item(a.work, data, int(seed), name, a.record)
        print(f"== {time.strftime('%H:%M:%S')} {item} done", flush=True)


if __name__ == "__main__":
    main()

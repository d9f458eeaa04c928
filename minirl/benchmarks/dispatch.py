"""`minirl bench WHAT`: which benchmark runs, with the sizing flags it takes, checked before anything runs."""
from __future__ import annotations

from pathlib import Path

from minirl.benchmarks.generation import bench_generation
from minirl.benchmarks.learning import bench_learning, bench_presets
from minirl.benchmarks.memory import bench_memory
from minirl.benchmarks.pipeline import VARIANTS, WORKLOADS, bench_pipeline
from minirl.benchmarks.sync import bench_sync
from minirl.benchmarks.trl import TASKS
from minirl.benchmarks.trl_bench import bench_trl

# the sizing flags (`minirl bench WHAT --workloads/--steps/--rounds`) each benchmark takes
SIZES = {"pipeline": ("workloads", "variants", "steps", "rounds"), "memory": ("steps", "rounds"),
         "trl": ("steps", "lr", "task", "eval_size", "save_every", "minirl_overrides", "trl_from"),
         "learning": ("eval_size", "eval_every", "presets", "minirl_overrides")}
# Config fields a learning benchmark sets itself, each from a flag of its own
OWN_FIELDS = {"seed": "--seeds", "max_async_steps": "--ks or a -k1 preset", "out_dir": "--out",
              "eval_size": "--eval-size", "eval_every": "--eval-every"}
BENCHMARKS = ("generation", "pipeline", "sync", "learning", "memory", "trl")


def run(what: str, out: str | Path, seed: int = 0, seeds=(0, 1, 2), ks=(0, 1, 2), **sizes) -> dict:
    """Run benchmark `what`; `sizes` (workloads, variants, steps, rounds; trl: lr, task, eval_size, save_every,
    minirl_overrides, trl_from;
    learning: eval_size, eval_every, presets, minirl_overrides: Config fields of every run, e.g. a task of your own)
    go to the benchmarks that take them."""
    if what not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {what!r}: use {', '.join(BENCHMARKS[:-1])} or {BENCHMARKS[-1]}")
    wrong = sorted(set(sizes) - set(SIZES.get(what, ())))
    if wrong:
        flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
        takes = ", ".join(map(flag, SIZES.get(what, ()))) or "none of them"
        raise ValueError(f"bench {what} does not take {', '.join(map(flag, wrong))} (it takes {takes})")
    for k in ("steps", "rounds", "eval_size", "save_every", "eval_every"):
        if k in sizes and sizes[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be at least 1, got {sizes[k]}")
    if what == "generation":
        return bench_generation(str(out))
    if what == "pipeline":
        unknown = [w for w in sizes.get("workloads", ()) if w not in WORKLOADS]
        if unknown:
            raise ValueError(f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}")
        unknown = [v for v in sizes.get("variants", ()) if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variant {unknown[0]!r}: choose from {', '.join(VARIANTS)}")
        return bench_pipeline(out, seed=seed, **sizes)
    if what == "sync":
        return bench_sync(str(out))
    if what == "trl":
        if sizes.get("task", "addition") not in TASKS:
            raise ValueError(f"unknown task {sizes['task']!r}: choose from {', '.join(TASKS)}")
        return bench_trl(out, seeds=seeds, **sizes)
    if what == "learning":
        fields = sizes.pop("minirl_overrides", None) or {}
        if own := [k for k in fields if k in OWN_FIELDS]:
            raise ValueError(f"--minirl-overrides sets {own[0]}, which bench learning sets itself: use "
                             f"{OWN_FIELDS[own[0]]}")
        if "presets" in sizes:
            return bench_presets(out, seeds=seeds, **sizes, **fields)
        return bench_learning(out, seeds=seeds, ks=ks, **sizes, **fields)
    return bench_memory(out, **sizes)

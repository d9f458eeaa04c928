"""Benchmarks, written as JSON. Speed is compared as ratios measured side by side in one run."""
from __future__ import annotations

import json
from pathlib import Path


def _write(out: str | Path, name: str, result: dict) -> dict:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(json.dumps(result, indent=2))
    return result


def run(what: str, out: str | Path, seed: int = 0, seeds=(0, 1, 2), ks=(0, 1, 2)) -> dict:
    if what == "generation":
        from .generation import bench_generation
        return bench_generation(str(out))
    if what == "pipeline":
        from .pipeline import bench_pipeline
        return bench_pipeline(out, seed=seed)
    if what == "sync":
        from .sync import bench_sync
        return bench_sync(str(out))
    if what == "learning":
        from .learning import bench_learning
        return bench_learning(out, seeds=seeds, ks=ks)
    if what == "memory":
        from .memory import bench_memory
        return bench_memory(out)
    raise ValueError(f"unknown benchmark {what!r}: use generation, pipeline, sync, learning or memory")

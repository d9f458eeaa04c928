"""Benchmarks, written as JSON. Speed is compared as ratios measured side by side in one run."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .config import Config


def _write(out: str | Path, name: str, result: dict) -> dict:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(json.dumps(result, indent=2))
    return result


def bench_pipeline(out: str | Path, steps: int = 10, warmup: int = 2, **overrides: Any) -> dict:
    """The same config with K = 0 and K = 1 on the same device split (on CPU: generation on core 0, training on
    core 1), one after the other in one process. Median step seconds exclude `warmup` steps."""
    from .run import Run
    base = Config(steps=steps, prompts_per_step=4, group_size=8, max_tokens=32, lr=5e-4, eval_size=0,
                  gen_devices="0", train_devices="1", seed=0, **overrides)
    res: dict[str, Any] = {"config": base.to_dict()}
    for K, key in ((0, "sync"), (1, "async")):
        run = Run(base.replace(max_async_steps=K, out_dir=str(Path(out) / f"pipeline_k{K}")))
        run.run(pipeline=K > 0)
        h = run.history[warmup:]
        res[f"{key}_step_s"] = statistics.median(x["time/step_s"] for x in h)
        res[f"{key}_gen_busy"] = statistics.mean(x["busy/gen"] for x in h)
        res[f"{key}_train_busy"] = statistics.mean(x["busy/train"] for x in h)
        res[f"{key}_reward_mean"] = statistics.mean(x["reward/mean"] for x in run.history)
    res["speedup"] = res["sync_step_s"] / res["async_step_s"]
    res["gen_busy"], res["train_busy"] = res["async_gen_busy"], res["async_train_busy"]
    return _write(out, "pipeline.json", res)


def run(what: str, out: str | Path) -> dict:
    if what == "generation":
        from .bench_generation import bench_generation
        return bench_generation(str(out))
    if what == "pipeline":
        return bench_pipeline(out)
    if what == "sync":
        from .bench_sync import bench_sync
        return bench_sync(str(out))
    raise ValueError(f"unknown benchmark {what!r}: use generation, pipeline or sync")

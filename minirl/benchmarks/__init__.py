"""Benchmarks, written as JSON. Speed is compared as ratios measured side by side in one run."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..config import DEMO, Config


def _write(out: str | Path, name: str, result: dict) -> dict:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(json.dumps(result, indent=2))
    return result


def bench_pipeline(out: str | Path, steps: int = 12, warmup: int = 2, eval_size: int = 64, async_k: int = 1,
                   **overrides: Any) -> dict:
    """The same config with K = 0, 1 and 2 on the same device split (on CPU: the generator process pinned to
    core 0, the trainer to core 1), one after the other, all through the pipeline. Speed: median step
    seconds of K=0 vs K=`async_k` (excluding `warmup` steps) and each side's busy fraction (the top-level keys;
    every K's figures are under "k0", "k1", "k2"). Learning: held-out greedy accuracy before/after for each K
    (same seed, same prompts).

    The workload is the demo's (8 prompts x G = 8, 24 tokens). The trainer's work per step is the samples of the
    groups that carry signal (the others have zero advantage): it swings 2-4x from step to step and shrinks as
    the policy learns, so on average the trainer waits for the generator. G = 12 x 5 and G = 16 x 4 were tried
    for a better balance: the first averaged the same trainer work over steps 2-11, the second gave the trainer
    ~1.5x the generator's time."""
    from ..run import Run
    base = Config(**{**dict(steps=steps, prompts_per_step=8, group_size=8, max_tokens=24, lr=5e-4,
                            eval_size=eval_size, gen_devices="0", train_devices="1", seed=0), **overrides})
    res: dict[str, Any] = {"config": base.to_dict(), "learning": {}, "async_k": async_k}
    for K in (0, 1, 2):
        run = Run(base.replace(max_async_steps=K, out_dir=str(Path(out) / f"pipeline_k{K}")), overwrite=True)
        s = run.run(pipeline=True)
        h = run.history[warmup:]
        res[f"k{K}"] = {"step_s": statistics.median(x["time/step_s"] for x in h),
                        "gen_busy": statistics.mean(x["busy/gen"] for x in h),
                        "train_busy": statistics.mean(x["busy/train"] for x in h),
                        "train_samples": statistics.mean(x["train/samples"] for x in h),  # the work per step
                        "max_staleness": max((x["staleness/max"] or 0) for x in h),
                        "backend": s["backend"]}
        res["learning"][f"k{K}"] = {"before": s["eval_accuracy_before"], "after": s["eval_accuracy_after"],
                                    "gain": s["eval_accuracy_after"] - s["eval_accuracy_before"]}
    res["sync_step_s"], res["async_step_s"] = res["k0"]["step_s"], res[f"k{async_k}"]["step_s"]
    res["speedup"] = res["sync_step_s"] / res["async_step_s"]
    res["gen_busy"], res["train_busy"] = res[f"k{async_k}"]["gen_busy"], res[f"k{async_k}"]["train_busy"]
    return _write(out, "pipeline.json", res)


def _eval_curve(metrics_jsonl: Path) -> list[list[float]]:
    """[[step, held-out accuracy], ...] from a run's metrics log."""
    recs = (json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip())
    return [[r["step"], r["accuracy"]] for r in recs if r.get("event") == "eval"]


def bench_learning(out: str | Path, seeds=(0, 1, 2), eval_size: int = 128, eval_every: int = 10, ks=(0, 1, 2),
                   **overrides: Any) -> dict:
    """Does asynchrony cost learning? For each seed, the demo (its config and number of steps) with K = 0, 1 and 2;
    held-out greedy accuracy on the same `eval_size` problems for every K of a seed, before, every `eval_every`
    steps and after. K = 0 runs the synchronous loop on every core (the pipeline with K = 0 reproduces it exactly,
    only slower on the 1 + 1 split); K >= 1 runs the pipeline on the split (generator on core 0, trainer on core 1).
    Writes learning.json: per seed and K the gain and the accuracy curve; per K the mean gain and its standard
    error over seeds; and the paired differences K - K0 (same seed, same problems) with their standard errors, of
    the final accuracy and of the curve's mean after step 0 (less noisy than one endpoint). Runs already in
    DIR/learning.json with the same config are kept, so an interrupted benchmark resumes, and more seeds add on;
    `ks` runs only some K (the summaries cover the seeds that have the runs they need)."""
    from ..run import Run
    base = Config(**{**DEMO, "eval_size": eval_size, "eval_every": eval_every, **overrides})
    res: dict[str, Any] = {"config": base.to_dict(), "seeds": list(seeds), "runs": {}}
    done = Path(out) / "learning.json"
    if done.exists():
        prev = json.loads(done.read_text())
        if prev.get("config") == res["config"]:
            res["runs"] = prev.get("runs", {})
    for seed in seeds:
        for K in ks:
            if f"s{seed}_k{K}" in res["runs"]:
                continue
            split = dict(gen_devices="0", train_devices="1") if K else {}
            run = Run(base.replace(seed=seed, max_async_steps=K, out_dir=str(Path(out) / f"s{seed}_k{K}"), **split),
                      overwrite=True)  # a run not in learning.json was interrupted: start it again
            s = run.run()
            res["runs"][f"s{seed}_k{K}"] = {
                "before": s["eval_accuracy_before"], "after": s["eval_accuracy_after"],
                "gain": s["eval_accuracy_after"] - s["eval_accuracy_before"],
                "max_staleness": max((x.get("staleness/max") or 0) for x in run.history),
                "curve": _eval_curve(Path(out) / f"s{seed}_k{K}" / "metrics.jsonl")}
            _write(out, "learning.json", res)  # partial results survive an interrupted run

    def mean_se(xs):
        m = statistics.mean(xs)
        return {"mean": m, "se": statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None, "n": len(xs)}

    def curve_mean(r):
        return statistics.mean(a for step, a in r["curve"] if step > 0)
    runs = res["runs"]
    for K in (0, 1, 2):
        have = [s for s in seeds if f"s{s}_k{K}" in runs]
        if have:
            res[f"gain_k{K}"] = mean_se([runs[f"s{s}_k{K}"]["gain"] for s in have])
            res[f"curve_mean_k{K}"] = mean_se([curve_mean(runs[f"s{s}_k{K}"]) for s in have])
        paired = [s for s in have if f"s{s}_k0" in runs]
        if K and paired:
            res[f"gain_k{K}_minus_k0"] = mean_se([runs[f"s{s}_k{K}"]["after"] - runs[f"s{s}_k0"]["after"]
                                                  for s in paired])
            res[f"curve_mean_k{K}_minus_k0"] = mean_se([curve_mean(runs[f"s{s}_k{K}"]) - curve_mean(runs[f"s{s}_k0"])
                                                        for s in paired])
    return _write(out, "learning.json", res)


def run(what: str, out: str | Path, seed: int = 0, seeds=(0, 1, 2), ks=(0, 1, 2)) -> dict:
    if what == "generation":
        from .generation import bench_generation
        return bench_generation(str(out))
    if what == "pipeline":
        return bench_pipeline(out, seed=seed)
    if what == "sync":
        from .sync import bench_sync
        return bench_sync(str(out))
    if what == "learning":
        return bench_learning(out, seeds=seeds, ks=ks)
    if what == "memory":
        from .memory import bench_memory
        return bench_memory(out)
    raise ValueError(f"unknown benchmark {what!r}: use generation, pipeline, sync, learning or memory")

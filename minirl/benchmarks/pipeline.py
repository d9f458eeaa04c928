"""`minirl bench pipeline`: the asynchronous pipeline against the best synchronous loop, interleaved.

The synchronous side is what a user gets by default: K = 0, every core to each phase in turn (generate, score,
train). The asynchronous sides run generation ahead of training (K = 1, 2): on CPU either on the default split
(generator pinned to the first half of the cores, trainer to the rest) or sharing every core (both sides may use
all cores; the OS gives a core to whichever side has work). Each workload runs every variant once per round, the
order rotated between rounds (ABC, then BCA, ...), same seed and prompts, so the machine's drift falls on every
variant alike.

Workloads (each a set of Config overrides on the demo's):
- demo:      8 prompts x 8 samples x 24 tokens, the arithmetic reward.
- long-tail: 4 prompts x 8 samples x up to 160 tokens at temperature 1.0: most answers end early, a few run on,
             and a synchronous batch waits for its longest completion. Run on both generators (on CPU the
             default is transformers; vLLM's continuous batching lets the next step's requests start beside the
             stragglers once generation runs ahead), so the best synchronous setup is the faster of the two.
- judge:     the demo with a reward that waits `JUDGE_LATENCY_S` per call before answering (what a remote judge
             model or a test runner behind an API costs), 8 reward workers: the synchronous loop waits for the
             judge with every core idle; the pipeline generates and trains meanwhile.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from minirl.benchmarks.output import write_json
from minirl.config import DEMO, Config
from minirl.rewards.builtin import arithmetic_correct
from minirl.run.loop import Run

JUDGE_LATENCY_S = 0.5


def judged_correct(prompt: str, completion: str, answer: int, **cols) -> float:
    """The arithmetic reward behind a remote judge's latency (`JUDGE_LATENCY_S` of waiting, no CPU)."""
    time.sleep(JUDGE_LATENCY_S)  # stands for the network round trip of a judge call
    return arithmetic_correct(prompt, completion, answer, **cols)


WORKLOADS: dict[str, dict[str, Any]] = {
    "demo": {},
    "long-tail": dict(prompts_per_step=4, max_tokens=160),
    "judge": dict(rewards=[f"{__name__}:judged_correct"], reward_workers=8),
}
VARIANTS: dict[str, dict[str, Any]] = {
    "sync": dict(max_async_steps=0),                                         # the synchronous loop, every core
    "k1": dict(max_async_steps=1),                                           # the default split
    "k1_shared": dict(max_async_steps=1, gen_devices="all", train_devices="all"),
    "k2": dict(max_async_steps=2),
    "sync_vllm": dict(max_async_steps=0, backend="vllm"),                    # CPU: vLLM instead of transformers
    "k1_vllm": dict(max_async_steps=1, backend="vllm"),
}
WORKLOAD_VARIANTS: dict[str, tuple[str, ...]] = {  # what each workload runs by default
    "demo": ("sync", "k1", "k1_shared"),
    "long-tail": ("sync", "k1", "sync_vllm", "k1_vllm"),
    "judge": ("sync", "k1", "k1_shared"),
}


def _devices(overrides: dict[str, Any]) -> dict[str, Any]:
    """'all' = every core of this machine, on both sides."""
    every = f"0-{(os.cpu_count() or 1) - 1}"
    return {k: (every if v == "all" else v) for k, v in overrides.items()}


def _one(cfg: Config, warmup: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    run = Run(cfg, overwrite=True)
    s = run.run()
    h = run.history[warmup:]
    lens = [x["length/mean"] for x in h]
    return {**_phase_means(run.history, warmup),
            "step_s": statistics.median(x["time/step_s"] for x in h),
            "gen_busy": statistics.mean(x["busy/gen"] for x in h),
            "train_busy": statistics.mean(x["busy/train"] for x in h),
            "train_samples": statistics.mean(x["train/samples"] for x in h),
            "length_mean": statistics.mean(lens), "length_max": max(x["length/max"] for x in h),
            "max_staleness": max((x["staleness/max"] or 0) for x in h),
            "reward_first": s["reward_first"], "reward_last": s["reward_last"],
            "wall_s": time.perf_counter() - t0, "backend": s["backend"]}


def bench_pipeline(out: str | Path, workloads=("demo", "long-tail", "judge"),
                   variants: tuple[str, ...] | None = None, rounds: int = 2, steps: int = 6, warmup: int = 1,
                   seed: int = 0, **overrides: Any) -> dict:
    """Every variant on every workload (`variants`, default each workload's `WORKLOAD_VARIANTS`), `rounds` times
    interleaved. Per workload: each variant's step seconds (the mean over rounds of each run's steady-state mean
    step, `_steady_mean`: after `warmup`, the last step left out), `best_sync_step_s` (the fastest synchronous variant's), `async_step_s` (the
    fastest asynchronous variant's) and `speedup` = best_sync_step_s / async_step_s (> 1: async is faster). The
    top level repeats the first workload's figures (`speedup`, `gen_busy`, `train_busy`, `best_sync_step_s`,
    `async_step_s`) and lists every workload under `workloads`. No held-out evaluation: learning is `bench
    learning`'s measurement; `reward_first` / `reward_last` show each run trained. Runs already in
    DIR/pipeline.json with the same config are kept: an interrupted benchmark resumes where it stopped."""

    def variants_of(w: str) -> tuple[str, ...]:
        vs = variants or WORKLOAD_VARIANTS.get(w, ("sync", "k1", "k1_shared"))
        if torch.cuda.is_available():  # CPU variants: sharing every core; vLLM instead of transformers (GPU default)
            vs = tuple(v for v in vs if v not in ("k1_shared", "sync_vllm", "k1_vllm"))
        return vs
    base = {**DEMO, "steps": steps, "eval_size": 0, "checkpoint_every": 0, "seed": seed, **overrides}
    res: dict[str, Any] = {"settings": {"rounds": rounds, "steps": steps, "warmup": warmup, "seed": seed,
                                        "variants": {w: {v: VARIANTS[v] for v in variants_of(w)}
                                                     for w in workloads},
                                        "judge_latency_s": JUDGE_LATENCY_S},
                           "order": [], "runs": {}, "workloads": []}
    done = Path(out) / "pipeline.json"  # an interrupted benchmark resumes: runs recorded with the same config stay
    prev = json.loads(done.read_text()).get("runs", {}) if done.exists() else {}
    for w in workloads:
        wv = variants_of(w)
        for r in range(rounds):
            order = list(wv[r % len(wv):]) + list(wv[:r % len(wv)])
            for v in order:
                cfg = Config(**{**base, **WORKLOADS[w], **_devices(VARIANTS[v]),
                                "out_dir": str(Path(out) / f"pipeline_{w}_{v}_r{r}")})
                key = f"{w}/{v}/r{r}"
                res["order"].append(key)
                if prev.get(key, {}).get("config") == cfg.to_dict():
                    res["runs"][key] = prev[key]
                    continue
                res["runs"][key] = {"config": cfg.to_dict(), **_one(cfg, warmup)}
                write_json(out, "pipeline.json", res)  # partial results survive an interrupted benchmark
        _fill_means(res["runs"], warmup)
        res["workloads"].append(_summary(w, wv, rounds, res["runs"]))
        write_json(out, "pipeline.json", res)
    return _top(out, res)


def _steady_mean(step_s: list[float], warmup: int) -> float:
    """A run's mean step seconds in steady state: after `warmup` steps, and without the last step. An asynchronous
    run drains at its end: its last batch was generated beside the step before, and nothing is generated beside
    the last step, which takes only its training: counted in, it makes an asynchronous run look faster than the
    steps before it were (BENCHMARKS.md, "Figures moved out of docstrings")."""
    return statistics.mean(step_s[warmup:-1] if len(step_s) > warmup + 1 else step_s[warmup:])


def _phase_means(steps: list[dict], warmup: int) -> dict[str, float]:
    """A run's steady-state means (`_steady_mean`) of its step seconds and of the seconds each side worked on a
    step: `gen_s_mean` (generating the step's batch) and `train_s_mean` (the trainer's step; not the adapter push
    and its check, which in a pipeline waits for the generator to answer)."""
    return {f"{k}_mean": _steady_mean([x[f"time/{k}"] for x in steps], warmup)
            for k in ("step_s", "gen_s", "train_s") if all(f"time/{k}" in x for x in steps)}


def _fill_means(runs: dict, warmup: int, force: bool = False) -> None:
    """A run recorded without `step_s_mean` (written before it was measured), or every run with `force`, gets its
    means from its own metrics log (`_phase_means`)."""
    for run in runs.values():
        if force or "step_s_mean" not in run:
            log = Path(run["config"]["out_dir"]) / "metrics.jsonl"
            steps = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "step"]
            run.update(_phase_means(steps, warmup))


def _top(out, res: dict) -> dict:
    first = res["workloads"][0]
    res.update({k: first[k] for k in ("speedup", "best_sync_step_s", "async_step_s", "best_sync", "best_async",
                                      "gen_busy", "train_busy")})
    return write_json(out, "pipeline.json", res)


def summarize(out: str | Path) -> dict:
    """Recompute `out`/pipeline.json's summaries from its runs' own logs (`_fill_means(force=True)`)."""
    res = json.loads((Path(out) / "pipeline.json").read_text())
    _fill_means(res["runs"], res["settings"]["warmup"], force=True)
    variants = res["settings"]["variants"]
    res["workloads"] = [_summary(w, tuple(variants[w]), res["settings"]["rounds"], res["runs"])
                        for w in dict.fromkeys(k.split("/")[0] for k in res["order"])]
    return _top(out, res)


def _summary(w: str, variants, rounds: int, runs: dict) -> dict[str, Any]:
    """Per variant: the mean over rounds of each run's steady-state mean step (`_steady_mean`: a run's mean step is
    its throughput; an asynchronous run's steps alternate between waiting and not, so their median says little).

    Where the runs logged each side's seconds, also `phase_s` (per variant, the mean gen and train seconds of a
    step) and the bound overlap cannot beat: an asynchronous step takes at least its slower side's seconds on that
    side's share of the machine (`slower_side_s`, the best asynchronous variant's), so `overlap_ceiling` =
    best_sync_step_s / slower_side_s is the most any scheduling of the same work (continuous batching, streaming
    partial rollouts) could gain on that split; near 1, only less work per side would. For a generator that
    streams (vLLM), a step's generation overlaps the next one's and its gen seconds overstate the bound."""
    per = {v: [runs[f"{w}/{v}/r{r}"] for r in range(rounds)] for v in variants}
    med = {v: statistics.mean(x["step_s_mean"] for x in xs) for v, xs in per.items()}
    asyncs = [v for v in variants if VARIANTS[v]["max_async_steps"] > 0]
    syncs = [v for v in variants if VARIANTS[v]["max_async_steps"] == 0]
    best, best_sync = min(asyncs, key=med.__getitem__), min(syncs, key=med.__getitem__)
    phases = {}
    if all("gen_s_mean" in x and "train_s_mean" in x for xs in per.values() for x in xs):
        phases["phase_s"] = {v: {side: statistics.mean(x[f"{side}_s_mean"] for x in xs) for side in ("gen", "train")}
                             for v, xs in per.items()}
        phases["slower_side_s"] = max(phases["phase_s"][best].values())
        phases["overlap_ceiling"] = med[best_sync] / phases["slower_side_s"]
    return {"workload": w, "overrides": WORKLOADS[w], "step_s": med, **phases,
            "step_s_by_round": {v: [x["step_s_mean"] for x in xs] for v, xs in per.items()},
            "median_step_s_by_round": {v: [x["step_s"] for x in xs] for v, xs in per.items()},
            "best_sync_step_s": med[best_sync], "best_sync": best_sync, "async_step_s": med[best],
            "best_async": best, "speedup": med[best_sync] / med[best],
            "gen_busy": statistics.mean(x["gen_busy"] for x in per[best]),
            "train_busy": statistics.mean(x["train_busy"] for x in per[best]),
            "length_mean": {v: statistics.mean(x["length_mean"] for x in xs) for v, xs in per.items()}}

"""`minirl bench learning`: does asynchrony cost learning, and how long does each setting take to learn?"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from minirl.benchmarks.output import write_json
from minirl.config import DEMO, Config
from minirl.config.presets import PRESETS
from minirl.core.stats import mean_se
from minirl.run.loop import Run


def _eval_curve(metrics_jsonl: Path) -> list[list[float]]:
    """[[step, held-out accuracy], ...] from a run's metrics log."""
    recs = (json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip())
    return [[r["step"], r["accuracy"]] for r in recs if r.get("event") == "eval"]


def _mean_se(xs) -> dict:
    """Mean, standard error over the values (`minirl.core.stats`: None for one value) and their number."""
    mean, se = mean_se(xs)
    return {"mean": mean, "se": se, "n": len(xs)}


def _time_to(curve: list[list[float]], step_s: list[float], target: float) -> float | None:
    """Training seconds (the steps' wall clock, evaluations excluded) until the first held-out evaluation at or
    above `target`; None if no evaluation reached it."""
    for step, acc in curve:
        if acc >= target:
            return sum(step_s[:int(step)])
    return None


def bench_learning(out: str | Path, seeds=(0, 1, 2), eval_size: int = 128, eval_every: int = 5, ks=(0, 1, 2),
                   target: float = 0.7, **overrides: Any) -> dict:
    """Does asynchrony cost learning? For each seed, the demo (its config and number of steps) with K = 0, 1 and 2;
    held-out greedy accuracy on the same `eval_size` problems for every K of a seed, before, every `eval_every`
    steps and after. K = 0 runs the synchronous loop on every core (the pipeline with K = 0 reproduces it exactly,
    only slower on the 1 + 1 split); K >= 1 runs the pipeline on the split (generator on core 0, trainer on core 1).
    Writes learning.json: per seed and K the gain and the accuracy curve; per K the mean gain and its standard
    error over seeds; and the paired differences K - K0 (same seed, same problems) with their standard errors, of
    the final accuracy and of the curve's mean after step 0 (less noisy than one endpoint); and time to accuracy:
    per run the training seconds until held-out accuracy first reached `target` (`train_s_to_target`, None when
    it did not), per K its mean over the seeds that reached it and how many did. Runs already in
    DIR/learning.json with the same config are kept, so an interrupted benchmark resumes, and more seeds add on;
    `ks` runs only some K (the summaries cover the seeds that have the runs they need)."""
    base = Config(**{**DEMO, "eval_size": eval_size, "eval_every": eval_every, **overrides})
    res: dict[str, Any] = {"config": base.to_dict(), "seeds": list(seeds), "target": target, "runs": {}}
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
            curve = _eval_curve(Path(out) / f"s{seed}_k{K}" / "metrics.jsonl")
            step_s = [x["time/step_s"] for x in run.history]
            res["runs"][f"s{seed}_k{K}"] = {
                "before": s["eval_accuracy_before"], "after": s["eval_accuracy_after"],
                "gain": s["eval_accuracy_after"] - s["eval_accuracy_before"],
                "max_staleness": max((x.get("staleness/max") or 0) for x in run.history),
                "curve": curve, "step_s": step_s, "train_s": sum(step_s),
                "train_s_to_target": _time_to(curve, step_s, target)}
            write_json(out, "learning.json", res)  # partial results survive an interrupted run

    def curve_mean(r):
        return statistics.mean(a for step, a in r["curve"] if step > 0)
    runs = res["runs"]
    for K in (0, 1, 2):
        have = [s for s in seeds if f"s{s}_k{K}" in runs]
        if have:
            res[f"gain_k{K}"] = _mean_se([runs[f"s{s}_k{K}"]["gain"] for s in have])
            res[f"curve_mean_k{K}"] = _mean_se([curve_mean(runs[f"s{s}_k{K}"]) for s in have])
            reached = [runs[f"s{s}_k{K}"]["train_s_to_target"] for s in have]
            hit = [t for t in reached if t is not None]
            res[f"time_to_target_k{K}"] = {"mean_s": statistics.mean(hit) if hit else None, "reached": len(hit),
                                           "n": len(have)}
        paired = [s for s in have if f"s{s}_k0" in runs]
        if K and paired:
            res[f"gain_k{K}_minus_k0"] = _mean_se([runs[f"s{s}_k{K}"]["after"] - runs[f"s{s}_k0"]["after"]
                                                  for s in paired])
            res[f"curve_mean_k{K}_minus_k0"] = _mean_se([curve_mean(runs[f"s{s}_k{K}"]) - curve_mean(runs[f"s{s}_k0"])
                                                        for s in paired])
    return write_json(out, "learning.json", res)


def _runs(paths: list[Path]) -> dict[str, dict]:
    """The runs of one or more learning.json files, by seed: each file holds one setting, run at one K (a setting
    with K = 1 is compared by its K = 1 runs); a file with several K gives its K = 0 runs."""
    runs: dict[str, dict] = {}
    for p in paths:
        found = json.loads(Path(p).read_text())["runs"]
        ks = {key.split("_k")[1] for key in found}
        for key, r in found.items():
            seed, k = key[1:].split("_k")
            if k == "0" or len(ks) == 1:
                runs[seed] = r
    return runs


def accuracy_at_seconds(curve: list[list[float]], step_s: list[float]) -> list[tuple[float, float]]:
    """[(training seconds, held-out accuracy)] for each evaluation: the one before step N follows N steps."""
    return [(sum(step_s[:int(step)]), acc) for step, acc in curve]


def accuracy_over_time(points: list[tuple[float, float]], horizon: float) -> float:
    """The mean held-out accuracy over [0, horizon] training seconds, each evaluation's accuracy holding until
    the next one (a step function over `accuracy_at_seconds`' points)."""
    area, (t_prev, a_prev) = 0.0, points[0]
    for t, acc in points[1:]:
        if t >= horizon:
            break
        area += (t - t_prev) * a_prev
        t_prev, a_prev = t, acc
    return (area + (horizon - t_prev) * a_prev) / horizon


def compare_presets(files: dict[str, list[Path]], target: float = 0.7) -> dict:
    """Per setting (name -> its learning.json files, K = 0 runs): held-out accuracy after the run, its gain, and the
    curve's mean over the evaluations after step 0 that every run has (runs evaluated every 5 and every 10 steps
    compare at steps 10, 20, ...), each as mean and standard error over seeds; then each setting minus the first,
    paired by seed (same problems, same first sample), over the seeds both have.
    Time to accuracy, from each run's step times (evaluations excluded): the training seconds to the first
    evaluation at or above `target` (over the seeds that reached it), and the mean accuracy over the first
    `horizon_s` training seconds (the shortest run's), paired as above. Seconds compare only runs timed on one
    machine in one interleaved call (`bench_presets`); accuracies compare across calls (a seed's run repeats)."""
    runs = {name: _runs(paths) for name, paths in files.items()}
    steps = set.intersection(*({s for s, _ in r["curve"] if s > 0} for rs in runs.values() for r in rs.values()))
    horizon = min(sum(r["step_s"]) for rs in runs.values() for r in rs.values())

    def curve_mean(r):
        return statistics.mean(a for s, a in r["curve"] if s in steps)

    def over_time(r):
        return accuracy_over_time(accuracy_at_seconds(r["curve"], r["step_s"]), horizon)

    out: dict[str, Any] = {"common_eval_steps": sorted(steps), "target": target, "horizon_s": horizon,
                           "settings": {}}
    first = next(iter(runs))
    for name, rs in runs.items():
        hit = [t for r in rs.values() if (t := _time_to(r["curve"], r["step_s"], target)) is not None]
        row = {"seeds": sorted(rs, key=int), "after": _mean_se([r["after"] for r in rs.values()]),
               "gain": _mean_se([r["gain"] for r in rs.values()]),
               "curve_mean": _mean_se([curve_mean(r) for r in rs.values()]),
               "median_step_s": _mean_se([statistics.median(r["step_s"]) for r in rs.values()]),
               "train_s": _mean_se([sum(r["step_s"]) for r in rs.values()]),
               "s_to_target": {**(_mean_se(hit) if hit else {"mean": None, "se": None, "n": 0}),
                               "reached": len(hit), "seeds": len(rs)},
               "acc_over_time": _mean_se([over_time(r) for r in rs.values()])}
        paired = [s for s in rs if s in runs[first]]
        if name != first and paired:
            row[f"after_minus_{first}"] = _mean_se([rs[s]["after"] - runs[first][s]["after"] for s in paired])
            row[f"curve_mean_minus_{first}"] = _mean_se([curve_mean(rs[s]) - curve_mean(runs[first][s])
                                                         for s in paired])
            row[f"acc_over_time_minus_{first}"] = _mean_se([over_time(rs[s]) - over_time(runs[first][s])
                                                            for s in paired])
        out["settings"][name] = row
    return out


# Settings `minirl bench learning --presets` takes besides the loss_type presets: name -> (K, Config overrides).
# Issue 55's table: each ratio-based preset off-policy, one step behind (K = 1) or two epochs per batch (at K = 0
# with one epoch every ratio is 1, and grpo = gspo, dapo = cispo exactly), the RLOO and REINFORCE++ baselines, the
# default with an entropy bonus (0.01: within the 1e-3 .. 1e-2 of verl's and SkyRL's examples), and the default
# trained on the 20 % highest-entropy tokens only (TRL's rho 0.2, the "80/20" paper's setting).
SETTINGS: dict[str, tuple[int, dict[str, Any]]] = {
    **{p: (0, {"loss_type": p}) for p in PRESETS},
    **{f"{p}-k1": (1, {"loss_type": p}) for p in ("grpo", "dapo", "cispo", "gspo")},
    **{f"{p}-epochs2": (0, {"loss_type": p, "ppo_epochs": 2}) for p in ("grpo", "dapo", "cispo", "gspo")},
    "rloo": (0, {"loss_type": "dapo", "advantage_estimator": "rloo"}),
    "reinforce++": (0, {"loss_type": "dapo", "advantage_estimator": "reinforce++"}),
    "dapo-entropy": (0, {"loss_type": "dapo", "entropy_coef": 0.01}),
    "dapo-top-entropy": (0, {"loss_type": "dapo", "top_entropy_quantile": 0.2}),
}


def bench_presets(out: str | Path, presets=("grpo", "dr_grpo", "dapo", "gspo"), seeds=(0, 1, 2),
                  eval_size: int = 256, eval_every: int = 5, **overrides: Any) -> dict:
    """`minirl bench learning --presets ...`: the demo with each setting (a `loss_type` preset, or a name of
    SETTINGS: its K and fields; DIR/<name>/, through `bench_learning`), the settings' order rotating by seed, then
    `compare_presets` over them in DIR/presets.json, paired against the first. Interrupted runs resume as
    `bench_learning`'s do."""
    unknown = [p for p in presets if p not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown preset {unknown[0]!r}: choose from {', '.join(SETTINGS)}")
    if clash := [(k, p) for p in presets for k in SETTINGS[p][1] if k in overrides]:
        raise ValueError(f"{clash[0][0]}={overrides[clash[0][0]]!r} would replace what setting {clash[0][1]!r} "
                         f"sets, so the settings would not differ by it: leave {clash[0][0]} out")
    for i, seed in enumerate(seeds):
        for p in presets[i % len(presets):] + presets[:i % len(presets)]:
            k, fields = SETTINGS[p]
            bench_learning(Path(out) / p, seeds=(seed,), ks=(k,), eval_size=eval_size, eval_every=eval_every,
                           **{**fields, **overrides})
    return write_json(out, "presets.json", compare_presets({p: [Path(out) / p / "learning.json"] for p in presets}))

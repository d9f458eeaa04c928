"""`minirl bench trl`, minirl's half and the comparison: minirl's side of a spec (`trl.trl_spec`: the same rows in the
same order as TRL's, the same settings, the adapter saved at the same steps), the one evaluator that scores every
saved adapter of both toolkits (minirl's greedy held-out accuracy), and `bench_trl`, which runs the seeds
interleaved and writes DIR/trl.json.

Each side trains in a process of its own, so its peak resident memory (`ru_maxrss`, the process alone: reward
workers and servers are not counted, on either side) is its own. minirl runs its defaults (loss, clipping, `tis_cap`,
asynchrony) except where the issue fixes a setting; `minirl_overrides` change them, for ablations.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from minirl.benchmarks.output import write_json
from minirl.benchmarks.trl import ROOT, TASKS, run_trl, setup_trl_venv, task_rows, trl_spec
from minirl.config import Config
from minirl.run.checkpoint import save_adapter
from minirl.run.evaluation import evaluate
from minirl.run.loop import Run
from minirl.training.models import resolve_model

Side = Callable[[dict], dict]  # spec -> {"step_s": [...], "peak_rss_mb": ...}; adapters in spec["out"]/adapters


def minirl_config(spec: dict):
    """The minirl Config for a spec: its settings, float32, the rows in the given order (`shuffle=False`), no
    evaluation of its own (the shared evaluator scores the saved adapters), on-policy as TRL's trainer is (K = 0),
    then `spec["minirl"]` overrides."""
    s = spec["settings"]
    return Config.from_dict({**dict(
        model=spec["model"], dtype="float32", seed=spec["seed"], steps=spec["steps"], shuffle=False, eval_size=0,
        checkpoint_every=0, out_dir=str(Path(spec["out"]) / "run"), rewards=["arithmetic_correct"],
        prompts_per_step=s["prompts_per_step"], group_size=s["group_size"], max_tokens=s["max_tokens"],
        temperature=s["temperature"], lr=s["lr"], lr_schedule="constant", lora_rank=s["lora_rank"],
        lora_alpha=s["lora_alpha"], target_modules="all-linear", max_grad_norm=s["max_grad_norm"], kl_coef=0.0,
        ppo_epochs=1, max_async_steps=0), **spec.get("minirl", {})})


def _minirl_main(spec_path: str) -> None:
    """minirl's side of a spec, in this process: train, save adapters/step-N, write minirl.json."""
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    run = Run(minirl_config(spec), data=spec["rows"], overwrite=True)
    run.setup()
    if 0 in spec["save_steps"]:
        save_adapter(run.trainer, out / "adapters" / "step-0")

    def saved(rec: dict) -> None:  # after step index rec["step"], rec["step"] + 1 steps are done
        if rec["step"] + 1 in spec["save_steps"]:
            save_adapter(run.trainer, out / "adapters" / f"step-{rec['step'] + 1}")
    run.on_step.append(saved)
    t0 = time.perf_counter()
    run.run()
    (out / "minirl.json").write_text(json.dumps({
        "step_s": [h["time/step_s"] for h in run.history], "train_s": time.perf_counter() - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "prompt_ids": [h["prompt_ids"] for h in run.history]}, indent=1))


def run_minirl(spec: dict) -> dict:
    """minirl's side of a spec in a process of its own (`python -m minirl.benchmarks.trl_bench SPEC`); returns its
    minirl.json (seconds per step, peak memory, the prompt indices each step took)."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(out / "minirl.log", "w") as log:
        r = subprocess.run([sys.executable, "-m", "minirl.benchmarks.trl_bench", str(out / "spec.json")], env=env,
                           stdout=log, stderr=subprocess.STDOUT)
    if r.returncode:
        raise RuntimeError(f"minirl's side failed (exit {r.returncode}): see {out / 'minirl.log'}")
    return json.loads((out / "minirl.json").read_text())


def evaluate_adapters(model: str, held: Sequence[dict], adapters: Sequence[str | Path], max_tokens: int,
                      lora_rank: int, lora_alpha: int, **overrides: Any) -> list[float]:
    """Greedy held-out accuracy (`minirl.run.evaluation.evaluate`, the first reward the metric) of each peft adapter
    folder on `model`, whichever toolkit saved it: one model load, each adapter copied into minirl's LoRA in turn.
    An adapter of another rank or alpha, or whose tensors are not exactly this model's LoRA tensors (a silently
    half-loaded adapter would score as the base model), raises, naming the folder."""
    cfg = Config(**{**dict(model=model, dtype="float32", steps=0, eval_size=len(held), max_tokens=max_tokens,
                           rewards=["arithmetic_correct"], lora_rank=lora_rank, lora_alpha=lora_alpha,
                           target_modules="all-linear"), **overrides})
    run = Run(cfg, data=list(held), eval_data=list(held))
    run.load()  # no out_dir of its own: nothing is written
    try:
        want = set(get_peft_model_state_dict(run.trainer.model))
        accs = []
        for i, folder in enumerate(adapters):
            folder = Path(folder)
            conf = json.loads((folder / "adapter_config.json").read_text())
            if (conf.get("r"), conf.get("lora_alpha")) != (lora_rank, lora_alpha):
                raise ValueError(f"{folder}: LoRA r {conf.get('r')} / alpha {conf.get('lora_alpha')}, but the "
                                 f"evaluator runs r {lora_rank} / alpha {lora_alpha}: evaluate it at its own")
            tensors = load_file(str(folder / "adapter_model.safetensors"))
            if set(tensors) != want:
                extra, missing = sorted(set(tensors) - want), sorted(want - set(tensors))
                raise ValueError(f"{folder}: the adapter's tensors are not this model's LoRA (not in the model: "
                                 f"{extra[:2]}; missing from the adapter: {missing[:2]})")
            set_peft_model_state_dict(run.trainer.model, tensors)
            run.trainer.version = i + 1
            run.sync.push(run.trainer, run.generator)
            accs.append(evaluate(run.rollouts, run.eval_prompts, run.scorer, max_tokens).accuracy)
        return accs
    finally:
        run.close()


def _spread(xs: list[float]) -> dict:
    return {"mean": statistics.mean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else None, "min": min(xs),
            "max": max(xs), "n": len(xs)}


def _time_to(acc: dict[str, float], step_s: list[float], target: float) -> float | None:
    """Training seconds until the first saved step whose accuracy is at least `target`; None if none reached it."""
    for step in sorted(acc, key=int):
        if acc[step] >= target:
            return sum(step_s[:int(step)])
    return None


def summarize(res: dict, target: float | None) -> dict:
    """Per side: accuracy per saved step (mean and spread over seeds), seconds per step, peak memory, and seconds
    to `target` (default: TRL's mean accuracy at the last saved step, the issue's bar)."""
    runs, out = res["runs"], {}
    last = str(max(res["config"]["save_steps"]))
    trl_final = [r["accuracy"][last] for r in runs.values() if r["side"] == "trl"]
    target = target if target is not None else (statistics.mean(trl_final) if trl_final else None)
    for side in ("trl", "minirl"):
        rs = [r for r in runs.values() if r["side"] == side]
        if not rs:
            continue
        out[side] = {
            "accuracy": {st: _spread([r["accuracy"][st] for r in rs]) for st in map(str, res["config"]["save_steps"])},
            "step_s": _spread([statistics.mean(r["step_s"]) for r in rs]),
            "peak_rss_mb": _spread([r["peak_rss_mb"] for r in rs]),
            "seeds": sorted(r["seed"] for r in rs)}
        if target is not None:
            hit = [t for r in rs if (t := _time_to(r["accuracy"], r["step_s"], target)) is not None]
            out[side]["train_s_to_target"] = {"mean_s": statistics.mean(hit) if hit else None, "reached": len(hit),
                                              "n": len(rs)}
    return {**res, "target": target, "summary": out}


def bench_trl(out: str | Path, seeds: Sequence[int] = (0, 1, 2), steps: int = 10, lr: float | None = None,
              task: str = "addition", eval_size: int = 64, save_every: int = 2, target: float | None = None,
              model: str = "smollm2-135m-instruct", sides: dict[str, Side] | None = None,
              minirl_overrides: dict | None = None, settings: dict | None = None,
              eval_overrides: dict | None = None, trl_from: str | Path | None = None) -> dict:
    """TRL's GRPOTrainer and minirl on the same rows in the same order, seeds interleaved (TRL seed s, minirl seed
    s, TRL seed s + 1, ...), each saving its adapter every `save_every` steps (and at 0 and `steps`); every adapter
    then scored by `evaluate_adapters` on the task's first `eval_size` held-out problems. Writes DIR/trl.json after
    each run: the config, per run the accuracy per saved step, seconds per step and peak memory, and the summary
    (`summarize`). Runs already in DIR/trl.json with the same config are kept (an interrupted benchmark resumes;
    more seeds add on). `settings` changes the shared settings (`trl.SETTINGS`) for both sides, `minirl_overrides`
    minirl's Config only, `eval_overrides` the evaluator's Config; `sides` replaces a side's trainer (tests: a fake
    TRL). `trl_from` takes TRL's runs from another trl.json made with the same settings (an ablation of minirl's
    settings then runs minirl alone; those runs are marked "from", and their seconds were not interleaved)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
    if steps < 1 or save_every < 1 or eval_size < 1:
        raise ValueError(f"steps, save_every and eval_size must be at least 1 (got {steps}, {save_every}, {eval_size})")
    sides = sides or {"trl": lambda spec: run_trl(str(setup_trl_venv()), spec), "minirl": run_minirl}
    save_steps = sorted({0, steps, *range(save_every, steps, save_every)})
    settings = {**(settings or {}), **({"lr": lr} if lr is not None else {})}
    probe = trl_spec(model, 0, steps, save_steps, Path(out), task=task, **settings)
    # a wrong override is one line before anything runs
    minirl_config({**probe, "minirl": minirl_overrides or {}})
    config = {"model": model, "task": task, "steps": steps, "save_steps": save_steps, "eval_size": eval_size,
              "settings": probe["settings"], "minirl": minirl_overrides or {}, "eval": eval_overrides or {}}
    res: dict[str, Any] = {"config": config, "runs": {}}
    done = Path(out) / "trl.json"
    if done.exists():
        prev = json.loads(done.read_text())
        if prev.get("config") == config:
            res["runs"] = prev.get("runs", {})
    if trl_from is not None:
        if not Path(trl_from).is_file():
            raise ValueError(f"--trl-from {trl_from}: no such file (give the trl.json a `minirl bench trl` wrote)")
        src = json.loads(Path(trl_from).read_text())
        shared = lambda c: {k: v for k, v in c.items() if k != "minirl"}  # noqa: E731
        if shared(src.get("config", {})) != shared(config):
            raise ValueError(f"{trl_from}: its TRL runs were made with other settings than these: run TRL here "
                             f"(leave out --trl-from) or match its steps, lr, task and eval size")
        for key, r in src.get("runs", {}).items():
            if r["side"] == "trl" and r["seed"] in seeds:
                res["runs"].setdefault(key, {**r, "from": str(trl_from)})
    path = str(resolve_model(model))  # after every check of the arguments: its first call dequantizes the model
    held = task_rows(0, task=task)[1][:eval_size]
    s = probe["settings"]
    for seed in seeds:
        for side in ("trl", "minirl"):
            key = f"{side}_s{seed}"
            if key in res["runs"]:
                continue
            spec = trl_spec(path, seed, steps, save_steps, Path(out) / key, task=task, **settings)
            spec["minirl"] = minirl_overrides or {}
            t0 = time.perf_counter()
            rec = sides[side](spec)
            wall = time.perf_counter() - t0
            adapters = [Path(spec["out"]) / "adapters" / f"step-{st}" for st in save_steps]
            accs = evaluate_adapters(path, held, adapters, s["max_tokens"], s["lora_rank"], s["lora_alpha"],
                                     **(eval_overrides or {}))
            res["runs"][key] = {"side": side, "seed": seed, "accuracy": dict(zip(map(str, save_steps), accs)),
                                "step_s": rec["step_s"], "peak_rss_mb": rec["peak_rss_mb"], "wall_s": wall,
                                **({"prompt_ids": rec["prompt_ids"]} if "prompt_ids" in rec else {})}
            write_json(out, "trl.json", summarize(res, target))  # partial results survive an interrupted run
    return write_json(out, "trl.json", summarize(res, target))


if __name__ == "__main__":  # python -m minirl.benchmarks.trl_bench SPEC.json: minirl's side of one spec
    _minirl_main(sys.argv[1])

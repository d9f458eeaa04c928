"""`minirl bench memory --out DIR`: where the demo workload's memory goes, by phase, for LoRA and QLoRA.

Each row is the demo's config (SmolLM2-135M, 8 prompts x G = 8, 24 tokens, the synchronous loop: K = 0, every
row, so generation is in this process) run for a few steps
in a fresh process of its own (a peak is per process, and the allocator keeps what an earlier row freed), with the
peak resident memory of each phase: `load` (model + generator set-up), `generate` (every `generate` call; no
held-out evaluation: its 16 greedy rows weigh less than a step's 64), `train` (every optimizer step). On Linux a phase's peak is the kernel's own high-water mark
(VmHWM), reset at the phase's start (/proc/self/clear_refs), so nothing between two samples is missed; on a GPU the
phase's `torch.cuda.max_memory_allocated` is added. The reward worker processes are counted apart (their largest
total RSS), as is the model's own bytes (parameters + buffers: a 4-bit base counts its packed bytes).
Rows: `lora` (the demo: token_budget 512), `qlora`, the demo at token_budget 4096 and 1024 and at 4096 with
max_tokens 48 (the memory plan's calibration: tests/test_plan_calibration.py), and `Config()`'s defaults at
max_tokens 32. Every row but the defaults' runs with `cpu_compact_memory` on (resident memory follows the live
tensors, which the plan counts); the defaults' row is what a user gets (at K = 0).
Writes DIR/memory.json: {"rows": {name: {...}}, "vs_lora": {name: {peak and step-time ratios to lora}}, "order"}.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from minirl.benchmarks.output import write_json
from minirl.config import DEMO, Config
from minirl.core.metrics import memory_metrics
from minirl.run.loop import Run
from minirl.training.batch import make_batch
from minirl.training.packing import pack

if TYPE_CHECKING:
    from minirl.training.trainer import Trainer

_COMPACT = {"cpu_compact_memory": True}  # resident memory follows the live tensors: what the plan counts
ROWS = {"lora": {**_COMPACT}, "qlora": {"load_in_4bit": True, **_COMPACT},
        "lora_token_budget_4096": {"token_budget": 4096, **_COMPACT},
        "lora_token_budget_1024": {"token_budget": 1024, **_COMPACT},
        "lora_token_budget_4096_max_tokens_48": {"token_budget": 4096, "max_tokens": 48, **_COMPACT},
        "config_defaults_max_tokens_32": {"defaults": True, "max_tokens": 32}}
# `defaults`: the row starts from `Config()` (every default, token_budget 'auto' included) instead of the demo's
# config: issue 36's workload, 8 prompts x 8 completions x 32 tokens with the defaults.


def _status_mb(field: str, pid: str = "self") -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) / 1024 for ln in f if ln.startswith(field + ":")), None)
    except OSError:
        return None


class PhasePeaks:
    """Peak memory of this process per named phase (the max over every time the phase ran)."""

    def __init__(self):
        self.rss_mb: dict[str, float] = {}
        self.cuda_mb: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        """Measure the block as phase `name` (a window of `metrics.memory_metrics`). A block whose code reads (and
        so resets) the peak itself, as `Trainer.step` does for `mem/*`, puts its readings in the yielded dict
        ("rss_mb", "cuda_mb")."""
        memory_metrics()  # a new window starts here
        got: dict = {}
        try:
            yield got
        finally:
            m = memory_metrics()
            rss = got.get("rss_mb") or m["mem/rss_mb"]
            self.rss_mb[name] = max(self.rss_mb.get(name, 0.0), rss)
            cuda = got.get("cuda_mb") or m.get("mem/cuda_mb")
            if cuda is not None:
                self.cuda_mb[name] = max(self.cuda_mb.get(name, 0.0), cuda)


def children_rss_mb() -> float:
    """Total RSS of this process's descendants (the reward workers)."""
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            total += p.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return total


def model_mb(model) -> float:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20


def micro_tokens(trainer: Trainer, groups) -> int:
    """The tokens of the step's largest micro-batch, as the trainer lays it out (`trainer.packing`): real tokens
    of a shared-prefix packed row, rows x longest row of a padded one. What the activations of a training step
    scale with (the memory plan's calibration reads it)."""
    samples = trainer.samples(groups)
    if not samples:
        return 0
    batch = make_batch(samples, 0, "token-mean", 1)
    if trainer.packing == "shared-prefix":
        return max(mb.n_real_tokens for mb in pack(samples, batch, trainer.token_budget))
    return max(int(mb.input_ids_B_L.numel()) for mb in batch.micro_batches(trainer.token_budget))


def measure(overrides: dict, steps: int) -> dict:
    """One row, in this process: the demo config with `overrides`, `steps` steps, peaks by phase."""
    peaks, workers, micro = PhasePeaks(), [0.0], []
    with tempfile.TemporaryDirectory(prefix="minirl-mem-") as tmp:
        base = {} if overrides.get("defaults") else DEMO
        cfg = Config(**{**base, "steps": steps, "eval_size": 0, "checkpoint_every": 0, "out_dir": tmp,
                        "max_async_steps": 0, **{k: v for k, v in overrides.items() if k != "defaults"}})
        run = Run(cfg, overwrite=True)
        with peaks.phase("load"):
            run.setup()
        prompt_tokens = round(statistics.mean(len(p.token_ids) for p in run.train_prompts), 1)
        gen, step = run.generator.generate, run.trainer.step

        def generate(*a, **kw):
            with peaks.phase("generate"):
                return gen(*a, **kw)

        def train(*a, **kw):
            micro.append(micro_tokens(run.trainer, a[0] if a else kw["groups"]))
            with peaks.phase("train") as got:
                out = step(*a, **kw)
                got.update(rss_mb=out.get("mem/rss_mb"), cuda_mb=out.get("mem/cuda_mb"))
            workers[0] = max(workers[0], children_rss_mb())
            return out
        run.generator.generate, run.trainer.step = generate, train  # the parts' rollouts is this generator
        model = model_mb(run.trainer.model)
        summary = run.run()
        hist = run.history
    res = {"config": overrides, "steps": steps, "backend": summary["backend"], "model_mb": round(model, 1),
           "peak_rss_mb": round(max(peaks.rss_mb.values()), 1),
           "phase_rss_mb": {k: round(v, 1) for k, v in peaks.rss_mb.items()},
           "reward_workers_rss_mb": round(workers[0], 1),
           "step_s": [round(h["time/step_s"], 3) for h in hist],
           "train_s": [round(h["time/train_s"], 3) for h in hist],
           "gen_s": [round(h["time/gen_s"], 3) for h in hist],
           "train_tokens": [h["train/tokens"] for h in hist], "micro_tokens": micro,
           "token_budget": run.trainer.token_budget, "packing": run.trainer.packing,
           "prompt_tokens": prompt_tokens,
           "completion_tokens": cfg.max_tokens,
           "adapter_finite": run.trainer.adapter_is_finite()}
    if peaks.cuda_mb:
        res["peak_cuda_mb"] = round(max(peaks.cuda_mb.values()), 1)
        res["phase_cuda_mb"] = {k: round(v, 1) for k, v in peaks.cuda_mb.items()}
    return res


def _start(overrides: dict, steps: int) -> subprocess.Popen:
    """`measure` in a fresh interpreter: its peaks are its own."""
    cmd = [sys.executable, "-m", "minirl.benchmarks.memory", json.dumps(overrides), str(steps)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def _result(p: subprocess.Popen, overrides: dict) -> dict:
    out, err = p.communicate()
    if p.returncode != 0:
        return {"config": overrides, "error": "\n".join(err.strip().splitlines()[-5:]) or f"exit code {p.returncode}"}
    return json.loads(out.strip().splitlines()[-1])


def bench_memory(out: str | Path, steps: int = 3, rounds: int = 2, rows=tuple(ROWS)) -> dict:
    """Each row of ROWS (demo config + its overrides) in a fresh process of its own, one at a time (each has every
    core), `rounds` times in rotated order (A B C, B C A, ...) so that drift in the machine's speed falls on every
    row alike. A row's peak is the max over its rounds; its step times are all its rounds' steps, the first step of
    each (warm-up: allocator growth, first-call costs) left out of the medians. Ratios to the `lora` row: peaks and
    median train / step times."""
    res: dict = {"steps": steps, "rounds": rounds, "load_avg_start": os.getloadavg()[0], "order": [], "rows": {}}
    t0 = time.time()
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    for r in range(rounds):
        order = list(rows[r % len(rows):]) + list(rows[:r % len(rows)])
        res["order"].append(order)
        for name in order:
            runs[name].append(_result(_start(ROWS[name], steps), ROWS[name]))
            write_json(out, "memory.json", {**res, "partial": True, "runs": runs})  # an interrupted run keeps these
    for name, rs in runs.items():
        ok = [x for x in rs if "peak_rss_mb" in x]
        if not ok:
            res["rows"][name] = rs[-1]
            continue
        row = {**ok[0], "peak_rss_mb": max(x["peak_rss_mb"] for x in ok),
               "phase_rss_mb": {k: max(x["phase_rss_mb"].get(k, 0.0) for x in ok) for k in ok[0]["phase_rss_mb"]},
               "step_s": [x["step_s"] for x in ok], "train_s": [x["train_s"] for x in ok],
               "gen_s": [x["gen_s"] for x in ok], "errors": len(rs) - len(ok)}
        for k in ("step_s", "train_s", "gen_s"):
            row[f"median_{k}"] = round(statistics.median(v for one in row[k] for v in one[1:] or one), 3)
        # the rows sample different tokens (QLoRA's weights differ), so train time is compared per trained token
        row["train_tokens_per_s"] = round(statistics.median(
            t / s for x in ok for t, s in list(zip(x["train_tokens"], x["train_s"]))[1:] if s > 0), 1)
        res["rows"][name] = row
    res["load_avg_end"], res["wall_s"] = os.getloadavg()[0], round(time.time() - t0, 1)
    base = res["rows"].get("lora", {})
    if "peak_rss_mb" in base:
        res["vs_lora"] = {name: {"peak_rss": round(r["peak_rss_mb"] / base["peak_rss_mb"], 3),
                                 "model": round(r["model_mb"] / base["model_mb"], 3),
                                 "train_s": round(r["median_train_s"] / base["median_train_s"], 3),
                                 "train_tokens_per_s": round(r["train_tokens_per_s"] / base["train_tokens_per_s"], 3),
                                 "step_s": round(r["median_step_s"] / base["median_step_s"], 3)}
                          for name, r in res["rows"].items() if name != "lora" and "peak_rss_mb" in r}
    return write_json(out, "memory.json", res)


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]), int(sys.argv[2]))))

"""`minirl bench memory --out DIR`: where the demo workload's memory goes, by phase, for LoRA and QLoRA.

Each row is the demo's config (SmolLM2-135M, 8 prompts x G = 8, 24 tokens, the synchronous loop) run for a few steps
in a fresh process of its own (a peak is per process, and the allocator keeps what an earlier row freed), with the
peak resident memory of each phase: `load` (model + generator set-up), `generate` (every `generate` call; no
held-out evaluation: its 16 greedy rows weigh less than a step's 64), `train` (every optimizer step). On Linux a phase's peak is the kernel's own high-water mark
(VmHWM), reset at the phase's start (/proc/self/clear_refs), so nothing between two samples is missed; on a GPU the
phase's `torch.cuda.max_memory_allocated` is added. The reward worker processes are counted apart (their largest
total RSS), as is the model's own bytes (parameters + buffers: a 4-bit base counts its packed bytes).
Writes DIR/memory.json: {"rows": {"lora": {...}, "qlora": {...}}, "qlora_vs_lora": {peak and step-time ratios}}.
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

from ..metrics import memory_metrics
from . import _write

ROWS = {"lora": {}, "qlora": {"load_in_4bit": True}}


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
    import psutil
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            total += p.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return total


def model_mb(model) -> float:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20


def measure(overrides: dict, steps: int) -> dict:
    """One row, in this process: the demo config with `overrides`, `steps` steps, peaks by phase."""
    from ..config import DEMO, Config
    from ..run import Run
    peaks, workers = PhasePeaks(), [0.0]
    with tempfile.TemporaryDirectory(prefix="minirl-mem-") as tmp:
        cfg = Config(**{**DEMO, "steps": steps, "eval_size": 0, "checkpoint_every": 0, "out_dir": tmp, **overrides})
        run = Run(cfg, overwrite=True)
        with peaks.phase("load"):
            run.setup()
        gen, step = run.generator.generate, run.trainer.step

        def generate(*a, **kw):
            with peaks.phase("generate"):
                return gen(*a, **kw)

        def train(*a, **kw):
            with peaks.phase("train") as got:
                out = step(*a, **kw)
                got.update(rss_mb=out.get("mem/rss_mb"), cuda_mb=out.get("mem/cuda_mb"))
            workers[0] = max(workers[0], children_rss_mb())
            return out
        run.generator.generate, run.trainer.step = generate, train
        run.rollouts = run.generator
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
           "train_tokens": [h["train/tokens"] for h in hist],
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


def bench_memory(out: str | Path, steps: int = 2, rows=tuple(ROWS)) -> dict:
    """Each row of ROWS (demo config + its overrides) in a process of its own, all at the same time, so that they
    share the machine's load (each peak is its own process's); ratios QLoRA / LoRA of peaks and median step times."""
    res: dict = {"steps": steps, "load_avg_start": os.getloadavg()[0], "rows": {}}
    t0 = time.time()
    procs = {name: _start(ROWS[name], steps) for name in rows}
    for name, p in procs.items():
        res["rows"][name] = _result(p, ROWS[name])
    res["load_avg_end"], res["wall_s"] = os.getloadavg()[0], round(time.time() - t0, 1)
    lo, q = res["rows"].get("lora", {}), res["rows"].get("qlora", {})
    if "peak_rss_mb" in lo and "peak_rss_mb" in q:
        res["qlora_vs_lora"] = {
            "peak_rss": q["peak_rss_mb"] / lo["peak_rss_mb"], "model": q["model_mb"] / lo["model_mb"],
            "train_s": statistics.median(q["train_s"]) / statistics.median(lo["train_s"]),
            "step_s": statistics.median(q["step_s"]) / statistics.median(lo["step_s"])}
    return _write(out, "memory.json", res)


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]), int(sys.argv[2]))))

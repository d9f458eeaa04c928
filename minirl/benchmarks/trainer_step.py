"""`Trainer.step` on stored batches, padded vs shared-prefix packed, in interleaved rounds.

Batches are scored groups captured from real runs (`scripts/capture_trainer_batches.py`) and stored as JSON, so
the equal-math tests and this benchmark load the same ones. A stored file is
`{"model": ..., "settings": {...}, "steps": [[group, ...], ...]}`, a group being
`{"prompt": [ids], "temperature": t, "rewards": [...], "advantages": [...], "completions": [{"ids": [...],
"logprobs": [...], "versions": [...], "mask": [...] | null}, ...]}`.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Sequence

import torch

from minirl.config import Config
from minirl.training.trainer import Trainer
from minirl.types import Completion, Group, Prompt, ScoredGroup


def dump_groups(groups: Sequence[ScoredGroup]) -> list[dict]:
    """Scored groups as JSON-ready dicts (only what the trainer reads)."""
    return [{"prompt": list(g.group.prompt.token_ids), "temperature": g.group.temperature,
             "rewards": list(g.rewards), "advantages": list(g.advantages),
             "completions": [{"ids": list(c.token_ids), "logprobs": list(c.logprobs), "versions": list(c.versions),
                              "mask": None if c.mask is None else list(c.mask)} for c in g.group.completions]}
            for g in groups]


def load_groups(rows: Sequence[dict]) -> list[ScoredGroup]:
    """The inverse of `dump_groups`."""
    out = []
    for i, r in enumerate(rows):
        comps = tuple(Completion(tuple(c["ids"]), tuple(c["logprobs"]), tuple(c["versions"]), "", "stop",
                                 None if c["mask"] is None else tuple(c["mask"])) for c in r["completions"])
        out.append(ScoredGroup(Group(Prompt(i, tuple(r["prompt"]), ""), comps, r["temperature"]),
                               tuple(r["rewards"]), {}, tuple(r["advantages"])))
    return out


def load_batches(path: str | Path) -> tuple[dict, list[list[ScoredGroup]]]:
    """A stored file: its header (model, settings) and its steps' scored groups."""
    d = json.loads(Path(path).read_text())
    return {k: v for k, v in d.items() if k != "steps"}, [load_groups(s) for s in d["steps"]]


def _cpu_model() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_trainer_step(path: str | Path, rounds: int = 3, model: str | None = None, token_budget: int | None = None,
                       gradient_checkpointing: bool = False, kl_coef: float = 0.0, steps: int | None = None,
                       progress=None) -> dict:
    """Time `Trainer.step` on every stored step, padded vs shared-prefix, in `rounds` interleaved rounds (the
    side that goes first alternates). Each side has its own trainer from the same seed; a side's time for a
    round is the sum over the stored steps (the first `steps` of them if given); `progress(result)` is called
    with the partial result after each round. Returns the settings, per-side seconds per round, medians and the
    ratio packed / padded (medians)."""
    head, all_steps = load_batches(path)
    steps = all_steps[:steps] if steps else all_steps
    s = head.get("settings", {})
    cfg = Config(model=model or head["model"], backend="hf", seed=0, max_tokens=s.get("max_tokens", 48),
                 token_budget=token_budget or s.get("token_budget", 512), loss_agg=s.get("loss_agg"),
                 gradient_checkpointing=gradient_checkpointing, kl_coef=kl_coef)
    sides = {name: Trainer(cfg.replace(packing=name)) for name in ("padded", "shared-prefix")}
    secs: dict[str, list[float]] = {n: [] for n in sides}
    cuda = torch.cuda.is_available()
    peak_mb: dict[str, float] = {}
    metrics: dict[str, dict] = {}
    order = []

    def result() -> dict:
        med = {n: statistics.median(v) for n, v in secs.items() if v}
        return {
            "what": "Trainer.step on stored batches, padded vs shared-prefix packed",
            "batches": str(path), "steps_per_round": len(steps), "rounds": len(order), "order": order,
            "settings": {"model": cfg.model, "token_budget": cfg.token_budget, "max_tokens": cfg.max_tokens,
                         "loss_agg": cfg.recipe.loss_agg, "gradient_checkpointing": gradient_checkpointing,
                         "kl_coef": kl_coef, "torch_threads": torch.get_num_threads()},
            "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(),
                        "gpu": torch.cuda.get_device_name(0) if cuda else None}, "commit": _commit(),
            "seconds": secs, "median_s": med,
            "ratio_packed_over_padded": med["shared-prefix"] / med["padded"] if len(med) == 2 else None,
            "forward_tokens": {n: m.get("train/forward_tokens") for n, m in metrics.items()},
            "micro_batches": {n: m.get("train/micro_batches") for n, m in metrics.items()},
            "trained_tokens": {n: m.get("train/tokens") for n, m in metrics.items()},
            "peak_cuda_mb": peak_mb or None, "device": sides["padded"].device,
            "dtype": str(next(sides["padded"].model.parameters()).dtype),
        }

    for r in range(rounds):
        names = list(sides) if r % 2 == 0 else list(sides)[::-1]
        order.append(names)
        for name in names:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for groups in steps:
                metrics[name] = sides[name].step(groups)
            if cuda:
                torch.cuda.synchronize()
                peak_mb[name] = max(peak_mb.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**20)
            secs[name].append(time.perf_counter() - t0)
        if progress is not None:
            progress(result())
    return result()

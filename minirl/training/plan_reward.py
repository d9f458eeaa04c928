"""The memory plan's part 'reward model' (`training.plan`): each `reward_model(path=...)` in `rewards`
(`rewards.reward_model.reward_model_uses`) sized from its config.json alone (no weights loaded), on the device it
names, once per process that loads it: each reward worker loads its own copy (`reward_workers: N`: N copies),
`reward_workers: 0` one, in the run's process.

A copy: its weights in the dtype it loads in (transformers' 'auto': the config's `dtype` / `torch_dtype`, float32
where it names none), the sequence-classification head (hidden x num_labels, no bias) in place of the lm_head; one
batch's forward without gradients, `batch_size` rows of min(prompt + max_tokens, max_length) tokens: the KV cache the
decoder's forward builds (`use_cache` is on by default) and one decoder layer's intermediates, as `plan_hf` counts
them (the residual, q, k, v, the attention output, gate, up and their product; SDPA keeps no attention scores);
on a GPU the CUDA context of the process (a worker's own; the run's process only where the trainer is elsewhere).
A config the plan cannot read (not a decoder-only transformer, not reachable) counts 0, with a note saying so.
A local LLM judge (`judge(..., local=...)`) is counted the same way, on the CPU (`plan_judge`).

A reward worker runs under RLIMIT_DATA of `reward_memory_mb`: a CPU copy there, beside the worker's own memory once
torch and transformers are imported (WORKER_TORCH_MIB), past that limit cannot load (MemoryError, "can't start new
thread" or a worker killed by std::bad_alloc, at the first call): a problem that stops the run before anything
loads (`check_reward_models`), naming the reward_memory_mb it needs. A GPU copy is not checked, though it too is
loaded on the host first (`reward_model._load` moves it after) and the CUDA context's host memory may count against
the limit: not measured (no GPU here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from minirl.config import Config, ConfigError
from minirl.rewards.reward_model import RewardModelUse, reward_model_uses
from minirl.training.models import config_json
from minirl.training.plan import CUDA_CONTEXT_GB, GiB, Shape
from minirl.training.plan_judge import judge_copy_bytes, local_judge_uses

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MiB = 1 << 20
# A reward worker's memory as RLIMIT_DATA counts it (VmData) beside its CPU copies: its own once it has unpickled a
# reward that imports torch and transformers (315 MiB measured: torch 2.13 CPU, x86-64; a CUDA build not measured),
# and WORKER_SLACK times the copies as this plan counts them (loading took 1.22x the weights: the tokenizer, the
# loader's threads; a forward or generate more than the plan's count: the allocator, CPU attention). Measured in a
# worker (scripts/reward_worker_memory.py), each the plan's count, where it failed and where it scored: a 47M float32
# classifier, 363 MiB, 8 rows of ~305 tokens: failed at reward_memory_mb 765 and 790 (two runs), scored at 790 and
# 810 (1.3x + 315); the embedded model as local judge, 715 MiB, 8 questions of ~320 tokens: failed at 1200, scored at
# 1240 (1.27x + 315). With the margin here they need 857 and 1314 (measured: both scored there).
WORKER_TORCH_MIB, WORKER_SLACK = 384, 1.3


@dataclass(frozen=True)
class RewardModelLoad:
    """What the reward models take on one device: GiB of all their copies, and a note for each."""
    gb: float = 0.0
    notes: tuple[str, ...] = ()


def copy_bytes(c: dict, use: RewardModelUse, cfg: Config, prompt: int) -> tuple[int, int, int, str]:
    """(weights, activations, parameters, dtype) of one copy of the reward model of config.json `c` (module
    docstring); a config Shape cannot read raises its ConfigError."""
    shape = Shape.from_config(c)
    text = c.get("text_config", c)
    dtype = str(c.get("dtype") or c.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype") or "float32")
    b = DTYPE_BYTES.get(dtype.removeprefix("torch."), 4)
    labels = len(c.get("id2label") or {}) or int(c.get("num_labels", 2))  # transformers' default: 2 labels
    params = shape.params() - (0 if shape.tied else shape.vocab * shape.hidden) + shape.hidden * labels
    h, q, i = shape.hidden, shape.heads * shape.head_dim, shape.intermediate
    tokens = use.batch_size * min(prompt + cfg.max_tokens, use.max_length)
    acts = tokens * (shape.kv_bytes_per_token(b) + b * (4 * h + 3 * q + 3 * i))
    return params * b, acts, params, dtype


def worker_limit_problem(copies: list[tuple[str, str, int]], cfg: Config) -> str | None:
    """The problem of the CPU copies (ref, what, bytes) each reward worker loads (each holds every reward) when
    reward_memory_mb cannot hold them together (None: they fit, or `reward_workers: 0` loads them in the run's
    process, with no limit)."""
    one = sum(n for _, _, n in copies)
    need = WORKER_TORCH_MIB + math.ceil(WORKER_SLACK * one / MiB)
    if not copies or not cfg.reward_workers or need <= cfg.reward_memory_mb:
        return None
    what = f"{copies[0][0]}: one copy of the {copies[0][1]}" if len(copies) == 1 else \
        f"{', '.join(r for r, _, _ in copies)}: one copy of each of these {len(copies)} models"
    it, them = ("it", "it") if len(copies) == 1 else ("they", "them")
    return (f"{what} needs about {need} MiB in each reward worker ({one / MiB:.0f} MiB planned, with the worker's "
            f"own torch and the loader's slack), over reward_memory_mb={cfg.reward_memory_mb}: {it} cannot load "
            f"there; raise reward_memory_mb to {need}, or set reward_workers: 0 to load {them} in the run's process")


def reward_model_loads(cfg: Config, train_device: str, prompt: int,
                       objects: Sequence[Any] = ()) -> tuple[dict[str, RewardModelLoad], list[str]]:
    """({device: what its reward models and local judges take}, problems) for those of `cfg.rewards` and of
    `objects` (a run's rewards given as Python objects, whose names alone are in `cfg.rewards`: a local judge's is
    counted from its object): `prompt` a prompt's tokens (the plan's assumption), `train_device` the trainer's (whose
    process already has a CUDA context there). A problem is one line: a local path that does not exist, CPU copies
    a reward worker's reward_memory_mb cannot hold."""
    loads: dict[str, RewardModelLoad] = {}
    problems: list[str] = []
    in_worker: list[tuple[str, str, int]] = []  # the CPU copies each reward worker loads: (ref, what, bytes)
    copies = cfg.reward_workers or 1
    where = f"one per reward worker, reward_workers: {cfg.reward_workers}" if cfg.reward_workers else \
        "reward_workers: 0, in the run's process"

    def add(device: str, gb: float, note: str) -> None:
        prev = loads.get(device, RewardModelLoad())
        loads[device] = RewardModelLoad(prev.gb + gb, (*prev.notes, note))

    for use in reward_model_uses(cfg.rewards):
        if use.path.startswith((".", "/", "~")) and not Path(use.path).expanduser().exists():
            problems.append(f"{use.ref}: the reward model folder {use.path!r} does not exist; point path= at a "
                            "saved sequence-classification model (or a Hub id)")
            continue
        if use.device != "cpu" and not use.device.startswith("cuda:"):
            continue  # another accelerator ('mps'): no plan of this machine holds it
        try:
            weights, acts, params, dtype = copy_bytes(config_json(use.path), use, cfg, prompt)
        except Exception as e:  # noqa: BLE001 - not readable or not reachable: a note, not a refusal
            add(use.device, 0.0, f"{use.ref}: not counted ({' '.join(str(e).split())})")
            continue
        gpu = use.device.startswith("cuda")
        context = CUDA_CONTEXT_GB * GiB if gpu and (cfg.reward_workers or use.device != train_device) else 0
        one = weights + acts + context
        add(use.device, copies * one / GiB,
            f"reward model {use.path} ({params / 1e9:.2f}B, {dtype}) on {use.device}: {copies} "
            f"cop{'ies' if copies > 1 else 'y'} ({where}) x {one / GiB:.2f} GiB (weights {weights / GiB:.2f}, "
            f"a batch of {use.batch_size} {acts / GiB:.2f}" + (f", CUDA context {CUDA_CONTEXT_GB:g}" if context
                                                              else "") + ")")
        if not gpu:
            in_worker.append((use.ref, "reward model", one))
    for judge in local_judge_uses([*cfg.rewards, *objects]):
        if judge.path.startswith((".", "/", "~")) and not Path(judge.path).expanduser().exists():
            problems.append(f"{judge.ref}: the local judge's folder {judge.path!r} does not exist; point local= "
                            "at a saved causal language model (or a Hub id, or the embedded model's name)")
            continue
        try:
            weights, acts, params = judge_copy_bytes(config_json(judge.path), judge, cfg, prompt)
        except Exception as e:  # noqa: BLE001 - as a reward model's
            add("cpu", 0.0, f"{judge.ref}: not counted ({' '.join(str(e).split())})")
            continue
        one = weights + acts
        add("cpu", copies * one / GiB,
            f"local judge {judge.path} ({params / 1e9:.2f}B, float32) on cpu: {copies} "
            f"cop{'ies' if copies > 1 else 'y'} ({where}) x {one / GiB:.2f} GiB (weights {weights / GiB:.2f}, "
            f"{judge.concurrency} questions generated together {acts / GiB:.2f})")
        in_worker.append((judge.ref, "local judge", one))
    if why := worker_limit_problem(in_worker, cfg):
        problems.append(why)
    return loads, problems


def check_reward_models(cfg: Config, objects: Sequence[Any] = ()) -> None:
    """Before the reward workers start: the reward models' and local judges' problems (`reward_model_loads`; a run's
    reward `objects` too), one line each, raised as a ConfigError."""
    if problems := reward_model_loads(cfg, "cpu", min(cfg.max_prompt_tokens, 256), objects)[1]:
        raise ConfigError("\n".join(problems))


def reward_gb_on(cfg: Config, device: str) -> float:
    """GiB of the reward models' copies on `device` (the trainer's: an engine's 'auto' share leaves them room)."""
    device = "cuda:0" if device == "cuda" else device
    return reward_model_loads(cfg, device, min(cfg.max_prompt_tokens, 256))[0].get(device, RewardModelLoad()).gb

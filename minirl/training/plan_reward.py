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
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minirl.config import Config
from minirl.rewards.reward_model import RewardModelUse, reward_model_uses
from minirl.training.models import config_json
from minirl.training.plan import CUDA_CONTEXT_GB, GiB, Shape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


def reward_model_loads(cfg: Config, train_device: str, prompt: int) -> tuple[dict[str, RewardModelLoad], list[str]]:
    """({device: what its reward models take}, problems) for the reward models of `cfg.rewards`: `prompt` a
    prompt's tokens (the plan's assumption), `train_device` the trainer's (whose process already has a CUDA
    context there). A problem is one line: a local path that does not exist."""
    loads: dict[str, RewardModelLoad] = {}
    problems = []
    copies = cfg.reward_workers or 1
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
            note = f"{use.ref}: not counted ({' '.join(str(e).split())})"
            prev = loads.get(use.device, RewardModelLoad())
            loads[use.device] = RewardModelLoad(prev.gb, (*prev.notes, note))
            continue
        gpu = use.device.startswith("cuda")
        context = CUDA_CONTEXT_GB * GiB if gpu and (cfg.reward_workers or use.device != train_device) else 0
        one = weights + acts + context
        where = f"one per reward worker, reward_workers: {cfg.reward_workers}" if cfg.reward_workers else \
            "reward_workers: 0, in the run's process"
        note = (f"reward model {use.path} ({params / 1e9:.2f}B, {dtype}) on {use.device}: {copies} "
                f"cop{'ies' if copies > 1 else 'y'} ({where}) x {one / GiB:.2f} GiB (weights {weights / GiB:.2f}, "
                f"a batch of {use.batch_size} {acts / GiB:.2f}" + (f", CUDA context {CUDA_CONTEXT_GB:g}" if context
                                                                  else "") + ")")
        prev = loads.get(use.device, RewardModelLoad())
        loads[use.device] = RewardModelLoad(prev.gb + copies * one / GiB, (*prev.notes, note))
    return loads, problems


def reward_gb_on(cfg: Config, device: str) -> float:
    """GiB of the reward models' copies on `device` (the trainer's: an engine's 'auto' share leaves them room)."""
    device = "cuda:0" if device == "cuda" else device
    return reward_model_loads(cfg, device, min(cfg.max_prompt_tokens, 256))[0].get(device, RewardModelLoad()).gb

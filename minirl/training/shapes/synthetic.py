"""`synthetic(name)`: a randomly initialised model of a published shape, saved once as a Hugging Face folder."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from minirl.training.folders import publish_folder

HERE = Path(__file__).parent
TOKENIZER = HERE / "tokenizer"
NAMES = tuple(sorted(p.stem for p in HERE.glob("*.json")))


def shape_config(name: str) -> dict:
    """The config.json values of shape `name` (one of NAMES)."""
    if name not in NAMES:
        raise ValueError(f"unknown model shape {name!r}: use one of {', '.join(NAMES)}")
    return json.loads((HERE / f"{name}.json").read_text())


SHIPPED = ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B", "meta-llama/Llama-3.2-1B")  # Hub ids of NAMES


def published_shape(model_id: str) -> str | None:
    """The shipped shape of a Hub id ('Qwen/Qwen2.5-1.5B-Instruct', 'unsloth/Llama-3.2-1B' -> 'qwen2.5-1.5b',
    'llama-3.2-1b': an instruct model has its base's sizes), or None. For a plan without the Hub."""
    name = model_id.rsplit("/", 1)[-1].lower().removesuffix("-instruct")
    return name if "/" in model_id and name in NAMES and name != "qwen2-tiny" else None


def _default_dir() -> Path:
    return Path(os.environ.get("MINIRL_CACHE", Path.home() / ".cache" / "minirl")) / "synthetic"


def synthetic(name: str, path: str | Path | None = None, seed: int = 0, device: str = "cpu") -> Path:
    """Build (once) a randomly initialised model of shape `name` in `path` (default: the cache dir's
    `synthetic/<name>`), in the shape's dtype, with the committed tokenizer; return the folder. `device` is where
    the random init runs ('cuda' is much faster at 1B+); the folder is the same either way up to the RNG."""

    path = Path(path) if path is not None else _default_dir() / name
    if (path / "config.json").exists():
        return path
    values = shape_config(name)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    ids = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(**{**values, **ids})
    dtype = getattr(torch, values.get("torch_dtype", "float32"))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.do_sample = False
    def write(tmp: Path) -> None:
        model.to("cpu").save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return publish_folder(path, write)

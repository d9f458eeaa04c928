"""Export a run for serving: its LoRA adapter merged into the base model, as a plain transformers folder with the
tokenizer (`minirl export RUN_DIR --merged OUT`, `Run.export(out)`), which transformers and vLLM load like any
model.

The merge is done in float32 on the CPU (W + scale * B @ A, peft's `merge_and_unload`), then saved in the run's
weight dtype. A QLoRA run's adapter was trained against the 4-bit (NF4) base; it is merged into the full-precision
base, so the merged model is the adapter on the unquantised weights, not the exact policy the run sampled from --
the export says so in one line.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from minirl.config import Config
from minirl.run.checkpoint import temp_dir, usual_permissions
from minirl.training.models import load_tokenizer, resolve_model, train_dtype


def check_run(run_dir: Path) -> Config:
    """The run's Config, after the one-line checks that `run_dir` is a run with a saved adapter."""
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{str(run_dir)!r} is not a minirl run folder (no config.yaml); give the out_dir of a run")
    if not (run_dir / "adapter" / "adapter_config.json").is_file():
        raise ValueError(f"{str(run_dir)!r} has no saved adapter (adapter/adapter_config.json): the run has not "
                         "finished a step, or its adapter was not finite; resume it, then export")
    return Config.from_yaml(run_dir / "config.yaml")


def merged_model(cfg: Config, run_dir: Path):
    """The run's adapter merged into its base model, in float32 on the CPU; `(model, note)`, `note` the one line
    printed when the run was QLoRA (merged into the full-precision base), else None."""
    note = None
    if cfg.load_in_4bit:
        note = (f"minirl: the run trained a QLoRA adapter on the 4-bit base; it is merged into the full-precision "
                f"base {cfg.model!r}, so the merged model is not bit-for-bit the policy the run sampled from")
        print(note, flush=True)
    kw = {k: v for k, v in cfg.model_kwargs.items() if k != "quantization_config"}
    base = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model), dtype=torch.float32, **kw)
    merged = PeftModel.from_pretrained(base, str(run_dir / "adapter")).merge_and_unload()
    merged.config.use_cache = True
    return merged, note


def export_merged(run_dir: str | Path, out: str | Path) -> dict:
    """Merge `run_dir`'s adapter into its base model and save model + tokenizer to `out` (a new or empty folder,
    written whole or not at all). Returns what was written, with `note` when the run was QLoRA."""

    run_dir, out = Path(run_dir), Path(out)
    cfg = check_run(run_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{str(out)!r} already exists and is not empty; give a new folder for the merged model")
    save_dtype = torch.float32 if cfg.load_in_4bit else train_dtype(cfg)
    merged, note = merged_model(cfg, run_dir)
    merged = merged.to(save_dtype)
    tok = load_tokenizer(cfg.model, cfg.model_kwargs, cfg.chat_template)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out.parent, out.name)  # not mkdtemp's: private (0700), the folder would stay so
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        usual_permissions(tmp)  # safetensors writes its files private (0600): a server of another user could not read
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"merged": str(out), "base": cfg.model, "adapter": str(run_dir / "adapter"),
            "dtype": str(save_dtype).removeprefix("torch."), **({"note": note} if note else {})}

"""Shared-prefix packing on a GPU: equal math (float32, CUDA SDPA with the packed mask, checkpointing on and off,
kl_coef > 0) and `Trainer.step` time padded vs packed (bf16, checkpointing on and off), on the stored demo batches
with a randomly initialised model of SmolLM2-135M's shape (the embedded GGUF does not travel). One JSON in $OUT.

    python scripts/gpu_packing_check.py"""
from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BATCHES = ROOT / "tests" / "data" / "trainer_batches_demo.json"


def smollm_shaped(folder: Path) -> str:
    """A random Llama of SmolLM2-135M's shape, with the tiny test tokenizer (only its pad id is used)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from minirl.training.models import build_tiny_model
    tiny = build_tiny_model(folder.parent / "tiny")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, head_dim=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    for f in tiny.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    return str(folder)


def equal_math(model: str, ckpt: bool) -> dict:
    from minirl import Config
    from minirl.benchmarks.trainer_step import load_batches
    from minirl.training.trainer import Trainer
    _, steps = load_batches(BATCHES)
    out, grads = {}, {}
    for packing in ("padded", "shared-prefix"):
        tr = Trainer(Config(model=model, backend="hf", dtype="float32", lora_rank=16, max_tokens=24, seed=0,
                            token_budget=512, packing=packing, gradient_checkpointing=ckpt, kl_coef=0.05,
                            max_grad_norm=1e9))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in tr.model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.01)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out[packing] = tr.step(steps[0])
        out[packing]["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        grads[packing] = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if "lora" in n}
        del tr
        gc.collect()  # peft's model holds reference cycles: free it before the other side's peak is taken
        if cuda:
            torch.cuda.empty_cache()
    pad, pk = grads["padded"], grads["shared-prefix"]
    rel = max(float((pk[n] - pad[n]).norm() / pad[n].norm().clamp(min=1e-30)) for n in pad)
    worst = max(float(((pk[n] - pad[n]).abs() / (1e-7 + 1e-4 * pad[n].abs())).max()) for n in pad)
    return {"gradient_checkpointing": ckpt, "loss": {k: v["loss"] for k, v in out.items()},
            "kl_ref": {k: v["kl_ref"] for k, v in out.items()}, "lora_tensors": len(pad),
            "max_rel_grad_norm_diff": rel, "max_diff_over_tolerance(rtol1e-4,atol1e-7)": worst,
            "forward_tokens": {k: v["train/forward_tokens"] for k, v in out.items()},
            "peak_cuda_mb": {k: v["peak_cuda_mb"] for k, v in out.items()}}


def main() -> None:
    from minirl.benchmarks.trainer_step import bench_trainer_step
    out = Path(os.environ.get("OUT") or "gpu_packing_out")
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    t0 = time.time()
    model = smollm_shaped(tmp / "smol-shape")
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "transformers": __import__("transformers").__version__}
    res["equal_math_fp32"] = [equal_math(model, ckpt) for ckpt in (False, True)]
    print(json.dumps(res["equal_math_fp32"], indent=1), flush=True)
    res["bench_bf16"] = [bench_trainer_step(BATCHES, rounds=6, model=model, gradient_checkpointing=ckpt, kl_coef=kl)
                         for ckpt in (False, True) for kl in (0.0, 0.05)]
    for b in res["bench_bf16"]:
        print(json.dumps({k: b[k] for k in ("settings", "median_s", "ratio_packed_over_padded", "peak_cuda_mb",
                                            "forward_tokens")}), flush=True)
    res["wall_s"] = time.time() - t0
    (out / "gpu_packing_check.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()

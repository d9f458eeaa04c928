"""`minirl bench generation`: minirl's vLLM generation thread against raw vLLM `AsyncLLM`, and adapter sync latency.

Both paths run on the same engine instance (so the same weights, KV cache and cores), alternating rounds, on the
same prompts (arithmetic questions through the chat template) and the same sampling params: one request per
prompt with n samples, per-token logprobs, per-request seeds. Raw = `AsyncLLM.generate` driven directly on the
engine loop; minirl = `VLLMGenerator.generate` from the caller thread (Completion objects, versions, ...).

transformers generation (the HF backend), merged vs unmerged LoRA: the same peft model (rank 16, all linear
layers, random lora_B) through `HFGenerator` with `merge=True` and `merge=False`, alternating rounds, the same
seeds (so the same tokens: checked).

Sync latency (file transport): a rank-16 all-linear peft LoRA of the model is saved to tmpfs (/dev/shm) and
loaded with `load_adapter`; measured from the start of `save_pretrained` until `add_lora` has returned (new
requests are served with it).

vLLM server (backend 'vllm-server', `servers.py`): the same prompts and params through a vLLM OpenAI-compatible
server on the same cores, alternating rounds with the in-process engine (`server_vs_inproc`), and the adapter
push to it. Writes `out_dir/generation.json`.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .. import lifecycle
from ..generators.vllm import VLLMGenerator, request_seed
from ..models import resolve_model
from .servers import bench_server
from ..types import Prompt, SamplingParams


def bench_prompts(tokenizer, count: int) -> list[Prompt]:
    """A fixed set of arithmetic questions, tokenized through the chat template."""
    out = []
    for i in range(count):
        a, b = (i * 37) % 90 + 10, (i * 53) % 90 + 10
        q = f"What is {a} + {b}? Think step by step, then give the answer."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        out.append(Prompt(i, tuple(ids), q, {"answer": a + b}))
    return out


def _raw_round(gen: VLLMGenerator, prompts, n: int, params: SamplingParams, visit: int) -> int:
    """Raw vLLM: one `AsyncLLM.generate` per prompt, gathered on the engine loop. Returns tokens generated."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    llm = gen.engine

    async def one(p: Prompt) -> int:
        sp = VSP(n=n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                 seed=request_seed(params.seed, p.index, visit), logprobs=0, flat_logprobs=True,
                 output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=list(p.token_ids)), sp,
                                      f"raw-{visit}-{p.index}", lora_request=gen.serving):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    async def run():
        return sum(await asyncio.gather(*(one(p) for p in prompts)))
    return gen.call(run())


def _lora_model(model_path: str, rank: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))


def bench_hf_merge(model_path: str, prompts, n: int = 8, max_tokens: int = 24, rounds: int = 2) -> dict:
    """transformers tokens/s with the LoRA merged for generation (the default) vs unmerged, side by side."""
    import torch
    from transformers import AutoTokenizer
    from ..generators.hf import HFGenerator
    model = _lora_model(model_path, 16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    tok = AutoTokenizer.from_pretrained(model_path)
    gens = {"merged": HFGenerator(model, tok), "unmerged": HFGenerator(model, tok, merge=False)}
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0)
    gens["merged"].generate(prompts[:2], 2, params)  # warm-up
    secs, toks = {k: 0.0 for k in gens}, {k: 0 for k in gens}
    for r in range(rounds):
        for k in (("merged", "unmerged") if r % 2 == 0 else ("unmerged", "merged")):
            t = time.perf_counter()
            groups = gens[k].generate(prompts, n, params)
            secs[k] += time.perf_counter() - t
            toks[k] += sum(len(c.token_ids) for g in groups for c in g.completions)
    rate = {k: toks[k] / secs[k] for k in gens}
    return {"hf_merged_tok_s": round(rate["merged"], 2), "hf_unmerged_tok_s": round(rate["unmerged"], 2),
            "hf_merge_speedup": round(rate["merged"] / rate["unmerged"], 3),
            "hf_same_tokens": toks["merged"] == toks["unmerged"],
            "hf_workload": {"prompts": len(prompts), "n": n, "max_tokens": max_tokens, "rounds": rounds,
                            "torch_threads": torch.get_num_threads()}}


def bench_files_sync(gen: VLLMGenerator, model_path: str, reps: int = 10, rank: int = 16,
               root: str | None = None) -> dict:
    """File-transport sync latency: save_pretrained to tmpfs + load_adapter, `reps` times (a new version and a
    new folder each time, like the trainer). Leaves the engine on the base model."""
    import torch
    peft_model = _lora_model(model_path, rank)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(root or tempfile.mkdtemp(prefix="minirl-sync-", dir=shm))
    lifecycle.keep_tidy(root)  # removed by the watchdog if the benchmark is killed
    times, nbytes = [], 0
    try:
        for v in range(1, reps + 1):
            with torch.no_grad():  # a fake optimizer step, so every version differs
                for name, p in peft_model.named_parameters():
                    if "lora_B" in name:
                        p.add_(torch.randn_like(p) * 1e-3)
            path = root / f"v{v}"
            t0 = time.perf_counter()
            peft_model.save_pretrained(path)
            gen.load_adapter(str(path), v)
            times.append((time.perf_counter() - t0) * 1000)
            nbytes = sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".json"))
            old = root / f"v{v - 2}"
            if old.exists():
                shutil.rmtree(old)
        gen.load_adapter(None, 0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        lifecycle.tidied(root)
    times.sort()
    pct = lambda q: times[min(len(times) - 1, round(q * (len(times) - 1)))]  # noqa: E731
    return {"sync_files_p50_ms": round(pct(0.5), 2), "sync_files_p95_ms": round(pct(0.95), 2),
            "sync_files_ms": [round(t, 2) for t in times], "adapter_bytes": nbytes, "adapter_rank": rank,
            "loaded_adapters_after": len(gen.loaded_adapters())}


def bench_generation(out_dir: str, model: str = "smollm2-135m-instruct", num_prompts: int = 32, n: int = 8,
                     max_tokens: int = 48, temperature: float = 1.0, rounds: int = 2, sync_reps: int = 10,
                     dtype: str = "auto", cpu_cores: str | None = None, kv_cache_gb: float = 1.0,
                     gpu_memory_utilization: float = 0.3, max_model_len: int = 1024, generator=None) -> dict:
    """Measure raw AsyncLLM vs minirl tokens/s (alternating rounds on one engine) and file sync latency; write
    and return `out_dir/generation.json`. Pass a running `VLLMGenerator` as `generator` to reuse it."""
    from transformers import AutoTokenizer
    model_path = resolve_model(model)
    prompts = bench_prompts(AutoTokenizer.from_pretrained(model_path), num_prompts)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
    own = generator is None
    t0 = time.perf_counter()
    gen = generator or VLLMGenerator(model_path, max_lora_rank=16, max_model_len=max_model_len, dtype=dtype,
                                     cpu_cores=cpu_cores, kv_cache_gb=kv_cache_gb,
                                     gpu_memory_utilization=gpu_memory_utilization)
    startup_s = time.perf_counter() - t0
    try:
        gen.generate(prompts[:4], 2, SamplingParams(max_tokens=8, seed=0))  # warm-up
        raw_tok = mini_tok = 0
        raw_s = mini_s = 0.0
        rounds_log = []
        for r in range(rounds):  # alternate which path goes first, to cancel drift in machine load
            for path in (("raw", "minirl") if r % 2 == 0 else ("minirl", "raw")):
                t = time.perf_counter()
                if path == "raw":
                    tok = _raw_round(gen, prompts, n, params, visit=1000 + r)
                    dt_raw = time.perf_counter() - t
                else:
                    groups = gen.generate(prompts, n, params)
                    dt_mini = time.perf_counter() - t
                    mtok = sum(len(c.token_ids) for g in groups for c in g.completions)
            raw_tok, raw_s, mini_tok, mini_s = raw_tok + tok, raw_s + dt_raw, mini_tok + mtok, mini_s + dt_mini
            rounds_log.append({"raw_tok_s": round(tok / dt_raw, 1), "minirl_tok_s": round(mtok / dt_mini, 1)})
        result = {"raw_tok_s": round(raw_tok / raw_s, 2), "minirl_tok_s": round(mini_tok / mini_s, 2)}
        result["ratio"] = round(result["minirl_tok_s"] / result["raw_tok_s"], 4)
        result.update(rounds=rounds_log, raw_tokens=raw_tok, minirl_tokens=mini_tok)
        result.update(bench_files_sync(gen, model_path, reps=sync_reps))
        result.update(bench_server(gen, model_path, prompts, n, params, rounds=rounds, sync_reps=sync_reps,
                                   log_dir=str(Path(out_dir) / "server_logs")))
        result.update(bench_hf_merge(model_path, prompts[:8]))
        result.update(model=model, num_prompts=num_prompts, n=n, max_tokens=max_tokens, temperature=temperature,
                      dtype=str(gen.engine_args.dtype), device="cpu" if gen.on_cpu else "gpu",
                      engine_startup_s=round(startup_s, 1))
    finally:
        if own:
            gen.close()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generation.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cpu-cores", default=None)
    a = ap.parse_args()
    print(json.dumps(bench_generation(a.out, a.model, a.num_prompts, a.n, a.max_tokens, rounds=a.rounds,
                                      dtype=a.dtype, cpu_cores=a.cpu_cores), indent=2))

"""`minirl bench generation`: generation speed, side by side (`compare.interleaved`: rounds A B, B A, ...; both
sides from the same seeds, prompts and caches; tokens compared token by token). Writes `out_dir/generation.json`:
one entry per comparison, each with its figures, `seeds`, `rounds`, `order` and `settings`.

All of it runs on the run's own parts: a `Trainer` of the demo's config (the embedded model, rank-16 all-linear
LoRA, float32 on CPU) and the vLLM engine and sync `make_generator` gives a run with backend='vllm'.

  raw_vs_minirl    minirl's `VLLMGenerator.generate` against raw `AsyncLLM.generate` on the same engine, the base
                   model served. The same per-request seeds, so the same tokens; the prefix cache emptied before
                   each side, so both pay their prefills.
  vllm_vs_hf       what backend='auto' decides on CPU: the demo's step (8 prompts x 8 samples x 24 tokens) through
                   vLLM with the LoRA served (pushed as a run pushes it: a new LoRA id per version) against
                   transformers `generate` on the trainer's own model with the adapter (`HFGenerator`, LoRA merged
                   on CPU, as the synchronous loop runs it). Before each round one fake optimizer step changes the
                   adapter and it is pushed (push time reported apart), so vLLM's prefix cache cannot hit and the
                   merge is recomputed inside the timed transformers side, as in a run. The two draw from different
                   random streams, so their tokens differ (`identical_fraction` ~ 0 by construction): tokens/s is
                   the figure.
  cpu_lora         vLLM's CPU LoRA ops (a copy of the adapter per token) vs minirl's (`minirl.sync.cpu_lora`, the
                   default in minirl's engines), swapped on the same engine: the demo's step with the adapter, the
                   same seed, the prefix cache emptied before each side; and the sync check's `score` of the probe.
  hf_merge         `HFGenerator` merged (the CPU default) vs unmerged on the trainer's model, the demo's step, a
                   fake optimizer step before each round so that the merge cost is inside the timed merged side
                   (`merge_ms`: the merge alone); the same seed, so the same tokens up to merge rounding.
  hf_decode        `HFGenerator`'s own decoding loop (`hf.decode`: a row that ends leaves the batch and its KV cache;
                   the CPU default) vs transformers `generate` (which decodes every row until the last one ends) on
                   the trainer's model with the adapter merged, on the demo's step and on the long-tail step of
                   `bench pipeline` (4 prompts x 8 samples x up to 160 tokens). The same seed, but the two draw
                   differently once a row has ended, so tokens differ: tokens/s and seconds per step are the
                   figures. Needs no vLLM engine.
  check            the engine's part of the sync check (`sync.verify` after every push): the probe (the first demo
                   prompt + 32 tokens, `make_probe`) scored as one prompt-logprobs request (what an idle engine
                   gets: the synchronous loop's check) vs one 1-token request per position (what it gets beside
                   running requests), on the engine's default ops, a fake step and a push before each round;
                   both must agree within the float32 tolerance (`max_diff`).
  server_vs_inproc the same work through a vLLM server (`servers.py`), and its adapter push.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from minirl.benchmarks.compare import empty_prefix_cache, interleaved, sequences
from minirl.benchmarks.servers import bench_server
from minirl.config import DEMO, Config
from minirl.data import rows as D
from minirl.generation.factory import make_generator
from minirl.generation.hf import HFGenerator, merged_lora
from minirl.generation.vllm import VLLMGenerator, request_seed
from minirl.sync.base import WeightSync
from minirl.sync.check import make_probe
from minirl.sync.senders import call_on_loop, rpc
from minirl.training.trainer import Trainer
from minirl.types import AdapterSource, Prompt, SamplingParams


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


def demo_prompts(tokenizer, count: int = 8) -> list[Prompt]:
    """The first `count` training prompts of the demo (the built-in arithmetic task, seed 0)."""
    return D.to_prompts(D.arithmetic_splits(64, 0)[0][:count], tokenizer)


def fake_step(trainer: AdapterSource, scale: float = 1e-3) -> None:
    """Stand-in for an optimizer step: every lora_B moves by seeded noise, in place; the version goes up."""
    g = torch.Generator().manual_seed(trainer.version + 1)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g).to(p) * scale)
    trainer.version += 1


def raw_generate(gen: VLLMGenerator, prompts, n: int, params: SamplingParams, seed: int) -> list[tuple[int, ...]]:
    """Raw vLLM: one `AsyncLLM.generate` per prompt, gathered on the engine loop, with the per-request seed
    minirl gives a prompt's first visit (`request_seed(seed, index, 0)`) and the adapter it serves."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    llm, tag = gen.engine, time.monotonic_ns()

    async def one(p: Prompt):
        sp = VSP(n=n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                 seed=request_seed(seed, p.index, 0), logprobs=0, flat_logprobs=True,
                 output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=list(p.token_ids)), sp, f"raw-{tag}-{p.index}",
                                      lora_request=gen.serving):
            final = out
        return [tuple(c.token_ids) for c in sorted(final.outputs, key=lambda c: c.index)]

    async def run():
        return [s for seqs in await asyncio.gather(*(one(p) for p in prompts)) for s in seqs]
    return gen.call(run())


def _minirl_generate(gen: VLLMGenerator, prompts, n, params):
    gen.restart_seeds()  # each prompt's first visit: the seeds raw_generate uses
    return sequences(gen.generate(prompts, n, params))


def _settings(prompts, n: int, params: SamplingParams, **more) -> dict:
    return {"prompts": len(prompts), "n": n, "max_tokens": params.max_tokens, "temperature": params.temperature,
            **more}


def bench_raw_vs_minirl(gen: VLLMGenerator, prompts, n: int, params: SamplingParams, rounds: int = 4,
                        seeds=(0, 0)) -> dict:
    """minirl vs raw AsyncLLM tokens/s on `gen`; `seeds` = (raw's, minirl's) (equal: the same tokens)."""
    seed = dict(zip(("raw", "minirl"), seeds))
    sides = {"raw": lambda: raw_generate(gen, prompts, n, params, seed["raw"]),
             "minirl": lambda: _minirl_generate(gen, prompts, n, replace(params, seed=seed["minirl"]))}
    res = interleaved(sides, rounds, each_side=lambda _: empty_prefix_cache(gen))
    return {**res, "seeds": seed, "settings": _settings(
        prompts, n, params, prefix_cache="emptied before each side", adapter=gen.serving and gen.serving.lora_name)}


def bench_vllm_vs_hf(trainer: Trainer, gen: VLLMGenerator, sync: WeightSync, prompts, n: int, params: SamplingParams,
                     rounds: int = 4,
                     seeds=(0, 0)) -> dict:
    """vLLM (the LoRA served, pushed by `sync`) vs transformers `generate` on the trainer's model (merged LoRA on
    CPU, as the synchronous loop runs it); `seeds` = (transformers', vLLM's). A fake step and a push before each
    round."""
    hf = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version)
    seed, push_ms = dict(zip(("hf", "vllm"), seeds)), []

    def step(_):
        fake_step(trainer)
        push_ms.append(round(sync.push(trainer, gen).ms, 1))
    sides = {"hf": lambda: sequences(hf.generate(prompts, n, replace(params, seed=seed["hf"]))),
             "vllm": lambda: _minirl_generate(gen, prompts, n, replace(params, seed=seed["vllm"]))}
    res = interleaved(sides, rounds, each_round=step)
    return {**res, "push_ms": push_ms, "seeds": seed, "settings": _settings(
        prompts, n, params, trainer_dtype=str(next(trainer.model.parameters()).dtype), engine_dtype=gen.dtype,
        lora_rank=trainer.cfg.lora_rank, transport=sync.transport, hf_merge=hf.merge,
        torch_threads=torch.get_num_threads(), prefix_cache="on (a run's engine); a new adapter every round",
        note="vLLM and transformers sample from different random streams: tokens differ, compare tokens/s")}


def bench_cpu_lora(trainer: Trainer, gen: VLLMGenerator, sync: WeightSync, prompts, n: int, params: SamplingParams,
                   rounds: int = 4,
                   seed: int = 0) -> dict:
    """vLLM's own CPU LoRA ops vs minirl's (`minirl.sync.cpu_lora`), swapped in and out of the same engine between
    sides (`minirl_cpu_lora`): the demo's step with the adapter served, pushed as a run pushes it (a fake step and
    a push before each round), the same seed and the prefix cache emptied before each side; then, interleaved the
    same way, the engine's part of the sync check (`score` of the run's 32-token probe, `make_probe`)."""
    tok = trainer.tokenizer

    def use(name):
        want = name == "minirl_ops"
        if call_on_loop(gen, rpc(gen, "minirl_cpu_lora", want), 30.0) != want:
            raise RuntimeError(f"the engine's worker could not switch to {name}")
        empty_prefix_cache(gen)
    start = call_on_loop(gen, rpc(gen, "minirl_info"), 30.0)["cpu_lora"]
    sides = {k: (lambda: _minirl_generate(gen, prompts, n, replace(params, seed=seed)))
             for k in ("vllm_ops", "minirl_ops")}
    res = interleaved(sides, rounds, each_round=lambda _: (fake_step(trainer), sync.push(trainer, gen)),
                      each_side=use)
    probe = make_probe(trainer.model, prompts[0].token_ids, 32, 0, tok.all_special_ids, len(tok))
    score_s = {k: [] for k in sides}
    for r in range(rounds):
        fake_step(trainer)
        sync.push(trainer, gen)
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            use(name)
            t = time.perf_counter()
            gen.score(*probe, params.temperature)
            score_s[name].append(round(time.perf_counter() - t, 3))
    call_on_loop(gen, rpc(gen, "minirl_cpu_lora", start), 30.0)  # the engine's ops as found
    return {**res, "check_score_s": score_s, "seeds": {k: seed for k in sides}, "settings": _settings(
        prompts, n, params, engine_dtype=gen.dtype, lora_rank=trainer.cfg.lora_rank, transport=sync.transport,
        prefix_cache="emptied before each side", probe_tokens=len(probe[1]),
        note="the same engine and seed: tokens differ only where the two ops' float rounding flips a sample")}


def bench_check(trainer: Trainer, gen: VLLMGenerator, sync: WeightSync, prompt, rounds: int = 4) -> dict:
    """The probe scored whole (one request) vs position by position on the same engine and adapter (module
    docstring: `check`); order alternated per round."""
    tok = trainer.tokenizer
    probe = make_probe(trainer.model, prompt.token_ids, 32, 0, tok.all_special_ids, len(tok))
    secs, diffs, order = {"whole": [], "per_position": []}, [], []
    for r in range(rounds):
        fake_step(trainer)
        sync.push(trainer, gen)
        got = {}
        for name in (["whole", "per_position"] if r % 2 == 0 else ["per_position", "whole"]):
            order.append(name)
            t = time.perf_counter()
            got[name] = gen.score(*probe, 1.0, whole=name == "whole")
            secs[name].append(round(time.perf_counter() - t, 3))
        diffs.append(max(abs(a - b) for a, b in zip(got["whole"], got["per_position"])))
    return {"score_s": secs, "median_s": {k: statistics.median(v) for k, v in secs.items()},
            "speedup": statistics.median(secs["per_position"]) / statistics.median(secs["whole"]),
            "max_diff": max(diffs), "rounds": rounds, "order": order,
            "settings": {"probe_tokens": len(probe[1]), "prompt_tokens": len(probe[0]), "engine_dtype": gen.dtype,
                         "lora_rank": trainer.cfg.lora_rank, "transport": sync.transport, "temperature": 1.0}}


def bench_hf_merge(trainer: Trainer, prompts, n: int, params: SamplingParams, rounds: int = 4, seeds=(0, 0),
                   merge_reps: int = 5) -> dict:
    """transformers tokens/s with the LoRA merged for generation (the CPU default) vs unmerged, on the trainer's
    model; `seeds` = (unmerged's, merged's). A fake step before each round: the merged side re-merges, timed."""
    tok = trainer.tokenizer
    gens = {"unmerged": HFGenerator(trainer.model, tok, lambda: trainer.version, merge=False),
            "merged": HFGenerator(trainer.model, tok, lambda: trainer.version, merge=True)}
    seed = dict(zip(gens, seeds))
    sides = {k: (lambda k=k: sequences(gens[k].generate(prompts, n, replace(params, seed=seed[k])))) for k in gens}
    res = interleaved(sides, rounds, each_round=lambda _: fake_step(trainer))
    merge_ms, cache = [], {}
    for _ in range(merge_reps):  # the merge alone: what a new adapter costs the merged side once per step
        fake_step(trainer)
        t = time.perf_counter()
        with merged_lora(trainer.model, cache, trainer.version):
            pass
        merge_ms.append((time.perf_counter() - t) * 1e3)
    return {**res, "merge_ms": round(statistics.median(merge_ms), 2), "seeds": seed, "settings": _settings(
        prompts, n, params, dtype=str(next(trainer.model.parameters()).dtype), lora_rank=trainer.cfg.lora_rank,
        torch_threads=torch.get_num_threads(), merge_in_timing="a new adapter every round: merged once per round")}


def bench_hf_decode(trainer: Trainer, prompts, n: int, params: SamplingParams, rounds: int = 4) -> dict:
    """transformers `generate` vs minirl's `decode` on the trainer's model (LoRA merged, as the synchronous loop
    generates), the same seed on both sides."""
    tok = trainer.tokenizer
    gens = {"generate": HFGenerator(trainer.model, tok, lambda: trainer.version, compact=False),
            "decode": HFGenerator(trainer.model, tok, lambda: trainer.version, compact=True)}
    sides = {k: (lambda k=k: sequences(gens[k].generate(prompts, n, params))) for k in gens}
    res = interleaved(sides, rounds)
    return {**res, "step_s_speedup": round(res["generate_s_per_round"] / res["decode_s_per_round"], 4),
            "settings": _settings(prompts, n, params, dtype=str(next(trainer.model.parameters()).dtype),
                                  lora_rank=trainer.cfg.lora_rank, torch_threads=torch.get_num_threads(),
                                  note="the same seed; tokens differ once a row ends (the random draws shift)")}


def hf_parts(out_dir: str, lora_rank: int = 16):
    """The demo's trainer alone (the comparisons that need no vLLM engine); `out_dir`: its run folder (the
    caller's to remove)."""
    cfg = Config(**{**DEMO, "lora_rank": lora_rank, "lora_alpha": 2 * lora_rank, "out_dir": out_dir})
    return Trainer(cfg, device="cpu")


def run_parts(out_dir: str, lora_rank: int = 16):
    """(trainer, generator, sync) as a demo run with backend='vllm' builds them on this machine; `out_dir`: their
    run folder (the caller's to remove)."""
    cfg = Config(**{**DEMO, "backend": "vllm", "lora_rank": lora_rank, "lora_alpha": 2 * lora_rank,
                    "out_dir": out_dir})
    trainer = Trainer(cfg, device="cpu")
    gen, sync, _ = make_generator(cfg, trainer, "vllm", False, None)
    return trainer, gen, sync


COMPARISONS = ("raw_vs_minirl", "server_vs_inproc", "cpu_lora", "check", "vllm_vs_hf", "hf_merge", "hf_decode")
HF_ONLY = {"hf_merge", "hf_decode"}  # comparisons that need no vLLM engine
LONG_TAIL = (4, 8, 160)  # prompts, samples, tokens: `bench pipeline`'s long-tail workload


def unknown_comparisons(only) -> str | None:
    """The one-line error for names in `only` that are not comparisons (None: all known, or `only` is None)."""
    bad = sorted(set(only or ()) - set(COMPARISONS))
    return f"unknown comparisons {bad}; choose from {', '.join(COMPARISONS)}" if bad else None


def bench_generation(out_dir: str, num_prompts: int = 16, n: int = 8, max_tokens: int = 32, rounds: int = 4,
                     demo_rounds: int = 4, servers: bool = True, parts=None, demo_size=None, only=None) -> dict:
    """Every comparison above (or those named in `only`); write and return `out_dir/generation.json`. `parts`: a
    running (trainer, generator, sync) from `run_parts` to reuse (not closed here). `demo_size`: (prompts, samples,
    tokens) of the demo's step for `cpu_lora`, `vllm_vs_hf` and `hf_merge` (default: the demo's, 8 x 8 x 24)."""
    if unknown_comparisons(only):
        raise ValueError(unknown_comparisons(only))
    want = set(COMPARISONS if only is None else only)
    own = parts is None
    # the parts' run folder (nothing in it is a result): removed when the comparisons end, also on an error
    with tempfile.TemporaryDirectory(prefix="minirl-bench-") if own else contextlib.nullcontext() as scratch:
        t0 = time.perf_counter()
        if parts is None and want <= HF_ONLY:  # no engine to start
            trainer, gen, sync = hf_parts(scratch), None, None
        else:
            trainer, gen, sync = parts or run_parts(scratch)
        startup_s = time.perf_counter() - t0
        tok = trainer.tokenizer
        temp = trainer.cfg.temperature
        result = {"settings": {"model": trainer.cfg.model, "torch_threads": torch.get_num_threads(),
                               **({"device": "cpu" if gen.on_cpu else "gpu", "engine_dtype": gen.dtype,
                                   "prefix_caching": bool(gen.engine_args.enable_prefix_caching),
                                   "engine_startup_s": round(startup_s, 1)} if gen is not None else
                                  {"device": str(trainer.device), "engine": "none (transformers only)"})}}
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)

        def done(name: str, figures: dict) -> None:  # written as each comparison ends: an interrupted run keeps them
            result[name] = figures
            (out / "generation.json").write_text(json.dumps(result, indent=2))
        try:
            params = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=0)
            mixed = bench_prompts(tok, num_prompts)
            if gen is not None:
                _minirl_generate(gen, mixed[:2], 2, replace(params, max_tokens=4))  # warm-up (either path would do)
            if "raw_vs_minirl" in want:
                done("raw_vs_minirl", bench_raw_vs_minirl(gen, mixed, n, params, rounds))
            if servers and "server_vs_inproc" in want:
                done("server_vs_inproc", bench_server(gen, trainer.model_path, mixed, n, params, rounds=rounds,
                                                      log_dir=str(out / "server_logs")))
            count, group, tokens = demo_size or (trainer.cfg.prompts_per_step, trainer.cfg.group_size,
                                                 trainer.cfg.max_tokens)
            demo, step = demo_prompts(tok, count), SamplingParams(temperature=temp, max_tokens=tokens, seed=0)
            if gen is not None and gen.on_cpu and "cpu_lora" in want:
                done("cpu_lora", bench_cpu_lora(trainer, gen, sync, demo, group, step, demo_rounds))
            if gen is not None and "check" in want:
                done("check", bench_check(trainer, gen, sync, demo[0], demo_rounds))
            if "vllm_vs_hf" in want:
                done("vllm_vs_hf", bench_vllm_vs_hf(trainer, gen, sync, demo, group, step, demo_rounds))
            if "hf_merge" in want:
                done("hf_merge", bench_hf_merge(trainer, demo, group, step, demo_rounds))
            if "hf_decode" in want:
                fake_step(trainer)  # an adapter that is not zero, as in a run
                lt_count, lt_group, lt_tokens = LONG_TAIL
                done("hf_decode", {
                    "demo": bench_hf_decode(trainer, demo, group, step, demo_rounds),
                    "long_tail": bench_hf_decode(trainer, demo_prompts(tok, lt_count), lt_group,
                                                 replace(step, max_tokens=lt_tokens), demo_rounds)})
        finally:
            if own and gen is not None:  # closed before their folder goes
                sync.close()
                gen.close()
    return result


if __name__ == "__main__":  # the vLLM engine core is spawned
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--demo-rounds", type=int, default=4)
    ap.add_argument("--no-servers", action="store_true")
    ap.add_argument("--only", default=None, help=f"comma-separated comparisons (default all: {','.join(COMPARISONS)})")
    a = ap.parse_args()
    only = a.only and a.only.split(",")
    if unknown_comparisons(only):
        ap.error(f"--only: {unknown_comparisons(only)}")
    print(json.dumps(bench_generation(a.out, a.num_prompts, a.n, a.max_tokens, a.rounds, a.demo_rounds,
                                      servers=not a.no_servers, only=only), indent=2))

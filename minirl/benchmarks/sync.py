"""`minirl bench sync --out DIR`: adapter sync latency per transport and rank, and generation speed with syncs.

Latency is "trainer hands over → engine serves the new weights": `push()` returns once the worker has installed
the adapter and new requests use it. In-memory transports run in-place (policy `inflight`: the weights go into
the served adapter's slot); `files` is save to tmpfs + vLLM's LoRA load under a new id. The engine runs in its
default dtype (bfloat16 on CPU), so the in-memory transports ship bfloat16 bytes.
Writes DIR/sync.json: {"results": [{"transport", "rank", "p50_ms", "p95_ms", "bytes"}, ...],
"gen_tok_s_no_sync", "gen_tok_s_sync_every_step", ...}.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
import types
from pathlib import Path

RANKS = (8, 16, 64)
COMPARED = ("files", "ipc", "collective")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def fake_trainer(base, rank: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from minirl.adapter import make_contiguous
    pm = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                         task_type="CAUSAL_LM")).eval()
    make_contiguous(pm)  # as the Trainer builds it
    t = types.SimpleNamespace(model=pm, version=0)

    def bump():
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        t.version += 1

    def save_adapter(path):
        pm.save_pretrained(path)
        return path
    t.bump, t.save_adapter = bump, save_adapter
    return t


def throughput(gen, rounds: list, push=None) -> tuple[float, int]:
    """(Generated tokens/s, tokens) over `rounds` (one round = one step's rollouts: a list of prompts). With `push`, an
    adapter sync is issued at the start of every round, concurrently with that round's generation (as the async
    pipeline does). Seeded and restarted per call, so that calls with the same rounds sample the same tokens when
    the weights are the same: a difference is then the cost of the syncs alone."""
    from minirl.types import SamplingParams
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=0)
    gen.restart_seeds()
    t0, toks = time.perf_counter(), 0
    for prompts in rounds:
        th = threading.Thread(target=push) if push else None
        fut = gen.submit(prompts, 2, params)
        if th:
            th.start()
        groups = fut.result()
        if th:
            th.join()
        toks += sum(len(c.token_ids) for g in groups for c in g.completions)
    return toks / (time.perf_counter() - t0), toks


def story_rounds(tok, rounds: int, per_round: int = 8) -> list:
    """`rounds` lists of `per_round` chat prompts ("Write a story about the number i."): long, seeded generations
    for measuring generation speed."""
    from minirl.types import Prompt

    def chat(i):
        ids = tok.apply_chat_template([{"role": "user", "content": f"Write a story about the number {i}."}],
                                      add_generation_prompt=True, tokenize=True)
        return Prompt(i, tuple(ids if isinstance(ids, list) else ids["input_ids"]), "")
    return [[chat(i) for i in range(per_round * r, per_round * (r + 1))] for r in range(rounds)]


def split_cores() -> tuple[str | None, set[int] | None]:
    """The async pipeline's CPU split for a sync benchmark: the engine worker on the first core, the trainer (this
    thread) on the others. (None, None) with fewer than 2 usable cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return None, None
    return str(cores[0]), set(cores[1:])


def pin_trainer(cores: set[int] | None) -> None:
    """Bind this (trainer) thread and torch's threads to `cores` (None: leave as is); call after the engine has
    started (an engine started later would inherit it: `unpin` first)."""
    if cores:
        import torch
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


def bench_sync(out_dir: str, n: int = 15, ranks=RANKS, transports=COMPARED, rounds: int = 2, pairs: int = 5) -> dict:
    """Latency of `n` pushes per transport and rank; then, at rank 16, `pairs` pairs of generation blocks (`rounds`
    rounds each) without and with an in-place ipc push per round. The slowdown is the median over pairs of
    1 - synced/plain (each pair back to back, so the machine's drift cancels)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from minirl.generators.vllm import VLLMGenerator
    from minirl.models import resolve_model
    from minirl.sync.files import FileSync
    from minirl.sync.tensor import TensorSync
    from minirl.sync.wire import engine_kwargs

    path = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    results, detail, no_sync, with_sync, slowdown = [], {}, float("nan"), float("nan"), float("nan")
    gen_cores, train_cores = split_cores()
    all_cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    for rank in ranks:
        # one engine per rank, sized to the adapter as a run sizes it (max_lora_rank = the LoRA rank)
        os.sched_setaffinity(0, all_cores)  # the engine processes must not inherit the trainer's pinning
        gen = VLLMGenerator(path, max_lora_rank=rank, max_model_len=512, kv_cache_gb=1, cpu_cores=gen_cores,
                            engine_kwargs={**engine_kwargs(), "enable_prefix_caching": False})
        pin_trainer(train_cores)
        try:
            base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            tr = fake_trainer(base, rank)
            for transport in transports:
                sync = FileSync() if transport == "files" else TensorSync(transport, inflight=True, timeout_s=60)
                ms, nbytes = [], 0
                try:
                    for i in range(n + 2):
                        tr.bump()
                        st = sync.push(tr, gen)
                        if i >= 2:  # the first pushes open the channel / register the adapter
                            ms.append(st.ms)
                            nbytes = st.bytes
                finally:
                    sync.close()
                results.append({"transport": transport, "rank": rank, "p50_ms": round(statistics.median(ms), 2),
                                "p95_ms": round(_pct(ms, 0.95), 2), "bytes": nbytes})
                print(json.dumps(results[-1]), flush=True)
            if rank == 16:  # generation speed: never syncing vs one in-place ipc sync per step
                # the same weights pushed every round (the engine's work per sync does not depend on the values),
                # so that both kinds of blocks generate the same tokens; no prefix caching (the engine is started
                # without it) so that neither reuses the other's KV blocks
                rounds_ = story_rounds(tok, rounds)
                sync = TensorSync("ipc", inflight=True, timeout_s=60)
                tr.bump()
                sync.push(tr, gen)
                push_ms = []

                def push():
                    push_ms.append(sync.push(tr, gen).ms)
                throughput(gen, rounds_[:1])  # warm-up
                # interleaved (no sync, sync, no sync, ...) so that the machine's drift hits both alike
                plain, synced, toks = [], [], set()
                for _ in range(pairs):
                    for out, fn in ((plain, None), (synced, push)):
                        rate, n_tok = throughput(gen, rounds_, fn)
                        out.append(rate)
                        toks.add(n_tok)
                no_sync, with_sync = statistics.median(plain), statistics.median(synced)
                slowdown = statistics.median(1 - b / a for a, b in zip(plain, synced))
                sync.close()
                detail = {"gen_push_p50_ms_under_load": round(statistics.median(push_ms), 2),
                          "gen_tokens_per_block": sorted(toks),
                          "gen_tok_s_blocks": {"no_sync": [round(x, 1) for x in plain],
                                               "sync_every_step": [round(x, 1) for x in synced]}}
            tr.model.unload()
        finally:
            gen.close()
    os.sched_setaffinity(0, all_cores)
    torch.set_num_threads(threads)
    by = {(r["transport"], r["rank"]): r["p50_ms"] for r in results}
    out = {"results": results, "gen_tok_s_no_sync": round(no_sync, 1), "gen_tok_s_sync_every_step": round(with_sync, 1),
           "gen_slowdown_frac": round(slowdown, 4),
           "speedup_vs_files_rank16": {t: round(by[("files", 16)] / by[(t, 16)], 1)
                                       for t in transports if t != "files" and ("files", 16) in by},
           "engine_dtype": "bfloat16 (vLLM CPU default)", "max_lora_rank": "= rank (one engine per rank)",
           "cores": {"engine": gen_cores, "trainer": sorted(train_cores or [])}, "mode": "in-memory: in-place (inflight); files: new id",
           "cpu_count": os.cpu_count(), **detail}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "sync.json").write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    import sys
    print(json.dumps(bench_sync(sys.argv[1] if len(sys.argv) > 1 else "runs/bench"), indent=2))

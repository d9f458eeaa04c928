"""Does an adapter push per round slow vLLM generation, and which part? Rank-16 in-place ipc, engine on core 0,
trainer on core 1, the blocks of `minirl bench sync` (the same seeded prompts, so the same tokens), interleaved:
no push / a real push / a no-op `collective_rpc` / re-serving the same LoRA id under a new request name.
Also the idle round trip of a no-op RPC.

    python scripts/sync_gen_slowdown.py [--reps 2]
"""
import argparse
import json
import os
import statistics
import time

if __name__ == "__main__":  # the vLLM engine core is spawned
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minirl.benchmarks.sync import fake_trainer, pin_trainer, split_cores, story_rounds, throughput
    from minirl.generation.vllm import VLLMGenerator
    from minirl.sync.senders import call_on_loop, rpc
    from minirl.sync.tensor import TensorSync
    from minirl.sync.wire import engine_kwargs
    from minirl.training.models import resolve_model
    from minirl.types import AdapterUpdate

    path = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    gen_cores, train_cores = split_cores()
    gen = VLLMGenerator(path, max_lora_rank=16, max_model_len=512, kv_cache_gb=1, cpu_cores=gen_cores,
                        engine_kwargs={**engine_kwargs(), "enable_prefix_caching": False})
    pin_trainer(train_cores)
    tr = fake_trainer(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), 16)
    rounds = story_rounds(tok, 2)
    sync = TensorSync("ipc", inflight=True, timeout_s=60)
    tr.bump()
    sync.push(tr, gen)
    served = [0]

    def push():
        sync.push(tr, gen)

    def noop():
        call_on_loop(gen, rpc(gen, "minirl_versions"), 30)

    def reserve():
        served[0] += 1
        v, lid = 10_000 + served[0], sync.lora_id
        gen.update_adapter(lambda: AdapterUpdate(v, slot=lid))  # a new name and path, as a push makes
    try:
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            noop()
            ts.append((time.perf_counter() - t) * 1e3)
        out = {"idle_noop_rpc_ms": round(statistics.median(ts), 2)}
        variants = {"no_push": None, "push": push, "noop_rpc": noop, "reserve": reserve}
        throughput(gen, rounds[:1])  # warm-up
        blocks = {k: [] for k in variants}
        for _ in range(args.reps):
            for k, fn in variants.items():
                rate, seqs = throughput(gen, rounds, fn)
                blocks[k].append({"tok_s": round(rate, 1), "tokens": sum(map(len, seqs))})
                print(k, blocks[k][-1], flush=True)
        out.update({k: {"median_tok_s": statistics.median(b["tok_s"] for b in v), "blocks": v}
                    for k, v in blocks.items()})
    finally:
        sync.close()
        gen.close()
    print(json.dumps(out, indent=1))

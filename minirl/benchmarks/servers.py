"""`minirl bench generation`'s server rows: the same work through vLLM servers (backend 'vllm-server', minirl's
`ServerGenerator` over HTTP) and through the in-process engine (`VLLMGenerator`), alternating rounds, and the
adapter push to the servers.

The servers get the in-process engine's model, dtype, context length, KV cache and cores (the cores split
between them when there are several); the in-process engine stays up, idle while the servers run and the other
way round. Both start every round from the same per-request seeds, so with one server they sample the same
tokens (`identical_fraction`, token by token): the comparison is of the same work, and the HTTP path changes
nothing. Rounds interleaved, the side going first alternating (`compare.interleaved`).

The push (`server_sync_*`): a rank-16 all-linear LoRA saved to tmpfs and loaded on every server through
`/v1/load_lora_adapter` (`ServerSync`, what a run does), from the start of the save until every server serves it.
The in-memory transports (`ipc`, `collective`) are not offered for servers: they need a call into the engine's
worker, which vLLM's server only exposes as the development-mode `/collective_rpc` endpoint, outside its API key
check (any local user could call it); the `files` rows of `minirl bench sync` (the in-process engine's file push) are the same
file path without HTTP.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

from minirl.benchmarks.compare import interleaved, sequences
from minirl.benchmarks.sync import fake_trainer
from minirl.generation.factory import split_devices
from minirl.generation.server_proc import ServerOptions
from minirl.generation.vllm_server import ServerGenerator
from minirl.sync.servers import ServerSync


def bench_server(inproc, model_path: str, prompts, n: int, params, rounds: int = 4, sync_reps: int = 10,
                 num_servers: int = 1, log_dir: str | None = None, seeds=(0, 0)) -> dict:
    """Server vs in-process tokens/s on `prompts` (n samples each, `params`; `seeds` = (in-process's, the
    server's)), and the server push latency."""
    args = inproc.engine_args
    cores = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")  # what the in-process engine was bound to (None: unbound)
    places = split_devices(cores, num_servers, not inproc.on_cpu) if cores or not inproc.on_cpu else [None] * num_servers
    opts = [ServerOptions(model_path, dtype=inproc.dtype, max_model_len=args.max_model_len, max_lora_rank=16,
                          on_cpu=inproc.on_cpu, cores=p if inproc.on_cpu else None,
                          gpus=None if inproc.on_cpu else p,
                          kv_cache_gb=(args.kv_cache_memory_bytes or 1 << 30) / (1 << 30),
                          gpu_memory_utilization=args.gpu_memory_utilization) for p in places]
    t0 = time.perf_counter()
    srv = ServerGenerator(launch=opts, log_dir=log_dir or tempfile.mkdtemp(prefix="minirl-bench-servers-"))
    startup_s = time.perf_counter() - t0
    try:
        seed = dict(zip(("inproc", "server"), seeds))

        def side(g, name):
            def go():
                g.restart_seeds()  # every round from the same per-request seeds
                return sequences(g.generate(prompts, n, replace(params, seed=seed[name])))
            return go
        for name, g in (("inproc", inproc), ("server", srv)):  # the server's prefix cache cannot be emptied (its
            side(g, name)()  # endpoint is development-mode only): both sides' caches warmed by the same work instead
        result = interleaved({"inproc": side(inproc, "inproc"), "server": side(srv, "server")}, rounds)
        result.update(seeds=seed, servers=num_servers, server_cores=places if inproc.on_cpu else None,
                      server_startup_s=round(startup_s, 1), settings={
                          "prompts": len(prompts), "n": n, "max_tokens": params.max_tokens,
                          "temperature": params.temperature, "dtype": inproc.dtype,
                          "prefix_cache": "on, warmed on both sides by one untimed pass of the same work"})
        result.update(bench_server_sync(srv, model_path, sync_reps))
    finally:
        srv.close()
    return result


def bench_server_sync(srv, model_path: str, reps: int = 10, rank: int = 16) -> dict:
    """`ServerSync.push` of a rank-`rank` adapter `reps` times (a new version each time): total, save, load."""
    trainer = fake_trainer(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), rank)
    sync = ServerSync()
    total, save, load, nbytes = [], [], [], 0
    try:
        for _ in range(reps):
            trainer.bump()
            st = sync.push(trainer, srv)
            total.append(st.ms)
            save.append(sync.last["save_ms"])
            load.append(sync.last["load_ms"])
            nbytes = st.bytes
        srv.load_adapter(None, 0)
    finally:
        sync.close()
    p50 = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
    return {"server_sync_p50_ms": p50(total), "server_sync_save_p50_ms": p50(save),
            "server_sync_load_p50_ms": p50(load), "server_sync_ms": [round(x, 1) for x in total],
            "server_sync_bytes": nbytes, "server_sync_rank": rank}

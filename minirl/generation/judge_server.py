"""The vLLM server behind `judge(serve=model)` (minirl.rewards.llm_judge): one per model and process, started on
first need (before the reward workers: they inherit its URL and key through the environment) and stopped at exit.

It is a server as `server_proc` starts them for generation, waited for as `server_fleet` waits: on 127.0.0.1, a
random API key (in the environment, never on the command line or in a log), its key sent only once the server
itself holds the port, its log in a temporary folder: named in any error and kept when the server fails to start
or dies before the end of the run, removed when it is stopped at exit. On CPU in float32 (as minirl's CPU
servers), 1 GiB of KV cache; on a GPU it takes `GPU_SHARE` of the first visible one, beside the trainer: give the
trainer room, or serve the judge yourself and pass `url=`. The thread that starts it stays alive until exit, as
the server dies when that thread ends (PR_SET_PDEATHSIG); the lifecycle watchdog ends it if the trainer is
killed."""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures as cf
import secrets
import shutil
import sys
import tempfile
import threading

import torch

from minirl.generation.server_fleet import Fleet
from minirl.generation.server_proc import ServerOptions
from minirl.rewards.llm_judge import set_server_starter
from minirl.training.models import resolve_model

MAX_MODEL_LEN = 2048     # the judge's question and reply, in tokens
START_TIMEOUT_S = 900.0  # importing vLLM and loading the model: ~2 min on a busy 2-core CPU here
GPU_SHARE = 0.2


def start_judge_server(model: str) -> tuple[str, str]:
    """Start a vLLM server for `model` and wait until its engine answers: (base URL, API key). Raises the
    server's error (with its log's end) if it cannot start."""
    on_gpu = torch.cuda.is_available()
    opts = ServerOptions(model, dtype="auto" if on_gpu else "float32", max_model_len=MAX_MODEL_LEN, max_lora_rank=8,
                         max_loras=1, on_cpu=not on_gpu, gpus="0" if on_gpu else None, kv_cache_gb=1.0,
                         gpu_memory_utilization=GPU_SHARE)
    key, up, held = secrets.token_urlsafe(24), cf.Future(), threading.Event()
    log_dir = tempfile.mkdtemp(prefix="minirl-judge-")
    fleet = Fleet([], [opts], key, log_dir, restart=False, timeout_s=120.0, health_every_s=60.0,
                  start_timeout_s=START_TIMEOUT_S, needs=dict, name=str)
    threading.Thread(target=_hold, args=(fleet, up, held), name="minirl-judge-server", daemon=True).start()
    try:
        up.result()
    except BaseException as e:  # the folder stays, for its log
        if log_dir not in str(e):
            e.add_note(f"the judge server's log folder: {log_dir}")
        raise
    atexit.register(stop_judge_server, fleet, log_dir, held)
    return fleet.servers[0].url, key


def stop_judge_server(fleet: Fleet, log_dir: str, held: threading.Event) -> bool:
    """At exit: stop the server and let its thread end. Its log folder is removed, unless the server had died
    before (then it stays, named on stderr). Returns whether it was removed."""
    s = fleet.servers[0]
    code = s.proc.exit_code() if s.proc is not None else None
    fleet.shutdown()
    held.set()
    if code is None:
        shutil.rmtree(log_dir, ignore_errors=True)
        return True
    print(f"minirl: the judge's vLLM server ({s.opts.model}) exited with code {code} during "
          f"the run; its log: {log_dir}", file=sys.stderr)
    return False


def _hold(fleet: Fleet, up: cf.Future, held: threading.Event) -> None:
    """Bring the server up from this thread, then keep the thread (and so the server) alive until `held` is set
    (at exit, once the server is stopped)."""
    async def bring_up() -> None:
        s = fleet.servers[0]
        try:
            await fleet.bring_up(s)
        finally:
            if s.api is not None:
                await s.api.aclose()
    try:
        asyncio.run(bring_up())
    except BaseException as e:  # noqa: BLE001 - the caller raises it
        fleet.shutdown()
        up.set_exception(e)
        return
    up.set_result(None)
    held.wait()


set_server_starter(start_judge_server, resolve_model)

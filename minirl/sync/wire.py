"""What the sync senders and the vLLM worker's receiver agree on (no vLLM imports): the install request, the
in-memory adapter's LoRARequest name and path, the ipc progress word, and the two-rank torch.distributed group of
`collective`."""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from minirl.core import lifecycle
from minirl.core.environ import environ
from minirl.sync import vllm_compat as compat
from minirl.sync.base import CollectiveError

WORKER_EXTENSION = "minirl.sync.receiver.AdapterReceiver"
MEM_SCHEME = "minirl-mem://"
PROGRESS_BITS = 40  # the ipc progress word: push number << 40 | elements packed (all ones: the push was abandoned)
PROGRESS_MASK = (1 << PROGRESS_BITS) - 1


class EngineHost(Protocol):
    """What the in-memory transports need of a generator: its vLLM engine (`AsyncLLM`, None once closed; they
    call `collective_rpc` on it), the loop that engine runs on, where it runs, and how it was started."""
    loop: asyncio.AbstractEventLoop
    engine: Any
    closed: bool
    on_cpu: bool
    worker_extension: str | None  # the engine's `worker_extension_cls` (None: none)


@dataclass(frozen=True)
class InstallRequest:
    """What the worker's install of an adapter needs (`AdapterReceiver.minirl_install`'s arguments; the doorbell
    carries it as it is). `seq`: the sender's push number on a channel with a progress header (the worker copies
    each tensor as soon as it is packed); `chunk`: a broadcast sent in chunks of that many elements (copied as
    each chunk arrives); `fast=False` always takes vLLM's reload path."""
    channel: str
    lora_id: int
    version: int
    name: str
    timeout_s: float = 30.0
    fast: bool = True
    seq: int | None = None
    chunk: int | None = None


def engine_kwargs() -> dict:
    """Engine args that install the receiver: pass as `VLLMGenerator(..., engine_kwargs=engine_kwargs())`."""
    return {"worker_extension_cls": WORKER_EXTENSION}


def lora_path_for(lora_id: int, version: int) -> str:
    """The LoRARequest path of an in-memory adapter. The version is part of the path because vLLM keys its prefix
    cache on (lora_name, lora_path): a new version must never reuse KV blocks computed with older weights."""
    return f"{MEM_SCHEME}{lora_id}/v{version}"


def adapter_name(key: int | str, version: int) -> str:
    """The one name an adapter version is served under: `key` is its vLLM LoRA id (in-process engine, files or
    memory; a LoRARequest's path is then `lora_path_for`) or the generator's tag (vLLM servers: runs sharing
    servers never collide). Never parsed back: whoever names an adapter keeps what it named."""
    return f"minirl-{key}-v{version}"


def rendezvous_dir() -> str:
    """A private folder (0700, /dev/shm when writable) for one collective group's file store: the group's peers
    meet through a file only this user can open, so no TCP store listens on any port (torch's TCPStore binds
    every interface) and there is no free-port race. Its path is handed to the worker over the engine's RPC."""
    return lifecycle.private_dir("rdv")


# What an NCCL group of minirl's is built with (a value the user set is left as it is): its bootstrap on the loopback
# interface, and blocking waits, so that a send to a dead or stuck peer raises in `finish` within its timeout (then
# `SyncTimeout`) instead of torch's NCCL watchdog tearing the whole process down (its default error handling). Set
# only while the communicator is built (NCCL and ProcessGroupNCCL read them then), not for the process's life.
NCCL_BUILD_ENV = {"NCCL_SOCKET_IFNAME": "lo", "TORCH_NCCL_BLOCKING_WAIT": "1"}


def open_group(rdv_dir: str, rank: int, backend: str, timeout_s: float, tag: str = "minirl"):
    """A two-process torch.distributed group (rank 0 = trainer, rank 1 = engine worker) that does not touch the
    default group (vLLM has its own). The peers meet through a file store in `rdv_dir` (`rendezvous_dir`); gloo's
    connections are bound to 127.0.0.1 (NCCL's bootstrap to the loopback interface unless NCCL_SOCKET_IFNAME is
    set; `NCCL_BUILD_ENV`). Raises `TimeoutError` when the peer does not join within `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.FileStore(os.path.join(rdv_dir, "store"), 2)
    store.set_timeout(timeout)
    store = dist.PrefixStore(tag, store)
    try:
        if backend == "gloo":
            pg = compat.gloo_group(store, rank, 2, timeout)
        elif backend == "nccl":
            with environ(NCCL_BUILD_ENV, keep_set=True):  # read only while a communicator is built
                pg = compat.nccl_group(store, rank, 2, timeout)
                store.set("joined", "1") if rank == 0 else store.get("joined")  # meet here, then connect
                pg.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        else:
            raise ValueError(f"unknown collective backend {backend!r}")
    except ValueError:
        raise
    except Exception as e:  # DistStoreError / RuntimeError when the peer does not come
        raise TimeoutError(f"minirl collective sync: rank {rank} could not meet its peer within {timeout_s:.0f} s "
                           f"({type(e).__name__}: {e})") from e
    return store, pg


def broadcast(pg, buf, timeout_s: float, what: str, wait: bool = True):
    """Broadcast `buf` from rank 0; a peer that is gone or late raises within `timeout_s`. `wait=False`: returns
    the started work, for `finish`."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timedelta(seconds=timeout_s)
    try:
        work = pg.broadcast([buf], opts)
    except Exception as e:
        raise _broadcast_error(e, timeout_s, what) from e
    return finish(work, timeout_s, what) if wait else work


def finish(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except Exception as e:
        raise _broadcast_error(e, timeout_s, what) from e


def _broadcast_error(e: Exception, timeout_s: float, what: str) -> CollectiveError:
    return CollectiveError(f"minirl collective sync failed during {what} (peer gone or no answer within "
                           f"{timeout_s:.0f} s): {type(e).__name__}: {e}")

"""`make_sync`: the transport a vLLM generator gets for a config value, and why."""
from __future__ import annotations

from typing import TYPE_CHECKING

from minirl.sync import vllm_compat
from minirl.sync.base import WeightSync
from minirl.sync.files import FileSync
from minirl.sync.tensor import TensorSync, pick_transport

if TYPE_CHECKING:
    from minirl.sync.tensor import InMemoryTarget


def make_sync(transport: str, generator: "InMemoryTarget", trainer_device: str = "cpu", inflight: bool = False,
              timeout_s: float = 30.0) -> tuple[WeightSync, str]:
    """The `WeightSync` for a vLLM generator and a config value, and why: 'files' → FileSync; 'ipc' /
    'collective' → TensorSync; 'auto' → in-memory when the engine has the receiver, else files."""
    if transport == "files":
        return FileSync(), "sync_transport='files'"
    if not vllm_compat.vllm_hooks():  # warned once: another vLLM release than the hooks were checked against
        return FileSync(), (f"vLLM {vllm_compat.vllm_version()} is not a release minirl's in-memory sync was checked "
                            f"against ({', '.join(vllm_compat.VLLM_CHECKED)}): files")
    if transport == "auto":
        name, why = pick_transport(generator, trainer_device)
        if name == "files":
            return FileSync(), why
        return TensorSync(name, inflight=inflight, timeout_s=timeout_s), why
    return TensorSync(transport, inflight=inflight, timeout_s=timeout_s), f"sync_transport={transport!r}"

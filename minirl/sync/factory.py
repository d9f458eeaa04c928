"""`make_sync`: the transport a vLLM generator gets for a config value, and why, from the hooks its engine offers."""
from __future__ import annotations

from typing import TYPE_CHECKING

from minirl.config import ConfigError
from minirl.sync import vllm_compat
from minirl.sync.base import WeightSync
from minirl.sync.files import FileSync
from minirl.sync.hook_report import HookReport
from minirl.sync.senders import call_on_loop, rpc
from minirl.sync.tensor import TensorSync, has_receiver, pick_transport

if TYPE_CHECKING:
    from minirl.sync.tensor import InMemoryTarget


def engine_hooks(generator: "InMemoryTarget | None", timeout_s: float = 30.0) -> HookReport:
    """What the running engine offers minirl's hooks: `vllm_compat.check_hooks` run in its worker (on the model
    runner in use, V1 or V2), or, for an engine without minirl's receiver, a report saying so. On a release the
    hooks were not checked on, one warning (`vllm_compat.vllm_hooks`)."""
    version = vllm_compat.vllm_version()
    vllm_compat.vllm_hooks(version)
    if generator is None or not has_receiver(generator):
        return HookReport(version, "?", vllm_compat.VLLM_CHECKED, vllm_compat.checked(version, vllm_compat.VLLM_CHECKED),
                          ("worker_extension_cls (the engine was started without minirl's receiver)",))
    return HookReport.from_dict(call_on_loop(generator, rpc(generator, "minirl_hooks", timeout_s=timeout_s), timeout_s))


def refuse_unchecked_inflight(inflight: bool) -> None:
    """Before the engine starts (its model loads): `inflight` on a vLLM release the hooks were not checked on is
    refused at once, in one line (`make_sync` checks the running engine's hooks themselves)."""
    version = vllm_compat.vllm_version()
    if inflight and not vllm_compat.checked(version, vllm_compat.VLLM_CHECKED):
        raise ConfigError(HookReport(version, "not started", vllm_compat.VLLM_CHECKED, False).refusal())


def make_sync(transport: str, generator: "InMemoryTarget | None", trainer_device: str = "cpu", inflight: bool = False,
              timeout_s: float = 30.0) -> tuple[WeightSync, str]:
    """The `WeightSync` for a vLLM generator and a config value, and why: 'files' → FileSync; 'ipc' /
    'collective' → TensorSync; 'auto' → in-memory when the engine has the receiver, else files. The engine's
    hooks are checked first (`engine_hooks`): without those of the in-memory sync it gets files (the reason says
    which are missing); `inflight` (exact per-token versions across in-place swaps) without its own is refused
    with one line (ConfigError)."""
    if transport == "files" and not inflight:
        return FileSync(), "sync_transport='files'"
    hooks = engine_hooks(generator, timeout_s)
    if inflight and not hooks.inflight:
        raise ConfigError(hooks.refusal())
    if transport == "files":
        return FileSync(), "sync_transport='files'"
    if not hooks.sync:
        return FileSync(), f"no in-memory sync on this engine ({hooks.why()}): files"
    if transport == "auto":
        name, why = pick_transport(generator, trainer_device)
        if name == "files":
            return FileSync(), why
        return TensorSync(name, inflight=inflight, timeout_s=timeout_s), f"{why} ({hooks.why()})"
    return TensorSync(transport, inflight=inflight, timeout_s=timeout_s), f"sync_transport={transport!r} ({hooks.why()})"

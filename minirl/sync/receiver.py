"""Engine-side receiver of in-memory adapter syncs: a vLLM worker extension.

Passed to vLLM as `worker_extension_cls="minirl.sync.receiver.AdapterReceiver"`; vLLM mixes it into its worker
class, and the trainer side (`minirl.sync.senders`) reaches its methods with `AsyncLLM.collective_rpc(name, args=...)`.
Utility calls run in the engine core between two engine steps, so an adapter swap never lands inside a forward.

How an adapter gets in, without files:
- A *channel* is opened once per sender: the flat buffer layout (tensor names, shapes, offsets, dtype, the peft
  config) plus where the bytes come from: a shared-memory file (`shm`, CPU), a CUDA IPC handle (`cuda_ipc`, GPU)
  or a broadcast in a dedicated torch.distributed group between trainer (rank 0) and this worker (rank 1)
  (`collective`: gloo on CPU, NCCL on GPU). The buffer is mapped (or allocated) once.
- `minirl_install(channel, lora_id, ...)` serves the channel's current tensors as LoRA `lora_id`. The first time
  (or after a change of layout / slot), it copies them into an in-memory store and asks vLLM's own LoRA manager to
  (re)load that id with `load_inplace=True`: vLLM builds the `LoRAModel` (packing q/k/v and gate/up itself),
  registers it and activates it into a slot of the stacked LoRA tensors. After that, an install for the active
  id is the fast in-place swap: the tensors are copied straight into that slot (dtype converted, lora_B scaled as
  vLLM would fold it, unless it arrived pre-scaled), and sequences in flight on that id continue on the new weights
  from the next engine step. The `LoRAModel`'s own tensors are then older than the slot; they are refreshed from
  the slot (`_minirl_flush`) before anything that could read them or reuse the slot (loading, activating or
  evicting an adapter).
- The manager's `_load_adapter` is wrapped once so that LoRA paths starting with `minirl-mem://` are built from
  the store instead of files; so a LoRARequest with such a path can be served, evicted and reloaded like a file
  adapter. `remove_adapter` (vLLM's `remove_lora`) also drops the store entry.

The doorbell (CPU and GPU alike): vLLM's utility call reaches the worker through the engine core (client loop →
ZMQ → engine core → the executor's shared-memory queue → worker, and back): ~5-7 ms on this 2-core machine, more
than the copy it carries. So a channel also opens a doorbell: a local socket (`multiprocessing.connection`, with an
authkey) served by a thread in the worker process. The sender rings it for in-place pushes to an installed id;
the thread runs the same install. A gate makes it exclusive with engine steps (a step is `execute_model` through
`sample_tokens`) and with the worker's other LoRA calls; a waiting install gets in before the next step.

Everything a call needs travels as plain msgpack-able values (ints, strings, bytes, lists, dicts).
"""
from __future__ import annotations

import time
from typing import Any

from ..adapter import unpack
from .channel import Channel, Gate, Doorbell
from .wire import MEM_SCHEME, lora_path_for


def _same_layout(a: dict, b: dict) -> bool:
    """Same tensors at the same offsets under the same LoRA config (the dtype may differ)."""
    return all(a[k] == b[k] for k in ("names", "shapes", "offsets", "peft_config"))


def _device_uuid(device) -> str | None:
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


class _State:
    def __init__(self):
        self.channels: dict[str, Channel] = {}
        self.store: dict[int, tuple[Any, dict, dict]] = {}   # lora id -> (flat CPU copy, layout, peft config)
        self.versions: dict[int, int] = {}
        self.built: dict[int, tuple] = {}  # lora id -> (LoRAModel, its flat, [(lora_b, scaling)], layout it came in)
        self.plans: dict[int, tuple] = {}                    # lora id -> fast in-place copy plan
        self.started: dict[int, list] = {}   # lora id -> [(worker request id, version it started on)] since last install
        self.stale: dict[int, tuple] = {}    # lora id -> (its LoRAModel tensors, its slot views): slots are newer
        self.gate = Gate()                  # steps vs installs from the doorbell thread
        self.mid_step = False                # execute_model returned; the step ends with sample_tokens
        self.stream = None                   # CUDA: the stream the worker's calls run on
        self.wrapped = False


class AdapterReceiver:
    """Mixed into vLLM's worker class (`worker_extension_cls`). Method names are prefixed `minirl_` so they never
    clash with the worker's own attributes (vLLM asserts there is no clash)."""

    # ---- internals -------------------------------------------------------------------------------------------

    def _minirl(self) -> _State:
        st = getattr(self, "_minirl_state_obj", None)
        if st is None:
            st = self._minirl_state_obj = _State()
        if not st.wrapped:
            self._minirl_wrap_manager(st)
        return st

    def _minirl_manager(self):
        wm = getattr(self.model_runner, "lora_manager", None)
        if wm is None:
            raise RuntimeError("minirl adapter receiver: the engine has no LoRA manager (start it with "
                               "enable_lora=True)")
        return wm

    def _minirl_wrap_manager(self, st: _State) -> None:
        """Wrap the worker LoRA manager once: `minirl-mem://` adapters load from the store; removal frees it."""
        wm = self._minirl_manager()
        orig_load, orig_remove = wm._load_adapter, wm.remove_adapter
        receiver = self

        def _load_adapter(lora_request):
            if str(lora_request.lora_path).startswith(MEM_SCHEME):
                return receiver._minirl_build(lora_request.lora_int_id)
            return orig_load(lora_request)

        orig_add = wm.add_adapter
        mgr = wm._adapter_manager

        def add_adapter(lora_request) -> bool:
            # The fast in-place path writes only the slots; the LoRAModel's own tensors catch up here, before
            # anything can activate, evict or reload an adapter (which would read them or reuse the slot).
            lid = lora_request.lora_int_id
            if st.stale and (lid not in wm.list_adapters() or getattr(lora_request, "load_inplace", False)
                             or lid not in mgr.lora_index_to_id):
                receiver._minirl_flush()
            return orig_add(lora_request)

        def remove_adapter(adapter_id: int) -> bool:
            st.stale.pop(adapter_id, None)
            st.store.pop(adapter_id, None)
            st.built.pop(adapter_id, None)
            st.plans.pop(adapter_id, None)
            st.started.pop(adapter_id, None)
            st.versions.pop(adapter_id, None)
            return orig_remove(adapter_id)

        wm._load_adapter = _load_adapter
        wm.add_adapter = add_adapter
        wm.remove_adapter = remove_adapter
        self._minirl_gate_calls(st)
        # Record the adapter version each request starts on (first time the worker is given the request), so that
        # per-token versions stay exact across in-place swaps.
        runner = self.model_runner
        orig_update = getattr(runner, "_update_states", None)
        if orig_update is not None:
            def _update_states(scheduler_output, *a, **kw):
                for nr in getattr(scheduler_output, "scheduled_new_reqs", ()):
                    lr = getattr(nr, "lora_request", None)
                    if lr is not None and lr.lora_int_id in st.versions:
                        st.started.setdefault(lr.lora_int_id, []).append((nr.req_id, st.versions[lr.lora_int_id]))
                return orig_update(scheduler_output, *a, **kw)
            runner._update_states = _update_states
        st.wrapped = True

    def _minirl_gate_calls(self, st: _State) -> None:
        """Engine steps and the worker's LoRA calls pass the gate, so that a doorbell install never lands inside
        one. A step is `execute_model` through `sample_tokens` (when execute_model defers the sampling, it
        returns None): the tokens it samples come from the weights of its forward pass."""
        gate = st.gate
        execute, sample = self.execute_model, getattr(self, "sample_tokens", None)

        def execute_model(*a, **kw):
            gate.enter()
            try:
                out = execute(*a, **kw)
            except BaseException:
                gate.leave()
                raise
            if out is None and sample is not None:
                st.mid_step = True
            else:
                gate.leave()
            return out

        def sample_tokens(*a, **kw):
            try:
                return sample(*a, **kw)
            finally:
                if st.mid_step:
                    st.mid_step = False
                    gate.leave()

        def gated(fn):
            def call(*a, **kw):
                with gate:
                    return fn(*a, **kw)
            return call

        self.execute_model = execute_model
        if sample is not None:
            self.sample_tokens = sample_tokens
        for name in ("add_lora", "remove_lora", "pin_lora"):
            if hasattr(self, name):
                setattr(self, name, gated(getattr(self, name)))

    def _minirl_flush(self) -> None:
        """Copy the slots written by fast in-place installs back into their LoRAModels' tensors."""
        import torch
        st = self._minirl()
        for own_views, slot_views in st.stale.values():
            torch._foreach_copy_(own_views, slot_views)
        st.stale.clear()

    def _minirl_build(self, lora_id: int):
        """A vLLM LoRAModel for `lora_id` from the store (what `_load_adapter` does for a folder)."""
        import torch
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        st = self._minirl()
        self._minirl_flush()
        if lora_id not in st.store:
            raise RuntimeError(f"minirl adapter receiver: LoRA id {lora_id} is not in the in-memory store "
                               "(it was removed, or the engine restarted); push the adapter again")
        flat, layout, peft_config = st.store[lora_id]
        if flat is None:  # kept only as the registered model's tensors (fast in-place path): undo the scaling
            _, own, scales, _ = st.built[lora_id]
            flat = own.clone()
            for b, sc in scales:
                off = (b.data_ptr() - own.data_ptr()) // own.element_size()
                flat[off:off + b.numel()].div_(sc)
            st.store[lora_id] = (flat, layout, peft_config)
        wm = self._minirl_manager()
        helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": wm.max_position_embeddings})
        helper.validate_legal(wm.lora_config)
        model = wm._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapper = mapper.get_rename_mapper()
        # vLLM folds the scaling into lora_b in place: give it its own copy (in its LoRA dtype, so that the
        # LoRAModel's tensors are views of it), keep the store pristine
        dtype = wm.lora_config.lora_dtype if isinstance(wm.lora_config.lora_dtype, torch.dtype) else flat.dtype
        own = flat.to(dtype=dtype, copy=True)
        tensors = unpack(own, layout)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=wm.lora_config.lora_dtype, model_vocab_size=wm.vocab_size, weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        if not lora.loras:
            raise RuntimeError("minirl adapter receiver: none of the pushed tensors is a LoRA weight vLLM knows")
        # for the fast in-place path: the scaling vLLM is about to fold into each lora_b (a view of `own`)
        scales = [(lw.lora_b, float(lw.scaling)) for lw in lora.loras.values()
                  if isinstance(lw.lora_b, torch.Tensor) and isinstance(lw.scaling, (int, float))]
        st.built[lora_id] = (lora, own, scales, layout)
        st.plans.pop(lora_id, None)
        return lora

    def _minirl_plan(self, lora_id: int):
        """Destination slot views and source tensors for a fast in-place update of an active adapter, or None
        when some layer is not a plain (tp=1, one LoRA per slice) linear LoRA layer: then vLLM's own full reload
        path is used. The plan is valid while the registered LoRAModel and its slot index stay the same."""
        st = self._minirl()
        mgr = self._minirl_manager()._adapter_manager
        built = st.built.get(lora_id)
        lora = mgr.get_adapter(lora_id)
        if built is None or lora is None or built[0] is not lora or lora_id not in mgr.lora_index_to_id:
            return None
        idx = mgr.lora_index_to_id.index(lora_id)
        plan = st.plans.get(lora_id)
        if plan is not None and plan[0] is lora and plan[1] == idx:
            return plan
        _, own, scales, _ = built
        lo, hi = own.data_ptr(), own.data_ptr() + own.numel() * own.element_size()

        def aliased(t) -> bool:
            return lo <= t.data_ptr() < hi
        if not all(aliased(b) for b, _ in scales):
            return None  # vLLM copied (dtype conversion): no aliasing to exploit
        dst, src = [], []
        for name, module in mgr.modules.items():
            lw = mgr._get_lora_layer_weights(lora, name)
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
                    dst.append(stacked[idx, 0, : t.shape[0], : t.shape[1]])
                    src.append(t)
        if not src or not all(aliased(t) for t in src):
            return None
        scale_of = {id(b): sc for b, sc in scales if sc != 1.0}
        by_scale: dict[float, list] = {}  # slot views of the lora_B that vLLM scales (folds into its LoRAModel)
        for d, t in zip(dst, src):
            if id(t) in scale_of:
                by_scale.setdefault(scale_of[id(t)], []).append(d)
        es, base = own.element_size(), own.data_ptr()
        where = [(t.data_ptr() - base) // es for t in src]  # the same tensors in any flat of this layout
        plan = (lora, idx, built[3], list(by_scale.items()), dst, src, where, {})
        st.plans[lora_id] = plan
        return plan

    def _minirl_snapshot(self, lora_id: int) -> dict[str, int]:
        """Output tokens produced so far by each request the worker holds on `lora_id` (between two steps these
        were all sampled with the weights in place until now)."""
        out = {}
        for rid, rs in getattr(self.model_runner, "requests", {}).items():
            lr = getattr(rs, "lora_request", None)
            if lr is not None and lr.lora_int_id == lora_id:
                out[rid] = len(rs.output_token_ids)
        return out

    # ---- calls (collective_rpc) ------------------------------------------------------------------------------

    def minirl_info(self) -> dict:
        import os
        wm = self._minirl_manager()
        mgr = wm._adapter_manager
        st = self._minirl()
        return {"pid": os.getpid(), "device": str(self.device), "loras": sorted(wm.list_adapters()),
                "slots": list(mgr.lora_index_to_id), "stored": sorted(st.store), "channels": sorted(st.channels),
                "lora_dtype": str(wm.lora_config.lora_dtype), "max_lora_rank": wm.lora_config.max_lora_rank,
                "modules": len(mgr.modules), "device_uuid": _device_uuid(self.device)}

    def minirl_open_channel(self, channel: str, layout: dict, source: dict) -> dict:
        """Map (shm, CUDA IPC) or join (collective) the sender's buffer; idempotent per channel name. With
        `source["doorbell"]`, also opens the channel's doorbell: the answer carries its address and authkey."""
        st = self._minirl()
        with st.gate:
            old = st.channels.pop(channel, None)
            if old is not None:
                old.close()
            ch = st.channels[channel] = Channel(layout, source, self.device)
            out = {"channel": channel, "kind": source["kind"], "nbytes": int(layout["nbytes"])}
            if source.get("doorbell"):
                if ch.raw.device.type == "cuda":
                    import torch
                    st.stream = torch.cuda.current_stream(ch.raw.device)
                ch.bell = Doorbell(self, channel)
                out["doorbell"] = {"address": ch.bell.listener.address, "authkey": ch.bell.authkey}
            return out

    def minirl_close_channel(self, channel: str) -> bool:
        st = self._minirl()
        with st.gate:
            ch = st.channels.pop(channel, None)
            if ch is not None:
                ch.close()
        return ch is not None

    def minirl_install(self, channel: str, lora_id: int, version: int, name: str, timeout_s: float = 30.0,
                       fast: bool = True, seq: int | None = None) -> dict:
        """`_minirl_install` as an engine call (between two engine steps)."""
        with self._minirl().gate:
            return {**self._minirl_install(channel, lora_id, version, name, timeout_s, fast, seq), "via": "rpc"}

    def _minirl_install(self, channel: str, lora_id: int, version: int, name: str, timeout_s: float = 30.0,
                        fast: bool = True, seq: int | None = None, received: bool = False,
                        chunk: int | None = None) -> dict:
        """Take the channel's current adapter and serve it as LoRA `lora_id` (new, or replacing that id's weights
        in place, slot included). Returns timings and, for exact per-token versions across in-place swaps:
        `swap`: worker request id -> output tokens it had at the swap (all produced by `prev_version`), for the
        requests the worker holds on this id; `started`: [(worker request id, version)] of the requests that
        started on this id since its previous install (a request never listed started on the newest version).
        `seq`: the sender's push number on a channel with a progress header; the fast path copies each tensor
        as soon as it is packed, the others wait for the whole buffer. `received`: the caller already took the
        channel's transfer (the doorbell does, before the gate). `chunk`: a broadcast sent in chunks of that many
        elements (the fast path copies each tensor as soon as its chunk is in). Call it inside the gate."""
        import torch
        from vllm.lora.request import LoRARequest
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        st = self._minirl()
        ch = st.channels.get(channel)
        if ch is None:
            raise RuntimeError(f"minirl adapter receiver: no channel {channel!r} (open it first)")
        flat = ch.flat if received else ch.receive(timeout_s, chunk)
        t1 = time.perf_counter()
        wm = self._minirl_manager()
        inplace = lora_id in wm.list_adapters()
        swap = self._minirl_snapshot(lora_id) if inplace else {}
        plan = self._minirl_plan(lora_id) if inplace and fast else None
        t_plan = time.perf_counter()
        if plan is not None and _same_layout(plan[2], ch.layout) and int(ch.layout["numel"]) == flat.numel():
            # The channel's tensors go straight into the adapter's slot (converted to the slot's dtype as they
            # are copied), then lora_B is scaled there as vLLM folds it, unless it arrived pre-scaled (then vLLM's
            # scaling is 1 and there is nothing to scale). The LoRAModel's own tensors are brought up to date only
            # if something is about to read them (`_minirl_flush`).
            _, _, _, by_scale, dst, src, where, by_flat = plan
            got = by_flat.get(flat.data_ptr())
            if got is None:  # slot views and buffer views in buffer order, with where each one's bytes end
                by_flat.clear()
                order = sorted(range(len(src)), key=where.__getitem__)
                got = by_flat[flat.data_ptr()] = ([dst[i] for i in order],
                                                 [flat[where[i]:where[i] + src[i].numel()].view(src[i].shape)
                                                  for i in order],
                                                 [where[i] + src[i].numel() for i in order])
            dsts, views, ends = got
            i = 0
            while i < len(ends):  # as the sender marks them packed (all at once without a progress header)
                done, j = ch.wait(seq, ends[i], deadline), i
                while j < len(ends) and ends[j] <= done:
                    j += 1
                torch._foreach_copy_(dsts[i:j], views[i:j])
                i = j
            t_copy = time.perf_counter()
            for sc, ds in by_scale:
                torch._foreach_mul_(ds, sc)
            if flat.is_cuda:  # done reading the sender's buffer before it may be packed again
                torch.cuda.current_stream(flat.device).synchronize()
            st.stale[lora_id] = (src, dst)
            st.timings = {"plan_ms": (t_plan - t1) * 1e3, "slots_ms": (t_copy - t_plan) * 1e3,
                          "mul_ms": (time.perf_counter() - t_copy) * 1e3}
            st.store[lora_id] = (None, ch.layout, ch.layout["peft_config"])  # raw = the LoRAModel, scaling undone
            path = "fast"
        else:
            ch.wait(seq, flat.numel(), deadline)
            prev = st.store.get(lora_id)
            raw = prev[0] if prev is not None else None
            if raw is not None and raw.numel() == flat.numel() and raw.dtype == flat.dtype:
                raw.copy_(flat)
            else:
                raw = flat.to("cpu", copy=True)
            st.store[lora_id] = (raw, ch.layout, ch.layout["peft_config"])
            wm.add_adapter(LoRARequest(name, lora_id, lora_path_for(lora_id, version), load_inplace=True))
            path = "vllm"
        prev_version = st.versions.get(lora_id)
        st.versions[lora_id] = version
        started = st.started.pop(lora_id, [])
        t2 = time.perf_counter()
        return {"lora_id": lora_id, "version": version, "inplace": inplace, "prev_version": prev_version,
                "swap": swap, "started": started, "path": path,
                "recv_ms": (t1 - t0) * 1e3, "install_ms": (t2 - t1) * 1e3, **getattr(st, "timings", {})}

    def minirl_versions(self) -> dict:
        """LoRA id -> version of the weights currently installed under that id."""
        return dict(self._minirl().versions)

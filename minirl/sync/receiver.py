"""Engine-side receiver of in-memory adapter syncs: a vLLM worker extension.

Passed to vLLM as `worker_extension_cls="minirl.sync.receiver.AdapterReceiver"`; vLLM mixes it into its worker
class, and the trainer side (`minirl.sync.senders`) reaches its methods with `AsyncLLM.collective_rpc(name, args=...)`.
Utility calls run in the engine core between two engine steps, so an adapter swap never lands inside a forward.
`AdapterReceiver` is only that call surface; the state and the work are a `Receiver`, one per worker.

How an adapter gets in, without files:
- A *channel* is opened once per sender: the flat buffer layout (tensor names, shapes, offsets, dtype, the peft
  config) plus where the bytes come from: a shared-memory file (`shm`, CPU), a CUDA IPC handle (`cuda_ipc`, GPU)
  or a broadcast in a dedicated torch.distributed group between trainer (rank 0) and this worker (rank 1)
  (`collective`: gloo on CPU, NCCL on GPU). The buffer is mapped (or allocated) once (`minirl.sync.channel`).
- `minirl_install(channel, lora_id, ...)` serves the channel's current tensors as LoRA `lora_id`. The first time
  (or after a change of layout / slot), it copies them into an in-memory store and asks vLLM's own LoRA manager to
  (re)load that id with `load_inplace=True`: vLLM builds the `LoRAModel` (packing q/k/v and gate/up itself),
  registers it and activates it into a slot of the stacked LoRA tensors. After that, an install for the active
  id is the fast in-place swap (`minirl.sync.slots.SlotPlan`): the tensors are copied straight into that slot
  (dtype converted, lora_B scaled as vLLM would fold it, unless it arrived pre-scaled), and sequences in flight on
  that id continue on the new weights from the next engine step. The `LoRAModel`'s own tensors are then older than
  the slot; they are refreshed from the slot (`Receiver.flush`) before anything that could read them or reuse the
  slot (loading, activating or evicting an adapter).
- The manager's `_load_adapter` is wrapped once so that LoRA paths starting with `minirl-mem://` are built from
  the store instead of files; so a LoRARequest with such a path can be served, evicted and reloaded like a file
  adapter. `remove_adapter` (vLLM's `remove_lora`) also drops the store entry. These wraps, the gate's and every
  other touch of vLLM's private names go through `minirl.sync.vllm_compat`, whose `check_hooks` verifies them on
  this worker first (`minirl_hooks`, asked at engine start): without the sync's hooks the receiver does not start;
  without those of exact per-token versions (the model runner's request state, V1 or V2) it notes no request and
  refuses an in-place install rather than mislabel tokens.

The doorbell (CPU and GPU alike): vLLM's utility call reaches the worker through the engine core (client loop → ZMQ
→ engine core → the executor's shared-memory queue → worker, and back), which takes longer than the copy it carries
(BENCHMARKS.md, "Figures moved out of docstrings"). So a channel also opens a doorbell: a local socket
(`multiprocessing.connection`, with an authkey) served by a thread in the worker process. The sender rings it for
in-place pushes to an installed id; the thread runs the same install (`Receiver.ring`). A gate makes it exclusive
with engine steps (a step is `execute_model` through `sample_tokens`) and with the worker's other LoRA calls; a
waiting install gets in before the next step.

Everything an engine call needs travels as plain msgpack-able values (ints, strings, bytes, lists, dicts).
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from minirl.sync import cpu_lora
from minirl.sync import vllm_compat as compat
from minirl.sync.channel import Channel, Doorbell, Gate
from minirl.sync.slots import Built, SlotPlan, StoredAdapter, build_lora, plan_slot
from minirl.sync.wire import MEM_SCHEME, InstallRequest, lora_path_for

cpu_lora.install_default()  # vLLM-CPU's LoRA ops without a copy of the adapter per token, in this (the worker's) process


def _device_uuid(device) -> str | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


class Receiver:
    """The receiver's state and work in one engine worker: its channels, the adapters it serves from memory, and
    the hooks into the worker that keep installs out of engine steps and per-token versions exact."""

    def __init__(self, worker):
        self.worker = worker
        self.wm = compat.worker_lora_manager(worker)
        if self.wm is None:
            raise RuntimeError("minirl adapter receiver: the engine has no LoRA manager (start it with "
                               "enable_lora=True)")
        self.hooks = compat.check_hooks(worker)  # every hook by presence and signature on this worker's classes
        if not self.hooks.sync:
            raise RuntimeError(f"minirl adapter receiver: no in-memory sync on this engine ({self.hooks.why()})")
        self.channels: dict[str, Channel] = {}
        self.store: dict[int, StoredAdapter] = {}
        self.built: dict[int, Built] = {}        # lora id -> the LoRAModel vLLM registered (built from the store)
        self.plans: dict[int, SlotPlan] = {}     # lora id -> its fast in-place copy plan
        self.stale: dict[int, SlotPlan] = {}     # lora ids whose slot is newer than their LoRAModel's tensors
        self.versions: dict[int, int] = {}       # lora id -> version of the weights installed under it
        # lora id -> [(worker request id, version it started on)] for the requests started since its last install
        self.started: dict[int, list[tuple[str, int]]] = {}
        self.gate = Gate()                       # engine steps and LoRA calls vs installs from the doorbell thread
        self.stream = None                       # CUDA: the stream the worker's calls run on
        self._hook_manager()
        # a doorbell install never lands inside a step or a LoRA call; new requests are noted inside the gate
        compat.gate_worker_calls(worker, self.gate, self._note_start if self.hooks.inflight else None)

    # ---- hooks into the worker ------------------------------------------------------------------------------

    def _hook_manager(self) -> None:
        """Wrap the worker LoRA manager: `minirl-mem://` adapters load from the store; the slots written by fast
        installs are flushed before an adapter is loaded, activated or evicted; removal frees the id's state."""
        wm, mgr = self.wm, compat.adapter_manager(self.wm)

        def load(orig):
            def _load_adapter(lora_request):
                if str(lora_request.lora_path).startswith(MEM_SCHEME):
                    return self.build(lora_request.lora_int_id)
                return orig(lora_request)
            return _load_adapter

        def add(orig):
            def add_adapter(lora_request) -> bool:
                lid = lora_request.lora_int_id
                if self.stale and (lid not in wm.list_adapters() or getattr(lora_request, "load_inplace", False)
                                   or lid not in mgr.lora_index_to_id):
                    self.flush()
                return orig(lora_request)
            return add_adapter

        def remove(orig):
            def remove_adapter(adapter_id: int) -> bool:
                for state in (self.stale, self.store, self.built, self.plans, self.started, self.versions):
                    state.pop(adapter_id, None)
                return orig(adapter_id)
            return remove_adapter
        compat.wrap_adapter_calls(wm, load, add, remove)

    def _note_start(self, req_id: str, lora_id: int) -> None:
        """Record the adapter version a request starts on (the first time the worker is given the request), so
        that per-token versions stay exact across in-place swaps."""
        if lora_id in self.versions:
            self.started.setdefault(lora_id, []).append((req_id, self.versions[lora_id]))

    # ---- the adapters --------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Copy the slots written by fast in-place installs back into their LoRAModels' tensors."""
        for plan in self.stale.values():
            plan.flush()
        self.stale.clear()

    def build(self, lora_id: int):
        """A vLLM LoRAModel for `lora_id` from the store (what `_load_adapter` does for a folder)."""
        self.flush()
        stored = self.store.get(lora_id)
        if stored is None:
            raise RuntimeError(f"minirl adapter receiver: LoRA id {lora_id} is not in the in-memory store "
                               "(it was removed, or the engine restarted); push the adapter again")
        if stored.flat is None:  # kept only as the registered model's tensors (fast in-place path)
            stored = self.store[lora_id] = StoredAdapter(stored.layout, self.built[lora_id].unscaled())
        built = self.built[lora_id] = build_lora(self.wm, lora_id, stored.flat, stored.layout)
        self.plans.pop(lora_id, None)
        return built.lora

    def plan(self, lora_id: int) -> SlotPlan | None:
        """The fast in-place copy plan of the active adapter `lora_id`, or None (vLLM's reload path is used)."""
        mgr = compat.adapter_manager(self.wm)
        built, lora = self.built.get(lora_id), mgr.get_adapter(lora_id)
        if built is None or lora is None or built.lora is not lora or lora_id not in mgr.lora_index_to_id:
            return None
        slot = mgr.lora_index_to_id.index(lora_id)
        plan = self.plans.get(lora_id)
        if plan is None or plan.lora is not lora or plan.slot != slot:
            plan = plan_slot(mgr, built, slot)
            if plan is not None:
                self.plans[lora_id] = plan
        return plan

    def snapshot(self, lora_id: int) -> dict[str, int]:
        """Output tokens produced so far by each request the worker holds on `lora_id` (between two steps these
        were all sampled with the weights in place until now)."""
        return {rid: n for rid, (lid, n) in self.requests().items() if lid == lora_id}

    # ---- installs --------------------------------------------------------------------------------------------

    def install(self, req: InstallRequest, received: bool = False) -> dict:
        """Take the channel's current adapter and serve it as LoRA `req.lora_id` (new, or replacing that id's
        weights in place, slot included); call it inside the gate. `received`: the caller already took the
        channel's transfer (the doorbell does, before the gate).

        The report: timings and, for exact per-token versions across in-place swaps, `swap`: worker request id ->
        output tokens it had at the swap (all produced by `prev_version`), for the requests the worker holds on
        this id; `started`: [(worker request id, version)] of the requests that started on this id since its
        previous install (a request never listed started on the newest version). `path`: 'fast' (copies into the
        slot) or 'vllm' (vLLM's reload)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + req.timeout_s
        ch = self.channels.get(req.channel)
        if ch is None:
            raise RuntimeError(f"minirl adapter receiver: no channel {req.channel!r} (open it first)")
        flat = ch.flat if received else ch.receive(req.timeout_s, req.chunk)
        t1 = time.perf_counter()
        inplace = req.lora_id in self.wm.list_adapters()
        if inplace and not self.hooks.inflight:  # the sender refuses this first (`make_sync`); never mislabel tokens
            raise RuntimeError(f"minirl adapter receiver: {self.hooks.refusal()}")
        swap = self.snapshot(req.lora_id) if inplace else {}
        plan = self.plan(req.lora_id) if inplace and req.fast else None
        if plan is not None and plan.fits(ch.layout, flat):
            path, timings = "fast", self.copy_fast(plan, ch, flat, req, deadline, t1)
        else:
            path, timings = "vllm", self.reload(ch, flat, req, deadline)
        prev_version = self.versions.get(req.lora_id)
        self.versions[req.lora_id] = req.version
        started = self.started.pop(req.lora_id, [])
        return {"lora_id": req.lora_id, "version": req.version, "inplace": inplace, "prev_version": prev_version,
                "swap": swap, "started": started, "path": path,
                "recv_ms": (t1 - t0) * 1e3, "install_ms": (time.perf_counter() - t1) * 1e3, **timings}

    def copy_fast(self, plan: SlotPlan, ch: Channel, flat, req: InstallRequest, deadline: float,
                  t_recv: float) -> dict:
        """The fast path: the channel's tensors straight into the adapter's slot, each as soon as the sender has
        packed it (or its chunk arrived). Returns its timings (the plan's from `t_recv`)."""
        t_plan = time.perf_counter()
        t_copy = plan.copy_in(flat, lambda upto: ch.wait(req.seq, upto, deadline))
        self.stale[req.lora_id] = plan  # the LoRAModel's tensors catch up if something is about to read them
        self.store[req.lora_id] = StoredAdapter(ch.layout, None)
        return {"plan_ms": (t_plan - t_recv) * 1e3, "slots_ms": (t_copy - t_plan) * 1e3,
                "mul_ms": (time.perf_counter() - t_copy) * 1e3}

    def reload(self, ch: Channel, flat, req: InstallRequest, deadline: float) -> dict:
        """vLLM's own path: the whole buffer copied into the store, and the id (re)loaded from it in place.
        Returns its timings (none)."""
        from vllm.lora.request import LoRARequest
        ch.wait(req.seq, flat.numel(), deadline)
        prev = self.store.get(req.lora_id)
        raw = prev.flat if prev is not None else None
        if raw is not None and raw.numel() == flat.numel() and raw.dtype == flat.dtype:
            raw.copy_(flat)
        else:
            raw = flat.to("cpu", copy=True)
        self.store[req.lora_id] = StoredAdapter(ch.layout, raw)
        self.wm.add_adapter(LoRARequest(req.name, req.lora_id, lora_path_for(req.lora_id, req.version),
                                        load_inplace=True))
        return {}

    def ring(self, req: InstallRequest) -> dict:
        """An install rung on the doorbell (its thread): a whole transfer (collective) is taken before the gate
        (the buffer is ours alone), then the install goes in ahead of the next engine step."""
        ch = self.channels.get(req.channel)
        if ch is not None:
            ch.receive(req.timeout_s, req.chunk)
        self.gate.enter(install=True, timeout_s=req.timeout_s)
        t_gate = time.monotonic()  # for scripts/sync_breakdown.py (one clock for all processes)
        try:
            return {**self.install(req, received=True), "t_gate": t_gate}
        finally:
            self.gate.leave()

    # ---- channels --------------------------------------------------------------------------------------------

    def open_channel(self, channel: str, layout: dict, source: dict) -> dict:
        with self.gate:
            old = self.channels.pop(channel, None)
            if old is not None:
                old.close()
            ch = self.channels[channel] = Channel(layout, source, self.worker.device)
            out = {"channel": channel, "kind": source["kind"], "nbytes": int(layout["nbytes"])}
            if source.get("doorbell"):
                if ch.raw.device.type == "cuda":
                    self.stream = torch.cuda.current_stream(ch.raw.device)
                ch.bell = Doorbell(channel, self.ring, self.worker.device, self.stream)
                out["doorbell"] = {"address": ch.bell.address, "authkey": ch.bell.authkey}
            return out

    def close_channel(self, channel: str) -> bool:
        with self.gate:
            ch = self.channels.pop(channel, None)
            if ch is not None:
                ch.close()
        return ch is not None

    def info(self) -> dict:
        wm, dev = self.wm, self.worker.device
        mgr = compat.adapter_manager(wm)
        return {"pid": os.getpid(), "device": str(dev), "loras": sorted(wm.list_adapters()),
                "slots": list(mgr.lora_index_to_id), "stored": sorted(self.store), "channels": sorted(self.channels),
                "lora_dtype": str(wm.lora_config.lora_dtype), "max_lora_rank": wm.lora_config.max_lora_rank,
                "modules": len(mgr.modules), "device_uuid": _device_uuid(dev),
                "cpu_lora": cpu_lora.installed(), "requests": self.requests()}

    def requests(self) -> dict[str, list]:
        """Each request the worker holds now: worker request id -> [its LoRA id (None: the base model), the output
        tokens it has so far]."""
        return compat.runner_requests(self.worker.model_runner)


class AdapterReceiver:
    """Mixed into vLLM's worker class (`worker_extension_cls`): the engine calls. Names are prefixed `minirl_` so
    they never clash with the worker's own attributes (vLLM asserts there is no clash)."""

    def _minirl(self) -> Receiver:
        rec = getattr(self, "_minirl_receiver", None)
        if rec is None:  # at the first call: the worker and its LoRA manager exist by then
            rec = self._minirl_receiver = Receiver(self)
        return rec

    def minirl_info(self) -> dict:
        return self._minirl().info()

    def minirl_hooks(self) -> dict:
        """`vllm_compat.check_hooks` on this worker, as a dict (`HookReport.from_dict`): asked at engine start, before
        anything is hooked."""
        return dataclasses.asdict(compat.check_hooks(self))

    def minirl_cpu_lora(self, on: bool) -> bool:
        """minirl's CPU LoRA ops (True) or vLLM's (False) from the next engine step (`minirl.sync.cpu_lora`)."""
        return cpu_lora.install(on)

    def minirl_open_channel(self, channel: str, layout: dict, source: dict) -> dict:
        """Map (shm, CUDA IPC) or join (collective) the sender's buffer; idempotent per channel name. With
        `source["doorbell"]`, also opens the channel's doorbell: the answer carries its address and authkey."""
        return self._minirl().open_channel(channel, layout, source)

    def minirl_close_channel(self, channel: str) -> bool:
        return self._minirl().close_channel(channel)

    def minirl_install(self, channel: str, lora_id: int, version: int, name: str, timeout_s: float = 30.0,
                       fast: bool = True, seq: int | None = None) -> dict:
        """`Receiver.install` as an engine call (between two engine steps); see `InstallRequest`."""
        rec = self._minirl()
        with rec.gate:
            report = rec.install(InstallRequest(channel, lora_id, version, name, timeout_s, fast, seq))
        return {**report, "via": "rpc"}

    def minirl_versions(self) -> dict:
        """LoRA id -> version of the weights currently installed under that id."""
        return dict(self._minirl().versions)

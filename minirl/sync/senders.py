"""Trainer-side adapter senders: the adapter travels as tensors straight into the engine's LoRA slots.

Transports (same interface: open once, then `send(lora_id, version, ring)` per sync):
- `ipc`: one flat buffer that the engine worker maps once: a shared-memory file on CPU, a CUDA IPC handle on GPU
  (same code; only the handle differs). A sync is: one small request and a pack (flat copies into the engine's
  dtype, lora_B pre-scaled); the worker copies the buffer into the adapter's slot, on CPU while the trainer still
  packs.
- `collective`: a dedicated two-rank torch.distributed group (trainer rank 0, engine worker rank 1) that meets
  through a file store in a private folder (no store listens on a port) and connects on 127.0.0.1; the flat buffer is broadcast (in-place swaps: in chunks, each as soon as it is packed). gloo
  on CPU, NCCL on GPU, same code. Every wait is bounded.
- `files` is `minirl.sync.files.FileSync` (the fallback).

The request goes by vLLM's engine call (`collective_rpc`) for a new LoRA id, and by the channel's doorbell (a
socket to a thread in the worker, see `minirl.sync.channel`) for an in-place swap of an installed id (`ring=True`):
that skips the engine core's round trip, and the worker's report reaches the generator from the trainer's thread.

`TensorSync` is the `WeightSync` for these: a new LoRA id per version (policy `continue`: requests in flight keep
their adapter), or one LoRA id whose weights are replaced in place between engine steps (policy `inflight`).
The engine side is `minirl.sync.receiver.AdapterReceiver`; the engine must be started with
`worker_extension_cls=WORKER_EXTENSION` (see `wire.engine_kwargs()`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import time
import uuid
from multiprocessing.connection import Client

import torch

from minirl.core import lifecycle
from minirl.core.adapter import Packer, make_layout, move_into, prescaled_config, uniform
from minirl.sync import vllm_compat as compat
from minirl.sync.base import CollectiveError, SyncError, SyncTimeout
from minirl.sync.wire import (
    PROGRESS_BITS,
    PROGRESS_MASK,
    EngineHost,
    InstallRequest,
    adapter_name,
    broadcast,
    finish,
    open_group,
    rendezvous_dir,
)

# ---- talking to the engine ----------------------------------------------------------------------------------

def _llm(generator: EngineHost):
    llm = generator.engine
    if llm is None:
        raise SyncError("the generator's vLLM engine is not running (closed)")
    return llm


async def rpc(generator: EngineHost, method: str, *args, timeout_s: float = 30.0):
    """`AsyncLLM.collective_rpc` on the engine loop, bounded; returns the (single) worker's result."""
    try:
        res = await asyncio.wait_for(_llm(generator).collective_rpc(method, args=args), timeout_s)
    except asyncio.TimeoutError as e:
        raise SyncTimeout(f"engine call {method} got no answer within {timeout_s:.0f} s") from e
    except SyncError:
        raise
    except Exception as e:
        raise SyncError(f"engine call {method} failed: {type(e).__name__}: {e}") from e
    return res[0]


def call_on_loop(generator: EngineHost, coro, timeout_s: float):
    """Run `coro` on the generator's loop from another thread; bounded wait, clear errors."""
    return _result(asyncio.run_coroutine_threadsafe(coro, generator.loop), timeout_s)


async def install(generator: EngineHost, channel: str, lora_id: int, version: int, timeout_s: float = 30.0,
                  seq: int | None = None) -> dict:
    """On the engine loop: the worker takes the channel's bytes as LoRA `lora_id` (the generator then serves it:
    `update_adapter`). With `seq`, the worker reads the bytes as the sender's push number `seq` marks them packed
    (see `IpcSender`)."""
    return await rpc(generator, "minirl_install", channel, lora_id, version, adapter_name(lora_id, version),
                     timeout_s, True, seq, timeout_s=timeout_s + 2)  # the worker's own wait ends first: its error says why


class _Install:
    """One install request in flight: rung on the channel's doorbell (`ring`: straight to the worker's thread) or
    sent as vLLM's engine call (`install`, on the engine loop)."""

    def __init__(self, sender: "Sender", lora_id: int, version: int, seq: int | None, ring: bool,
                 chunk: int | None = None):
        self.sender, self.ring = sender, ring and sender.bell is not None
        gen, name = sender.generator, adapter_name(lora_id, version)
        if not self.ring:
            self.fut = asyncio.run_coroutine_threadsafe(
                install(gen, sender.channel, lora_id, version, sender.timeout_s, seq=seq), gen.loop)
            return
        self.t_ring = time.monotonic()
        try:
            sender.bell.send(InstallRequest(sender.channel, lora_id, version, name, sender.timeout_s, seq=seq,
                                            chunk=chunk))
        except BaseException as e:
            self.cancel()
            raise SyncError(f"the engine worker is gone (its doorbell: {type(e).__name__}: {e})") from e

    def result(self) -> dict:
        if not self.ring:
            return _result(self.fut, self.sender.timeout_s)
        report, wait_s = None, self.sender.timeout_s + 2  # the worker's own wait ends first: its error says why
        try:
            try:
                if not self.sender.bell.poll(wait_s):
                    raise SyncTimeout(f"the engine worker did not answer the push within {wait_s:.0f} s")
                status, answer = self.sender.bell.recv()
            except (EOFError, OSError) as e:
                raise SyncError(f"the engine worker is gone (its doorbell: {type(e).__name__}: {e})") from e
            if status != "ok":
                raise SyncError(f"engine install failed: {answer}")
            report = answer
            report.update(t_ring=self.t_ring, t_answered=time.monotonic())
            return report
        finally:
            if report is None:
                self.sender.drop_bell()  # no stale answer can be read by a later push: it goes by engine call

    def cancel(self) -> None:
        if self.ring:
            self.sender.drop_bell()
        else:
            self.fut.cancel()


class Sender:
    """What the in-memory senders share: the layout (in the engine's LoRA dtype), the channel's name and its
    doorbell connection; `send` packs, then installs by engine call (or rings the doorbell: `ring`)."""
    transport = "?"

    def __init__(self, generator: EngineHost, tensors: dict[str, torch.Tensor], peft_config: dict,
                 timeout_s: float = 30.0, scales: dict[str, float] | None = None,
                 wire_dtype: torch.dtype | None = None):
        self.generator, self.tensors, self.timeout_s = generator, tensors, timeout_s
        if scales is not None:  # lora_B goes pre-scaled: the worker's in-place swap is then copies only
            missing = [n for n in tensors if ".lora_B." in n and n not in scales]
            if missing:
                raise SyncError(f"no LoRA scaling known for {missing[:3]} …")
            peft_config = prescaled_config(peft_config)
        self.scales = scales
        # packed: in the engine's LoRA dtype (half the bytes for a bf16 engine); zero-copy: the parameters' dtype
        self.info = call_on_loop(generator, rpc(generator, "minirl_info", timeout_s=timeout_s), timeout_s)
        dtype = wire_dtype or getattr(torch, self.info["lora_dtype"].removeprefix("torch."), None)
        self.layout = make_layout(tensors, peft_config, dtype if isinstance(dtype, torch.dtype) else None)
        self.nbytes = self.layout["nbytes"]
        self.channel = f"{self.transport}-{uuid.uuid4().hex[:8]}"
        self.device = next(iter(tensors.values())).device
        self.packer: Packer | None = None
        self.bell = None  # multiprocessing Connection to the worker's doorbell (see `open_bell`)
        self.closed = False

    def open_bell(self, opened: dict) -> None:
        """Connect to the doorbell the worker opened with the channel (its `minirl_open_channel` answer)."""
        bell = opened.get("doorbell")
        if bell is not None:
            self.bell = Client(bell["address"], family="AF_UNIX", authkey=bell["authkey"])

    def drop_bell(self) -> None:
        bell, self.bell = self.bell, None
        if bell is not None:
            bell.close()

    def _pack(self) -> None:
        if self.packer is not None:  # zero-copy senders have nothing to pack
            self.packer.pack()
        if self.device.type == "cuda":  # the trainer's last writes must be done before the worker reads
            torch.cuda.current_stream(self.device).synchronize()

    def send(self, lora_id: int, version: int, ring: bool = False) -> dict:
        """Hand over the live tensors as LoRA `lora_id` / policy `version`; returns the worker's report. `ring`:
        an in-place swap of an installed id, sent by the doorbell when the channel has one."""
        if self.closed:
            raise SyncError("this adapter sender is closed")
        self._pack()
        return _Install(self, lora_id, version, None, ring).result()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.drop_bell()
        try:
            if not self.generator.closed:
                call_on_loop(self.generator, rpc(self.generator, "minirl_close_channel", self.channel,
                                                 timeout_s=5.0), 5.0)
        except Exception:
            pass


def shared_buffer(nbytes: int, device: torch.device) -> tuple[torch.Tensor, dict, str | None]:
    """(bytes, source for the receiver's `Channel`, file path to unlink once it is mapped or None): a CUDA
    allocation shared by its IPC handle on GPU, a shared-memory file on CPU."""
    if device.type == "cuda":
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return raw, {"kind": "cuda_ipc", "handle": compat.share_cuda(raw)}, None
    path = lifecycle.private_file("ipc", nbytes)  # 0600, a new random name, removed if we die
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), {"kind": "shm", "path": path}, path


class IpcSender(Sender):
    """Shared-memory file (CPU) or CUDA IPC handle (GPU) that the engine worker maps once.

    By default the adapter is packed into the buffer in the engine's dtype, lora_B pre-scaled (as `collective`
    does), so the worker's install is plain copies. On CPU the two overlap: the RPC goes first, then the trainer
    packs in chunks of `chunk_bytes` and after each one publishes how far it got in a small header after the data
    (one int64: push number << 40 | elements packed); the worker, on its own core, copies each tensor into the slot as soon
    as its bytes are marked packed (waiting with `sched_yield`, bounded by the timeout). On GPU the pack is
    kernels on the trainer's stream: it is synchronized, then the RPC is sent (no header; `overlap=False` does
    the same on CPU).

    `zero_copy=True` (when the parameters share one dtype and device) moves the trainer's parameters into the
    shared buffer itself, so a push packs nothing; the worker then converts and scales as it copies them into the
    slot. The trainer must not update them while a push runs (it does not: `push` returns once the worker has
    installed them). It moves the conversion onto the engine's core and is not the default."""
    transport = "ipc"
    HEADER = 64  # bytes

    def __init__(self, generator: EngineHost, tensors: dict[str, torch.Tensor], peft_config: dict,
                 timeout_s: float = 30.0, scales: dict[str, float] | None = None, zero_copy: bool = False,
                 chunk_bytes: int = 1 << 20, overlap: bool | None = None):
        params = list(tensors.values())
        zero_copy = zero_copy and uniform(params)
        super().__init__(generator, tensors, peft_config, timeout_s, None if zero_copy else scales,
                         wire_dtype=params[0].dtype if zero_copy else None)
        self.zero_copy = zero_copy
        dtype = getattr(torch, self.layout["dtype"].removeprefix("torch."))
        pipelined = self.device.type == "cpu" and overlap is not False
        data_bytes = -(-self.nbytes // self.HEADER) * self.HEADER  # the header starts 64-byte aligned
        self.raw, source, self.path = shared_buffer(data_bytes + self.HEADER * pipelined, self.device)
        flat = self.raw[:self.nbytes].view(dtype)
        self.header, self.seq = None, 0
        if pipelined:
            self.header = self.raw[data_bytes:data_bytes + 8].view(torch.int64)
            self.header.zero_()
            source["header"] = data_bytes
        self.chunk = max(1, chunk_bytes // flat.element_size())
        if zero_copy:
            move_into(params, flat)
        else:
            self.packer = Packer(tensors, flat, self.layout, self.scales)
        source["doorbell"] = True  # `send(ring=False)` still goes by engine call
        try:
            self.open_bell(call_on_loop(generator, rpc(generator, "minirl_open_channel", self.channel, self.layout,
                                                       source, timeout_s=timeout_s), timeout_s))
        finally:
            self._unlink()  # both sides hold their mapping now; the name is not needed (and cannot leak)

    def send(self, lora_id: int, version: int, ring: bool = False) -> dict:
        if self.header is None:
            return super().send(lora_id, version, ring)
        if self.closed:
            raise SyncError("this adapter sender is closed")
        self.seq += 1
        self.publish_progress(0)
        pending = _Install(self, lora_id, version, self.seq, ring)
        try:
            if self.packer is None:
                self.publish_progress(self.layout["numel"])
            else:
                for done in self.packer.pack_chunks(self.chunk):
                    self.publish_progress(done)
            t_packed = time.monotonic()
        except BaseException:
            self.publish_progress(PROGRESS_MASK)  # the worker stops waiting and reports it
            pending.cancel()
            raise
        return {**pending.result(), "t_packed": t_packed}

    def publish_progress(self, done: int) -> None:
        """Publish `done` packed elements of push `seq`: one aligned 64-bit store, push number and progress
        together, so that no reader can pair a new number with an old progress."""
        self.header[0] = (self.seq << PROGRESS_BITS) | done

    def _unlink(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            lifecycle.tidied(self.path)
            self.path = None

    def close(self) -> None:
        super().close()
        self._unlink()


def _result(fut, timeout_s: float):
    """The result of an engine-loop future, bounded."""
    try:
        return fut.result(timeout=timeout_s + 5)
    except concurrent.futures.TimeoutError as e:
        fut.cancel()
        raise SyncTimeout(f"adapter sync did not finish within {timeout_s + 5:.0f} s") from e


class CollectiveSender(Sender):
    """Two-rank torch.distributed group with the engine worker; each sync broadcasts the flat buffer."""
    transport = "collective"

    def __init__(self, generator: EngineHost, tensors: dict[str, torch.Tensor], peft_config: dict,
                 timeout_s: float = 30.0, scales: dict[str, float] | None = None,
                 chunk_bytes: int = 4 << 20):
        super().__init__(generator, tensors, peft_config, timeout_s, scales)
        dtype = getattr(torch, self.layout["dtype"].removeprefix("torch."))
        on_gpu = self.device.type == "cuda" and not generator.on_cpu
        self.backend = "nccl" if on_gpu else "gloo"
        self.device = self.device if on_gpu else torch.device("cpu")
        self.raw = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.packer = Packer(tensors, self.raw.view(dtype), self.layout, self.scales)
        self.chunk = max(1, chunk_bytes // self.raw.view(dtype).element_size())
        self.rdv_dir = rendezvous_dir()
        source = {"kind": "collective", "rdv_dir": self.rdv_dir, "backend": self.backend, "timeout_s": timeout_s,
                  "doorbell": True}
        fut = asyncio.run_coroutine_threadsafe(
            rpc(generator, "minirl_open_channel", self.channel, self.layout, source, timeout_s=timeout_s + 5),
            generator.loop)
        try:
            self.store, self.group = open_group(self.rdv_dir, 0, self.backend, timeout_s)
        except BaseException:
            fut.cancel()
            shutil.rmtree(self.rdv_dir, ignore_errors=True)
            lifecycle.tidied(self.rdv_dir)
            raise
        try:
            self.open_bell(fut.result(timeout=timeout_s + 10))
        except Exception as e:
            raise SyncError(f"the engine worker could not join the collective sync group: {e}") from e

    def send(self, lora_id: int, version: int, ring: bool = False) -> dict:
        """By engine call: pack, then broadcast the buffer whole. By the doorbell: the request goes first, then
        each chunk of `chunk_bytes` is broadcast as soon as it is packed, and the worker copies the tensors of
        each chunk into the slot as it arrives (pack, transfer and copy overlap)."""
        if self.closed:
            raise SyncError("this adapter sender is closed")
        if not (ring and self.bell is not None):
            self._pack()
        n, es = self.layout["numel"], self.nbytes // self.layout["numel"]
        pending = _Install(self, lora_id, version, None, ring, chunk=self.chunk)
        works = []  # the chunks' broadcasts: they hold the group's connections open (see `close`)
        try:
            if not pending.ring:
                broadcast(self.group, self.raw, self.timeout_s, "the trainer's send")
            else:
                sent = 0
                for done in self.packer.pack_chunks(self.chunk):
                    while sent < n and min(n, sent + self.chunk) <= done:
                        hi = min(n, sent + self.chunk)
                        works.append(broadcast(self.group, self.raw[sent * es:hi * es], self.timeout_s,
                                               "the trainer's send", wait=False))
                        sent = hi
                t_packed = time.monotonic()
                for w in works:
                    finish(w, self.timeout_s, "the trainer's send")
        except BaseException as e:  # a broadcast failed, or e.g. the pack: the worker may wait for chunks (`close`)
            works.clear()
            pending.cancel()
            if isinstance(e, CollectiveError):
                raise SyncTimeout(str(e)) from e
            raise
        report = pending.result()
        return {**report, "t_packed": t_packed} if pending.ring else report

    def close(self) -> None:
        # the group first: a worker still waiting for chunks of an abandoned push fails at once (its peer is gone)
        # instead of holding the engine's gate until its timeout, and then takes the channel-close call
        g, self.group = getattr(self, "group", None), None
        if g is not None and hasattr(g, "shutdown"):
            try:
                g.shutdown()
            except Exception:
                pass
        del g  # gloo closes the connections when the group's last reference goes
        self.store = None
        if getattr(self, "rdv_dir", None):
            shutil.rmtree(self.rdv_dir, ignore_errors=True)
            lifecycle.tidied(self.rdv_dir)
        super().close()


SENDERS = {"ipc": IpcSender, "collective": CollectiveSender}


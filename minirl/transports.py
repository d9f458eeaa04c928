"""Trainer-side adapter senders: the adapter travels as tensors straight into the engine's LoRA slots.

Transports (same interface: open once, then `send(lora_id, version, ring)` per sync):
- `ipc`: one flat buffer that the engine worker maps once: a shared-memory file on CPU, a CUDA IPC handle on GPU
  (same code; only the handle differs). A sync is: one small request and a pack (flat copies into the engine's
  dtype, lora_B pre-scaled); the worker copies the buffer into the adapter's slot, on CPU while the trainer still
  packs.
- `collective`: a dedicated two-rank torch.distributed group (trainer rank 0, engine worker rank 1) over a TCP
  store on 127.0.0.1; the flat buffer is broadcast (in-place swaps: in chunks, each as soon as it is packed). gloo
  on CPU, NCCL on GPU, same code. Every wait is bounded.
- `files` stays in `minirl.sync.FileSync` (the fallback).

The request goes by vLLM's engine call (`collective_rpc`) for a new LoRA id, and by the channel's doorbell (a
socket to a thread in the worker, see `minirl.vllm_ext`) for an in-place swap of an installed id (`ring=True`):
that skips the engine core's round trip, and the worker's report reaches the generator from the trainer's thread.

`TensorSync` is the `WeightSync` for these: a new LoRA id per version (policy `continue`: requests in flight keep
their adapter), or one LoRA id whose weights are replaced in place between engine steps (policy `inflight`).
The engine side is `minirl.vllm_ext.AdapterReceiver`; the engine must be started with
`worker_extension_cls=WORKER_EXTENSION` (see `engine_kwargs()`).
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import json
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import torch

from .sync import SyncStats
from .vllm_ext import (PROGRESS_BITS, PROGRESS_MASK, CollectiveError, broadcast, finish, lora_path_for, open_group,
                       unpack)

WORKER_EXTENSION = "minirl.vllm_ext.AdapterReceiver"
TRANSPORTS = ("auto", "ipc", "collective", "files")
_LORA_IDS = itertools.count(1_000_001)  # far above the generator's own counter (shared with request ids)


class SyncError(RuntimeError):
    """An adapter sync could not complete."""


class SyncTimeout(SyncError, TimeoutError):
    """An adapter sync did not complete within its timeout (peer gone or stuck)."""


def engine_kwargs() -> dict:
    """Engine args that install the receiver: pass as `VLLMGenerator(..., engine_kwargs=engine_kwargs())`."""
    return {"worker_extension_cls": WORKER_EXTENSION}


# ---- the adapter as one flat buffer ----------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, enum.Enum):
        return x.value
    return str(x)


def adapter_params(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """peft-format name (as in adapter_model.safetensors) -> the live LoRA parameter of a peft model; all lora_A
    first, then all lora_B (so the B scaling is one range of a packed buffer)."""
    from peft import get_peft_model_state_dict
    want = set(get_peft_model_state_dict(model, adapter_name=adapter))
    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            key = n.replace(f".{adapter}.", ".")
            if key in want:
                out[key] = p
    missing = want - set(out)
    if missing:
        raise SyncError(f"adapter tensors without a parameter: {sorted(missing)[:3]} …")
    return dict(sorted(out.items(), key=lambda kv: ".lora_B." in kv[0]))  # stable: model order within A, B


def make_contiguous(model, adapter: str = "default") -> torch.Tensor | None:
    """Rebind the adapter's LoRA parameters to consecutive views of one buffer, in `adapter_params` order, so that
    a sync packs the whole adapter with one flat copy instead of hundreds of small ones. Call it before the
    optimizer is built. Returns the buffer (None, changing nothing, when the parameters differ in dtype/device)."""
    params = list(adapter_params(model, adapter).values())
    if not _uniform(params):
        return None
    return move_into(params, torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                                         device=params[0].device))


def _uniform(params: list[torch.Tensor]) -> bool:
    """One dtype and one device for all (what one flat buffer needs)."""
    return bool(params) and len({(p.dtype, p.device) for p in params}) == 1


def move_into(params: list[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
    """Copy `params` into consecutive views of `flat` (same dtype and device) and rebind them there. A parameter
    keeps its identity (the optimizer and its state are untouched); only its storage moves."""
    off = 0
    with torch.no_grad():
        for p in params:
            view = flat[off:off + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            off += p.numel()
    return flat


def _span(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D tensor over `ts` when they are consecutive contiguous views of one storage, in order; else None."""
    t0 = ts[0]
    ptr, es, base = t0.data_ptr(), t0.element_size(), t0.untyped_storage().data_ptr()
    for t in ts:
        if (t.data_ptr() != ptr or not t.is_contiguous() or t.dtype != t0.dtype
                or t.untyped_storage().data_ptr() != base):
            return None
        ptr += t.numel() * es
    return t0.detach().as_strided(((ptr - t0.data_ptr()) // es,), (1,))


def peft_config_dict(model, adapter: str = "default") -> dict:
    return json.loads(json.dumps(model.peft_config[adapter].to_dict(), default=_jsonable))


def b_scalings(model, adapter: str = "default") -> dict[str, float]:
    """peft-format name of each lora_B weight -> the scaling peft applies to that module's LoRA output (alpha / r,
    or alpha / sqrt(r) with rsLoRA; per-module rank/alpha patterns included)."""
    out = {}
    for name, module in model.named_modules():
        sc = getattr(module, "scaling", None)
        if isinstance(sc, dict) and adapter in sc and hasattr(module, "lora_B"):
            out[f"{name}.lora_B.weight"] = float(sc[adapter])
    return out


def prescaled_config(peft_config: dict) -> dict:
    """The peft config to send with pre-scaled lora_B tensors: vLLM then computes scaling 1 and folds nothing."""
    return {**peft_config, "lora_alpha": peft_config["r"], "use_rslora": False, "alpha_pattern": {}}


def make_layout(tensors: dict[str, torch.Tensor], peft_config: dict, dtype: torch.dtype | None = None) -> dict:
    """Names, shapes and element offsets of the tensors in one flat buffer (plain values, msgpack-able)."""
    dtype = dtype or next(iter(tensors.values())).dtype
    names, shapes, offsets, off = [], [], [], 0
    for n, t in tensors.items():
        names.append(n)
        shapes.append(list(t.shape))
        offsets.append(off)
        off += t.numel()
    return {"names": names, "shapes": shapes, "offsets": offsets, "numel": off, "dtype": str(dtype),
            "nbytes": off * torch.empty((), dtype=dtype).element_size(), "peft_config": peft_config}


class Packer:
    """Copies the live tensors into a flat buffer laid out by `layout`: one flat copy when they are consecutive views
    of one buffer in layout order (`make_contiguous`), else one fused `_foreach_copy_`. With `scales` (name ->
    factor, e.g. `b_scalings`) those tensors are multiplied in the buffer (one `mul_` per run of equal factors):
    the LoRA scaling travels folded into lora_B, so the engine has nothing left to scale."""

    def __init__(self, tensors: dict[str, torch.Tensor], flat: torch.Tensor, layout: dict,
                 scales: dict[str, float] | None = None):
        self.src = list(tensors.values())
        self.flat = flat
        views = unpack(flat, layout)
        self.dst = [views[n] for n in tensors]
        self.runs: list[list] = []  # [start, end, factor]: ranges of `flat` to scale
        order = sorted(zip(layout["offsets"], layout["names"]))
        for off, n in order:
            sc = (scales or {}).get(n, 1.0)
            end = off + views[n].numel()
            if sc == 1.0:
                continue
            if self.runs and self.runs[-1][1] == off and self.runs[-1][2] == sc:
                self.runs[-1][1] = end
            else:
                self.runs.append([off, end, sc])
        in_order = [n for _, n in order] == list(tensors)
        self._span = _span(self.src) if in_order and views and flat.numel() == layout["numel"] else None
        self._ptrs = [t.data_ptr() for t in self.src]

    @torch.no_grad()
    def pack(self) -> None:
        for _ in self.pack_chunks(self.flat.numel()):
            pass

    @torch.no_grad()
    def pack_chunks(self, chunk: int):
        """Pack in ranges of about `chunk` elements, yielding after each the number of leading elements of the
        buffer that are final (copied and scaled), so that a reader can start on them; cache-hot per range."""
        n = self.flat.numel()
        if self._span is None or [t.data_ptr() for t in self.src] != self._ptrs:
            torch._foreach_copy_(self.dst, [t.detach() for t in self.src])
            self._scale(0, n)
            yield n
            return
        for lo in range(0, n, max(1, chunk)):
            hi = min(n, lo + chunk)
            self.flat[lo:hi].copy_(self._span[lo:hi])
            self._scale(lo, hi)
            yield hi

    def _scale(self, lo: int, hi: int) -> None:
        for a, b, sc in self.runs:  # in the buffer's dtype, as vLLM folds it (a fused out= mul measured slower)
            if a < hi and b > lo:
                self.flat[max(a, lo):min(b, hi)].mul_(sc)


# ---- talking to the engine ----------------------------------------------------------------------------------

def _llm(generator):
    llm = getattr(getattr(generator, "_engine", None), "llm", None)
    if llm is None:
        raise SyncError("the generator has no running vLLM engine (closed, or not a VLLMGenerator)")
    return llm


async def rpc(generator, method: str, *args, timeout_s: float = 30.0):
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


def call_on_loop(generator, coro, timeout_s: float):
    """Run `coro` on the generator's loop from another thread; bounded wait, clear errors."""
    return _result(asyncio.run_coroutine_threadsafe(coro, generator.loop), timeout_s)


def adapter_name(lora_id: int, version: int) -> str:
    """The LoRARequest name of an in-memory adapter (its path: `vllm_ext.lora_path_for`)."""
    return f"minirl-v{version}-{lora_id}"


async def install(generator, channel: str, lora_id: int, version: int, timeout_s: float = 30.0,
                  seq: int | None = None) -> dict:
    """On the engine loop: the worker takes the channel's bytes as LoRA `lora_id`, then new requests use it. With
    `seq`, the worker reads the bytes as the sender's push number `seq` marks them packed (see `IpcSender`)."""
    name = adapter_name(lora_id, version)
    info = await rpc(generator, "minirl_install", channel, lora_id, version, name, timeout_s, True, seq,
                     timeout_s=timeout_s + 2)  # the worker's own wait ends first: its error says why
    await generator.serve_installed_async(lora_id, name, lora_path_for(lora_id, version), version, info)
    return info


class _Install:
    """One install request in flight: rung on the channel's doorbell (`ring`: straight to the worker's thread, the
    report handed to the generator from here) or sent as vLLM's engine call (`install`, on the engine loop)."""

    def __init__(self, sender: "_Sender", lora_id: int, version: int, seq: int | None, ring: bool,
                 chunk: int | None = None):
        self.sender, self.ring = sender, ring and sender.bell is not None
        gen, name = sender.generator, adapter_name(lora_id, version)
        if not self.ring:
            self.fut = asyncio.run_coroutine_threadsafe(
                install(gen, sender.channel, lora_id, version, sender.timeout_s, seq=seq), gen.loop)
            return
        self.swap = (lora_id, name, lora_path_for(lora_id, version), version)
        self.t_ring = time.monotonic()
        gen.begin_swap()
        try:
            sender.bell.send({"channel": sender.channel, "lora_id": lora_id, "version": version, "name": name,
                              "timeout_s": sender.timeout_s, "seq": seq, "chunk": chunk})
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
            self.sender.generator.end_swap(*self.swap, report)
            if report is None:
                self.sender.drop_bell()  # no stale answer can be read by a later push: it goes by engine call

    def cancel(self) -> None:
        if self.ring:
            self.sender.generator.end_swap(*self.swap, None)
            self.sender.drop_bell()
        else:
            self.fut.cancel()


class _Sender:
    transport = "?"

    def __init__(self, generator, tensors: dict[str, torch.Tensor], peft_config: dict, timeout_s: float = 30.0,
                 scales: dict[str, float] | None = None, wire_dtype: torch.dtype | None = None):
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
        from multiprocessing.connection import Client
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
            if not getattr(self.generator._engine, "closed", True):
                call_on_loop(self.generator, rpc(self.generator, "minirl_close_channel", self.channel,
                                                 timeout_s=5.0), 5.0)
        except Exception:
            pass


def shared_buffer(nbytes: int, device: torch.device, tag: str) -> tuple[torch.Tensor, dict, str | None]:
    """(bytes, source for the receiver's `_Channel`, file path to unlink once it is mapped or None): a CUDA
    allocation shared by its IPC handle on GPU, a shared-memory file on CPU."""
    if device.type == "cuda":
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return raw, {"kind": "cuda_ipc", "handle": list(raw.untyped_storage()._share_cuda_())}, None
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    path = str(shm / f"minirl-{tag}-{os.getpid()}")
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), {"kind": "shm", "path": path}, path


class IpcSender(_Sender):
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

    def __init__(self, generator, tensors, peft_config, timeout_s: float = 30.0, scales=None, zero_copy: bool = False,
                 chunk_bytes: int = 1 << 20, overlap: bool | None = None):
        params = list(tensors.values())
        zero_copy = zero_copy and _uniform(params)
        super().__init__(generator, tensors, peft_config, timeout_s, None if zero_copy else scales,
                         wire_dtype=params[0].dtype if zero_copy else None)
        self.zero_copy = zero_copy
        dtype = getattr(torch, self.layout["dtype"].removeprefix("torch."))
        pipelined = self.device.type == "cpu" and overlap is not False
        data_bytes = -(-self.nbytes // self.HEADER) * self.HEADER  # the header starts 64-byte aligned
        self.raw, source, self.path = shared_buffer(data_bytes + self.HEADER * pipelined, self.device, self.channel)
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
        self._progress(0)
        pending = _Install(self, lora_id, version, self.seq, ring)
        try:
            if self.packer is None:
                self._progress(self.layout["numel"])
            else:
                for done in self.packer.pack_chunks(self.chunk):
                    self._progress(done)
            t_packed = time.monotonic()
        except BaseException:
            self._progress(PROGRESS_MASK)  # the worker stops waiting and reports it
            pending.cancel()
            raise
        return {**pending.result(), "t_packed": t_packed}

    def _progress(self, done: int) -> None:
        """Publish `done` packed elements of push `seq`: one aligned 64-bit store, push number and progress
        together, so that no reader can pair a new number with an old progress."""
        self.header[0] = (self.seq << PROGRESS_BITS) | done

    def _unlink(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None

    def close(self) -> None:
        super().close()
        self._unlink()


def _result(fut, timeout_s: float):
    """The result of an engine-loop future, bounded."""
    import concurrent.futures
    try:
        return fut.result(timeout=timeout_s + 5)
    except concurrent.futures.TimeoutError as e:
        fut.cancel()
        raise SyncTimeout(f"adapter sync did not finish within {timeout_s + 5:.0f} s") from e


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class CollectiveSender(_Sender):
    """Two-rank torch.distributed group with the engine worker; each sync broadcasts the flat buffer."""
    transport = "collective"

    def __init__(self, generator, tensors, peft_config, timeout_s: float = 30.0, scales=None,
                 host: str = "127.0.0.1", port: int | None = None, chunk_bytes: int = 4 << 20):
        super().__init__(generator, tensors, peft_config, timeout_s, scales)
        dtype = getattr(torch, self.layout["dtype"].removeprefix("torch."))
        on_gpu = self.device.type == "cuda" and not getattr(generator, "on_cpu", True)
        self.backend = "nccl" if on_gpu else "gloo"
        self.device = self.device if on_gpu else torch.device("cpu")
        self.raw = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.packer = Packer(tensors, self.raw.view(dtype), self.layout, self.scales)
        self.chunk = max(1, chunk_bytes // self.raw.view(dtype).element_size())
        port = port or free_port(host)
        source = {"kind": "collective", "host": host, "port": port, "backend": self.backend, "timeout_s": timeout_s,
                  "doorbell": True}
        fut = asyncio.run_coroutine_threadsafe(
            rpc(generator, "minirl_open_channel", self.channel, self.layout, source, timeout_s=timeout_s + 5),
            generator.loop)
        try:
            self.store, self.group = open_group(host, port, 0, self.backend, timeout_s)
        except BaseException:
            fut.cancel()
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
        super().close()


SENDERS = {"ipc": IpcSender, "collective": CollectiveSender}


# ---- choosing ------------------------------------------------------------------------------------------------

def has_receiver(generator) -> bool:
    args = getattr(generator, "engine_args", None)
    return getattr(args, "worker_extension_cls", "") == WORKER_EXTENSION and hasattr(generator, "_engine")


def pick_transport(generator, trainer_device: str | torch.device = "cpu") -> tuple[str, str]:
    """(transport, why) for a generator and the trainer's device: in-memory whenever the engine carries the
    receiver; `ipc` when both sides share memory (CPU, or the same GPU); `collective` (NCCL) across GPUs."""
    if getattr(generator, "name", "") != "vllm":
        return "files", "the generator is not vLLM"
    if not has_receiver(generator):
        return "files", f"the engine was started without worker_extension_cls={WORKER_EXTENSION!r}"
    dev = torch.device(trainer_device)
    if getattr(generator, "on_cpu", True) or dev.type == "cpu":
        if getattr(generator, "on_cpu", True) and dev.type == "cpu":
            return "ipc", "CPU engine and trainer: shared-memory buffer mapped by the engine worker"
        return "collective", "engine and trainer on different device types: gloo broadcast"
    info = call_on_loop(generator, rpc(generator, "minirl_info", timeout_s=30.0), 30.0)
    same = info.get("device_uuid") == str(torch.cuda.get_device_properties(dev).uuid)
    if same:
        return "ipc", "engine and trainer on the same GPU: CUDA IPC handle"
    return "collective", "engine and trainer on different GPUs: NCCL broadcast"


class TensorSync:
    """`WeightSync` over an in-memory transport. `inflight=True`: one LoRA id whose weights are swapped in place
    between engine steps (sequences in flight continue on the new weights); otherwise a new LoRA id per version
    (sequences in flight finish on their adapter, which the generator removes once idle).

    `transport`: 'ipc', 'collective' or 'auto'. Bounded: every wait raises `SyncError`/`SyncTimeout` after
    `timeout_s`. `last` holds the worker's report of the latest push (timings, in-place swap token counts)."""

    def __init__(self, transport: str = "auto", inflight: bool = False, timeout_s: float = 30.0):
        if transport not in ("auto", "ipc", "collective"):
            raise ValueError(f"transport={transport!r}: use 'auto', 'ipc' or 'collective'")
        self.requested, self.transport, self.why = transport, transport, ""
        self.inflight, self.timeout_s = inflight, timeout_s
        self.sender: _Sender | None = None
        self._gen = None
        self.lora_id: int | None = None
        self.last: dict = {}

    def _sender(self, trainer, generator) -> _Sender:
        if self.sender is None or self._gen is not generator:
            if self.sender is not None:
                self.sender.close()
            dev = next(p for p in trainer.model.parameters()).device
            if self.requested == "auto":
                self.transport, self.why = pick_transport(generator, dev)
                if self.transport == "files":
                    raise SyncError(f"no in-memory transport: {self.why}; use FileSync")
            elif not has_receiver(generator):
                raise SyncError(f"sync_transport={self.requested!r} needs the engine started with "
                                f"worker_extension_cls={WORKER_EXTENSION!r}")
            self.sender = SENDERS[self.transport](generator, adapter_params(trainer.model),
                                                  peft_config_dict(trainer.model), timeout_s=self.timeout_s,
                                                  scales=b_scalings(trainer.model))
            self._gen, self.lora_id = generator, None
        return self.sender

    def push(self, trainer, generator) -> SyncStats:
        t0 = time.perf_counter()
        sender = self._sender(trainer, generator)
        ring = self.inflight and self.lora_id is not None  # an in-place swap of the installed id: the doorbell
        if self.lora_id is None or not self.inflight:
            self.lora_id = next(_LORA_IDS)
        try:
            self.last = sender.send(self.lora_id, trainer.version, ring=ring)
        except BaseException:
            # a push that failed midway may have left that id's slot part old, part new, and the channel mid-way
            # through a transfer: a later push starts a fresh id on a fresh channel
            self.lora_id = None
            self.close()
            raise
        return SyncStats(trainer.version, (time.perf_counter() - t0) * 1e3, sender.nbytes, self.transport)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def make_sync(transport: str, generator, trainer_device="cpu", inflight: bool = False, timeout_s: float = 30.0):
    """The `WeightSync` for a config value: 'files' → FileSync; 'ipc' / 'collective' → TensorSync; 'auto' → the
    fastest that works for the layout (in-memory when the engine has the receiver, else files). Returns
    (sync, why)."""
    from .sync import FileSync
    if transport == "files":
        return FileSync(), "sync_transport='files'"
    if transport == "auto":
        name, why = pick_transport(generator, trainer_device)
        if name == "files":
            return FileSync(), why
        return TensorSync(name, inflight=inflight, timeout_s=timeout_s), why
    return TensorSync(transport, inflight=inflight, timeout_s=timeout_s), f"sync_transport={transport!r}"


# ---- exact per-token versions across in-place swaps --------------------------------------------------------------

def split_worker_request_id(worker_id: str) -> tuple[str, int]:
    """vLLM's worker request id -> (the id the caller gave `generate`, sample index). vLLM appends '-<8 chars>' to
    the caller's id and prefixes '<j>_' for sample j of an n > 1 request."""
    import re
    m = re.match(r"^(?:(\d+)_)?(.+)-[0-9A-Za-z]{8}$", worker_id)
    if m is None:
        return worker_id, 0
    return m.group(2), int(m.group(1) or 0)


class SwapLog:
    """The worker's reports of installs on one LoRA id, in order, for exact per-token version tags across in-place
    swaps. Feed it every `minirl_install` report (`TensorSync.last`, or the `report` given to the generator's
    `serve_installed_async`), then ask `token_versions` for a finished request by the id the caller gave
    `AsyncLLM.generate` and the sample index. Ask only when no install is in flight (its report may concern the
    request)."""

    def __init__(self):
        self.records: list[dict] = []

    def add(self, report: dict) -> None:
        key = split_worker_request_id
        self.records.append({"version": report["version"], "prev": report.get("prev_version"),
                             "swap": {key(rid): n for rid, n in (report.get("swap") or {}).items()},
                             "started": {key(rid): v for rid, v in report.get("started") or ()}})

    def token_versions(self, request_id: str, n_tokens: int, index: int = 0) -> list[int]:
        """Version of each of the `n_tokens` output tokens of sample `index` of request `request_id`."""
        k = (request_id, index)
        start = next((i for i, r in enumerate(self.records) if k in r["started"]), None)
        if start is None:  # started after the last install we know of
            return [self.records[-1]["version"]] * n_tokens if self.records else []
        v, pos, out = self.records[start]["started"][k], 0, []
        for r in self.records[start:]:
            if k not in r["swap"]:
                break  # finished before this install
            n = min(r["swap"][k], n_tokens)
            out += [v] * (n - pos)
            pos, v = n, r["version"]
        return out + [v] * (n_tokens - pos)

    def prune(self, keep: int = 10_000) -> None:
        del self.records[:-keep]

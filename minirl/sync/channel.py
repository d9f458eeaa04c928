"""The vLLM worker's side of a sync channel: the buffer it maps or receives into (`Channel`), the doorbell socket a
sender rings for in-place swaps (`Doorbell`), and the gate that keeps installs out of engine steps (`Gate`).
Used by `minirl.sync.receiver`; imports no vLLM."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from multiprocessing.connection import Listener
from typing import Any, Callable

import torch
import torch.distributed as dist

from minirl.core.adapter import torch_dtype
from minirl.sync import vllm_compat as compat
from minirl.sync.wire import PROGRESS_BITS, PROGRESS_MASK, broadcast, finish, open_group


class Gate:
    """One thing at a time in the worker's LoRA state: an engine step, a LoRA call, or an install. Installs that
    are waiting go before the next step (`enter(install=True)`). `waiting`: callers blocked in `enter` (steps and
    installs), `installs_waiting`: the installs among them."""

    def __init__(self):
        self.cv = threading.Condition()
        self.busy = False
        self.waiting = self.installs_waiting = 0

    def enter(self, install: bool = False, timeout_s: float | None = None) -> None:
        with self.cv:
            self.installs_waiting += install
            self.waiting += 1
            try:
                free = self.cv.wait_for(lambda: not self.busy and (install or not self.installs_waiting), timeout_s)
            finally:
                self.installs_waiting -= install
                self.waiting -= 1
            if not free:
                raise TimeoutError(f"minirl adapter receiver: the engine step did not end within {timeout_s:.0f} s")
            self.busy = True

    def leave(self) -> None:
        with self.cv:
            self.busy = False
            self.cv.notify_all()

    def __enter__(self):
        self.enter()

    def __exit__(self, *exc):
        self.leave()


class Doorbell:
    """A socket served by a thread of the worker process: each request (an `InstallRequest`) goes to `handle`, on
    the engine's device and CUDA stream, and is answered ("ok", its report) or ("error", message). Only the sender
    holding the authkey can connect (`address`, `authkey`)."""

    def __init__(self, channel: str, handle: Callable[[Any], dict], device=None, stream=None):
        self.authkey = os.urandom(16)
        self.listener = Listener(family="AF_UNIX", authkey=self.authkey)
        self.address = self.listener.address
        self.conn = None
        self.handle, self.device, self.stream = handle, device, stream
        self.thread = threading.Thread(target=self._serve, name=f"minirl-doorbell-{channel}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.conn = self.listener.accept()
        except Exception:
            return
        finally:
            self.listener.close()
        if self.device is not None and torch.device(self.device).type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            try:
                req = self.conn.recv()
            except (EOFError, OSError):
                return
            t_rung = time.monotonic()  # for scripts/sync_breakdown.py (one clock for all processes)
            try:
                with _on_stream(self.stream):  # GPU: the transfer and the copies ordered with the forward passes
                    report = self.handle(req)
                answer = ("ok", {**report, "via": "doorbell", "t_rung": t_rung, "t_done": time.monotonic()})
            except Exception as e:
                answer = ("error", f"{type(e).__name__}: {e}")
            try:
                self.conn.send(answer)
            except (EOFError, OSError):
                return

    def close(self) -> None:
        for c in (self.conn, self.listener):
            try:
                if c is not None:
                    c.close()
            except Exception:
                pass


def _on_stream(stream):
    """The engine's CUDA stream for the doorbell thread's copies (so they are ordered with the forward passes)."""
    if stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def ipc_handle_here(handle: list, device) -> tuple[int, list]:
    """(device index, handle) to open a CUDA IPC `handle` in this process: the handle's first entry is the device
    index in the *sender's* numbering (the trainer may see every GPU, the engine only its own: with the trainer on
    cuda:1 the engine's GPU is its cuda:0), so it becomes `device`'s index here. IPC is picked only when both sides
    are on one GPU (`tensor.pick_transport` compares the GPUs' UUIDs), so the engine's device is the sender's."""
    index = torch.device(device).index or 0
    return index, [index, *handle[1:]]


class Channel:
    """One sender's flat buffer as the worker sees it (mapped, or received into), with its doorbell if any."""

    def __init__(self, layout: dict, source: dict, device):
        self.layout, self.source = layout, source
        self.kind = source["kind"]
        self.group = self.store = None
        dtype = torch_dtype(layout["dtype"])
        nbytes = int(layout["nbytes"])
        self.header = None
        if self.kind == "shm":
            at = source.get("header")  # the sender publishes its pack progress there (see `wait`)
            raw = torch.from_file(source["path"], shared=True, size=nbytes if at is None else int(at) + 8,
                                  dtype=torch.uint8)
            if at is not None:
                self.header = raw[int(at):int(at) + 8].view(torch.int64)
                raw = raw[:nbytes]
        elif self.kind == "cuda_ipc":
            index, h = ipc_handle_here(source["handle"], device)
            torch.cuda.set_device(index)
            storage = compat.open_cuda(h)
            raw = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (nbytes,), (1,))
        elif self.kind == "collective":
            self.store, self.group = open_group(source["rdv_dir"], 1, source["backend"], float(source["timeout_s"]))
            dev = device if source["backend"] == "nccl" else "cpu"
            raw = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        else:
            raise ValueError(f"unknown minirl channel kind {self.kind!r}")
        self.raw = raw
        self.flat = raw.view(dtype)
        self.bell: Doorbell | None = None
        self.chunk, self.got = None, 0  # a chunked broadcast in progress: its chunk size, elements received
        self.next: list = []  # (work, end) of each chunk still being received

    def wait(self, seq: int | None, upto: int, deadline: float) -> int:
        """Until the sender's push `seq` has packed at least the first `upto` elements (a header channel), or
        they have arrived (a chunked broadcast; others are complete once received): returns how many are there.
        Yields the core while waiting; raises when the sender gave up or at `deadline` (monotonic)."""
        if self.chunk:
            while self.got < upto:
                work, hi = self.next.pop(0)
                finish(work, max(0.1, deadline - time.monotonic()), "the engine worker's receive")
                self.got = hi
            return self.got
        if self.header is None or seq is None:
            return self.flat.numel()
        while True:
            word = int(self.header[0])
            now, done = word >> PROGRESS_BITS, word & PROGRESS_MASK
            if now == seq:
                if done == PROGRESS_MASK:
                    raise RuntimeError(f"minirl adapter receiver: the sender abandoned push {seq} mid-pack")
                if done >= upto:
                    return done
            elif now > seq:
                raise RuntimeError(f"minirl adapter receiver: push {seq} was superseded by push {now}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"minirl adapter receiver: push {seq} was not packed in time (the trainer is "
                                   f"gone or stuck)")
            os.sched_yield()

    def receive(self, timeout_s: float, chunk: int | None = None):
        """The current adapter bytes (a view; copy before the sender may write again). A broadcast sent in
        chunks of `chunk` elements is only started here, every chunk's receive at once (gloo's threads take the
        next chunks while the caller copies the first ones); `wait` says which ones are in."""
        self.chunk, self.got, self.next = None, 0, []
        if self.kind == "collective" and chunk:
            self.chunk = int(chunk)
            n, es = self.flat.numel(), self.flat.element_size()
            self.next = [(broadcast(self.group, self.raw[lo * es:min(n, lo + self.chunk) * es], timeout_s,
                                    "the engine worker's receive", wait=False), min(n, lo + self.chunk))
                         for lo in range(0, n, self.chunk)]
        elif self.kind == "collective":
            broadcast(self.group, self.raw, timeout_s, "the engine worker's receive")
        elif self.kind == "cuda_ipc":
            torch.cuda.current_stream(self.raw.device).synchronize()
        return self.flat

    def close(self):
        if self.bell is not None:
            self.bell.close()
            self.bell = None
        if self.group is not None:
            try:
                if hasattr(self.group, "shutdown"):
                    self.group.shutdown()
                elif isinstance(self.group, dist.ProcessGroupNCCL) and hasattr(self.group, "abort"):
                    self.group.abort()
            except Exception:
                pass
        self.group = self.store = self.raw = self.flat = self.header = None

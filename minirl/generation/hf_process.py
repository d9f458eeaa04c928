"""The transformers generator in a process of its own (the asynchronous pipeline's CPU/HF generation side).

Why a process: transformers `generate` on a small model is mostly Python overhead, so a generating thread and a
training thread in one process take turns on the GIL and each runs at about half speed. In its own process,
pinned to its own cores, generation runs truly beside the trainer.

  trainer process                                       generator process (a fresh interpreter)
  ───────────────                                       ───────────────────────────
  ProcGenerator.generate(prompts) ── pipe ──►  worker thread: apply staged adapter, HFGenerator.generate
  ShmSync.push: pack LoRA → shared flat buffer   (minirl.sync.local)
                ("adapter", v)    ── pipe ──►  main thread: copy buffer → staging, ack   (never waits on a
                                                generation: a new version starts with the next request, as the
                                                `continue` policy asks)

The adapter travels the way the vLLM `ipc` transport sends it (one shared-memory flat buffer, one fused copy).
If the process dies, every waiting call raises `GeneratorProcessError`; closing (or the trainer dying) ends it.
The trainer dying, however: the process has PR_SET_PDEATHSIG (so create a `ProcGenerator` in a thread that
outlives it: the run's own thread does), and the trainer's watchdog (`minirl.core.lifecycle`) ends it and removes the
shared-memory file should the trainer die before unlinking it.
"""
from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import itertools
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file

from minirl.config import Config
from minirl.core import lifecycle
from minirl.core.adapter import Packer, adapter_params, make_layout, unpack
from minirl.generation.hf import HFGenerator, LocalEngine
from minirl.sync.vllm_compat import foreach_copy
from minirl.training.models import build_model, load_tokenizer
from minirl.types import AdapterUpdate, Group, Prompt, SamplingParams


class GeneratorProcessError(RuntimeError):
    pass


# The process is a fresh interpreter (`subprocess.Popen`, as reward workers are), not multiprocessing's spawn: spawn
# re-runs the trainer's main script as `__mp_main__`, so a script that starts a run at its top level, with no
# `if __name__ == "__main__":`, would start a second run in the child. It takes the trainer's sys.path, then
# `_serve`'s arguments, over the socket it is given.
_BOOT = ("import sys\nfrom multiprocessing.connection import Connection\nc = Connection(int(sys.argv[1]))\n"
         "sys.path[:] = c.recv()\nfrom minirl.generation.hf_process import _serve\n_serve(c, *c.recv())")


def _die_with(parent: int) -> None:
    """Linux: the kernel sends us SIGKILL when the thread that started us ends (the trainer, even SIGKILLed); if
    it already has, go now. The trainer's watchdog (`minirl.core.lifecycle`) ends us too; this is the faster path."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)


def _serve(conn, cfg: Config, layout: dict, shm_path: str, cores: list[int] | None, device: str,
           parent: int, slots: int | None = None) -> None:
    """The generator process: the main thread takes messages, one worker thread runs generate/score in order."""
    # A notebook's "interrupt kernel" signals the kernel's whole process group, this process included: the trainer
    # ends us (its close, PDEATHSIG, the watchdog), so an interrupt meant for the user's cell must not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(parent)

    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    send_lock = threading.Lock()

    def send(*msg) -> None:
        with send_lock:
            conn.send(msg)

    try:
        model = build_model(cfg, device).eval()
        gen = HFGenerator(model, load_tokenizer(cfg.model), decode_mode=cfg.hf_decode, slots=slots)
        dtype = getattr(torch, layout["dtype"].removeprefix("torch."))
        shared = torch.from_file(shm_path, shared=True, size=layout["nbytes"], dtype=torch.uint8).view(dtype)
        staging = shared.clone()
        live = adapter_params(model)
        dst = [live[n].data for n in layout["names"]]
        views = unpack(staging, layout)  # name -> view of the staging buffer
        src = [views[n] for n in layout["names"]]
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        send(0, "err", traceback.format_exc())
        return
    staged = {"version": None}
    stage_lock = threading.Lock()
    jobs: queue.Queue = queue.Queue()

    def apply_staged() -> None:  # between requests only: a sequence never sees its weights change
        with stage_lock:
            if staged["version"] is not None:
                foreach_copy(dst, [s.to(d.device) for s, d in zip(src, dst)])
                gen.set_version(staged["version"])
                staged["version"] = None

    def worker() -> None:
        while (job := jobs.get()) is not None:
            rid, kind, args = job
            try:
                apply_staged()
                out = gen.generate(*args) if kind == "gen" else gen.score(*args)
                send(rid, "ok", out)
            except BaseException:  # noqa: BLE001 - reported to the caller with its traceback
                send(rid, "err", traceback.format_exc())

    th = threading.Thread(target=worker, name="minirl-genproc-worker", daemon=True)
    th.start()
    send(0, "ok", "ready")
    while True:
        try:
            rid, kind, args = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            break
        if kind == "close":
            break
        if kind == "adapter":  # copy now (a few ms), apply before the next request
            with stage_lock:
                staging.copy_(shared)
                staged["version"] = args[0]
            send(rid, "ok", args[0])
        elif kind == "version":  # the adapter version the next request runs on: the one staged, else the one
            with stage_lock:      # applied (answered here, not behind a generation that may run for minutes)
                send(rid, "ok", gen.version if staged["version"] is None else staged["version"])
        elif kind == "adapter_file":
            sd = load_file(f"{args[0]}/adapter_model.safetensors")
            with stage_lock:
                for n in layout["names"]:
                    views[n].copy_(sd[n])
                staged["version"] = args[1]
            send(rid, "ok", args[1])
        else:
            jobs.put((rid, kind, args))
    jobs.put(None)
    th.join(30)  # let a running request finish: exiting under it aborts the process


class ProcGenerator(LocalEngine):
    """`Generator` whose transformers model lives in a process of its own pinned to `cores` (CPU) or on `device`.
    `tensors` are the trainer's live LoRA parameters (peft names): `push(version)` sends them."""

    same_numerics = True  # the trainer's model code, dtype and kind of device: sync verification expects ~no noise

    def __init__(self, cfg: Config, tensors: dict[str, torch.Tensor], cores: list[int] | None = None,
                 device: str = "cpu", start_timeout_s: float = 300.0, timeout_s: float = 30.0,
                 slots: int | None = None):
        self.timeout_s = timeout_s
        self._version = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, cf.Future] = {0: cf.Future()}
        self._lock = threading.Lock()
        self._closed = False
        self.proc: subprocess.Popen | None = None  # set as it starts (close() after a failed start)
        self._conn = self._reader = None
        layout = make_layout(tensors, {})
        self.nbytes = layout["nbytes"]
        self.dtype = layout["dtype"].removeprefix("torch.")  # the process builds its model as the trainer did
        path = lifecycle.private_file("genproc", self.nbytes)  # 0600, a new name; the watchdog removes it if we die
        try:
            raw = torch.from_file(str(path), shared=True, size=self.nbytes, dtype=torch.uint8)
            self.packer = Packer(tensors, raw.view(next(iter(tensors.values())).dtype), layout)
            self.packer.pack()
            mine, theirs = socket.socketpair()
            with theirs:
                self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno())],
                                             pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            lifecycle.adopt(self.proc.pid)  # ended by the watchdog if we die (a notebook kernel killed, say)
            self._conn = Connection(mine.detach())
            self._conn.send(sys.path)
            self._conn.send((cfg, layout, str(path), cores, device, os.getpid(), slots))
            self._reader = threading.Thread(target=self._read, name="minirl-genproc-reader", daemon=True)
            self._reader.start()
            self._pending[0].result(start_timeout_s)  # the model is built and the buffer mapped
        except BaseException:
            self.close()
            raise
        finally:
            Path(path).unlink(missing_ok=True)  # both sides hold their mapping; the name cannot leak
            lifecycle.tidied(path)
        self.push(0)

    def _read(self) -> None:
        while True:
            try:
                rid, status, out = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                fut = self._pending.pop(rid, None)
            if fut is not None:
                if status == "ok":
                    fut.set_result(out)
                else:
                    fut.set_exception(GeneratorProcessError(f"in the generator process:\n{out}"))
        code = self.proc.poll() if self.proc is not None else None
        with self._lock:
            pending, self._pending = self._pending, {}
            for fut in pending.values():
                fut.set_exception(GeneratorProcessError(
                    f"the generator process exited (code {code}) before answering"))

    def _call(self, kind: str, *args, timeout: float | None = None):
        with self._lock:
            if self._closed or not self._reader.is_alive():
                raise GeneratorProcessError("the generator process is not running")
            rid = next(self._ids)
            fut = self._pending[rid] = cf.Future()
            self._conn.send((rid, kind, args))
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            raise GeneratorProcessError(f"the generator process did not answer {kind!r} within {timeout} s") from None

    @property
    def version(self) -> int:
        """The version last pushed (this side's record); `served_version` asks the process."""
        return self._version

    def served_version(self) -> int:
        """The adapter version the process serves its next request with, asked from the process itself (after
        it applied any staged adapter): what sync verification compares with the version pushed."""
        return self._call("version", timeout=self.timeout_s)

    def push(self, version: int) -> None:
        """Pack the trainer's adapter into the shared buffer; the process copies it before answering, and
        serves it from its next request on."""
        self.packer.pack()
        self._call("adapter", version, timeout=self.timeout_s)
        self._version = version

    def update_adapter(self, deliver: Callable[[], AdapterUpdate], in_place: bool = False) -> AdapterUpdate:
        """Run the transport's delivery, then serve it: a folder it names is loaded by the process; otherwise the
        trainer's adapter is packed into the shared-memory buffer the process mapped (`ShmSync`: the report says
        how many bytes)."""
        update = deliver()
        if update.path is not None:
            self.load_adapter(update.path, update.version)
            return update
        self.push(update.version)
        return dataclasses.replace(update, report={"bytes": self.nbytes})

    def load_adapter(self, path: str, version: int) -> None:
        self._call("adapter_file", path, version, timeout=self.timeout_s)
        self._version = version

    def generate(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> list[Group]:
        return self._call("gen", list(prompts), n, params)

    def score(self, prompt_ids, completion_ids, temperature: float) -> list[float]:
        return self._call("score", list(prompt_ids), list(completion_ids), temperature)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        proc = self.proc
        if proc is not None:
            try:
                self._conn.send((0, "close", ()))
            except (OSError, ValueError):
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._conn is not None:
            self._conn.close()
        if self._reader is not None:
            self._reader.join(5)

"""A reward worker process: started by `minirl.rewards.workers.RewardWorkers`, which loads this file by path in a
fresh interpreter (not `import minirl`: that imports torch). Standard library only. Also the framing both sides
use on their socket, a reply's JSON (`reply`), and the conversion of a returned value to a number (`number`)."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import ctypes
import inspect
import json
import os
import pickle
import resource
import signal
import socket
import struct
import sys
import threading
from decimal import Decimal
from fractions import Fraction
from typing import Any, Callable


def send_frame(sock: socket.socket, blob: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(blob)) + blob)


def recv_frame(sock: socket.socket, limit: int | None = None) -> bytes | None:
    """One frame, or None at end of stream. Raises ValueError for a frame over `limit` bytes (left unread)."""
    head = _recv_exact(sock, 8)
    if head is None:
        return None
    (n,) = struct.unpack("!Q", head)
    if limit is not None and n > limit:
        raise ValueError(f"reply of {n} bytes is over the {limit}-byte limit (return a number)")
    return _recv_exact(sock, n)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def reason(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return one_line(f"SystemExit({e.code!r})")
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - an exception whose str() fails still has a type
        text = ""
    return one_line(f"{type(e).__name__}: {text}" if text else type(e).__name__)


def one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


# What a failure reads like when the worker's memory limit (RLIMIT_DATA) is reached: Python's MemoryError, a thread
# whose stack cannot be mapped, torch's CPU allocator, C++'s std::bad_alloc (the worker aborts), ENOMEM
MEMORY_SIGNS = ("MemoryError", "can't start new thread", "can't allocate memory", "bad_alloc", "Cannot allocate memory")


def memory_hint(why: str, memory_mb: int | None) -> str:
    """`why`, and where it reads as memory running out in a worker with a limit, that limit and the ways out."""
    if not memory_mb or not any(sign in why for sign in MEMORY_SIGNS):
        return why
    return (f"{why} (a reward worker's memory is capped at reward_memory_mb={memory_mb} MiB: raise it, or set "
            "reward_workers: 0 to score in the run's process)")


def run_call(fn: Callable, prompt: str, completion: str, columns: dict) -> tuple[float | None, str | None]:
    """Call a reward (awaiting it if it gives an awaitable) and take its value as a number (`number`), both where
    the call runs and so under its timeout; every exception becomes `(None, 'raised ' + reason)`."""
    try:
        value = fn(prompt, completion, **columns)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return number(value)
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are a reward's failures too
        return None, f"raised {reason(e)}"


def run_batched(fn: Callable, prompts: list, completions: list, kwargs: dict,
                n: int) -> tuple[list | None, list | str]:
    """Call a batched (TRL-style) reward on a group's `n` completions, where the call runs and so under its
    timeout: `(values, reasons)`, one entry each per completion (a value a float or None, a reason None or why
    that entry failed), or `(None, reason)` when the whole call failed (it raised, or gave no list of `n`)."""
    try:
        value = call_batched(fn, prompts, completions, kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        return batch_values(value, n)
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are a reward's failures too
        return None, f"raised {reason(e)}"


def call_in_thread(run: Callable[[], tuple], timeout_s: float | None, name: str) -> tuple[Any, Any]:
    """`run()` (a `run_call` or `run_batched`) in a daemon thread of its own, so that an async reward is awaited
    beside a notebook's running event loop and a hanging one is left behind, not joined: its result, or `(None,
    'timeout after Ns')`. The in-process twin of a worker's call under its timeout."""
    done: cf.Future = cf.Future()

    def call() -> None:
        try:
            done.set_result(run())
        except BaseException as e:  # noqa: BLE001 - never a result left unset
            done.set_result((None, reason(e)))
    threading.Thread(target=call, daemon=True, name=name).start()
    try:
        return done.result(timeout=timeout_s)
    except cf.TimeoutError:
        return None, f"timeout after {timeout_s}s"


def batch_values(value: Any, n: int) -> tuple[list | None, list | str]:
    """What a batched reward returned, as `run_batched` gives it: a list (a tuple, a 1-d numpy array or torch tensor,
    as TRL takes them) of `n` numbers or None, each entry taken by `number`; anything else one reason for the whole
    call."""
    if _library(value) in ("numpy", "torch") and getattr(value, "ndim", None) == 1:
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return None, (f"returned {shown(value)}, expected a list of {n} floats or None "
                      "(a batched reward gives one value per completion)")
    if len(value) != n:
        return None, (f"wrong length: returned {len(value)} values for {n} completions; a batched reward gives one "
                      "value (or None) per completion, in order")
    pairs = [number(v) for v in value]
    return [v for v, _ in pairs], [None if why is None else f"{why} (entry {i})" for i, (_, why) in enumerate(pairs)]


def call_batched(fn: Callable, prompts: list, completions: list, kwargs: dict) -> Any:
    """A batched reward called as TRL calls it, by keyword (`prompts=`, `completions=`, the rest), when it names a
    `completions` parameter (`prompts` only where it takes it: `def f(completions, **kw)` gets it in `kw`);
    otherwise (`@minirl.reward(batched=True)` on other names) positionally, `fn(prompts, completions, **kwargs)`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "completions" not in params:
        return fn(prompts, completions, **kwargs)
    if "prompts" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {"prompts": prompts, **kwargs}
    return fn(completions=completions, **kwargs)


def number(v: Any) -> tuple[float | None, str | None]:
    """(float(v), None); (None, None) for None (a skip); (None, why) for a value that is not an int, float, bool
    (1.0 / 0.0, as TRL's float32 tensor of the rewards takes it), numpy number or 0-d torch tensor of a real or bool
    dtype (TRL takes a tensor: torch.tensor(rewards)), or that float() cannot take. An exception given as a value
    (a batched reward's entry: `judge`'s unreadable reply) is that sample's failure, its reason as if raised. A
    value's own methods can run here (a subclass's __float__, __class__ in isinstance) but never its __repr__; on an
    exact float or None no code of the value's runs."""
    if v is None:
        return None, None
    if isinstance(v, BaseException):
        return None, reason(v)
    try:
        if not isinstance(v, (int, float)) and not _is_numpy_number(v):
            if not _is_torch_number(v):
                return None, f"returned {shown(v)}, expected a float or None"
            v = v.detach()  # a loss-like value with requires_grad: the same number, without torch's warning
        return float(v), None
    except Exception as e:  # noqa: BLE001 - whatever a value's own methods raise, it is this call's failure
        return None, f"returned {shown(v)}, which float() cannot take ({reason(e)})"


SHOWN = (int, float, bool, complex, Decimal, Fraction)  # types whose own repr is bounded and calls no user code


def shown(v: Any) -> str:
    """`type value` for a failure's reason, at most 40 characters of each. Only builtin scalars are written (a
    string or bytes cut first): a container is its size, anything else its type alone, so no value's own
    `__repr__` runs (it could hang) and no repr walks a structure (2**40 shared leaves pickle to 160 bytes)."""
    t = type(v)
    if t in (str, bytes):
        text = repr(v[:40])
    elif t in (list, tuple, dict, set, frozenset):
        text = f"of {len(v)} items"
    elif t in SHOWN:
        try:
            text = repr(v)
        except ValueError:  # an int too long to write
            text = "(cannot be shown)"
    else:
        text = "(not shown)"
    return f"{t.__name__:.40} {text:.40}"


def _library(v: Any) -> str:
    """The top package of a value's type ('numpy', 'torch', 'builtins'): no code of the value's runs."""
    module = type(v).__module__
    return module.partition(".")[0] if type(module) is str else ""


def _is_numpy_number(v: Any) -> bool:
    return _library(v) == "numpy" and hasattr(v, "dtype") and v.dtype.kind in "biuf" and v.ndim == 0


def _is_torch_number(v: Any) -> bool:
    """A 0-d torch tensor of a real or bool dtype (not complex, as numpy's), by duck typing: a worker never imports
    torch for this. On the GPU too (float() copies it back)."""
    return _library(v) == "torch" and getattr(v, "ndim", None) == 0 and hasattr(v, "dtype") and \
        not v.dtype.is_complex


def reply(value: float | list | None, error: str | list | None) -> bytes:
    """A worker's reply to the trainer: JSON `[value, error]` (NaN and infinities as JSON's extensions); for a
    batched call `[values, reasons]`, two lists of one entry per completion."""
    return json.dumps([value, error]).encode()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the trainer died before the line above ran
        os._exit(0)


def serve(fd: int, parent_pid: int) -> None:
    """A worker's life: load the rewards, say ready, answer calls until the trainer closes the socket."""
    _die_with_parent(parent_pid)
    sock = socket.socket(fileno=fd)
    init = pickle.loads(recv_frame(sock))
    sys.path[:] = init["path"]
    if init["memory_mb"]:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = init["memory_mb"] << 20
        limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    fns = {}
    cwd = os.getcwd()  # as in the trainer (registry.working_folder_last): after site-packages, only while loading
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    for name, blob in init["rewards"]:
        try:
            fns[name] = pickle.loads(blob)
        except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it with the name
            why = f"reward {name!r} cannot be loaded in a worker process ({reason(e)})"
            fixed = memory_hint(why, init["memory_mb"])
            send_frame(sock, reply(None, fixed if fixed != why else
                                   f"{why}; make its module importable from the trainer's sys.path"))
            return
    if added:
        sys.path.remove(cwd)
    send_frame(sock, reply(None, None))
    while (msg := recv_frame(sock)) is not None:
        name, prompt, completion, columns, batch = pickle.loads(msg)
        if batch:
            value, error = run_batched(fns[name], prompt, completion, columns, batch)
        else:
            value, error = run_call(fns[name], prompt, completion, columns)
        if isinstance(error, list):
            error = [e and memory_hint(e, init["memory_mb"]) for e in error]
        elif error:
            error = memory_hint(error, init["memory_mb"])
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass  # a reward that closed or broke its streams
        send_frame(sock, reply(value, error))

"""Reward calls in worker processes: a faulty reward becomes a recorded failure, never a dead or stuck trainer.

`RewardWorkers(rewards, workers, timeout_s)` starts `workers` processes once, each holding every reward function;
`call_many(calls)` spreads a group's calls over them, one call per worker at a time. Each call has its own timeout,
counted from when it starts in its worker (no budget shared by the group, no GIL shared with anything). What goes
wrong in a call becomes its `RewardOutcome.error`, one line, and the pool goes on:
- it raises anything, BaseException included: "ZeroDivisionError: division by zero", "SystemExit(0)",
  "KeyboardInterrupt", "MemoryError" (past `memory_mb`: a failure that reads as memory running out, there or at
  start-up, names the limit as the config's reward_memory_mb and the ways out, `worker_main.memory_hint`);
- it runs past `timeout_s` (busy loop, sleep, a regex backtracking in C): "timeout after 1.0s"; its worker is
  killed with its process group (so with the reward's subprocesses) and replaced;
- it ends its process (`os._exit`, a segfault, the OOM killer): "worker died (signal SIGSEGV)"; replaced too;
- it prints more than `max_output_bytes` (stdout and stderr, read by the trainer from a pipe): "output flood:
  printed more than N bytes", its worker killed at once. A failure rather than a truncation: a reward printing
  that much is looping or dumping, and stopping it then bounds its time and what the trainer reads. Below the
  cap, what a call printed comes back in `RewardOutcome.output`;
- it returns something that is not a number (int, float, numpy number, 0-d torch tensor) or None, or that
  float() cannot take: "returned list of 2 items, expected a float or None". The conversion runs where the call
  ran (its worker, or its thread in-process), so a value whose `__float__` hangs is a timeout like a hung call;
- its worker sends a reply that is not one: over MAX_REPLY_BYTES, or not JSON `[float or null, str or null]` (a
  reward can write to its worker's socket): "return value cannot come back from the worker (...)"; its worker is
  replaced. JSON has no shared references and builds only builtin objects, so a reply of n bytes makes at most n
  objects, and its type is checked before anything else: nothing a worker sends runs code or stalls the trainer.
`value` is a float or None: checking it (finite, within the clip) is the Scorer's job. A batched call (a TRL-style
reward on a group, `RewardCall.batch` > 0) is one call with one timeout: its outcome has `values` and `errors`,
one entry per completion (an entry that is not a number fails alone), or `error` when the whole call failed (the
faults above, or a return that is not a list of `batch` entries).

Functions travel by cloudpickle (installed with vLLM; it has to become a declared dependency): notebook, `__main__`,
closure and lambda rewards by value; functions of importable modules by reference, imported in the worker from the
trainer's `sys.path`. minirl's own rewards go by value, so a worker never imports minirl (and torch with it: its
start-up time and memory, BENCHMARKS.md, "Figures moved out of docstrings"). A worker is a fresh interpreter from
`subprocess.Popen` (no fork of a process running torch or vLLM threads, no re-run of the trainer's `__main__` as
multiprocessing's spawn does) that loads `worker_main.py` by path (standard library only). It runs one BLAS/OpenMP
thread. It dies with the trainer, even by SIGKILL: it sets PR_SET_PDEATHSIG (Linux), which fires when the *thread*
that started it ends, so one pool-owned thread starts them all. Memory is capped by RLIMIT_DATA, not RLIMIT_AS: it
counts what the reward allocates, not address space merely reserved (thread stacks, BLAS, CUDA's tens of GB once
initialised).

`workers=0` runs each call in-process in its own daemon thread, one call after another, with the same per-call
timeout and the same outcomes for raised errors, each on its own (deep) copy of its arguments as in a worker: the
opt-in for pure, cheap rewards. It cannot stop a call that hangs (the thread is abandoned, still running), survive
`os._exit` or a segfault, cap memory, or capture prints (`output` is None).
"""
from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import math
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import cloudpickle

from minirl.core import lifecycle
from minirl.rewards import worker_main
from minirl.rewards.worker_main import memory_hint, one_line, reason, recv_frame, run_batched, run_call, send_frame

MAX_REPLY_BYTES = 1 << 16  # a reply is a float and a reason of a few hundred characters
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# A worker's first lines: load this file by path (not `import minirl`, which imports torch), then serve.
_BOOT = ("import importlib.util, sys\n"
         "spec = importlib.util.spec_from_file_location('minirl_reward_worker', sys.argv[1])\n"
         "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
         "spec.loader.exec_module(module)\n"
         "module.serve(int(sys.argv[2]), int(sys.argv[3]))\n")


@dataclass(frozen=True)
class RewardCall:
    """One reward function applied to one completion; `columns` are the prompt's dataset columns. `batch` > 0: a
    batched (TRL-style) reward applied once to a group's `batch` completions: `prompt` and `completion` are then
    lists, `columns` the keyword arguments (lists, one entry per completion, and `trainer_state`)."""
    reward: str
    prompt: Any
    completion: Any
    columns: Mapping[str, Any] = field(default_factory=dict)
    batch: int = 0


@dataclass(frozen=True)
class RewardOutcome:
    """What one call gave. `value`: the returned number as a float (None: a skip, or a failure). `error`: None, or
    one line saying why the call failed. `output`: what the call printed (at most `max_output_bytes`), None
    in-process. A batched call's `values` and `errors`: one entry per completion (`error` set instead when the
    whole call failed)."""
    value: float | None = None
    error: str | None = None
    output: str | None = None
    values: tuple[float | None, ...] | None = None
    errors: tuple[str | None, ...] | None = None


class RewardWorkers:
    """A pool of reward worker processes (or, with `workers=0`, in-process threads); see the module docstring.

    Start-up happens here, so a reward that cannot be pickled or loaded in a worker fails now, with its name.
    `call_many` is safe to call from any thread; calls from several threads take turns."""

    def __init__(self, rewards: Sequence[tuple[str, Callable]], workers: int, timeout_s: float,
                 max_output_bytes: int = 64 << 10, memory_mb: int | None = 2048, start_timeout_s: float = 60.0):
        names = [name for name, _ in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}; give each reward its own name")
        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an int >= 0 (0 runs rewards in-process), got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.max_output_bytes = max_output_bytes
        self._fns = dict(rewards)
        self._batches: list[int] = []  # per call of the running `call_many`: its `batch`
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        if workers == 0:
            return
        self._start_timeout_s = start_timeout_s
        self._memory_mb = memory_mb
        self._init = pickle.dumps({"path": list(sys.path), "memory_mb": memory_mb,
                                   "rewards": [(name, _pickle_reward(name, fn)) for name, fn in rewards]})
        self._spawner = cf.ThreadPoolExecutor(1, thread_name_prefix="minirl-reward-spawner")
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._spawner)
        try:
            self._workers.extend(self._spawn() for _ in range(workers))
            while not all(w.ready for w in self._workers):
                self._pump([])
        except BaseException:
            self.close()
            raise

    def call_many(self, calls: Sequence[RewardCall]) -> list[RewardOutcome]:
        """Run the calls (in parallel over the workers) and return their outcomes in the same order."""
        unknown = sorted({c.reward for c in calls} - set(self._fns))
        if unknown:
            raise ValueError(f"unknown reward(s) {unknown}: this pool holds {sorted(self._fns)}")
        with self._lock:
            if self._closed:
                raise RuntimeError("this RewardWorkers is closed; make a new one")
            if not self._workers:
                return [self._call_here(c) for c in calls]
            out: list[RewardOutcome | None] = [None] * len(calls)
            todo = deque(range(len(calls)))
            self._batches = [c.batch for c in calls]
            blobs = [pickle.dumps((c.reward, c.prompt, c.completion, dict(c.columns), c.batch)) for c in calls]
            try:
                while todo or any(w.call is not None for w in self._workers):
                    for w in list(self._workers):
                        if todo and w.ready and w.call is None:
                            self._dispatch(w, todo, blobs)
                    self._pump(out)
            except BaseException:  # Ctrl-C, say: calls still running belong to no one now, and a worker caught
                for w in [w for w in self._workers if w.call is not None or not w.ready]:  # mid-frame is not trusted
                    self._replace(w)
                raise
            return out

    def close(self) -> None:
        """Kill every worker (waiting for a `call_many` under way to finish first)."""
        with self._lock:
            self._closed = True
            if self._workers:
                self._finalizer()

    def __enter__(self) -> "RewardWorkers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- in-process -----------------------------------------------------------------------------------------

    def _call_here(self, call: RewardCall) -> RewardOutcome:
        fn = self._fns[call.reward]

        def run() -> tuple[Any, Any]:
            # its own copy of what it is given, as a worker's call gets from the pickle (and under its timeout): a
            # reward that edits a column (appends to a list of tests) changes neither the data nor what the next
            # reward or sample is given
            prompt, completion, columns = _own_copy((call.prompt, call.completion, dict(call.columns)))
            if call.batch:
                return run_batched(fn, prompt, completion, columns, call.batch)
            return run_call(fn, prompt, completion, columns)
        return _outcome(*worker_main.call_in_thread(run, self.timeout_s, "minirl-reward"), None)

    # --- worker processes -----------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        mine, theirs = socket.socketpair()
        with theirs:
            cmd = [sys.executable, "-c", _BOOT, worker_main.__file__, str(theirs.fileno()), str(os.getpid())]
            proc = self._spawner.submit(
                subprocess.Popen, cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env={**os.environ, **_ONE_THREAD}, start_new_session=True).result()
        os.set_blocking(proc.stdout.fileno(), False)
        mine.settimeout(self._start_timeout_s)
        try:
            send_frame(mine, self._init)
        except OSError:
            pass  # it died at once: its exit shows up as the start-up failure, with its output
        mine.settimeout(5.0)
        lifecycle.adopt(proc.pid)  # belt and braces to PR_SET_PDEATHSIG: the watchdog ends it if we die
        return _Worker(proc, mine, deadline=time.monotonic() + self._start_timeout_s)

    def _replace(self, w: _Worker) -> None:
        _kill(w)
        self._workers[self._workers.index(w)] = self._spawn()

    def _dispatch(self, w: _Worker, todo: deque, blobs: list[bytes]) -> None:
        # busy before the first byte goes: a Ctrl-C between the send and this line left a worker running a call
        # while marked idle, and the next call_many's call went to it and waited out its timeout
        i = todo.popleft()
        w.call, w.deadline, w.printed, w.kept = i, time.monotonic() + self.timeout_s, 0, bytearray()
        try:
            send_frame(w.sock, blobs[i])
        except OSError:  # it died while idle (the OOM killer, say): not this call's fault
            w.call = None
            todo.appendleft(i)
            return self._replace(w)

    def _pump(self, out: list) -> None:
        """Wait for the next event of a busy or starting worker (a reply, some output, a deadline); handle it."""
        live = [w for w in self._workers if w.call is not None or not w.ready]
        poller = select.poll()  # not select.select: a trainer's descriptors can go past its limit of 1024
        for w in live:
            poller.register(w.sock, select.POLLIN)
            if not w.silent:
                poller.register(w.proc.stdout, select.POLLIN)
        wait = max(0.0, min(w.deadline for w in live) - time.monotonic())
        readable = {fd for fd, _ in poller.poll(math.ceil(wait * 1000))}
        for w in live:
            self._service(w, w.sock.fileno() in readable, out)

    def _service(self, w: _Worker, has_reply: bool, out: list) -> None:
        blob, oversize = None, None
        if has_reply:
            try:
                blob = recv_frame(w.sock, MAX_REPLY_BYTES + 1024 * (self._batches[w.call] if w.ready else 0))
            except ValueError as e:
                oversize = str(e)
            except OSError:
                pass  # a reply cut short: the worker is going, treated as EOF
        _drain(w, self.max_output_bytes)  # after the reply, so all the call printed is in
        if w.printed > self.max_output_bytes:
            if not w.ready:
                raise RuntimeError(f"a reward worker printed more than {self.max_output_bytes} bytes while loading "
                                   f"the rewards; its output began: {one_line(w.text())}")
            return self._end(w, out, f"output flood: printed more than {self.max_output_bytes} bytes")
        if oversize:
            return self._end(w, out, oversize)
        if not has_reply:
            if time.monotonic() < w.deadline:
                return
            if not w.ready:
                raise RuntimeError(f"a reward worker did not start within {self._start_timeout_s}s (loading the "
                                   "rewards took too long); raise start_timeout_s or make the rewards lighter")
            return self._end(w, out, f"timeout after {self.timeout_s}s")
        if blob is None:
            _kill(w)
            why = f"worker died ({_death(w.proc.returncode)}{', std::bad_alloc' * ('bad_alloc' in w.text())})"
            if not w.ready:
                raise RuntimeError(memory_hint(f"a reward {why} while starting; its output: "
                                               f"{one_line(w.text(), 2000)}", self._memory_mb))
            return self._end(w, out, memory_hint(why, self._memory_mb))
        try:
            value, error = _reply(blob, self._batches[w.call] if w.ready else 0)
        except Exception as e:  # noqa: BLE001 - any bytes that are not a reply are the call's failure
            value, error = None, f"return value cannot come back from the worker ({reason(e)})"
            if w.ready:
                return self._end(w, out, error)  # what it sends next would be taken for the next call's reply
        if not w.ready:
            if error is not None:
                raise RuntimeError(error)
            w.ready, w.printed, w.kept = True, 0, bytearray()
            return
        out[w.call] = _outcome(value, error, w.text())
        w.call = None

    def _end(self, w: _Worker, out: list, error: str) -> None:
        """Record a failed call whose worker cannot go on (or is not trusted to), and put a fresh one in its place."""
        out[w.call] = RewardOutcome(None, error, w.text())
        self._replace(w)


@dataclass(eq=False)
class _Worker:
    """A worker process as the trainer sees it (mutable: its state changes with every call)."""
    proc: subprocess.Popen
    sock: socket.socket
    deadline: float  # monotonic: end of its start-up, then of its running call
    ready: bool = False
    call: int | None = None  # index of the running call in `call_many`'s list
    printed: int = 0  # bytes printed since the call (or start-up) began
    kept: bytearray = field(default_factory=bytearray)  # the first max_output_bytes of them
    silent: bool = False  # its output pipe is at end of stream (a reward closed fds 1 and 2): no longer watched

    def text(self) -> str:
        return self.kept.decode("utf-8", "replace")


def _drain(w: _Worker, cap: int) -> None:
    """Read what the worker printed (its pipe is non-blocking), keeping at most `cap` bytes; stop past the cap."""
    while w.printed <= cap:
        try:
            data = os.read(w.proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return
        if not data:
            w.silent = True
            return
        w.kept += data[:max(0, cap - len(w.kept))]
        w.printed += len(data)


def _kill(w: _Worker) -> None:
    if w.proc.returncode is None:  # not reaped yet, so its pid (and group id) cannot belong to another process
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)  # its own session: the reward's subprocesses go too
        except ProcessLookupError:
            pass
    w.proc.wait()
    w.sock.close()
    w.proc.stdout.close()


def _own_copy(x: Any) -> Any:
    """A deep copy of a call's arguments; `x` itself where some column cannot be copied (it is the reward's then)."""
    try:
        return copy.deepcopy(x)
    except Exception:  # noqa: BLE001 - an object deepcopy cannot take: the call goes on with the shared one
        return x


def _shutdown(workers: list[_Worker], spawner: cf.ThreadPoolExecutor) -> None:
    for w in workers:
        _kill(w)
    spawner.shutdown(wait=False)


def _death(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    return f"signal {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"


def _pickle_reward(name: str, fn: Callable) -> bytes:
    top = (getattr(fn, "__module__", None) or "").partition(".")[0]
    own = top == __name__.partition(".")[0] and top not in cloudpickle.list_registry_pickle_by_value()
    if own:
        cloudpickle.register_pickle_by_value(sys.modules[top])
    try:
        return cloudpickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure gets the same advice
        raise ValueError(f"reward {name!r} cannot be sent to a worker process ({reason(e)}); define it at module "
                         "level or in the notebook without capturing unpicklable objects, or pass workers=0") from None
    finally:
        if own:
            cloudpickle.unregister_pickle_by_value(sys.modules[top])


def _reply(blob: bytes, batch: int = 0) -> tuple[Any, Any]:
    """A worker's reply (`worker_main.reply`), its type checked before it is used; ValueError for anything else.
    A batched call's: `[values, reasons]` (lists of `batch` floats or null, strs or null) or `[null, str]`."""
    r = json.loads(blob)
    if type(r) is not list or len(r) != 2:
        raise ValueError(f"a reply is a pair, not {blob[:40]!r}")
    if batch and r[0] is None and type(r[1]) is str:
        return None, one_line(r[1])
    if batch and all(type(x) is list and len(x) == batch for x in r) and \
            all(type(v) in (float, type(None)) for v in r[0]) and all(type(e) in (str, type(None)) for e in r[1]):
        return r[0], [None if e is None else one_line(e) for e in r[1]]
    if not batch and type(r[0]) in (float, type(None)) and type(r[1]) in (str, type(None)):
        return r[0], None if r[1] is None else one_line(r[1])
    raise ValueError(f"a reply is [float or null, str or null] (a batched call's: two lists of {batch}), "
                     f"not {blob[:40]!r}")


def _outcome(value: Any, error: Any, output: str | None) -> RewardOutcome:
    """A call's outcome from its (value, error): lists (one entry per completion) for a batched call's values."""
    if isinstance(value, list):
        return RewardOutcome(None, None, output, tuple(value), tuple(error))
    return RewardOutcome(value, error if error is None else one_line(error), output)

"""A program in the sandbox: `run_python` runs one to its end; `start` gives a `Sandboxed` (a program while it
runs, with an optional line channel on its fds 3 and 4) that `pump` moves along, several at once: what
`run_tests` talks to. `isolation()` names the isolation in effect here. What is and is not isolated:
`minirl/rewards/sandbox/__init__.py`."""
from __future__ import annotations

import functools
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

UNSANDBOXED = "none (rlimits only)"
SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")
MIB = 1 << 20
RAM_SHARE = 1 / 16          # the memory limits of one program's processes together, by default, as a share of RAM
MAX_TIMEOUT_S = 24 * 3600
CHANNEL_LIMIT = 16 * MIB    # what a program may write on its channel (fd 4) in all; killed past it
ENABLE_SANDBOX = ("run as root with CAP_SYS_ADMIN (Docker: --cap-add SYS_ADMIN), or allow unprivileged user "
                  "namespaces (sysctl kernel.unprivileged_userns_clone=1; Ubuntu 24.04: "
                  "kernel.apparmor_restrict_unprivileged_userns=0)")


@dataclass(frozen=True)
class SandboxResult:
    """One run. `returncode` is the exit code, or minus the signal that ended the program, or None when the run
    was killed for time or output or never started. `reason` is "" when ok, else why not."""
    ok: bool
    returncode: int | None
    stdout: str
    stderr: str
    reason: str
    seconds: float
    isolation: str


class SandboxUnavailable(RuntimeError):
    """No isolation works on this machine and the caller did not allow unsandboxed runs."""


def isolation() -> str:
    """The isolation `run_python` uses here: "unshare(mount,net,pid,ipc,uts)+fresh uid" (as root),
    "unshare(user,mount,net,pid,ipc,uts)" (otherwise), or "none"; "+memory cgroup v2" (or v1) where one cgroup
    holds all of a program's memory."""
    return _probe()[0]


def default_max_processes(memory_mb: float, ram_bytes: int | None = None) -> int:
    """The process cap when none is given: as many processes of `memory_mb` as fit in RAM_SHARE of RAM (of
    `ram_bytes`, else this machine's), at least 1 and at most 16."""
    ram = ram_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(16, int(ram * RAM_SHARE // (memory_mb * MIB))))


def run_python(code: str, *, stdin: str = "", timeout_s: float = 5, memory_mb: float = 512,
               max_output_bytes: int = 64_000, max_processes: int | None = None,
               allow_unsandboxed: bool = False) -> SandboxResult:
    """Run `code` as a Python program in the sandbox with `stdin` as its input. `memory_mb` limits each process's
    address space; `max_processes` (default: `default_max_processes(memory_mb)`) its processes and threads. The
    program's faults come back in the result, never as exceptions; raises SandboxUnavailable when no isolation
    works here, unless `allow_unsandboxed`."""
    return start(code, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                 max_processes=max_processes, allow_unsandboxed=allow_unsandboxed).wait()


def start(code: str, *, stdin: str = "", timeout_s: float = 5, memory_mb: float = 512, max_output_bytes: int = 64_000,
          max_processes: int | None = None, allow_unsandboxed: bool = False, channel: bool = False) -> Sandboxed:
    """Start `code` in the sandbox (arguments as `run_python`); with `channel`, it reads JSON lines from fd 3 and
    writes them to fd 4. Call `finish()` on what comes back, whatever happens."""
    limits = _limits(code, stdin, timeout_s, memory_mb, max_output_bytes, max_processes)
    _, mode, why_not = _probe()
    if mode == "none" and not allow_unsandboxed:
        raise SandboxUnavailable(f"no sandbox on this machine ({why_not}); {ENABLE_SANDBOX}; or pass "
                                 "allow_unsandboxed=True to run with resource limits only")
    return _start(code, stdin, mode, limits, timeout_s, max_output_bytes, _LABELS.get(mode, UNSANDBOXED), channel)


def _limits(code: Any, stdin: Any, timeout_s: Any, memory_mb: Any, max_output_bytes: Any,
            max_processes: Any) -> dict:
    """The supervisor's limits, or one line naming the argument that is wrong."""
    for name, value in (("code", code), ("stdin", stdin)):
        if not isinstance(value, str):
            raise TypeError(f"run_python: {name} must be a str, got {type(value).__name__}")

    def number(name: str, value: Any, unit: str, top: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= top:
            raise ValueError(f"run_python: {name} must be a number of {unit} > 0 and <= {top}, got {value!r}")
        return value
    timeout_s = number("timeout_s", timeout_s, "seconds", MAX_TIMEOUT_S)
    memory_bytes = max(MIB, int(number("memory_mb", memory_mb, "MiB", 1 << 20) * MIB))
    processes = default_max_processes(memory_bytes / MIB) if max_processes is None else max_processes
    for name, value in (("max_output_bytes", max_output_bytes), ("max_processes", processes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"run_python: {name} must be a whole number >= 1, got {value!r}")
    return dict(cpu_s=math.ceil(timeout_s), memory_bytes=memory_bytes, max_processes=processes)


_LABELS = {"root": "unshare(mount,net,pid,ipc,uts)+fresh uid", "user": "unshare(user,mount,net,pid,ipc,uts)"}


@functools.cache
def _probe() -> tuple[str, str, str]:
    """(label, mode, why not) of the isolation that works here, found once by running a trivial program."""
    mode = "root" if os.geteuid() == 0 else "user"
    label = _LABELS[mode]
    result = _start("pass", "", mode, dict(cpu_s=10, memory_bytes=512 * MIB, max_processes=4), 30, 64_000, label).wait()
    return (result.isolation, mode, "") if result.ok else ("none", "none", f"{label}: {result.reason}")


@dataclass(eq=False)
class Sandboxed:
    """A program running in the sandbox, as its caller sees it (mutable: `pump` moves it along). What it prints
    is kept up to `cap` bytes (past that it is killed); with a channel, `send` queues a JSON line for its fd 3 and
    `lines` collects the lines it writes on fd 4 (at most CHANNEL_LIMIT bytes in all, else it is killed)."""
    proc: subprocess.Popen
    label: str
    timeout_s: float
    started: float
    cap: int
    reading: dict[int, str]                   # open fd -> "out" | "err" | "status" | "replies"
    requests: int = -1                        # our end of its fd 3; -1 once closed (or no channel)
    lines: deque = field(default_factory=deque)
    killed: str = ""                          # "" | "timeout" | "output limit" | "channel limit"
    _got: dict = field(default_factory=lambda: {"out": bytearray(), "err": bytearray(), "status": bytearray()})
    _partial: bytearray = field(default_factory=bytearray)
    _channel_bytes: int = 0
    _outgoing: bytearray = field(default_factory=bytearray)
    _closing: bool = False
    _result: SandboxResult | None = None

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s

    @property
    def done(self) -> bool:
        """Ended (every stream at its end) or killed."""
        return bool(self.killed) or not self.reading

    def send(self, message: dict) -> None:
        """Queue one message for the program's fd 3 (written by `pump`; dropped once the program is gone)."""
        if self.requests >= 0:
            self._outgoing += json.dumps(message).encode() + b"\n"

    def end_requests(self) -> None:
        """Close its fd 3 once the queued messages are written (it reads the end of its requests)."""
        self._closing = True
        if not self._outgoing:
            self._close_requests()

    def kill(self, why: str) -> None:
        if not self.killed:
            self.killed = why
            self.proc.terminate()  # the supervisor kills the init, and the kernel the rest of the namespace

    def wait(self) -> SandboxResult:
        """Let it run to its end (or its deadline), then `finish`."""
        try:
            pump([self])
        finally:
            result = self.finish()
        return result

    def finish(self) -> SandboxResult:
        """Stop it if it still runs, wait for its supervisor, and say how it ended."""
        if self._result is None:
            self._result = self._finish()
        return self._result

    def _finish(self) -> SandboxResult:
        if not self.done:
            self.kill("stopped")
        if self.killed:
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        for fd in self.reading:
            os.close(fd)
        self.reading.clear()
        self._close_requests()
        out, err, lines = self._got["out"], self._got["err"], self._got["status"].decode().split("\n")
        kind, _, value = next((s for s in lines if s.startswith(("exit ", "signal ", "error "))), "").partition(" ")
        group = next((s.split(" ")[1] for s in lines if s.startswith("memory-group ")), "")
        returncode = None
        if self.killed:
            reason = f"timeout after {self.timeout_s:g}s" if self.killed == "timeout" else self.killed
        elif kind == "error":
            reason = f"sandbox setup failed: {value}"
        elif kind in ("exit", "signal"):
            returncode = int(value) if kind == "exit" else -int(value)
            reason = "memory limit" if returncode == -9 and "memory-limit" in lines else _reason(returncode, err)
        else:
            reason = f"the sandbox ended without a status (supervisor exit {self.proc.returncode})"
        out = out[:self.cap]
        return SandboxResult(ok=not reason, returncode=returncode, stdout=out.decode(errors="replace"),
                             stderr=err[:self.cap - len(out)].decode(errors="replace"), reason=reason,
                             seconds=time.monotonic() - self.started,
                             isolation=self.label + (f"+memory cgroup {group}" if group else ""))

    def _service(self, fd: int, role: str) -> None:
        if role == "requests":
            try:
                del self._outgoing[:os.write(fd, self._outgoing)]
            except BlockingIOError:
                return
            except OSError:  # it closed its fd 3, or ended: what it did not read is lost with it
                self._outgoing.clear()
            if not self._outgoing and self._closing:
                self._close_requests()
            return
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            os.close(fd)
            del self.reading[fd]
        elif role == "replies":
            self._take_lines(chunk)
        else:
            self._got[role] += chunk
            if len(self._got["out"]) + len(self._got["err"]) > self.cap:
                self.kill("output limit")

    def _take_lines(self, chunk: bytes) -> None:
        self._channel_bytes += len(chunk)
        if self._channel_bytes > CHANNEL_LIMIT:
            return self.kill("channel limit")
        self._partial += chunk
        if b"\n" in chunk:
            *complete, rest = self._partial.split(b"\n")
            self.lines.extend(bytes(line) for line in complete)
            self._partial = bytearray(rest)

    def _close_requests(self) -> None:
        if self.requests >= 0:
            os.close(self.requests)
            self.requests = -1


def pump(programs: Sequence[Sandboxed], until: Callable[[], bool] = lambda: False) -> None:
    """Move these programs' bytes (output, status, channel) until `until()` holds or every one has ended; one
    past its deadline is killed ("timeout")."""
    while not until():
        now = time.monotonic()
        for p in programs:
            if not p.done and now >= p.deadline:
                p.kill("timeout")
        live = [p for p in programs if not p.done]
        if not live:
            return
        poller, roles = select.poll(), {}  # poll, not select: a trainer's descriptors can go past 1024
        for p in live:
            for fd, role in p.reading.items():
                poller.register(fd, select.POLLIN)
                roles[fd] = (p, role)
            if p._outgoing and p.requests >= 0:
                poller.register(p.requests, select.POLLOUT)
                roles[p.requests] = (p, "requests")
        for fd, _ in poller.poll(max(0, math.ceil((min(p.deadline for p in live) - now) * 1000))):
            p, role = roles[fd]
            if not p.done:
                p._service(fd, role)


def _start(code: str, stdin: str, mode: str, limits: dict, timeout_s: float, cap: int, label: str,
           channel: bool = False) -> Sandboxed:
    """Start the supervisor on `code`, with pipes for its output and status (and its channel)."""
    started = time.monotonic()
    pipes = [os.pipe() for _ in range(5 if channel else 3)]  # out, err, status, [requests, replies]
    ours = [r for r, _ in pipes[:3]] + ([pipes[3][1], pipes[4][0]] if channel else [])
    theirs = [w for _, w in pipes[:3]] + ([pipes[3][0], pipes[4][1]] if channel else [])
    try:
        with tempfile.TemporaryFile() as code_file, tempfile.TemporaryFile() as stdin_file:
            # any str the policy can write travels: a lone surrogate as its bytes (the program sees a source it cannot
            # decode, a SyntaxError: a result, not an exception here)
            code_file.write(code.encode(errors="surrogatepass")), stdin_file.write(stdin.encode(errors="surrogatepass"))
            code_file.seek(0), stdin_file.seek(0)
            config = dict(mode=mode, code_fd=code_file.fileno(), status_fd=theirs[2], caller=os.getpid(),
                          requests_fd=theirs[3] if channel else -1, replies_fd=theirs[4] if channel else -1, **limits)
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", SUPERVISOR,
                                     *(f"{k}={v}" for k, v in config.items())],
                                    stdin=stdin_file, stdout=theirs[0], stderr=theirs[1], env={},
                                    start_new_session=True, pass_fds=(code_file.fileno(), *theirs[2:]))
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    if channel:
        os.set_blocking(ours[3], False)
    return Sandboxed(proc, label, timeout_s, started, cap, dict(zip(ours[:3], ("out", "err", "status")))
                     | ({ours[4]: "replies"} if channel else {}), requests=ours[3] if channel else -1)


def _reason(returncode: int, stderr: bytes) -> str:
    if returncode == 0:
        return ""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        return {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit"}.get(sig, f"killed by {sig.name}")
    last_line = stderr.decode(errors="replace").strip().rsplit("\n", 1)[-1]
    return "memory limit" if last_line.startswith("MemoryError") else f"exit code {returncode}"

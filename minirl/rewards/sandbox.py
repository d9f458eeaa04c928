"""Run model-written Python in a sandbox, for code-execution rewards. Standard library only; Linux only.

`run_python(code)` runs one program and returns a `SandboxResult`; `run_tests(completion, tests)` runs the code
of a completion, then each MBPP/HumanEval-style test, and reports passed/total; `isolation()` names the
isolation in effect here; `extract_code` takes the code out of a completion.

How. A supervisor (`sandbox_supervisor.py`, run as a script) unshares new mount, network, PID, IPC and UTS namespaces with
ctypes `unshare(2)` -- inside a new user namespace when it is not root, so that it may -- builds a private
filesystem view with `mount(2)`, and forks PID 1 of the new PID namespace, a small init that runs the program
as its child and reaps orphans. No external tool: bubblewrap and unshare(1), run as root, map the program to
uid 0 of the host, which the kernel exempts from the process limit. What is isolated:

- Network: none. The new network namespace is empty (even loopback is down): no host listener, 127.0.0.1
  included, can be reached; abstract unix sockets are per namespace too.
- Processes: the program sees only its own (own PID namespace and /proc) and cannot signal or trace the host's
  or its init. On timeout, output overflow or the caller's death the supervisor kills the init, and with it
  the kernel kills every process of the namespace: nothing outlives a run, detached daemons included.
- Identity: as root the program runs as a fresh unprivileged uid/gid (random, per run) with no capabilities;
  otherwise as the caller's uid in the user namespace, its capabilities there ending at exec. No new
  privileges (setuid binaries do nothing). Its environment is HOME, TMPDIR and PATH, nothing inherited.
- Limits (setrlimit; and nice 10): CPU seconds, address space (`memory_mb`, per process), processes and threads
  (`max_processes`, counted by the kernel per uid and user namespace: the fresh uid is what makes it hold as
  root), file size, open files, no core files. Output (stdout and stderr together) is read with a cap,
  `max_output_bytes`, and the run killed past it; `timeout_s` is wall-clock.
- Filesystem: every host mount is read-only; /tmp is a fresh 64 MiB tmpfs, the program's cwd and HOME, gone
  with the run; /root, /home, /run, /var/tmp are empty (the Python installation is mounted back, read-only, if
  it lives there); /dev holds null, zero, full, random, urandom only. No mount change reaches the host.

What is NOT isolated:
- The kernel is shared and its whole system-call surface is reachable (no seccomp filter); the program may
  create nested user namespaces. A kernel bug is a way out.
- The program can READ what an unprivileged user (as root) or the caller (otherwise) can read outside the
  hidden directories: system files, /sys, the Python installation and its site-packages, project directories.
- Memory is limited per process, so a run may use up to `max_processes * memory_mb`; there is no cgroup, and
  the tmpfs is charged to the caller. CPU is limited in seconds per process, not in share.
- Host-wide figures stay visible (/proc/meminfo, /proc/cpuinfo, load, kernel version, /sys).

Where isolation is unavailable (root without CAP_SYS_ADMIN, or unprivileged user namespaces disabled, as under
Docker's default profile or Ubuntu 24.04's AppArmor setting), `run_python` refuses with an error naming the fix,
unless the caller passes `allow_unsandboxed=True`: then the program runs under the rlimits only (as root the
process limit does not hold), in a private temporary directory, with isolation "none (rlimits only)".

"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

UNSANDBOXED = "none (rlimits only)"
SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_supervisor.py")


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


@dataclass(frozen=True)
class TestsResult:
    """The tests of one completion: how many passed, the first failure's reason ("" when all passed)."""
    passed: int
    total: int
    first_failure: str
    run: SandboxResult

    @property
    def fraction(self) -> float:
        return self.passed / self.total

    @property
    def all_passed(self) -> bool:
        return self.passed == self.total


class SandboxUnavailable(RuntimeError):
    """No isolation works on this machine and the caller did not allow unsandboxed runs."""


_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The code of a completion: its first ```python fenced block (failing that, its first unlabeled fenced
    block; a fence left open runs to the end), else the whole text."""
    blocks = _FENCE.findall(completion)
    labeled = [body for label, body in blocks if label] or [body for _, body in blocks]
    return labeled[0] if labeled else completion


def isolation() -> str:
    """The isolation `run_python` uses here: "unshare(mount,net,pid,ipc,uts)+fresh uid" (as root),
    "unshare(user,mount,net,pid,ipc,uts)" (otherwise), or "none"."""
    return _probe()[0]


def run_python(code: str, *, stdin: str = "", timeout_s: float = 5, memory_mb: int = 512,
               max_output_bytes: int = 64_000, max_processes: int = 16,
               allow_unsandboxed: bool = False) -> SandboxResult:
    """Run `code` as a Python program in the sandbox with `stdin` as its input. The program's faults come back
    in the result, never as exceptions; raises SandboxUnavailable when no isolation works here, unless
    `allow_unsandboxed`."""
    for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_output_bytes", max_output_bytes),
                        ("max_processes", max_processes)):
        if not value > 0:
            raise ValueError(f"run_python: {name} must be positive, got {value!r}")
    label, mode, why_not = _probe()
    if mode == "none" and not allow_unsandboxed:
        raise SandboxUnavailable(
            f"no sandbox on this machine ({why_not}); run as root with CAP_SYS_ADMIN, or enable unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1, or kernel.apparmor_restrict_unprivileged_userns"
            "=0 on Ubuntu), or pass allow_unsandboxed=True to run with resource limits only")
    limits = dict(cpu_s=math.ceil(timeout_s), memory_mb=memory_mb, max_processes=max_processes)
    return _launch(code, stdin, mode, limits, timeout_s, max_output_bytes, UNSANDBOXED if mode == "none" else label)


@functools.cache
def _probe() -> tuple[str, str, str]:
    """(label, mode, why not) of the isolation that works here, found once by running a trivial program."""
    mode = "root" if os.geteuid() == 0 else "user"
    label = "unshare(mount,net,pid,ipc,uts)+fresh uid" if mode == "root" else "unshare(user,mount,net,pid,ipc,uts)"
    result = _launch("pass", "", mode, dict(cpu_s=10, memory_mb=512, max_processes=16), 30, 64_000, label)
    return (label, mode, "") if result.ok else ("none", "none", f"{label}: {result.reason}")


def _launch(code: str, stdin: str, mode: str, limits: dict, timeout_s: float, max_output_bytes: int,
            label: str) -> SandboxResult:
    """Start the supervisor, collect capped output until it ends or the deadline, stop it, read its status."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as code_file, tempfile.TemporaryFile() as stdin_file:
        code_file.write(code.encode()), stdin_file.write(stdin.encode())
        code_file.seek(0), stdin_file.seek(0)
        status_r, status_w = os.pipe()
        config = dict(mode=mode, code_fd=code_file.fileno(), status_fd=status_w, caller=os.getpid(), **limits)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", SUPERVISOR,
                                     *(f"{k}={v}" for k, v in config.items())],
                                    stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                    start_new_session=True, pass_fds=(code_file.fileno(), status_w))
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
    with os.fdopen(status_r, "rb") as status_pipe:
        out, err, status, killed = _collect(proc, status_pipe, start + timeout_s, max_output_bytes)
    if killed:
        proc.terminate()  # the supervisor kills the init, and the kernel the rest of the namespace
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
    kind, _, value = status.partition("\n")[0].partition(" ")
    returncode = None
    if killed:
        reason = f"timeout after {timeout_s:g}s" if killed == "timeout" else killed
    elif kind == "error":
        reason = f"sandbox setup failed: {value}"
    elif kind in ("exit", "signal"):
        returncode = int(value) if kind == "exit" else -int(value)
        reason = _reason(returncode, err)
    else:
        reason = f"the sandbox ended without a status (supervisor exit {proc.returncode})"
    return SandboxResult(ok=not reason, returncode=returncode, stdout=out.decode(errors="replace"),
                         stderr=err.decode(errors="replace"), reason=reason, seconds=time.monotonic() - start,
                         isolation=label)


def _collect(proc: subprocess.Popen, status_pipe, deadline: float, cap: int) -> tuple[bytes, bytes, str, str]:
    """Read stdout, stderr and the status pipe until all close, keeping at most `cap` bytes of output (a flood
    stops the run, never fills memory). Returns (stdout, stderr, status, "" | "timeout" | "output limit")."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray(), status_pipe: bytearray()}
    killed = ""
    with selectors.DefaultSelector() as sel:
        for f in bufs:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map() and not killed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = "timeout"
                break
            for key, _ in sel.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                bufs[key.fileobj] += chunk
                if len(bufs[proc.stdout]) + len(bufs[proc.stderr]) > cap:
                    killed = "output limit"
    proc.stdout.close(), proc.stderr.close()
    out = bytes(bufs[proc.stdout][:cap])
    return out, bytes(bufs[proc.stderr][:cap - len(out)]), bufs[status_pipe].decode(), killed


def _reason(returncode: int, stderr: bytes) -> str:
    if returncode == 0:
        return ""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        return {signal.SIGXCPU: "CPU time limit", signal.SIGXFSZ: "file size limit"}.get(sig, f"killed by {sig.name}")
    last_line = stderr.decode(errors="replace").strip().rsplit("\n", 1)[-1]
    return "memory limit" if last_line.startswith("MemoryError") else f"exit code {returncode}"


# ---- tests of a completion (MBPP / HumanEval style) ----

_HARNESS = '''\
import json, sys
_nonce = sys.stdin.readline().strip()
def _report(**fields):
    sys.stdout.write("\\n" + _nonce + " " + json.dumps(fields) + "\\n")
    sys.stdout.flush()
_g = {"__name__": "solution"}
try:
    exec(compile(%(setup)r + "\\n" + %(code)r, "solution.py", "exec"), _g)
    if %(entry_point)r is not None and %(entry_point)r not in _g:
        raise NameError("the entry point " + %(entry_point)r + " is not defined")
except BaseException as e:
    _report(error=type(e).__name__ + ": " + str(e) + " (in the solution)")
    raise SystemExit(1)
for _i, _test in enumerate(%(tests)r):
    _where = " ".join(_test.split())[:300]
    try:
        exec(compile(_test, "<test %%d>" %% _i, "exec"), _g)
        if %(entry_point)r is not None and "check" in _g:
            _g.pop("check")(_g[%(entry_point)r])
        _report(i=_i, ok=True)
    except AssertionError as e:
        _report(i=_i, ok=False, error="assertion failed: " + _where + (" (" + str(e) + ")" if str(e) else ""))
    except BaseException as e:
        _report(i=_i, ok=False, error=type(e).__name__ + ": " + str(e) + " in: " + _where)
'''


def run_tests(completion: str, tests: list[str], *, entry_point: str | None = None, setup: str = "",
              timeout_s: float = 5, memory_mb: int = 512, allow_unsandboxed: bool = False) -> TestsResult:
    """Run the completion's code (see `extract_code`) after `setup`, then each test in the same namespace, all
    in one sandboxed run: MBPP tests are asserts (`assert f(1) == 2`); a HumanEval test defines
    `check(candidate)`, which is called with the `entry_point` function. A reward can use `fraction` or
    `all_passed`.

    A test counts as passed only when the harness reports it on a line tagged with a per-run nonce, so a program
    that exits early or prints a fake verdict passes nothing. Code that digs the nonce out of the harness's
    memory could still forge one: the verdict resists accidents and casual tampering, not a determined attack."""
    if not tests:
        raise ValueError("run_tests: tests is empty; pass at least one test")
    if entry_point is not None and not entry_point.isidentifier():
        raise ValueError(f"run_tests: entry_point must be a function name, got {entry_point!r}")
    nonce = secrets.token_hex(16)
    program = _HARNESS % dict(setup=setup, code=extract_code(completion), tests=list(tests), entry_point=entry_point)
    run = run_python(program, stdin=nonce + "\n", timeout_s=timeout_s, memory_mb=memory_mb,
                     allow_unsandboxed=allow_unsandboxed)
    verdicts, lines = {}, []
    for line in run.stdout.split("\n"):
        if line.startswith(nonce + " "):
            fields = json.loads(line[len(nonce) + 1:])
            verdicts[fields.get("i", "solution")] = fields
            if lines and not lines[-1]:
                lines.pop()  # the newline the harness wrote before its verdict
        else:
            lines.append(line)
    run = replace(run, stdout="\n".join(lines).strip("\n"))
    passed = [i for i in range(len(tests)) if verdicts.get(i, {}).get("ok")]
    first_failure = ""
    if "solution" in verdicts:
        first_failure = verdicts["solution"]["error"]
    elif len(passed) < len(tests):
        i = min(set(range(len(tests))) - set(passed))
        first_failure = verdicts[i]["error"] if i in verdicts else f"test {i} did not finish: {run.reason or 'exited'}"
    return TestsResult(passed=len(passed), total=len(tests), first_failure=first_failure, run=run)

"""Run model-written Python in a sandbox, for code-execution rewards. Standard library only; Linux only.

`run_python(code)` runs one program and returns a `SandboxResult`; `run_tests(completion, tests)` judges a
completion's code against MBPP / HumanEval-style tests from outside it (`code_tests.py`) and reports
passed / total; `isolation()` names the isolation in effect here; `extract_code` takes the code out of a
completion.

How. A supervisor (`supervisor.py`, run as a script) unshares new mount, network, PID, IPC and UTS namespaces
with ctypes `unshare(2)` -- inside a new user namespace when it is not root, so that it may -- builds a private
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
- Keys: it joins a fresh, empty session keyring, so the caller's session keyring (and the user keyring it links)
  is out of reach; the fresh uid (as root) or the new user namespace (otherwise) gives it an empty user keyring;
  /proc/keys and /proc/key-users are hidden. Where the key system calls are all blocked (Docker's default seccomp
  profile blocks add_key, request_key and keyctl; the filter is inherited) joining fails but it cannot reach any
  keyring either, and runs; where only some are blocked, it does not run.
- Memory: as root, one memory cgroup per run (v2 where the caller's group lets its children have the memory
  controller, else v1; `confine.py`) holds the program's processes, its init and supervisor: anonymous memory,
  its /tmp (tmpfs), pipes and page tables together may not pass `memory_mb` + 64 MiB (the /tmp) + 32 MiB (the
  init and the interpreter's start); past it the kernel kills the largest process ("memory limit"). `isolation()`
  then ends in "+memory cgroup v1" (or v2). The program, its init and supervisor have `oom_score_adj` 1000, so
  under host memory pressure the OOM killer takes them before the trainer.
- System calls (seccomp, `confine.escape_filter`): memfd_create, memfd_secret and shmget are refused (memory no
  rlimit counts), so are unshare/clone with CLONE_NEWUSER (a nested user namespace could mount a tmpfs of its
  own); clone3 answers ENOSYS (the C library falls back to clone); another architecture's calls ENOSYS.
- Limits (setrlimit; and nice 10): CPU seconds, address space (`memory_mb`, per process), processes and threads
  (`max_processes`, counted by the kernel per uid and user namespace: the fresh uid is what makes it hold as
  root; by default as many as keep their memory limits together under RAM_SHARE = 1/16 of RAM, 1 to 16), file
  size, open files, POSIX message queues (none), no core files. Output (stdout and stderr together) is read with
  a cap, `max_output_bytes`, and the run killed past it; `timeout_s` is wall-clock.
- Filesystem, an allowlist: of the entries of / only usr, bin, sbin, lib, lib32, lib64, libx32 stay (read-only:
  the system's programs and libraries); every other folder is an empty read-only tmpfs (/home, /root, /srv,
  /opt, /mnt, /var, /run, /sys, a project's folder...) and every other file at / an empty one; /etc holds only
  ld.so.cache, ld.so.conf(.d) and localtime; the Python installation (and its venv) is mounted back, read-only,
  where it lies in a hidden place; /tmp is a fresh 64 MiB tmpfs, the program's cwd and HOME, gone with the run;
  /dev holds null, zero, full, random, urandom only; /proc is its PID namespace's. No mount change reaches the
  host.

What is NOT isolated:
- The kernel is shared; the filter above refuses a few calls, every other call is reachable. A kernel bug is a
  way out.
- The program can read the shown folders: the system's files under /usr, the Python installation and its
  site-packages. A unix socket placed in one of those (mode 0777) would be reachable.
- Without a writable memory cgroup (not root, or a read-only cgroup filesystem) memory is limited per process:
  up to `max_processes * memory_mb` plus the 64 MiB /tmp and pipe buffers (at most 256 open files each); programs
  running at once add up (a `run_tests` with a test program runs two; each reward worker its own). CPU is
  limited in seconds per process, not in share.
- Host-wide figures stay visible (/proc/meminfo, /proc/cpuinfo, load, kernel version).

Where isolation is unavailable (root without CAP_SYS_ADMIN, or unprivileged user namespaces disabled, as under
Docker's default profile or Ubuntu 24.04's AppArmor setting), `run_python` refuses with an error naming the fix,
unless the caller passes `allow_unsandboxed=True`: then the program runs under the rlimits only (as root the
process limit does not hold), in a private temporary directory, with isolation "none (rlimits only)"; nothing
then keeps a program from the caller's files and processes, nor a solution from its tests.
"""
from .code_tests import SplitAssert, TestsResult, as_programs, extract_code, run_tests, split_assert
from .process import (
    UNSANDBOXED,
    Sandboxed,
    SandboxResult,
    SandboxUnavailable,
    default_max_processes,
    isolation,
    run_python,
    start,
)

__all__ = ["UNSANDBOXED", "SandboxResult", "SandboxUnavailable", "Sandboxed", "SplitAssert", "TestsResult",
           "as_programs", "default_max_processes", "extract_code", "isolation", "run_python", "run_tests",
           "split_assert", "start"]

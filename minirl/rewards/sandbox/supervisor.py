"""The sandbox's supervisor: run as a script (`python -I -S -B supervisor.py key=value ...`) by
`minirl.rewards.sandbox.process`, afresh for every program. It unshares the namespaces, builds the private filesystem
view, drops to a fresh uid and runs the program under its limits (see `minirl/rewards/sandbox/__init__.py` for what is and
is not isolated). Standard library only, and only light modules: every run pays for its imports."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import sys

if __package__:  # imported: by the tests
    from .confine import MemoryGroup, deny_escapes
else:  # run as a script under -I, which leaves the script's folder off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from confine import MemoryGroup, deny_escapes

TMP_MB = 64                                      # size of the private /tmp, and the largest file
SLACK_MB = 32                                    # the cgroup's room for the init and the interpreter's start
OPEN_FILES = 256
SHOWN = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")  # of /'s entries, the only ones shown (read-only)
ETC_SHOWN = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")  # of /etc: what the loader and time need
DEVICES = ("null", "zero", "full", "random", "urandom")

# ---- the supervisor: `python -I -S supervisor.py mode=... code_fd=... status_fd=... caller=... <limits>` ----

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = (
    1, 2, 4, 8, 32, 1024, 2048, 4096, 16384)
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MOUNT_OPTION_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                      "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
KEY_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219), "riscv64": (217, 218, 219)}
KEYCTL_JOIN_SESSION_KEYRING = 1
REQUESTS_FD, REPLIES_FD = 3, 4  # the program's ends of its channel (run_tests), when it has one
_libc.syscall.restype = ctypes.c_long


def _check(what: str, ret: int) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [s.encode() if s is not None else None for s in (source, target, fstype)]
    _check(f"mount {target}", _libc.mount(*args, ctypes.c_ulong(flags), data.encode() if data else None))


def _prctl(option: int, value: int) -> None:
    _check(f"prctl {option}", _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0))


def _enter_namespaces(mode: str) -> None:
    """New mount/net/pid/ipc/uts namespaces; when not root, inside a new user namespace that maps the caller's
    ids to themselves (a non-zero uid there, so the program's capabilities end at exec)."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    _check("unshare", _libc.unshare(flags | (CLONE_NEWUSER if mode == "user" else 0)))
    if mode == "user":
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _check("sethostname", _libc.sethostname(b"sandbox", 7))


def python_dirs() -> set[str]:
    """The folders of this Python installation (the outermost of nested ones), mounted back where the sandbox's
    filesystem view covers them."""
    dirs = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix,  # sys.prefix: not with -S
                                          os.path.dirname(os.path.dirname(sys.executable)),  # a venv
                                          os.path.dirname(os.path.realpath(sys.executable)))}
    return {d for d in dirs if not any(d.startswith(other + "/") for other in dirs)}


def _build_filesystem(mode: str, uid: int) -> None:
    """Private mounts, an allowlist: of /'s entries only SHOWN (system programs and libraries) stay, read-only;
    every other folder is an empty read-only tmpfs and every other file an empty one (/dev/null); /etc keeps
    ETC_SHOWN; the Python installation is mounted back (read-only) where it lay in a hidden place; /dev is
    DEVICES only; /tmp a fresh writable tmpfs owned by `uid`. /proc is the init's own (`_init`)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    shown = tuple(f"/{name}/" for name in SHOWN)
    covered = {d: os.open(d, os.O_PATH) for d in python_dirs() if not (d + "/").startswith(shown)}
    etc = {f"/etc/{name}": os.open(f"/etc/{name}", os.O_PATH) for name in ETC_SHOWN if os.path.exists(f"/etc/{name}")}
    devices = {name: os.open(f"/dev/{name}", os.O_PATH) for name in DEVICES}
    _make_all_read_only(keep_locked_flags=mode == "user")
    entries = [f"/{name}" for name in sorted(os.listdir("/")) if name not in (*SHOWN, "proc", "tmp")]
    emptied = [p for p in entries if os.path.isdir(p) and not os.path.islink(p)]
    for path in emptied:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    for path in entries:  # a file at the root (a symlink resolves into a hidden or a shown place)
        if not os.path.islink(path) and not os.path.isdir(path):
            _mount(f"/proc/self/fd/{devices['null']}", path, None, MS_BIND)
    _bind_back({d: fd for d, fd in covered.items() if not d.startswith("/tmp/")} | etc)
    _bind_back({f"/dev/{name}": fd for name, fd in devices.items()})
    os.mkdir("/dev/shm")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"/dev/{name}")
    os.symlink("/proc/self/fd", "/dev/fd")
    for path in emptied:
        _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=700,uid={uid},gid={uid},size={TMP_MB}m")
    _bind_back({d: fd for d, fd in covered.items() if d.startswith("/tmp/")})


def _bind_back(paths: dict[str, int]) -> None:
    """Bind each path's original (held open as an O_PATH fd) over the new mount that covered it. A bind keeps
    its source's read-only flag."""
    for path, fd in paths.items():
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, exist_ok=True)
        else:
            open(path, "w").close()
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)


def _make_all_read_only(keep_locked_flags: bool) -> None:
    """Remount every mount read-only. In a user namespace the kernel refuses a remount that would drop a mount's
    nosuid/nodev/noexec/atime flags, so those are passed back as they are."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target = fields[4]
        for code in ("040", "011", "012", "134"):  # mountinfo's escapes: space, tab, newline, backslash
            target = target.replace("\\" + code, chr(int(code, 8)))
        options = fields[5].split(",")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        if keep_locked_flags:
            flags |= sum(MOUNT_OPTION_FLAGS.get(o, 0) for o in options)
            flags |= 0 if {"relatime", "noatime"} & set(options) else MS_STRICTATIME
        _mount(None, target, None, flags)


def _supervise(config: dict) -> None:
    """The supervisor, outside the PID namespace: set up, fork the init, wait for it. SIGTERM (the caller's
    timeout) or the caller's death (parent-death signal) makes it kill the init, and so the whole namespace."""
    for key in ("status_fd", "code_fd", "requests_fd", "replies_fd"):  # away from the program's 3 and 4, and
        config[key] = _move_high(config[key])                           # none inherited past exec (the status!)
    mode, status_fd, child = config["mode"], config["status_fd"], 0

    def stop(*_):
        if not child:
            os._exit(1)
        os.kill(child, signal.SIGKILL)
        if mode == "none":
            _kill_group(child)

    signal.signal(signal.SIGTERM, stop)
    os.umask(0o022)
    if mode == "none":
        import tempfile
        workdir = tempfile.mkdtemp(prefix="minirl-sandbox-")
    group = None
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # inherited: the OOM killer takes the sandbox first
            f.write("1000")
        if mode == "root":  # before anything the program's processes will be charged for
            group = MemoryGroup.make(config["memory_bytes"] + (TMP_MB + SLACK_MB) * (1 << 20))
            if group is not None:
                os.write(status_fd, f"memory-group v{group.version}\n".encode())
        with os.fdopen(config["code_fd"], "rb") as f:
            code = f.read()
        uid = (1 << 30) + int.from_bytes(os.urandom(4), "little") % (1 << 30) if mode == "root" else os.getuid()
        if mode != "none":
            _enter_namespaces(mode)
            _build_filesystem(mode, uid)
        os.chdir(workdir if mode == "none" else "/tmp")
        with open("main.py", "wb") as f:
            f.write(code)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # set after unshare(CLONE_NEWUSER), which clears it
        if os.getppid() != config["caller"]:
            raise OSError("the caller exited during setup")
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no stop() before `child` is known
        child = os.fork()
        if child == 0:
            _guarded(_run_program if mode == "none" else _init, config, uid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        wait_status = os.waitpid(child, 0)[1]
        if mode == "none":  # no init here: report, and kill what the program left in its session
            _report_exit(status_fd, wait_status)
            _kill_group(child)
        if group is not None and group.oom_kills():  # after the init's line: the caller reads both
            os.write(status_fd, b"memory-limit\n")
    except OSError as e:
        os.write(status_fd, f"error {e}\n".encode())
    finally:
        if group is not None:
            group.remove()
        if mode == "none":
            import shutil
            shutil.rmtree(workdir, ignore_errors=True)


def _init(config: dict, uid: int) -> None:
    """PID 1 of the namespace: mount its /proc, fork the program, reap every orphan until the program ends, write
    its "exit N" / "signal N" to the status pipe, exit (and the kernel kills whatever is left)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_DUMPABLE, 0)  # its /proc/1/fd (the status pipe) closed to a program of the same uid
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # no handler: as PID 1 it ignores the program's signals
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in ("keys", "key-users"):  # no listing of keys it may view (where keyctl is blocked: the caller's)
        if os.path.exists(f"/proc/{name}"):
            _mount("/dev/null", f"/proc/{name}", None, MS_BIND)
    program = os.fork()
    if program == 0:
        _guarded(_run_program, config, uid)
    while True:
        pid, wait_status = os.wait()
        if pid == program:
            _report_exit(config["status_fd"], wait_status)
            os._exit(0)


def _run_program(config: dict, uid: int) -> None:
    """The last steps before the program: own session, limits, identity (a fresh uid as root), no new
    privileges, a fixed environment, then exec Python on main.py."""
    import resource
    os.setsid()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    mib = 1024 * 1024
    nproc = config["max_processes"] + (2 if config["mode"] == "user" else 0)  # there, the init and supervisor count
    for limit, value in ((resource.RLIMIT_CPU, (config["cpu_s"], config["cpu_s"] + 1)),
                         (resource.RLIMIT_AS, (config["memory_bytes"],) * 2), (resource.RLIMIT_NPROC, (nproc,) * 2),
                         (resource.RLIMIT_FSIZE, (TMP_MB * mib,) * 2), (resource.RLIMIT_NOFILE, (OPEN_FILES,) * 2),
                         (resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_MSGQUEUE, (0, 0))):
        resource.setrlimit(limit, value)
    os.nice(10)  # below the host's work, and below the supervisor that must kill it in time
    if config["mode"] == "root":
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _join_fresh_session_keyring()
    if config["requests_fd"] >= 0:
        os.dup2(config["requests_fd"], REQUESTS_FD)
        os.dup2(config["replies_fd"], REPLIES_FD)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    deny_escapes()
    env = {"HOME": os.getcwd(), "TMPDIR": os.getcwd(), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    os.execve(sys.executable, [sys.executable, "-I", "-B", "-X", "utf8", "main.py"], env)


def _join_fresh_session_keyring() -> None:
    """Leave the caller's session keyring (its keys, and through it the caller's user keyring) for a new, empty
    one. Where every key system call is blocked (Docker's default seccomp profile, inherited by the program) no
    keyring is reachable at all, and the run goes on; any other failure stops it."""
    machine = os.uname().machine
    if machine not in KEY_SYSCALLS:
        raise OSError(f"cannot give the program a fresh session keyring: key system calls unknown on {machine}")
    add_key, request_key, keyctl = KEY_SYSCALLS[machine]
    if _libc.syscall(keyctl, KEYCTL_JOIN_SESSION_KEYRING, None) >= 0:
        return
    failed = {ctypes.get_errno()}
    for number in (add_key, request_key):  # NULL arguments: EFAULT where the call is allowed at all
        _libc.syscall(number, None, None, None, 0, 0)
        failed.add(ctypes.get_errno())
    if not failed <= {errno.EPERM, errno.ENOSYS}:
        raise OSError(f"cannot give the program a fresh session keyring ({', '.join(map(os.strerror, failed))})")


def _move_high(fd: int) -> int:
    if fd < 0:
        return fd
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def _report_exit(status_fd: int, wait_status: int) -> None:
    sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else 0
    os.write(status_fd, (f"signal {sig}\n" if sig else f"exit {os.WEXITSTATUS(wait_status)}\n").encode())


def _guarded(step, config: dict, uid: int) -> None:
    """Run a forked child's step; a fault becomes an "error" status line; the child never returns."""
    try:
        step(config, uid)
    except BaseException as e:  # noqa: BLE001 -- report it; never fall back into the parent's code
        os.write(config["status_fd"], f"error {type(e).__name__}: {e}\n".encode())
    os._exit(127)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    _supervise({k: v if k == "mode" else int(v) for k, v in (arg.split("=", 1) for arg in sys.argv[1:])})
    sys.exit(0)

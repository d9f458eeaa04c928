"""No process outlives its run: every child minirl starts ends with it, however the run ends.

Normal ends (a run that finishes, raises, is stopped, Ctrl-C, SIGTERM) close the children in `Run._finish`. For the
ends no code of ours survives (SIGKILL of the trainer, a notebook kernel killed or restarted, an OOM kill), one
small watchdog process per trainer process holds the read end of a pipe that only the trainer writes to. When the
trainer dies, the kernel closes the pipe; the watchdog then ends every process it was told about (`adopt`) and their
descendants (SIGTERM, then SIGKILL after a grace period), removes the files and folders it was told about
(`keep_tidy`) and the /dev/shm files those processes mapped that this run made (vLLM's message queues, hundreds of
MB together, stay behind a killed engine otherwise: BENCHMARKS.md, "Figures moved out of docstrings"): a file that
was not in /dev/shm (that name, that inode) when the watchdog started, and that no process outside the run maps or
holds open; a file that merely changed while it watched (a write updates its ctime) stays. Then it exits. While the
trainer lives, the watchdog samples the descendants of the adopted processes (and their mappings) every `POLL_S`, so
grandchildren (a vLLM engine core's own workers, say) are known before they are orphaned. A pid is matched with its
start time, so a pid reused by an unrelated process is never touched.

Children also protect themselves where they can: reward workers, the generator process and vLLM servers set
PR_SET_PDEATHSIG; the sandbox kills its namespace. The watchdog is the net under all of them, including the
children that vLLM starts itself.

    lifecycle.adopt(pid)                      # a child we started: end it if we die
    with lifecycle.adopting():                # children started by library code inside the block (vLLM's engine)
        AsyncLLM.from_engine_args(...)
    lifecycle.keep_tidy(path) / lifecycle.tidied(path)   # a /dev/shm file or temp folder: remove it if we die
    lifecycle.settle()                        # wait until the watchdog has taken all that in and scanned once more
    with lifecycle.sigterm_interrupts():      # the CLI: SIGTERM stops a run as Ctrl-C does (`Terminated`)
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading

POLL_S = 0.5
GRACE_S = 3.0

_lock = threading.Lock()
_watchdog: subprocess.Popen | None = None


def _send(line: str) -> None:
    global _watchdog
    with _lock:
        if _watchdog is None or _watchdog.poll() is not None:
            _watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", _WATCHDOG, str(os.getpid()), str(POLL_S), str(GRACE_S)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
                start_new_session=True)  # its own session: a Ctrl-C to the terminal's job does not reach it
            _watchdog.stdout.readline()  # its /dev/shm snapshot is taken: whatever this run makes next is after it
        try:
            _watchdog.stdin.write((line + "\n").encode())
            _watchdog.stdin.flush()
        except (BrokenPipeError, OSError):
            _watchdog = None


def settle(timeout_s: float = 30.0) -> bool:
    """Wait until the watchdog knows everything this process told it so far and has scanned the adopted processes
    once more (their descendants and the /dev/shm files they map are then known, should this process die now). The
    watchdog scans every `POLL_S` anyway; this is for code that must know it has (a grandchild about to be
    orphaned, a test). False: no watchdog answered within `timeout_s` (none runs, or not Linux)."""
    with _lock:
        if _watchdog is None or _watchdog.poll() is not None:
            return False
        try:
            _watchdog.stdin.write(b"scan\n")
            _watchdog.stdin.flush()
            ready, _, _ = select.select([_watchdog.stdout], [], [], timeout_s)
            return bool(ready) and _watchdog.stdout.readline() == b"scanned\n"
        except (BrokenPipeError, OSError, ValueError):
            return False


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def adopt(pid: int) -> None:
    """End process `pid` (and its descendants) if this process dies before it."""
    if sys.platform.startswith("linux") and (st := _start_time(pid)) is not None:
        _send(f"pid {pid} {st}")


def children() -> set[int]:
    """Pids of this process's live children."""
    me = str(os.getpid())
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[1].decode() == me:
                        out.add(int(d))
            except (OSError, IndexError):
                pass
    return out


@contextlib.contextmanager
def adopting():
    """Adopt every child this process starts inside the block (for children that library code starts). Children
    are looked for every `POLL_S` while the block runs, not only at its end: a block that takes a minute (vLLM
    starting its engine core, then waiting for it to load the model) can be cut short by a kill at any moment."""
    if not sys.platform.startswith("linux"):
        yield
        return
    _send("watch")  # the watchdog starts now: its /dev/shm snapshot precedes what the block's children make
    seen = children()
    done = threading.Event()

    def sweep() -> None:  # the watchdog itself may start inside the block: never adopt it (it would end itself first)
        for pid in children() - seen - {watchdog_pid()}:
            seen.add(pid)
            adopt(pid)

    def poll() -> None:
        while not done.wait(POLL_S):
            sweep()
    watcher = threading.Thread(target=poll, name="minirl-adopting", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        sweep()


_held: dict[str, int] = {}  # private file or folder -> the descriptor whose shared flock says "its owner lives"


def keep_tidy(path: str | os.PathLike) -> None:
    """Remove `path` (a file or a folder) if this process dies before `tidied(path)`."""
    if sys.platform.startswith("linux"):
        _send(f"path {os.fspath(path)}")


def tidied(path: str | os.PathLike) -> None:
    """`path` was removed (or handed over): the watchdog forgets it, and its life lock is released."""
    fd = _held.pop(os.fspath(path), None)
    if fd is not None:
        os.close(fd)
    if sys.platform.startswith("linux") and _watchdog is not None:
        _send(f"unpath {os.fspath(path)}")


def shm_dir() -> str | None:
    """/dev/shm when writable (RAM-backed), else None (the system temp folder)."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _publish(tmp: str, folder: str, tag: str, fd: int, is_dir: bool) -> str:
    """Hold a shared flock on the new file or folder `tmp` (open as `fd`) for its life, then give it its sweepable
    `minirl-TAG-PID-RANDOM` name: `sweep_stale` never sees one whose lock is not held yet."""
    fcntl.flock(fd, fcntl.LOCK_SH)
    while True:
        path = os.path.join(folder, f"minirl-{tag}-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            if is_dir:  # (a rename would replace an empty folder: the 48 random bits are what keep the name new)
                if os.path.lexists(path):
                    continue
                os.rename(tmp, path)
            else:
                os.link(tmp, path)  # never over an existing name
                os.unlink(tmp)
            break
        except FileExistsError:
            continue
    _held[path] = fd
    keep_tidy(path)
    return path


def private_file(tag: str, nbytes: int) -> str:
    """A new file of `nbytes` zero bytes in /dev/shm (else the temp folder) that only this user can open: created
    with O_CREAT | O_EXCL | O_NOFOLLOW and mode 0600 under a random name (never an existing file or a planted
    link), locked (a shared flock) until `tidied`, and removed by the watchdog if this process dies first. The
    caller unlinks it and calls `tidied`."""
    folder = shm_dir() or tempfile.gettempdir()
    while True:
        tmp = os.path.join(folder, f".minirl-new-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:
            continue
    try:
        path = _publish(tmp, folder, tag, fd, is_dir=False)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.unlink(path)
        tidied(path)
        raise
    return path


def private_dir(tag: str) -> str:
    """A new folder (0700) in /dev/shm (else the temp folder), locked until `tidied` as `private_file` is, and
    removed by the watchdog if this process dies first."""
    folder = shm_dir() or tempfile.gettempdir()
    tmp = tempfile.mkdtemp(prefix=f".minirl-new-{os.getpid()}-", dir=folder)
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _publish(tmp, folder, tag, fd, is_dir=True)
    except BaseException:
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_OURS = re.compile(r"^minirl-[a-z]+-(\d+)-")


def sweep_stale() -> list[str]:
    """Remove what killed minirl processes of this user left in /dev/shm and the temp folder: files and folders
    named by `private_file` / `private_dir` whose life lock nobody holds. Proof of death is the lock, not a
    missing /proc/PID: a run in another PID namespace (a container sharing /dev/shm) has no /proc entry here, but
    its lock is seen. The sweep holds the lock exclusively while it removes. Returns the removed paths."""
    removed = []
    for folder in {shm_dir() or tempfile.gettempdir(), tempfile.gettempdir()}:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
                if not _OURS.match(name) or st.st_uid != os.getuid() or stat.S_ISLNK(st.st_mode):
                    continue
                is_dir = stat.S_ISDIR(st.st_mode)
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if is_dir else 0))
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its owner (anywhere) holds it
                shutil.rmtree(path) if is_dir else os.unlink(path)
                removed.append(path)
            except OSError:
                pass
            finally:
                os.close(fd)
    return removed


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by `sigterm_interrupts`: every `except KeyboardInterrupt` / `finally`
    that makes a Ctrl-C stop clean (the run's checkpoint, its children closed) does the same for a SIGTERM."""


@contextlib.contextmanager
def sigterm_interrupts():
    """Inside the block, SIGTERM raises `Terminated` in the main thread, as SIGINT raises KeyboardInterrupt; without
    it a SIGTERM ends Python at once, like SIGKILL, and nothing is saved or closed. One SIGTERM is enough: later
    ones are ignored while the stop is under way (SIGKILL still ends it, and the watchdog its children). Only
    from the main thread; elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated("SIGTERM")
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def watchdog_pid() -> int | None:
    return _watchdog.pid if _watchdog is not None and _watchdog.poll() is None else None


# The watchdog's program, run by path (standard library only, `-I -S`: it starts at once)
_WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog_main.py")


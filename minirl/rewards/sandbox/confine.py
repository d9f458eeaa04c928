"""What bounds a sandboxed program besides its namespaces and rlimits (see `__init__.py`): a memory cgroup that
counts all of its memory, and a system-call filter that refuses the memory no limit counts where no cgroup is
writable. Standard library only: loaded by the supervisor (`supervisor.py`), afresh for every run."""
from __future__ import annotations

import ctypes
import errno
import os

CLONE_NEWUSER = 0x10000000
_libc = ctypes.CDLL(None, use_errno=True)


class MemoryGroup:
    """A memory cgroup of this run, holding the supervisor and all it forks: every page the program's processes
    use (anonymous, tmpfs, memfd, shm) counts against one limit. cgroup v2 where this process's own group lets
    its children have the memory controller, else v1's memory hierarchy; `make` gives None where neither is
    writable. The files it needs stay open: the filesystem view the program gets hides /sys."""

    def __init__(self, version: int, path: str, parent: int, parent_procs: int, events: int):
        self.version, self.path = version, path
        self._parent, self._parent_procs, self._events = parent, parent_procs, events

    @classmethod
    def make(cls, limit_bytes: int) -> "MemoryGroup | None":
        for version, root, own in _memory_hierarchies():
            parent = root + own.rstrip("/")
            if version == 2:
                try:
                    with open(f"{parent}/cgroup.subtree_control") as f:
                        if "memory" not in f.read().split():
                            continue
                except OSError:
                    continue
            _remove_stale(parent)
            path = f"{parent}/minirl-sandbox-{os.getpid()}-{os.urandom(4).hex()}"
            try:
                os.mkdir(path, 0o700)
            except OSError:
                continue
            try:
                limits = {1: (("memory.limit_in_bytes", limit_bytes), ("memory.memsw.limit_in_bytes", limit_bytes)),
                          2: (("memory.max", limit_bytes), ("memory.swap.max", 0))}[version]
                for i, (name, value) in enumerate(limits):
                    if i == 0 or os.path.exists(f"{path}/{name}"):  # no swap file where swap is not accounted
                        _write(f"{path}/{name}", str(value))
                group = cls(version, path, os.open(parent, os.O_PATH | os.O_CLOEXEC),
                            os.open(f"{parent}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC),
                            os.open(f"{path}/{'memory.oom_control' if version == 1 else 'memory.events'}",
                                    os.O_RDONLY | os.O_CLOEXEC))
                _write(f"{path}/cgroup.procs", str(os.getpid()))
                return group
            except OSError:  # a limit it may not set: the next hierarchy, or none
                os.rmdir(path)
        return None

    def oom_kills(self) -> int:
        """How many of its processes the kernel killed for the limit."""
        for line in os.pread(self._events, 1 << 16, 0).decode().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Leave the group (back to the parent), then remove it (by the parent's fd: the view built for the
        program hides /sys from this process too)."""
        os.write(self._parent_procs, str(os.getpid()).encode())
        try:
            os.rmdir(os.path.basename(self.path), dir_fd=self._parent)
        except OSError:
            pass  # the next run's `make` removes it (`_remove_stale`)
        for fd in (self._parent, self._parent_procs, self._events):
            os.close(fd)


def _remove_stale(parent: str) -> None:
    """Remove the groups of earlier runs whose supervisor is gone (left where a removal failed)."""
    for name in os.listdir(parent):
        if name.startswith("minirl-sandbox-") and not os.path.exists(f"/proc/{name.split('-')[2]}"):
            try:
                os.rmdir(f"{parent}/{name}")
            except OSError:
                pass


def _memory_hierarchies() -> list[tuple[int, str, str]]:
    """(version, mount point, this process's group in it) of the memory cgroup hierarchies mounted here, v2
    first."""
    with open("/proc/self/cgroup") as f:
        own = {}
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            own[controllers] = path
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            after = fields[fields.index("-") + 1:]
            if after[0] == "cgroup2" and "" in own:
                found.append((2, fields[4], own[""]))
            elif after[0] == "cgroup" and "memory" in after[2].split(","):
                path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
                if path is not None:
                    found.append((1, fields[4], path))
    return sorted(found)[::-1]


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# system call numbers: memfd_create, memfd_secret, shmget (memory outside the limits where no cgroup counts it),
# clone3 (its flags are behind a pointer: answered ENOSYS, and the C library falls back to clone), unshare and
# clone (refused with CLONE_NEWUSER: a nested user namespace may mount a tmpfs of its own). Both little-endian.
ESCAPE_SYSCALLS = {"x86_64": (0xC000003E, dict(memfd_create=319, memfd_secret=447, shmget=29, clone3=435,
                                               unshare=272, clone=56)),
                   "aarch64": (0xC00000B7, dict(memfd_create=279, memfd_secret=447, shmget=194, clone3=435,
                                                unshare=97, clone=220))}


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def escape_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """The seccomp program (classic BPF: code, jt, jf, k) `_deny_escapes` installs: another architecture's calls
    (and x32's) ENOSYS; memfd_create, memfd_secret, shmget EPERM; clone3 ENOSYS; unshare and clone EPERM when
    their flags hold CLONE_NEWUSER; everything else allowed."""
    if machine not in ESCAPE_SYSCALLS:
        raise OSError(f"no system call filter for {machine}: the sandbox cannot bound the program's memory here")
    arch, nr = ESCAPE_SYSCALLS[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, deny = 0x7FFF0000, lambda e: 0x00050000 | e
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny(errno.ENOSYS)), (ld, 0, 0, 0),
            (jge, 0, 1, 0x40000000), (ret, 0, 0, deny(errno.ENOSYS))]
    for name, err in (("memfd_create", errno.EPERM), ("memfd_secret", errno.EPERM), ("shmget", errno.EPERM),
                      ("clone3", errno.ENOSYS)):
        prog += [(jeq, 0, 1, nr[name]), (ret, 0, 0, deny(err))]
    for name in ("unshare", "clone"):  # flags: the low half of the first argument (seccomp_data.args[0], at 16)
        prog += [(jeq, 0, 3, nr[name]), (ld, 0, 0, 16), (jset, 0, 1, CLONE_NEWUSER),
                 (ret, 0, 0, deny(errno.EPERM)), (ld, 0, 0, 0)]
    return prog + [(ret, 0, 0, allow)]


def deny_escapes() -> None:
    """Install `escape_filter` for the program (inherited by all it starts; needs no_new_privs)."""
    insns = [_Insn(*i) for i in escape_filter(os.uname().machine)]
    if _libc.prctl(22, 2, ctypes.byref(_Prog(len(insns), (_Insn * len(insns))(*insns))), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"seccomp: {os.strerror(ctypes.get_errno())}")

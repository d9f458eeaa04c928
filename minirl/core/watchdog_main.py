"""The watchdog (`lifecycle.py`): one per trainer process, run by path with `python -I -S` (standard library only:
no site, no minirl, no torch: it starts at once). argv: the trainer's pid, the poll interval, the grace period.
stdin: lines from the trainer (`pid PID START`, `path PATH`, `unpath PATH`, `watch`, `scan`); EOF = the trainer died.
stdout: `ready` once its /dev/shm snapshot is taken; `scanned` after each `scan` (`lifecycle.settle`), once the lines
before it are taken in and the adopted processes scanned."""
import os
import select
import shutil
import signal
import sys
import time

parent, poll_s, grace_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
adopted, known, paths, mapped = {}, {}, set(), set()
try:  # what /dev/shm held before this run: never this run's to remove, however it changes
    before = {(e.name, e.inode()) for e in os.scandir("/dev/shm")}
except OSError:
    before = set()
os.write(1, b"ready\n")

def stat(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return int(rest[1]), rest[19].decode(), rest[0] == b"Z"
    except (OSError, IndexError, ValueError):
        return None

def alive(pid, start):
    s = stat(pid)
    return s is not None and s[1] == start and not s[2]

def scan():
    for pid, start in list(adopted.items()) + list(known.items()):
        if not alive(pid, start):
            adopted.pop(pid, None); known.pop(pid, None)
    tree = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (s := stat(int(d))) is not None:
            tree.setdefault(s[0], []).append((int(d), s[1]))
    todo = list(adopted)
    while todo:
        for pid, start in tree.get(todo.pop(), ()):
            if pid not in known and pid not in adopted:
                known[pid] = start
                todo.append(pid)
    for pid in list(adopted) + list(known):  # their shared-memory files (vLLM's message queues, say)
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if " /dev/shm/" in line and not line.endswith("(deleted)\n"):
                        fields = line.rstrip("\n").split(None, 5)
                        mapped.add((fields[5], int(fields[4])))
        except (OSError, IndexError, ValueError):
            pass

def held_elsewhere(skip):
    """Inodes of /dev/shm files that live processes outside the run map or hold open."""
    inodes = set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in skip:
            continue
        try:
            with open(f"/proc/{d}/maps") as f:
                inodes.update(int(line.split(None, 5)[4]) for line in f if " /dev/shm/" in line)
            for fd in os.listdir(f"/proc/{d}/fd"):
                try:
                    if os.readlink(f"/proc/{d}/fd/{fd}").startswith("/dev/shm/"):
                        inodes.add(os.stat(f"/proc/{d}/fd/{fd}").st_ino)
                except OSError:
                    pass
        except (OSError, IndexError, ValueError):
            pass
    return inodes

def end_all():
    scan()
    victims = {**known, **adopted}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, start in victims.items():
            if alive(pid, start):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5)
        while time.monotonic() < deadline and any(alive(p, s) for p, s in victims.items()):
            time.sleep(0.05)
    elsewhere = held_elsewhere(set(victims) | {os.getpid(), parent})
    for p, ino in mapped:  # made by this run: new since the watchdog started, and used by nobody else
        try:
            st = os.stat(p)
            if st.st_ino == ino and (os.path.basename(p), ino) not in before and st.st_uid == os.getuid() \
                    and ino not in elsewhere:
                os.unlink(p)
        except OSError:
            pass
    for p in paths:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except OSError:
                pass

buf = b""
while True:
    ready, _, _ = select.select([0], [], [], poll_s)
    if ready:
        data = os.read(0, 65536)
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            kind, _, rest = line.decode().partition(" ")
            if kind == "pid":
                pid, start = rest.split()
                if int(pid) != os.getpid():
                    adopted[int(pid)] = start
            elif kind == "path":
                paths.add(rest)
            elif kind == "unpath":
                paths.discard(rest)
            elif kind == "scan":
                scan()
                try:
                    os.write(1, b"scanned\n")
                except OSError:  # the trainer is gone (EOF follows)
                    pass
    scan()
    if os.getppid() != parent:
        break
end_all()

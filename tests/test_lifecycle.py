"""The watchdog: when the trainer process dies, however it dies, its children and their files go with it."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only (/proc, pipes)")

PARENT = textwrap.dedent("""
    import importlib.util, json, os, subprocess, sys, tempfile, time
    spec = importlib.util.spec_from_file_location("lifecycle", sys.argv[1])
    lifecycle = importlib.util.module_from_spec(spec); spec.loader.exec_module(lifecycle)
    sleeper = subprocess.Popen(["sleep", "1000"])
    lifecycle.adopt(sleeper.pid)
    with lifecycle.adopting():  # as if a library started it: a child that starts a grandchild of its own
        tree = subprocess.Popen(["bash", "-c", "sleep 1000 & echo $! > " + sys.argv[2] + "; wait"])
    fd, shm = tempfile.mkstemp(prefix="minirl-test-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    os.close(fd)
    lifecycle.keep_tidy(shm)
    folder = tempfile.mkdtemp(prefix="minirl-test-")
    lifecycle.keep_tidy(folder)
    while not (os.path.exists(sys.argv[2]) and os.path.getsize(sys.argv[2])):  # the grandchild runs
        time.sleep(0.05)
    assert lifecycle.settle()  # the watchdog has scanned the tree since: it knows the grandchild
    print(json.dumps({"pids": [sleeper.pid, tree.pid, int(open(sys.argv[2]).read())], "paths": [shm, folder],
                      "watchdog": lifecycle.watchdog_pid()}), flush=True)
    if sys.argv[3] == "exit":
        sys.stdin.readline()  # once the test has seen them all running (else, on a loaded machine, they might not be)
        sys.exit(0)  # a normal exit that forgot to close its children
    time.sleep(1000)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids, paths, seconds: float) -> float:
    """Wait for the pids to end and the paths to go; `seconds` only bounds a hang (the watchdog's grace is 3 s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not any(_alive(p) for p in pids) and not any(os.path.exists(p) for p in paths):
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"left behind: {[p for p in pids if _alive(p)]} {[p for p in paths if os.path.exists(p)]}")


@pytest.mark.parametrize("ending", ["SIGKILL", "exit"])
def test_children_grandchildren_and_files_end_with_the_trainer(tmp_path, ending):
    import minirl.core.lifecycle as lifecycle
    parent = subprocess.Popen([sys.executable, "-c", PARENT, lifecycle.__file__, str(tmp_path / "grandchild"),
                               ending], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(parent.stdout.readline())
    assert all(_alive(p) for p in info["pids"]) and all(os.path.exists(p) for p in info["paths"])
    if ending == "SIGKILL":
        parent.send_signal(signal.SIGKILL)
    else:  # it exits now: before, it exited at once, and CI once read its line after the watchdog had ended them
        parent.stdin.write("go\n")
        parent.stdin.flush()
    parent.wait(30)
    _gone_within(info["pids"] + [info["watchdog"]], info["paths"], 30)


def _stat_start(pid: int) -> str:
    """A process's start time as /proc gives it (what the watchdog matches a pid with)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def test_a_reused_pid_is_never_touched():
    """The watchdog matches a pid with its start time: a process it was told about that ended, and whose pid now
    belongs to someone else (simulated: a pid told with a wrong start time), is left alone, while a process told
    with its own start time (the positive control, in the same watchdog) is ended. The watchdog program is driven
    through its documented stdin protocol (`watchdog_main.py`), this test standing for the trainer."""
    import minirl.core.lifecycle as lifecycle
    bystander, victim = subprocess.Popen(["sleep", "1000"]), subprocess.Popen(["sleep", "1000"])
    program = str(Path(lifecycle.__file__).with_name("watchdog_main.py"))
    wd = subprocess.Popen([sys.executable, "-I", "-S", program, str(os.getpid()), "0.5", "3"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert wd.stdout.readline() == b"ready\n"
        wd.stdin.write(f"pid {bystander.pid} 1\npid {victim.pid} {_stat_start(victim.pid)}\nscan\n".encode())
        wd.stdin.flush()
        assert wd.stdout.readline() == b"scanned\n"  # both lines taken in
        wd.stdin.close()  # the trainer "died": the watchdog ends what it was told about, then exits
        wd.wait(30)
        assert not _alive(victim.pid)  # the control: a pid told with its start time is ended
        assert _alive(bystander.pid)
    finally:
        for p in (bystander, victim, wd):
            p.kill()
            p.wait()


def test_a_watchdog_started_inside_adopting_does_not_adopt_itself(tmp_path):
    """The first lifecycle call of a process can be `adopting()` itself (a vLLM engine is the run's first child):
    the watchdog then starts inside the block and must not count itself among the children it ends, or it
    would end itself first and leave the others."""
    import minirl.core.lifecycle as lifecycle
    script = textwrap.dedent(f"""
        import importlib.util, json, subprocess, sys, time
        spec = importlib.util.spec_from_file_location("lifecycle", {lifecycle.__file__!r})
        lc = importlib.util.module_from_spec(spec); spec.loader.exec_module(lc)
        with lc.adopting():  # starts the watchdog inside the block; the block's sweep adopts the child
            child = subprocess.Popen([sys.executable, "-c", "import signal, time; "  # SIGKILL is needed to end it
                                      "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)"])
        assert lc.settle()  # the watchdog has taken the adoption in and scanned
        print(json.dumps([child.pid, lc.watchdog_pid()]), flush=True)
        time.sleep(1000)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child, watchdog = json.loads(parent.stdout.readline())
    assert _alive(child) and _alive(watchdog)
    parent.send_signal(signal.SIGKILL)
    parent.wait(30)
    _gone_within([child, watchdog], [], 30)


def test_shared_memory_a_child_made_goes_with_it_and_an_older_file_stays(tmp_path):
    """vLLM's message queues are /dev/shm files its engine core makes and maps: the watchdog removes the
    files its processes mapped, but only those made while it watched (an older file they mapped is not theirs)."""
    import minirl.core.lifecycle as lifecycle
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    older = Path(f"/dev/shm/minirl-test-older-{os.getpid()}")
    older.write_bytes(b"\0" * 4096)  # in /dev/shm before the run's watchdog takes its snapshot
    child_code = ("import mmap, os, sys, time\n"
                  "maps = []\n"
                  "for p in sys.argv[1:]:\n"
                  "    if not os.path.exists(p):\n"
                  "        open(p, 'wb').truncate(4096)\n"
                  "    f = open(p, 'r+b'); maps.append(mmap.mmap(f.fileno(), 4096))\n"
                  "print('mapped', flush=True); time.sleep(1000)\n")
    script = textwrap.dedent(f"""
        import importlib.util, json, subprocess, sys, time
        spec = importlib.util.spec_from_file_location("lifecycle", {lifecycle.__file__!r})
        lc = importlib.util.module_from_spec(spec); spec.loader.exec_module(lc)
        with lc.adopting():  # starts the watchdog: its /dev/shm snapshot is taken before this returns
            pass
        child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], stdout=subprocess.PIPE)
        child.stdout.readline()
        lc.adopt(child.pid)
        assert lc.settle()  # the watchdog has read its mappings
        print(child.pid, flush=True)
        time.sleep(1000)
    """)
    made = f"/dev/shm/minirl-test-made-{os.getpid()}"
    try:
        parent = subprocess.Popen([sys.executable, "-c", script, child_code, made, str(older)], stdout=subprocess.PIPE,
                                  text=True)
        child = int(parent.stdout.readline())
        assert os.path.exists(made)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        _gone_within([child], [made], 30)
        assert older.exists()
    finally:
        older.unlink(missing_ok=True)
        Path(made).unlink(missing_ok=True)


def test_the_watchdog_removes_only_shared_memory_this_run_made(tmp_path):
    """A child maps three /dev/shm files: one it made (removed with it), one older than the run that it writes to
    (its ctime is then newer than the run: it stays), and one an unrelated live process made during the run and
    still maps (it stays)."""
    import minirl.core.lifecycle as lifecycle
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    made, older, shared = (f"/dev/shm/minirl-test-{k}-{tag}" for k in ("made", "older", "shared"))
    Path(older).write_bytes(b"\0" * 4096)
    mapper = ("import mmap, os, sys\n"
              "maps = []\n"
              "for p in sys.argv[1:]:\n"
              "    if not os.path.exists(p):\n"
              "        open(p, 'wb').truncate(4096)\n"
              "    f = open(p, 'r+b'); m = mmap.mmap(f.fileno(), 4096); m[0] = 1; maps.append(m)\n"
              "print('mapped', flush=True); import signal; signal.pause()\n")  # until it is killed
    script = textwrap.dedent(f"""
        import importlib.util, subprocess, sys
        spec = importlib.util.spec_from_file_location("lifecycle", {lifecycle.__file__!r})
        lc = importlib.util.module_from_spec(spec); spec.loader.exec_module(lc)
        with lc.adopting():  # as vLLM's engine is started; the watchdog's snapshot is taken on entry
            child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], stdout=subprocess.PIPE)
            child.stdout.readline()
        print(child.pid, lc.watchdog_pid(), flush=True)
        sys.stdin.read()
    """)
    other = subprocess.Popen([sys.executable, "-c", mapper, shared], stdout=subprocess.PIPE)
    parent = None
    try:
        parent = subprocess.Popen([sys.executable, "-c", script, mapper, made, older, shared], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert other.stdout.readline() == b"mapped\n"
        child, watchdog = map(int, parent.stdout.readline().split())
        assert os.path.exists(made) and Path(older).read_bytes()[0] == 1  # the child wrote to the older file
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        _gone_within([child, watchdog], [made], 30)  # the watchdog has finished
        assert os.path.exists(older) and os.path.exists(shared)
    finally:
        other.kill()
        other.wait()
        if parent is not None:
            parent.kill()
            parent.wait()
        for p in (made, older, shared):
            Path(p).unlink(missing_ok=True)

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
    while not (os.path.exists(sys.argv[2]) and os.path.getsize(sys.argv[2])):
        time.sleep(0.05)
    time.sleep(1.5)  # let the watchdog sample the grandchild
    print(json.dumps({"pids": [sleeper.pid, tree.pid, int(open(sys.argv[2]).read())], "paths": [shm, folder],
                      "watchdog": lifecycle.watchdog_pid()}), flush=True)
    if sys.argv[3] == "exit":
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
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not any(_alive(p) for p in pids) and not any(os.path.exists(p) for p in paths):
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"left behind: {[p for p in pids if _alive(p)]} {[p for p in paths if os.path.exists(p)]}")


@pytest.mark.parametrize("ending", ["SIGKILL", "exit"])
def test_children_grandchildren_and_files_end_with_the_trainer(tmp_path, ending):
    import minirl.lifecycle as lifecycle
    parent = subprocess.Popen([sys.executable, "-c", PARENT, lifecycle.__file__, str(tmp_path / "grandchild"),
                               ending], stdout=subprocess.PIPE, text=True)
    info = json.loads(parent.stdout.readline())
    assert all(_alive(p) for p in info["pids"]) and all(os.path.exists(p) for p in info["paths"])
    if ending == "SIGKILL":
        parent.send_signal(signal.SIGKILL)
    parent.wait(30)
    took = _gone_within(info["pids"] + [info["watchdog"]], info["paths"], 10)
    assert took < 10


def test_a_reused_pid_is_never_touched(tmp_path):
    """The watchdog matches a pid with its start time: a process it was told about that ended, and whose pid now
    belongs to someone else (simulated: an adopted pid with a wrong start time), is left alone."""
    import minirl.lifecycle as lifecycle
    bystander = subprocess.Popen(["sleep", "1000"])
    try:
        script = textwrap.dedent(f"""
            import importlib.util, sys
            spec = importlib.util.spec_from_file_location("lifecycle", {lifecycle.__file__!r})
            lc = importlib.util.module_from_spec(spec); spec.loader.exec_module(lc)
            lc._send("pid {bystander.pid} 1")  # its pid, another start time: not the process we were told about
            print(lc.watchdog_pid(), flush=True)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
        watchdog = int(out.stdout.split()[0])
        _gone_within([watchdog], [], 10)
        assert _alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()

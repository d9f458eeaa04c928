"""No open doors: the files minirl shares between its processes are private, and a killed run's are swept."""
import os
import stat
import subprocess
import sys

import pytest

from minirl import lifecycle

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only (/proc)")


def test_private_file_is_new_0600_and_never_an_existing_path():
    a, b = lifecycle.private_file("ipc", 4096), lifecycle.private_file("ipc", 4096)
    try:
        assert a != b and os.path.getsize(a) == 4096
        st = os.lstat(a)
        assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
        assert f"-{os.getpid()}-" in os.path.basename(a)
    finally:
        for p in (a, b):
            os.unlink(p)
            lifecycle.tidied(p)


def test_private_dir_is_0700():
    d = lifecycle.private_dir("rdv")
    try:
        assert os.stat(d).st_mode & 0o777 == 0o700
    finally:
        os.rmdir(d)
        lifecycle.tidied(d)


def test_sweep_removes_what_a_dead_run_left_and_nothing_else(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is gone (reaped)
    folder = lifecycle.shm_dir() or __import__("tempfile").gettempdir()
    left = [os.path.join(folder, f"minirl-ipc-{dead.pid}-0123456789ab"),
            os.path.join(folder, f"minirl-rdv-{dead.pid}-x1y2z3")]
    live = os.path.join(folder, f"minirl-ipc-{os.getpid()}-ba9876543210")
    other = os.path.join(folder, f"notminirl-ipc-{dead.pid}-0123456789ab")
    open(left[0], "w").close()
    os.mkdir(left[1])
    open(os.path.join(left[1], "store"), "w").close()
    open(live, "w").close()
    open(other, "w").close()
    try:
        removed = lifecycle.sweep_stale()
        assert set(left) <= set(removed)
        assert not any(os.path.exists(p) for p in left)
        assert os.path.exists(live) and os.path.exists(other)  # a live run's file, and not ours
    finally:
        for p in (live, other):
            os.unlink(p)

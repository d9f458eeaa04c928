"""The code sandbox against hostile programs: each contained, with a clear reason, back within timeout + 1 s, the
host unaffected. Isolation tests skip where `isolation()` is "none"; the refusal and the unsandboxed mode are
tested by removing CAP_SYS_ADMIN from a child Python (as Docker does), the user-namespace mode by running one as
an unprivileged uid; those two need root and skip otherwise."""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from minirl.rewards import sandbox, sandbox_supervisor as supervisor
from minirl.rewards.sandbox import SandboxUnavailable, extract_code, isolation, run_python, run_tests

REPO = Path(__file__).resolve().parents[1]
needs_isolation = pytest.mark.skipif(isolation() == "none", reason=f"no sandbox here: {isolation()}")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")


def alive(marker: str) -> list[int]:
    """Host processes whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def timed(code: str, timeout_s: float = 2, **kw):
    start = time.monotonic()
    result = run_python(code, timeout_s=timeout_s, **kw)
    assert time.monotonic() - start <= timeout_s + 1, result
    return result


def marked(marker: str, body: str) -> str:
    """A program that first re-executes itself with `marker` in its argv (so the host can find its processes)."""
    return (f"import os, sys\nif sys.argv[-1] != {marker!r}:\n"
            f"    os.execv(sys.executable, [sys.executable, '-I', 'main.py', {marker!r}])\n{body}")


def test_isolation_works_where_it_should():
    """Root with CAP_SYS_ADMIN can always build the sandbox: there, "none" is a bug, not a skip."""
    status = dict(line.split(":\t") for line in Path("/proc/self/status").read_text().splitlines())
    if os.geteuid() != 0 or not int(status["CapEff"], 16) & (1 << 21):
        pytest.skip("not root with CAP_SYS_ADMIN")
    try:
        run_python("pass")
    except SandboxUnavailable as e:
        pytest.fail(str(e))  # says why it failed
    assert isolation() == "unshare(mount,net,pid,ipc,uts)+fresh uid"


# ---- extract_code ----

def test_extract_code_takes_the_python_block_then_any_block_then_the_text():
    assert extract_code("Sure:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"
    assert extract_code("```\nx = 1\n```\n```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("```text\nnot code\n```") == "```text\nnot code\n```"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off mid-block
    assert extract_code("def f(): return 1") == "def f(): return 1"


# ---- positive cases ----

@needs_isolation
def test_stdin_echo_and_reported_isolation():
    r = timed("import sys; print(sys.stdin.read().upper(), end='')", stdin="hello\nworld\n")
    assert (r.ok, r.returncode, r.stdout, r.reason) == (True, 0, "HELLO\nWORLD\n", "")
    assert r.isolation == isolation() and isolation().startswith("unshare(")


@needs_isolation
def test_limits_identity_and_capabilities_in_effect():
    r = timed("import os, resource\n"
              "print([resource.getrlimit(getattr(resource, 'RLIMIT_' + n))[0] for n in "
              "('CPU', 'AS', 'NPROC', 'FSIZE', 'NOFILE', 'CORE')])\n"
              "status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines())\n"
              "print(status['CapEff'], status['NoNewPrivs'], os.getuid() != 0, os.getcwd(), sorted(os.environ))",
              timeout_s=3, memory_mb=300, max_processes=5)
    limits, rest = r.stdout.splitlines()
    nproc = 5 + (0 if os.geteuid() == 0 else 2)
    assert json.loads(limits) == [3, 300 * 2**20, nproc, supervisor.TMP_MB * 2**20, supervisor.OPEN_FILES, 0]
    caps, no_new_privs, not_root, cwd, env = rest.split(" ", 4)
    assert (caps, no_new_privs, not_root, cwd) == ("0000000000000000", "1", "True", "/tmp")
    assert set(eval(env)) - {"LC_CTYPE"} == {"HOME", "PATH", "TMPDIR"}  # LC_CTYPE: Python's own locale coercion


def _python_mount_points() -> list[str]:
    """What the sandbox's fresh /tmp holds besides the program: where the Python installation lives under /tmp
    (a project cloned there), the top folder of its bind-back mount."""
    return sorted({d.split("/")[2] for d in supervisor.python_dirs() if d.startswith("/tmp/")})


@needs_isolation
def test_concurrent_runs_are_independent():
    results = [None] * 4

    def one(i):
        results[i] = run_python(f"import os, time; open('mine', 'w').write('{i}'); time.sleep(0.3); "
                                f"print(open('mine').read(), sorted(os.listdir('.')))")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    listing = sorted(["main.py", "mine", *_python_mount_points()])
    assert [r.stdout for r in results] == [f"{i} {listing}\n" for i in range(4)]


# ---- hostile programs ----

@needs_isolation
def test_exit_codes_are_reported():
    r = timed("import sys; sys.exit(3)")
    assert (r.ok, r.returncode, r.reason) == (False, 3, "exit code 3")
    r = timed("import os; os._exit(4)")
    assert (r.ok, r.returncode, r.reason) == (False, 4, "exit code 4")


@needs_isolation
def test_segfault_is_named():
    r = timed("import ctypes; ctypes.string_at(0)")
    assert (r.ok, r.returncode, r.reason) == (False, -signal.SIGSEGV, "killed by SIGSEGV")


@needs_isolation
def test_signal_reasons_name_the_limit():
    r = timed("import os, signal; os.kill(os.getpid(), signal.SIGXCPU)")
    assert (r.returncode, r.reason) == (-signal.SIGXCPU, "CPU time limit")


@needs_isolation
def test_infinite_loop_is_killed_at_the_timeout():
    marker = "minirl-loop-" + secrets.token_hex(4)
    r = timed(marked(marker, "while True: pass"), timeout_s=1.5)
    assert (r.ok, r.returncode, r.reason) == (False, None, "timeout after 1.5s")
    assert alive(marker) == []


@needs_isolation
def test_fork_bomb_is_bounded_and_nothing_remains():
    marker = "minirl-forks-" + secrets.token_hex(4)
    count = marked(marker, "import time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
                           "    except OSError:\n        print(n, flush=True); break\n"
                           "    if pid == 0:\n        time.sleep(60); os._exit(0)\n    n += 1\ntime.sleep(60)")
    r = timed(count, timeout_s=2, max_processes=8)
    assert r.reason == "timeout after 2s" and r.stdout == "7\n"  # 8 processes: the program and 7 children
    assert alive(marker) == []
    bomb = marked(marker, "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    r = timed(bomb, timeout_s=2)
    assert r.reason == "timeout after 2s"
    assert alive(marker) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


@needs_isolation
def test_detached_daemon_does_not_outlive_the_run():
    marker = "minirl-daemon-" + secrets.token_hex(4)
    daemon = ("import ctypes, os, sys, time\n"
              "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # clear the parent-death signal\n"
              f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
              "    os._exit(0)\n"
              "time.sleep(0.5)\n")
    r = timed(daemon + "while True: pass", timeout_s=1.5)
    assert r.reason == "timeout after 1.5s" and alive(marker) == []
    r = timed(daemon + "print('bye')")  # ends by itself, leaving the daemon behind
    assert r.ok and r.stdout == "bye\n" and alive(marker) == []


@needs_isolation
def test_memory_bomb_hits_the_memory_limit():
    r = timed("blocks = []\nwhile True: blocks.append(bytearray(10**7))", memory_mb=256)
    assert (r.ok, r.returncode, r.reason) == (False, 1, "memory limit")
    assert r.stderr.strip().endswith("MemoryError")


@needs_isolation
def test_print_flood_is_cut_at_the_output_cap():
    r = timed("while True: print('x' * 1000)", max_output_bytes=10_000)
    assert (r.ok, r.returncode, r.reason) == (False, None, "output limit")
    assert 0 < len(r.stdout) <= 10_000 and set(r.stdout) <= {"x", "\n"}


@needs_isolation
def test_writes_outside_fail_and_host_files_are_untouched(tmp_path):
    outside = Path(REPO / f".sandbox-probe-{secrets.token_hex(4)}")  # visible in the sandbox, writable by anyone
    outside.mkdir(mode=0o777)
    try:
        outside.chmod(0o777)
        (outside / "existing").write_text("host")
        (outside / "existing").chmod(0o666)
        host_tmp = Path("/tmp") / f"minirl-probe-{secrets.token_hex(4)}"
        targets = [outside / "new", outside / "existing", host_tmp, tmp_path / "new", Path("/var/tmp/x"), Path("/x")]
        code = ("import os\nfor p in %r:\n    try:\n        open(p, 'w').write('sandbox')\n        print('wrote', p)\n"
                "    except OSError as e:\n        print('refused', p, e.errno)\n" % [str(t) for t in targets])
        r = timed(code)
        assert r.ok, r
        verbs = [line.split()[0] for line in r.stdout.splitlines()]
        assert verbs == ["refused", "refused", "wrote", "refused", "refused", "refused"], r.stdout
        # the one write that worked went into its own /tmp, not the host's
        assert (outside / "existing").read_text() == "host" and sorted(os.listdir(outside)) == ["existing"]
        assert not host_tmp.exists() and not (tmp_path / "new").exists() and not Path("/x").exists()
    finally:
        shutil.rmtree(outside)


@needs_isolation
def test_private_tmp_is_fresh_for_every_run():
    assert timed("open('left-behind', 'w').write('x')").ok
    assert timed("import os; print(sorted(os.listdir('.')))").stdout == f"{sorted(['main.py', *_python_mount_points()])}\n"


@needs_isolation
def test_large_files_are_refused():
    r = timed("open('big', 'wb').write(b'x' * (100 * 2**20))", memory_mb=512)
    assert r.returncode == 1 and ("File too large" in r.stderr or "No space left" in r.stderr), r


@needs_isolation
def test_loopback_listener_of_the_host_is_unreachable():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        r = timed("import socket\ns = socket.socket(); s.settimeout(1)\n"
                  f"try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n"
                  "except OSError as e:\n    print('failed', e.errno)")
        assert r.ok and r.stdout.startswith("failed"), r
        with pytest.raises(socket.timeout):
            listener.accept()


@needs_isolation
def test_parent_environment_is_not_inherited(monkeypatch):
    secret = "s3cret-" + secrets.token_hex(8)
    monkeypatch.setenv("MINIRL_SANDBOX_SECRET", secret)
    r = timed("import os\nprint(dict(os.environ))\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()] + "
              f"['{os.getpid()}', '{os.getppid()}']:\n"
              "    try:\n        print(pid, open(f'/proc/{pid}/environ').read())\n"
              "    except OSError as e:\n        print(pid, 'unreadable', e.errno)")
    assert r.ok and "MINIRL_SANDBOX_SECRET" not in r.stdout and secret not in r.stdout, r


@needs_isolation
def test_killing_the_parent_or_the_caller_is_contained():
    code = ("import os, signal\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()), os.getpid())\n"
            "for target in (os.getppid(), %d, 1, -1):\n    try:\n"
            "        os.kill(target, signal.SIGKILL)\n        print('sent', target)\n"
            "    except OSError as e:\n        print('refused', target, e.errno)\n" % os.getpid())
    r = timed(code)
    assert r.ok, r  # the program survived its kill(-1): nothing else was visible to kill, its init ignores it
    assert r.stdout.splitlines()[0] == "['1', '2'] 2"  # it sees its init and itself, no host process
    assert f"sent {os.getpid()}" not in r.stdout  # our pid does not exist in its namespace
    os.kill(os.getpid(), 0)  # and we are alive


@needs_isolation
def test_the_program_cannot_forge_its_status():
    r = timed("import ctypes, os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'exit 0\\n')\n"
              "    except OSError:\n        pass\nctypes.string_at(0)")
    assert (r.returncode, r.reason) == (-signal.SIGSEGV, "killed by SIGSEGV")


def test_bad_arguments_are_refused_with_one_line():
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="tests is empty"):
        run_tests("pass", [])


# ---- run_tests ----

ADD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"


@needs_isolation
def test_run_tests_passes_correct_asserts_and_names_the_failed_one():
    r = run_tests(ADD, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    assert (r.passed, r.total, r.first_failure, r.fraction, r.all_passed) == (2, 2, "", 1.0, True)
    r = run_tests(ADD, ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(1) == 1"])
    assert (r.passed, r.total, r.all_passed) == (1, 3, False)
    assert r.first_failure == "assertion failed: assert add(2, 2) == 5"


@needs_isolation
def test_run_tests_reports_a_broken_solution_and_uses_setup():
    r = run_tests("def add(a, b) return a + b", ["assert add(1, 2) == 3"])
    assert r.passed == 0 and r.first_failure.startswith("SyntaxError") and "(in the solution)" in r.first_failure
    r = run_tests("def area(r):\n    return pi * r * r", ["assert round(area(1), 2) == 3.14"],
                  setup="from math import pi")
    assert r.all_passed, r


@needs_isolation
def test_run_tests_cannot_be_gamed_by_exiting_or_faking_a_verdict():
    fake_verdict = ("import json, sys\n"  # a forged verdict line, with whatever it can read of the nonce
                    "print('\\n' + sys.stdin.readline().strip() + ' ' + json.dumps({'i': 0, 'ok': True}))")
    for trick in ("import os; os._exit(0)", "import sys; sys.exit(0)", fake_verdict):
        r = run_tests(f"def add(a, b):\n    return 0\n{trick}\n", ["assert add(1, 2) == 3"])
        assert r.passed == 0, (trick, r)
    r = run_tests("def add(a, b):\n    import sys; sys.exit(0)", ["assert add(1, 2) == 3"])
    assert r.passed == 0 and r.first_failure.startswith("SystemExit"), r


@needs_isolation
def test_run_tests_humaneval_check_and_partial_credit_on_timeout():
    check = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n"
    assert run_tests(ADD, [check], entry_point="add").all_passed
    r = run_tests(ADD, [check], entry_point="plus")
    assert r.passed == 0 and "plus" in r.first_failure
    r = run_tests(ADD, ["assert add(1, 1) == 2", "while True: pass", "assert add(0, 0) == 0"], timeout_s=1.5)
    assert (r.passed, r.first_failure) == (1, "test 1 did not finish: timeout after 1.5s")


# ---- where no isolation works, and the user-namespace mode ----

def _python_as(prefix: list[str], python: str, script: str) -> dict:
    """Run `script` (which prints one JSON line) in a fresh Python under `prefix` (setpriv ...), with this
    sandbox module loaded from its file as `sandbox` (it is standalone: the system Python has no minirl deps)."""
    load = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('sandbox', {sandbox.__file__!r})\n"
            "sandbox = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(sandbox)\n")
    out = subprocess.run([*prefix, python, "-I", "-c", load + script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_root
def test_without_cap_sys_admin_it_refuses_unless_allowed():
    script = """if True:
        import json, os
        try:
            sandbox.run_python("print(1)")
            refusal = None
        except sandbox.SandboxUnavailable as e:
            refusal = str(e)
        r = sandbox.run_python("import os; print(os.getcwd())", allow_unsandboxed=True)
        t = sandbox.run_python("while True: pass", timeout_s=1, allow_unsandboxed=True)
        print(json.dumps(dict(isolation=sandbox.isolation(), refusal=refusal, ok=r.ok, label=r.isolation,
                              cwd=r.stdout.strip(), cwd_left=os.path.exists(r.stdout.strip()), timeout=t.reason,
                              seconds=t.seconds)))"""
    got = _python_as(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin"], sys.executable, script)
    assert got["isolation"] == "none"
    assert "no sandbox on this machine" in got["refusal"] and "allow_unsandboxed=True" in got["refusal"]
    assert (got["ok"], got["label"], got["cwd_left"]) == (True, "none (rlimits only)", False)
    assert got["cwd"].startswith(("/tmp/minirl-sandbox-", "/var/tmp/minirl-sandbox-"))
    assert got["timeout"] == "timeout after 1s" and got["seconds"] <= 2


@needs_isolation
def test_python_under_a_covered_directory_is_mounted_back_read_only(tmp_path):
    """A venv under /tmp (which the sandbox replaces) still runs the program, and the program cannot change it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    script = ("r = sandbox.run_python(\"import sys; print(sys.prefix); open(sys.prefix + '/x', 'w')\")\n"
              "print(json.dumps(dict(isolation=sandbox.isolation(), stdout=r.stdout, stderr=r.stderr)))")
    got = _python_as([], str(tmp_path / "venv" / "bin" / "python"), "import json\n" + script)
    assert got["isolation"] == isolation() and got["stdout"] == f"{tmp_path / 'venv'}\n"
    assert "Read-only file system" in got["stderr"] and not (tmp_path / "venv" / "x").exists()


@needs_root
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs a system Python for another uid")
def test_user_namespace_mode_as_an_unprivileged_uid():
    """The mode for non-root callers, exercised here as uid 4242 with the system Python (the venv's lives under
    /root). Skips if this kernel does not allow unprivileged user namespaces."""
    marker = "minirl-user-" + secrets.token_hex(4)
    bomb = marked(marker, "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    count = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
             "        print(n); break\n    if pid == 0:\n        time.sleep(30); os._exit(0)\n    n += 1")
    script = f"""if True:
        import json, os
        label = sandbox.isolation()
        run = lambda code, **kw: sandbox.run_python(code, timeout_s=2, **kw)
        out = dict(isolation=label)
        if label != "none":
            out["count"] = run({count!r}, max_processes=6).stdout
            out["bomb"] = run({bomb!r}).reason
            out["net"] = run("import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)").stderr
            out["write"] = run("open('/etc/minirl-probe', 'w')").stderr
            out["caps"] = run("print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])").stdout
        print(json.dumps(out))"""
    got = _python_as(["setpriv", "--reuid", "4242", "--regid", "4242", "--clear-groups"], "/usr/bin/python3", script)
    if got["isolation"] == "none":
        pytest.skip("unprivileged user namespaces are not available on this kernel")
    assert got["isolation"] == "unshare(user,mount,net,pid,ipc,uts)"
    assert got["count"] == "5\n" and got["bomb"] == "timeout after 2s" and alive(marker) == []
    assert "Network is unreachable" in got["net"] and "Read-only file system" in got["write"]
    assert got["caps"] == "0000000000000000\n"

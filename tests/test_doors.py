"""No open doors: the files minirl shares between its processes are private, and a killed run's are swept."""
import os
import stat
import subprocess
import sys

import pytest

from minirl.core import lifecycle

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
    live, live_dir = lifecycle.private_file("ipc", 64), lifecycle.private_dir("rdv")  # this live process's
    other = os.path.join(folder, f"notminirl-ipc-{dead.pid}-0123456789ab")
    open(left[0], "w").close()
    os.mkdir(left[1])
    open(os.path.join(left[1], "store"), "w").close()
    open(other, "w").close()
    try:
        removed = lifecycle.sweep_stale()
        assert set(left) <= set(removed)
        assert not any(os.path.exists(p) for p in left)
        assert all(os.path.exists(p) for p in (live, live_dir, other))  # a live run's file and folder, not ours
    finally:
        os.unlink(live)
        os.rmdir(live_dir)
        os.unlink(other)
        lifecycle.tidied(live)
        lifecycle.tidied(live_dir)


# A run in another PID namespace (a container sharing /dev/shm): its pid has no /proc entry here, but it holds
# its files' life locks.
OTHER_NAMESPACE = """
import fcntl, os, sys
fds = []
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(p) else 0))
    fcntl.flock(fd, fcntl.LOCK_SH)
    fds.append(fd)
print("locked", flush=True)
sys.stdin.read()
"""


def test_sweep_keeps_the_files_of_a_live_run_whose_pid_is_not_in_this_proc():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # the other run's pid, as seen from here: no /proc entry
    folder = lifecycle.shm_dir() or __import__("tempfile").gettempdir()
    theirs = [os.path.join(folder, f"minirl-ipc-{gone.pid}-feedfacecafe"),
              os.path.join(folder, f"minirl-rdv-{gone.pid}-deadbeef0000")]
    open(theirs[0], "w").close()
    os.mkdir(theirs[1])
    owner = subprocess.Popen([sys.executable, "-c", OTHER_NAMESPACE, *theirs], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "locked"
        removed = lifecycle.sweep_stale()
        assert not set(theirs) & set(removed) and all(os.path.exists(p) for p in theirs)
        owner.stdin.close()
        owner.wait(30)  # the owner is gone: its locks with it
        assert set(theirs) <= set(lifecycle.sweep_stale())
    finally:
        owner.kill()
        owner.wait()
        if os.path.exists(theirs[0]):
            os.unlink(theirs[0])
        if os.path.isdir(theirs[1]):
            os.rmdir(theirs[1])


def test_nccl_socket_ifname_is_set_only_while_the_groups_communicator_is_made(tmp_path, monkeypatch):
    """The NCCL group's loopback setting reaches NCCL when it builds the communicator, and blocking waits reach
    torch's ProcessGroupNCCL when it is constructed (so a dead peer raises `SyncTimeout` instead of the watchdog
    killing the process; issue 52 item 7); the trainer process's environment is as it was afterwards; a value the
    user set is kept. (NCCL itself is faked: no GPU here.)"""
    import torch
    import torch.distributed as dist

    from minirl.sync.wire import open_group
    seen, built = [], []

    class FakeNCCL:
        class Options:
            pass

        def __init__(self, store, rank, size, opts):
            built.append(os.environ.get("TORCH_NCCL_BLOCKING_WAIT"))

        def eager_connect_single_device(self, device):
            seen.append(os.environ.get("NCCL_SOCKET_IFNAME"))
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    open_group(str(tmp_path), 0, "nccl", 5.0)
    assert seen == ["lo"] and "NCCL_SOCKET_IFNAME" not in os.environ
    assert built == ["1"] and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    (tmp_path / "again").mkdir()
    open_group(str(tmp_path / "again"), 0, "nccl", 5.0)
    assert seen == ["lo", "eth1"] and os.environ["NCCL_SOCKET_IFNAME"] == "eth1"


def test_runs_sharing_an_adapter_dir_keep_their_adapters_apart_and_prune_only_their_own(tmp_path):
    """Two runs given the same adapter_dir: each writes its versions into a folder of its own (neither overwrites
    the other's v1), and pruning removes only version folders the run wrote (a user's `v7` stays)."""
    from minirl.sync.servers import ServerSync

    class Trainer:
        def __init__(self, tag):
            self.tag, self.version = tag, 0

        def save_adapter(self, path):
            os.makedirs(path)
            with open(os.path.join(path, "adapter_model.safetensors"), "w") as f:
                f.write(f"{self.tag} v{self.version}")

    class Generator:  # serves the latest version only
        def __init__(self):
            self.loaded = {}

        def update_adapter(self, deliver, in_place=False):
            update = deliver()
            self.loaded = {update.version: update.path}
            return update

        def versions_in_use(self):
            return set(self.loaded)
    shared = tmp_path / "adapters"
    (shared / "v7").mkdir(parents=True)
    (shared / "v7" / "mine.txt").write_text("the user's")
    (shared / "v1").mkdir()
    runs = [(Trainer(t), Generator(), ServerSync(shared)) for t in ("a", "b")]
    assert runs[0][2].root != runs[1][2].root and runs[0][2].root.parent == shared
    for v in (1, 2):
        for trainer, gen, sync in runs:
            trainer.version = v
            sync.push(trainer, gen)
    for trainer, gen, sync in runs:
        path = gen.loaded[2]
        with open(os.path.join(path, "adapter_model.safetensors")) as f:
            assert f.read() == f"{trainer.tag} v2"
        assert sorted(os.listdir(sync.root)) == ["v2"]  # its v1 pruned
    assert (shared / "v7" / "mine.txt").read_text() == "the user's" and (shared / "v1").is_dir()
    for _, _, sync in runs:
        sync.close()
    assert sorted(os.listdir(shared)) == ["v1", "v7"]


class Decoy:
    """A listener on 127.0.0.1 that records what each connection sends (up to 64 KiB), then closes it."""

    def __init__(self):
        import socket
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(2.0)
            data = b""
            try:
                while b"\r\n\r\n" not in data and len(data) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            except OSError:
                pass
            self.received.append(data)
            conn.close()

    def close(self):
        import socket
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress (a close alone would not)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)


def test_a_loopback_client_ignores_proxy_settings(monkeypatch):
    """With HTTP_PROXY / ALL_PROXY set, a request to a local server goes to the server, not the proxy (which would
    receive the API key)."""
    import asyncio
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from minirl.generation.server_api import ServerAPI

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "base"}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    server = HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = Decoy()
    for k in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(k, f"http://127.0.0.1:{proxy.port}")
    for k in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(k, raising=False)

    async def ask():
        api = ServerAPI(f"http://127.0.0.1:{server.server_address[1]}", "SECRET-KEY")
        try:
            return await api.models(timeout_s=10.0)
        finally:
            await api.aclose()
    try:
        assert asyncio.run(ask()) == {"data": [{"id": "base"}]}
        assert proxy.received == []
    finally:
        server.shutdown()
        proxy.close()
    from minirl.generation.server_api import is_loopback
    assert is_loopback("http://localhost:8000") and is_loopback("http://[::1]:80") and not is_loopback("http://10.0.0.2")


LISTENER = """
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(1)
print("listening", flush=True); sys.stdin.read()
"""


def test_a_port_is_the_servers_only_when_its_own_process_listens_there():
    from minirl.generation.server_proc import listening_in_group
    decoy = Decoy()
    bystander = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                                 start_new_session=True)
    import socket
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert server.stdout.readline() == b"listening\n"
        assert not listening_in_group(decoy.port, bystander.pid)  # someone else's listener
        assert not listening_in_group(port, bystander.pid)
        assert listening_in_group(port, server.pid)
    finally:
        for p in (bystander, server):
            p.kill()
            p.wait()
        decoy.close()


def test_a_decoy_on_a_started_servers_port_never_receives_the_api_key(tmp_path, monkeypatch):
    """Another local user binds the port minirl chose before the server does: minirl sends nothing there (no
    Authorization header); the server, finding its port taken, exits and start-up fails in one error."""
    import asyncio

    from minirl.generation import server_proc
    from minirl.generation.server_fleet import Fleet, ServerError
    decoy = Decoy()
    monkeypatch.setattr(server_proc, "free_port", lambda: decoy.port)
    # the server "starts" for a second before it fails (the thing under test: the fleet's probes meanwhile go to
    # the port's other owner, the decoy, which must not get the key)
    taken = "import sys, time; time.sleep(1); print('OSError: [Errno 98] Address already in use'); sys.exit(1)"
    monkeypatch.setattr(server_proc, "server_argv", lambda opts, port: [sys.executable, "-c", taken])
    fleet = Fleet([], [server_proc.ServerOptions("m")], "SECRET-KEY", str(tmp_path), restart=False, timeout_s=30,
                  health_every_s=2, start_timeout_s=30, needs=dict, name=str)
    try:
        with pytest.raises(ServerError, match="exited with code 1 while starting"):
            asyncio.run(fleet.bring_up(fleet.servers[0]))
    finally:
        decoy.close()
    assert not any(b"SECRET-KEY" in r or b"authorization" in r.lower() for r in decoy.received), decoy.received
    control = Decoy()  # the positive control: a request that carries the key is recorded, as a leak would be
    try:
        import socket
        with socket.create_connection(("127.0.0.1", control.port)) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nAuthorization: Bearer SECRET-KEY\r\n\r\n")
            c.recv(1)  # the decoy closes the connection once it has recorded the request
    finally:
        control.close()
    assert any(b"SECRET-KEY" in r for r in control.received)

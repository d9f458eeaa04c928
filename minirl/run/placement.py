"""Placement: which backend generates, where generation and training run, and how far generation runs ahead (K).

Decided from the config and the device facts (`Devices`: GPU count, memory per GPU, compute capability, whether
vLLM is installed; `device_facts()` reads this machine's, `minirl plan --gpus N --gpu-gb G` fakes them) by one pure
function, `place`, before anything loads; a bad device string fails here, naming the
field and the accepted forms. The result is one printed line at start and `placement` in summary.json.

  CPU               the cores are split (vLLM's worker or the generator process on some, the trainer's torch
                    threads on the rest) when K >= 1 (`auto`: the transformers generator on 2+ cores);
                    synchronously (K = 0) each phase takes every core in turn.
  1 GPU             engine and trainer share cuda:0, K = 0 (synchronous); a vLLM engine sleeps (sleep mode level 1)
                    while the trainer works, and is woken before the adapter push.
  2 GPUs (vLLM)     trainer on cuda:0, one engine on GPU 1 (its processes see only that GPU), K = 1.
  3+ GPUs (vLLM)    trainer on cuda:0; `backend: auto` starts a vLLM server on each other GPU (`auto_servers`: where
                    servers do all the run asks), K = 1; `backend: vllm-server, num_servers: N-1` does the same by
                    hand: the servers go to every GPU but the trainer's.
The memory plan then plans each device for what the placement puts on it (`minirl.run.plan`).
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

import torch

from minirl.config import Config, ConfigError, parse_cores
from minirl.generation.factory import pick_backend, vllm_available

_GPU_IDS = re.compile(r"^(cuda:)?\d+(,(cuda:)?\d+)*$")
_CORES = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


@dataclass(frozen=True)
class Devices:
    """The facts of the machine a run is placed on: its GPU count (0: CPU), each GPU's memory in GB (1e9; empty:
    not known), the lowest compute capability among them, whether vLLM is installed, and its CPU cores and memory."""
    count: int
    memory_gb: tuple[float, ...] = ()
    capability: tuple[int, int] | None = None
    vllm: bool | None = None  # None: looked up where the backend is picked
    cores: int | None = None  # CPU cores; None: this machine's (os.cpu_count())
    cpu_gb: float | None = None  # the machine's memory in GB (1e9); None: this machine's

    @classmethod
    def fake(cls, count: int, gpu_gb: float | None = None, capability: tuple[int, int] | None = None,
             vllm: bool | None = None) -> "Devices":
        """`count` GPUs of `gpu_gb` GB each (a plan for another machine)."""
        return cls(count, (float(gpu_gb),) * count if gpu_gb else (), capability, vllm)

    def gb(self, index: int) -> float | None:
        return self.memory_gb[index] if index < len(self.memory_gb) else None


def device_facts() -> Devices:
    """This machine's `Devices` (GPUs as CUDA_VISIBLE_DEVICES shows them)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not n:
        return Devices(0, vllm=vllm_available())
    mem = tuple(torch.cuda.get_device_properties(i).total_memory / 1e9 for i in range(n))
    return Devices(n, mem, min(tuple(torch.cuda.get_device_capability(i)) for i in range(n)), vllm_available())


@dataclass(frozen=True)
class Placement:
    backend: str
    backend_why: str
    max_async_steps: int  # K
    async_why: str
    gen_devices: str | None  # GPU ids ('1', '1,2') or CPU cores ('0-3'); None: no constraint
    train_device: str  # 'cpu' or 'cuda:N'
    train_threads: int | None  # on CPU: the trainer's torch thread count
    cuda_devices: int
    engine_sleeps: bool = False  # vLLM shares the trainer's GPU with K = 0: it sleeps while the trainer works
    num_servers: int | None = None  # `backend: auto` on 3+ GPUs: the vLLM servers it starts (one a GPU)
    your_servers: int = 0  # server_urls: servers started by hand, on no device of this plan

    def line(self) -> str:
        gen = self.gen_devices or ("every GPU" if self.cuda_devices else "every core")
        if self.your_servers:
            gen = f"your {self.your_servers} server{'s' if self.your_servers > 1 else ''} (server_urls)"
        gen += f" ({self.num_servers} servers, one per GPU)" if self.num_servers else ""
        n = self.train_threads
        train = self.train_device + (f" ({n} thread{'s' if n > 1 else ''})" if n else "")
        return (f"minirl: placement: {self.backend} generation on {gen}, training on {train}, "
                f"K = {self.max_async_steps} ({self.async_why})" + ("; the engine sleeps while the trainer works"
                                                                     if self.engine_sleeps else ""))

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_split(cfg: Config, k: int, n: int) -> tuple[str | None, int]:
    """On `n` CPU cores: the cores generation is pinned to, and the trainer's torch thread count."""
    gen = None if cfg.gen_devices == "auto" else cfg.gen_devices
    if cfg.train_devices != "auto":
        train = len(parse_cores(cfg.train_devices))
    elif k == 0 or n == 1:
        train = n  # synchronous: the two sides take turns, each may use every core
    else:
        train = max(1, n // 2)
        gen = gen or (f"0-{n - train - 1}" if n - train > 1 else "0")
    return gen, train


def pick_async_steps(cfg: Config, backend: str, cuda_devices: int, cores: int = 1) -> tuple[int, str]:
    """(K, why) for `max_async_steps`; 'auto' by this rule (`cores`: the CPU cores, on a CPU run):
    - your vLLM servers (`server_urls`), or vLLM with 2+ GPUs: generation and training on devices of their own:
      1 (each would idle while the other works; ahead by one step both stay busy). Reasoned, not measured.
    - the transformers generator on a CPU with 2+ cores, for a run that trains (steps > 0: an evaluation keeps every
      core) on single-turn prompts (no `env`): 1, the cores split between a generator process and the trainer.
      Measured on 2 cores (`minirl bench learning --presets dapo,dapo-k1`, BENCHMARKS.md "K = 1 against K = 0, in
      training seconds"): the demo reached 0.70 held-out sooner on each of 3 seeds, its steps 0.83x as long. It
      holds a second copy of the model (the CPU memory plan counts it) and a resumed run is no longer exact.
      Multi-turn episodes (`env`) stay at 0: generation is most of their step, and on 1 core it made `minirl demo
      --task retry` 1.12x as long (BENCHMARKS.md, "`minirl demo` with `auto` (K = 1) against K = 0").
    - otherwise (one GPU shared by both phases, one core, vLLM on a CPU: unmeasured): 0. It pays where rewards wait
      (a remote judge): set max_async_steps=1 there.
    """
    k = cfg.max_async_steps
    if k != "auto":
        return int(k), f"max_async_steps={k}"
    if backend == "vllm-server" and cfg.server_urls:
        return 1, "auto: generation on your servers (server_urls), training here: ahead by one step both stay busy"
    if backend in ("vllm", "vllm-server") and cuda_devices >= 2:
        return 1, f"auto: vLLM with {cuda_devices} GPUs, generation and training on devices of their own"
    if backend == "hf" and not cuda_devices and cores >= 2 and cfg.steps > 0 and cfg.env is None:
        return 1, (f"auto: {cores} CPU cores, half to a generator process, half to the trainer; max_async_steps=0 "
                   "is the synchronous loop, exact on resume")
    return 0, ("auto: generation and training share " + ("one GPU" if cuda_devices else "the CPU cores")
               + ": synchronous (set max_async_steps=1 when rewards wait, e.g. a remote judge)")


def _check_devices(cfg: Config, cuda_devices: int, cores: int) -> None:
    """One line naming the field and its accepted forms, before anything loads."""
    for name in ("gen_devices", "train_devices"):
        v = str(getattr(cfg, name))
        if v == "auto":
            continue
        if cuda_devices:
            ids = [int(x.removeprefix("cuda:")) for x in v.split(",")] if _GPU_IDS.match(v) else None
            one = name == "gen_devices" or (ids is not None and len(ids) == 1)
            if ids is None or not one or max(ids) >= cuda_devices:
                forms = "'1', 'cuda:1' or '1,2'" if name == "gen_devices" else "'0' or 'cuda:0'"
                raise ConfigError(f"{name}={v!r}: on this machine's {cuda_devices} GPU(s) give "
                                  f"{'GPU ids' if name == 'gen_devices' else 'one GPU'} below {cuda_devices}, "
                                  f"e.g. {forms}, or 'auto'")
        else:
            if not _CORES.match(v) or max(parse_cores(v)) >= cores:
                raise ConfigError(f"{name}={v!r}: on CPU give cores below {cores} as '1', '0-3' or '0,2-3', "
                                  "or 'auto'")


def auto_servers(cfg: Config, backend: str, k: int, cuda_devices: int) -> bool:
    """Whether `backend: auto` on 3+ GPUs starts a vLLM server on each GPU the trainer leaves, instead of one
    in-process engine that would leave the others idle: where vLLM is the pick, minirl places both sides
    (gen_devices auto), K >= 1, and servers do all the run asks: `inflight: continue` (a server finishes in-flight
    sequences on their adapter), no env episodes, `sync_transport: auto` (servers take the adapter through files,
    not the in-memory transports). Otherwise one engine on GPU 1, as on two GPUs."""
    return (cfg.backend == "auto" and backend == "vllm" and cuda_devices >= 3 and k >= 1 and cfg.gen_devices == "auto"
            and cfg.inflight == "continue" and cfg.env is None and cfg.sync_transport == "auto" and not cfg.server_urls)


def place(cfg: Config, devices: Devices | int) -> Placement:
    """The placement of a run on `devices` (a count: that many GPUs, 0: CPU), a pure function of its arguments
    (and of this machine's core count, where `devices.cores` is None)."""
    devices = Devices(devices) if isinstance(devices, int) else devices
    cuda_devices, cores = devices.count, devices.cores or os.cpu_count() or 1
    _check_devices(cfg, cuda_devices, cores)
    backend, backend_why = pick_backend(cfg.backend, cuda_devices > 0, cfg.load_in_4bit, devices.vllm)
    k, async_why = pick_async_steps(cfg, backend, cuda_devices, cores)
    yours = len(cfg.server_urls) if backend == "vllm-server" else 0
    if not cuda_devices:
        gen, threads = cpu_split(cfg, k, cores)
        if yours and cfg.train_devices == "auto":  # no generator of ours shares these cores
            gen, threads = None, cores
        return Placement(backend, backend_why, k, async_why, gen, "cpu", threads, 0, your_servers=yours)
    train = "cuda:0" if cfg.train_devices == "auto" else "cuda:" + cfg.train_devices.removeprefix("cuda:")
    servers = None
    if auto_servers(cfg, backend, k, cuda_devices):
        backend, servers = "vllm-server", cuda_devices - 1
        backend_why = (f"auto: {servers} vLLM servers, one on each GPU the trainer leaves (one in-process engine "
                       f"would leave {cuda_devices - 2} of the {cuda_devices} GPUs idle)")
    if cfg.gen_devices != "auto":
        gen = ",".join(x.removeprefix("cuda:") for x in cfg.gen_devices.split(","))
    elif cuda_devices >= 2 and k >= 1:  # GPUs of its own: servers every one the trainer does not use, else the first
        others = [str(i) for i in range(cuda_devices) if f"cuda:{i}" != train]
        gen = ",".join(others) if backend == "vllm-server" else others[0]
    else:  # colocated with the trainer
        gen = train.removeprefix("cuda:")
    if cfg.sync_transport == "collective" and backend == "vllm" and train.removeprefix("cuda:") in gen.split(","):
        raise ConfigError(f"sync_transport='collective' with the engine on the trainer's GPU ({train}): NCCL cannot "
                          "put two ranks on one GPU; use sync_transport='auto' (CUDA IPC there) or give the engine "
                          "a GPU of its own (gen_devices)")
    sleeps = backend == "vllm" and k == 0 and gen == train.removeprefix("cuda:")
    return Placement(backend, backend_why, k, async_why, None if yours else gen, train, None, cuda_devices, sleeps,
                     servers, yours)


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class CpuThreads:
    """On CPU, the trainer thread's torch thread count and cores for the run, given back at the end: the next run
    in this process (a notebook's, a benchmark's next variant) must not inherit this run's split."""

    def __init__(self) -> None:
        self._before: tuple[int, set[int] | None] | None = None

    def apply(self, p: Placement) -> None:
        if p.train_threads is None:
            return
        self._before = (torch.get_num_threads(), os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None)
        torch.set_num_threads(p.train_threads)

    def pin(self, cfg: Config) -> None:
        """Bind this (trainer) thread to its cores; after the engine spawned, so the engine does not inherit it."""
        if self._before is not None and cfg.train_devices != "auto" and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, parse_cores(cfg.train_devices))

    def restore(self) -> None:
        before, self._before = self._before, None
        if before is not None:
            torch.set_num_threads(before[0])
            if before[1] is not None:
                os.sched_setaffinity(0, before[1])

"""Adapter sync: only the LoRA weights travel from trainer to generator after each update.

`WeightSync` is the boundary: `push(trainer, generator)` hands the trainer's current adapter (policy version
`trainer.version`) to the generator and returns `SyncStats`. `make_sync` picks one for a run:

  shared      the synchronous transformers loop: the generator runs on the trainer's own model (`local.py`)
  shm         the transformers generator process: one shared-memory flat buffer (`local.py`)
  ipc         vLLM: a shared-memory file (CPU) / CUDA IPC handle (GPU) mapped by the engine worker (`senders.py`)
  collective  vLLM: a gloo (CPU) / NCCL (GPU) broadcast to the engine worker (`senders.py`)
  files       vLLM: the adapter saved to tmpfs in peft format and loaded by the engine (`files.py`)

The in-memory vLLM transports (`tensor.py`, `senders.py`) meet the worker-side receiver (`receiver.py`, a vLLM
worker extension, with `channel.py`) through what both sides share (`wire.py`, `minirl.adapter`).
After every push, `verify` checks that the engine serves the new adapter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

TRANSPORTS = ("auto", "ipc", "collective", "files")


class SyncError(RuntimeError):
    """An adapter sync could not complete."""


class SyncTimeout(SyncError, TimeoutError):
    """An adapter sync did not complete within its timeout (peer gone or stuck)."""


class CollectiveError(SyncError):
    """A broadcast of the collective sync failed: the peer is gone or did not answer in time."""


class SyncVerificationError(SyncError):
    """The engine does not serve the adapter the trainer just pushed."""


@dataclass(frozen=True)
class SyncStats:
    version: int
    ms: float
    bytes: int
    transport: str
    verify_max_diff: float | None = None


class WeightSync(Protocol):
    transport: str

    def push(self, trainer, generator) -> SyncStats:
        """Hand the trainer's current adapter (version `trainer.version`) to the generator."""

    def close(self) -> None: ...


def make_sync(transport: str, generator, trainer_device="cpu", inflight: bool = False,
              timeout_s: float = 30.0) -> tuple[WeightSync, str]:
    """The `WeightSync` for a vLLM generator and a config value, and why: 'files' → FileSync; 'ipc' /
    'collective' → TensorSync; 'auto' → in-memory when the engine has the receiver, else files."""
    from .files import FileSync
    from .tensor import TensorSync, pick_transport
    if transport == "files":
        return FileSync(), "sync_transport='files'"
    if transport == "auto":
        name, why = pick_transport(generator, trainer_device)
        if name == "files":
            return FileSync(), why
        return TensorSync(name, inflight=inflight, timeout_s=timeout_s), why
    return TensorSync(transport, inflight=inflight, timeout_s=timeout_s), f"sync_transport={transport!r}"


def default_atol(dtype: str) -> float:
    """Probe tolerance for a float32 trainer against an engine of `dtype`. Measured on the embedded model
    (32-token probes): a float32 engine agrees to ~3e-5 per token; a bfloat16 engine differs by up to ~0.25 (mean
    ~0.03), about as much as a moderately different adapter, so with 16-bit engines the check only catches gross
    errors (base or much older weights)."""
    return 1e-2 if str(dtype).removeprefix("torch.") == "float32" else 0.5


def verify(generator, prompt_ids: Sequence[int], completion_ids: Sequence[int], want: Sequence[float],
           version: int | None = None, temperature: float = 1.0, atol: float | None = None) -> float:
    """Check that `generator` serves the adapter whose logprobs for the probe (`prompt_ids` + `completion_ids`)
    are `want` (the trainer's), as policy `version`. Returns the max abs logprob difference; raises
    `SyncVerificationError` when the version differs or the difference exceeds `atol` (default: by the engine's
    dtype, `default_atol`)."""
    if version is not None and generator.version != version:
        raise SyncVerificationError(f"engine serves version {generator.version}, trainer pushed version {version}")
    atol = default_atol(getattr(generator, "dtype", "float32")) if atol is None else atol
    got = generator.score(prompt_ids, completion_ids, temperature)
    if len(got) != len(want):
        raise SyncVerificationError(f"probe length mismatch: engine {len(got)}, trainer {len(want)}")
    diffs = [abs(a - b) for a, b in zip(got, want)]
    worst = max(diffs, default=0.0)
    if not worst <= atol:  # NaN fails too
        i = diffs.index(worst) if worst == worst else 0
        raise SyncVerificationError(
            f"engine and trainer disagree on the probe after the push of version {generator.version}: "
            f"max |logprob diff| = {worst:.4f} > atol {atol} (token {i}: engine {got[i]:.4f}, trainer "
            f"{want[i]:.4f}). The engine is serving a stale, base or wrong adapter; check that the LoRA target "
            "modules are supported by the engine, or use sync_transport='files'.")
    return worst

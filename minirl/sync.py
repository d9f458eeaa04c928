"""Adapter sync: only the LoRA weights travel from trainer to generator after each update.

`WeightSync` is the boundary. `FileSync` writes the adapter in peft format to a tmpfs folder and the engine
loads it under a new integer version. After every push, `verify` checks that the engine really serves the new
adapter (its logprobs for a fixed probe equal the trainer's) — the stale-or-base-adapter bug made loud.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence


class SyncVerificationError(RuntimeError):
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


def tmpfs_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SharedSync:
    """The generator runs on the trainer's own model (transformers backend): nothing has to move."""
    transport = "shared"

    def push(self, trainer, generator) -> SyncStats:
        return SyncStats(trainer.version, 0.0, 0, self.transport)

    def close(self) -> None:
        pass


class FileSync:
    """Save to tmpfs, `generator.load_adapter(path, version)`; keeps only the last `keep` folders."""
    transport = "files"

    def __init__(self, keep: int = 3):
        self.root = Path(tempfile.mkdtemp(prefix="minirl-adapters-", dir=tmpfs_dir()))
        self.keep = keep
        self._dirs: list[Path] = []

    def push(self, trainer, generator) -> SyncStats:
        t0 = time.perf_counter()
        path = trainer.save_adapter(self.root / f"v{trainer.version}")
        generator.load_adapter(str(path), trainer.version)
        ms = (time.perf_counter() - t0) * 1e3
        self._dirs.append(path)
        while len(self._dirs) > self.keep:
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)
        nbytes = sum(f.stat().st_size for f in path.iterdir())
        return SyncStats(trainer.version, ms, nbytes, self.transport)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def verify(trainer, generator, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float,
           atol: float | None = None) -> float:
    """Engine logprobs of a fixed probe vs the trainer's, and the version the engine reports. Raises
    `SyncVerificationError` on a mismatch; returns the max abs logprob difference."""
    if generator.version != trainer.version:
        raise SyncVerificationError(f"engine serves version {generator.version}, trainer is at {trainer.version}")
    if atol is None:  # the engine knows how closely its numerics can match (float32 vs 16-bit)
        atol = generator.default_atol() if hasattr(generator, "default_atol") else 0.05
    want = trainer.logprobs(prompt_ids, completion_ids, temperature)
    got = generator.score(prompt_ids, completion_ids, temperature)
    diff = max((abs(a - b) for a, b in zip(want, got)), default=0.0)
    if len(want) != len(got) or diff > atol:
        raise SyncVerificationError(
            f"after pushing version {trainer.version} the engine's probe logprobs differ from the trainer's by "
            f"{diff:.4f} (> {atol}): the engine is not serving the new adapter. Check the LoRA target modules "
            "are supported by the engine, or use sync_transport='files'.")
    return diff

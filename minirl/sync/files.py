"""`FileSync`: the adapter saved in peft format to a tmpfs folder and loaded by the engine under a new version —
the fallback transport, and the one every engine supports."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from minirl.core import lifecycle
from minirl.sync.base import AdapterTarget, SyncStats
from minirl.types import AdapterSource, AdapterUpdate


def tmpfs_dir() -> Path:
    """/dev/shm when writable (RAM-backed: no disk in the sync path), else the system temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class FileSync:
    """Save to tmpfs, then the generator serves that folder (`update_adapter`); keeps only the last `keep`
    folders."""
    transport = "files"

    def __init__(self, keep: int = 3):
        self.root = Path(lifecycle.private_dir("adapters"))  # 0700, removed if we die
        self.keep = keep
        self._dirs: list[Path] = []

    def push(self, trainer: AdapterSource, generator: AdapterTarget) -> SyncStats:
        t0 = time.perf_counter()
        version = trainer.version
        path = trainer.save_adapter(self.root / f"v{version}")
        generator.update_adapter(lambda: AdapterUpdate(version, path=str(path)))
        ms = (time.perf_counter() - t0) * 1e3
        self._dirs.append(path)
        while len(self._dirs) > self.keep:
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)
        nbytes = sum(f.stat().st_size for f in path.iterdir())
        return SyncStats(trainer.version, ms, nbytes, self.transport)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        lifecycle.tidied(self.root)

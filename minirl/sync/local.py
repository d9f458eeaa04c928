"""Syncs for the transformers generators: nothing to move (`SharedSync`), or one shared-memory buffer to the
generator process (`ShmSync`)."""
from __future__ import annotations

import time

from minirl.sync.base import AdapterTarget, SyncStats
from minirl.types import AdapterSource, AdapterUpdate


class SharedSync:
    """The generator runs on the trainer's own model (the synchronous transformers loop): nothing has to move."""
    transport = "shared"

    def push(self, trainer: AdapterSource, generator: AdapterTarget) -> SyncStats:
        return SyncStats(trainer.version, 0.0, 0, self.transport)

    def close(self) -> None:
        pass


class ShmSync:
    """For `ProcGenerator`: the trainer's adapter is packed into the shared-memory flat buffer the generator
    process mapped (the CPU twin of the vLLM `ipc` transport), and the process copies it before answering."""
    transport = "shm"

    def push(self, trainer: AdapterSource, generator: AdapterTarget) -> SyncStats:
        t0 = time.perf_counter()
        version = trainer.version
        update = generator.update_adapter(lambda: AdapterUpdate(version))  # it packs its mapped buffer
        nbytes = (update.report or {}).get("bytes", 0)
        return SyncStats(version, (time.perf_counter() - t0) * 1e3, nbytes, self.transport)

    def close(self) -> None:
        pass

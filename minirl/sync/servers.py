"""`ServerSync`: the adapter to vLLM servers (`generation/vllm_server.py`) — written once per version, in peft
format, to a folder every server reads at the same path, then loaded on each through `/v1/load_lora_adapter`.

Each run writes into a folder of its own under `root` (`run-<random>`): two runs given the same `adapter_dir`
never overwrite each other's versions, and pruning removes only version folders this run wrote (never a user's
`v3` beside them, nor another run's). The folder of a version appears whole or not at all (saved under a temporary name, then renamed), so a server
never reads a half-written adapter, on a shared mount either. A version's folder is removed once no server holds
that version any more (the generator unloads a version when no request in flight uses it), so a server that
evicted an adapter from its cache can still reload it while it is in use.
"""
from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Protocol

from minirl.core import lifecycle
from minirl.sync.base import AdapterTarget, SyncStats
from minirl.types import AdapterSource, AdapterUpdate


class ServerTarget(AdapterTarget, Protocol):
    """What `ServerSync` needs of the servers' generator: it serves a folder (`update_adapter`) and says which
    versions a server may still read from theirs (`versions_in_use`)."""

    def versions_in_use(self) -> set[int]: ...


class ServerSync:
    """`root`: the shared folder (created if missing), in which this run writes to a new folder of its own
    (`self.root`, removed at close); None: a fresh tmpfs folder (servers on this machine), removed at close.
    `last`: the save and load milliseconds of the latest push."""
    transport = "server-files"

    def __init__(self, root: str | Path | None = None):
        self.owned = root is None
        if root is None:
            self.root = Path(lifecycle.private_dir("serveradapters"))  # private: 0700, tidied
        else:
            Path(root).mkdir(parents=True, exist_ok=True)
            while True:
                self.root = Path(root) / f"run-{secrets.token_hex(6)}"
                try:
                    self.root.mkdir()  # new: never a folder another run (or the user) has
                    break
                except FileExistsError:
                    continue
        self.written: set[int] = set()  # the versions this run wrote (the only folders it prunes)
        self.last: dict[str, float] = {}

    def push(self, trainer: AdapterSource, generator: ServerTarget) -> SyncStats:
        t0 = time.perf_counter()
        version = trainer.version
        final = self.root / f"v{version}"
        tmp = self.root / f".v{version}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        trainer.save_adapter(tmp)
        if final.exists():  # the same version pushed again (a resumed run): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        self.written.add(version)
        t1 = time.perf_counter()
        generator.update_adapter(lambda: AdapterUpdate(version, path=str(final)))
        t2 = time.perf_counter()
        self.last = {"save_ms": (t1 - t0) * 1e3, "load_ms": (t2 - t1) * 1e3}
        self._prune(generator.versions_in_use())
        nbytes = sum(f.stat().st_size for f in final.iterdir())
        return SyncStats(version, (t2 - t0) * 1e3, nbytes, self.transport)

    def _prune(self, in_use: set[int]) -> None:
        for version in sorted(self.written - in_use):
            shutil.rmtree(self.root / f"v{version}", ignore_errors=True)
            self.written.discard(version)

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.root, ignore_errors=True)
            lifecycle.tidied(self.root)
            return
        for version in sorted(self.written):
            shutil.rmtree(self.root / f"v{version}", ignore_errors=True)
        self.written.clear()
        try:
            self.root.rmdir()  # empty unless someone else put files in it: then it stays, with them
        except OSError:
            pass

"""Adapter sync: only the LoRA weights travel from trainer to generator after each update.

`WeightSync` (`base.py`) is the boundary: `push(trainer, generator)` hands the trainer's current adapter (policy version
`trainer.version`) to the generator and returns `SyncStats`. `make_sync` (`factory.py`) picks one for a run:

  shared      the synchronous transformers loop: the generator runs on the trainer's own model (`local.py`)
  shm         the transformers generator process: one shared-memory flat buffer (`local.py`)
  ipc         vLLM: a shared-memory file (CPU) / CUDA IPC handle (GPU) mapped by the engine worker (`senders.py`)
  collective  vLLM: a gloo (CPU) / NCCL (GPU) broadcast to the engine worker (`senders.py`)
  files       vLLM: the adapter saved to tmpfs in peft format and loaded by the engine (`files.py`)

The in-memory vLLM transports (`tensor.py`, `senders.py`) meet the worker-side receiver (`receiver.py`, a vLLM
worker extension, with `channel.py`) through what both sides share (`wire.py`, `minirl.core.adapter`).
After every push, `verify` (`check.py`, with the run's `SyncCheck`) checks that the engine serves the new adapter.
Every vLLM private name, patched method and tensor write is in `vllm_compat.py`; its `check_hooks` verifies them on
the running engine (`hook_report.py`), and `make_sync` takes only what the engine's hooks allow.
"""
from minirl.sync.base import (
                              TRANSPORTS,
                              AdapterTarget,
                              CollectiveError,
                              SyncError,
                              SyncStats,
                              SyncTimeout,
                              SyncVerificationError,
                              Verification,
                              WeightSync,
)
from minirl.sync.check import SyncCheck, verify
from minirl.sync.factory import make_sync

__all__ = ["TRANSPORTS", "AdapterTarget", "CollectiveError", "SyncCheck", "SyncError", "SyncStats", "SyncTimeout",
           "SyncVerificationError", "Verification", "WeightSync", "make_sync", "verify"]

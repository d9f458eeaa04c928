"""`TensorSync`: the `WeightSync` over the in-memory transports (`ipc`, `collective`), and how `auto` picks one."""
from __future__ import annotations

import itertools
import time
from typing import Protocol

import torch

from minirl.core.adapter import adapter_params, b_scalings, peft_config_dict
from minirl.sync.base import AdapterTarget, SyncError, SyncStats
from minirl.sync.senders import SENDERS, Sender, call_on_loop, rpc
from minirl.sync.wire import WORKER_EXTENSION, EngineHost
from minirl.types import AdapterSource, AdapterUpdate

_LORA_IDS = itertools.count(1_000_001)  # far above the generator's own counter (shared with request ids)


# ---- choosing ------------------------------------------------------------------------------------------------

def has_receiver(generator: EngineHost) -> bool:
    return generator.worker_extension == WORKER_EXTENSION


def pick_transport(generator: EngineHost, trainer_device: str | torch.device = "cpu") -> tuple[str, str]:
    """(transport, why) for a vLLM generator and the trainer's device: in-memory whenever the engine carries the
    receiver; `ipc` when both sides share memory (CPU, or the same GPU); `collective` (NCCL) across GPUs."""
    if not has_receiver(generator):
        return "files", f"the engine was started without worker_extension_cls={WORKER_EXTENSION!r}"
    dev = torch.device(trainer_device)
    if generator.on_cpu or dev.type == "cpu":
        if generator.on_cpu and dev.type == "cpu":
            return "ipc", "CPU engine and trainer: shared-memory buffer mapped by the engine worker"
        return "collective", "engine and trainer on different device types: gloo broadcast"
    info = call_on_loop(generator, rpc(generator, "minirl_info", timeout_s=30.0), 30.0)
    same = info.get("device_uuid") == str(torch.cuda.get_device_properties(dev).uuid)
    if same:
        return "ipc", "engine and trainer on the same GPU: CUDA IPC handle"
    return "collective", "engine and trainer on different GPUs: NCCL broadcast"


class InMemoryTarget(EngineHost, AdapterTarget, Protocol):
    """A generator the in-memory transports deliver to: its engine (`EngineHost`), and `update_adapter`, which
    runs the delivery and serves what the worker installed."""


class TensorSync:
    """`WeightSync` over an in-memory transport. `inflight=True`: one LoRA id whose weights are swapped in place
    between engine steps (sequences in flight continue on the new weights); otherwise a new LoRA id per version
    (sequences in flight finish on their adapter, which the generator removes once idle).

    `transport`: 'ipc', 'collective' or 'auto'. Bounded: every wait raises `SyncError`/`SyncTimeout` after
    `timeout_s`. `last` holds the worker's report of the latest push (timings, in-place swap token counts)."""

    def __init__(self, transport: str = "auto", inflight: bool = False, timeout_s: float = 30.0):
        if transport not in ("auto", "ipc", "collective"):
            raise ValueError(f"transport={transport!r}: use 'auto', 'ipc' or 'collective'")
        self.requested, self.transport, self.why = transport, transport, ""
        self.inflight, self.timeout_s = inflight, timeout_s
        self.sender: Sender | None = None
        self._gen: InMemoryTarget | None = None
        self.lora_id: int | None = None
        self.last: dict = {}

    def _sender(self, trainer: AdapterSource, generator: InMemoryTarget) -> Sender:
        if self.sender is None or self._gen is not generator:
            if self.sender is not None:
                self.sender.close()
            dev = next(p for p in trainer.model.parameters()).device
            if self.requested == "auto":
                self.transport, self.why = pick_transport(generator, dev)
                if self.transport == "files":
                    raise SyncError(f"no in-memory transport: {self.why}; use FileSync")
            elif not has_receiver(generator):
                raise SyncError(f"sync_transport={self.requested!r} needs the engine started with "
                                f"worker_extension_cls={WORKER_EXTENSION!r}")
            self.sender = SENDERS[self.transport](generator, adapter_params(trainer.model),
                                                  peft_config_dict(trainer.model), timeout_s=self.timeout_s,
                                                  scales=b_scalings(trainer.model))
            self._gen, self.lora_id = generator, None
        return self.sender

    def push(self, trainer: AdapterSource, generator: InMemoryTarget) -> SyncStats:
        t0 = time.perf_counter()
        sender = self._sender(trainer, generator)
        ring = self.inflight and self.lora_id is not None  # an in-place swap of the installed id: the doorbell
        if self.lora_id is None or not self.inflight:
            self.lora_id = next(_LORA_IDS)
        lora_id, version = self.lora_id, trainer.version

        def deliver() -> AdapterUpdate:  # the worker installs the bytes under `lora_id`; the generator serves it
            return AdapterUpdate(version, slot=lora_id, report=sender.send(lora_id, version, ring=ring))
        try:
            self.last = generator.update_adapter(deliver, in_place=self.inflight).report
        except BaseException:
            # a push that failed midway may have left that id's slot part old, part new, and the channel mid-way
            # through a transfer: a later push starts a fresh id on a fresh channel
            self.lora_id = None
            self.close()
            raise
        return SyncStats(trainer.version, (time.perf_counter() - t0) * 1e3, sender.nbytes, self.transport)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

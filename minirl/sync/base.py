"""What every transport shares: the errors, `SyncStats`, the `WeightSync` protocol and the target it pushes to."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

from minirl.types import AdapterSource, AdapterUpdate

TRANSPORTS = ("auto", "ipc", "collective", "files")


class SyncError(RuntimeError):
    """An adapter sync could not complete."""


class SyncTimeout(SyncError, TimeoutError):
    """An adapter sync did not complete within its timeout (peer gone or stuck)."""


class CollectiveError(SyncTimeout):
    """A broadcast of the collective sync failed: the peer is gone or did not answer in time (a `SyncTimeout`)."""


class SyncVerificationError(SyncError):
    """The engine does not serve the adapter the trainer just pushed."""


@dataclass(frozen=True)
class Verification:
    """What `verify` found after one push. Diffs: root-mean-square per-token logprob differences on the probe."""
    version: int                   # the version the engine says it serves, read back from the engine
    new_diff: float                # engine vs the trainer under the adapter just pushed
    prev_diff: float | None        # engine vs the trainer under the reference adapter (None: first check)
    sep: float | None              # trainer: new vs reference adapter (how far the pushes since it moved the probe)
    verified: bool                 # True: new and reference adapter told apart; False: too close (not an error)
    reference: tuple[float, ...]   # the next check's reference: the trainer's probe logprobs of ...
    reference_version: int         # ... this version (this check's when told apart, else the previous reference)

    def metrics(self) -> dict[str, float | None]:
        return {"sync/verify_new_diff": self.new_diff, "sync/verify_prev_diff": self.prev_diff,
                "sync/verify_sep": self.sep, "sync/verified": float(self.verified)}


@dataclass(frozen=True)
class SyncStats:
    version: int
    ms: float
    bytes: int
    transport: str
    verification: "Verification | None" = None  # set by the run after `verify`

    def metrics(self) -> dict[str, float]:
        """The push's step metrics (`minirl.core.metrics.METRICS`)."""
        out = {"sync/ms": self.ms, "sync/bytes": self.bytes}
        return {**out, **self.verification.metrics()} if self.verification is not None else out


class AdapterTarget(Protocol):
    """What every transport needs of the generator it delivers to: `update_adapter` runs the transport's delivery
    and serves what it delivered (`minirl.types.Generator.update_adapter`). A transport that needs more says so in
    a protocol of its own (`tensor.InMemoryTarget`, `servers.ServerTarget`); `generation.make_generator` pairs
    each generator with a transport it meets."""

    def update_adapter(self, deliver: Callable[[], AdapterUpdate], in_place: bool = False) -> AdapterUpdate: ...


G = TypeVar("G", bound=AdapterTarget, contravariant=True)


class WeightSync(Protocol[G]):
    """A transport: `WeightSync[T]` delivers the trainer's adapter to a generator that meets `T`."""
    transport: str

    def push(self, trainer: AdapterSource, generator: G) -> SyncStats:
        """Hand the trainer's current adapter (version `trainer.version`) to the generator."""

    def close(self) -> None: ...

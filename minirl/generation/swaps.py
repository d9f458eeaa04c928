"""Exact per-token versions across in-place adapter swaps (the `inflight` policy), from the worker's install reports.

When the trainer's adapter is written into the slot of the LoRA id being served, the requests in flight on that id
go on with the new weights from the next engine step. The worker reports each such install
(`minirl.sync.receiver.Receiver.install`): how many output tokens each of its requests on the id had at the swap,
and which requests started since the previous install, on which version. `SwapLog` turns one LoRA id's reports
into each token's version; `SwapTracker` is the generator's bookkeeping around it.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from dataclasses import dataclass
from typing import Container, Iterator


def split_worker_request_id(worker_id: str) -> tuple[str, int]:
    """vLLM's worker request id -> (the id the caller gave `generate`, sample index). vLLM appends '-<8 chars>' to
    the caller's id and prefixes '<j>_' for sample j of an n > 1 request."""
    m = re.match(r"^(?:(\d+)_)?(.+)-[0-9A-Za-z]{8}$", worker_id)
    if m is None:
        return worker_id, 0
    return m.group(2), int(m.group(1) or 0)


@dataclass(frozen=True)
class SwapRecord:
    """One install's report, keyed by (caller request id, sample index)."""
    version: int                          # the version installed
    swap: dict[tuple[str, int], int]      # -> output tokens it had at the swap (sampled before it)
    started: dict[tuple[str, int], int]   # -> version it started on, for those that started since the last install


class SwapLog:
    """The worker's reports of installs on one LoRA id, in order. Feed it every `minirl_install` report
    (`TensorSync.last`, or the `report` of an `AdapterUpdate` given to the generator), then ask
    `token_versions` for a finished request by the id the caller gave `AsyncLLM.generate` and the sample index.
    Ask only when no install is in flight (its report may concern the request)."""

    def __init__(self):
        self.records: list[SwapRecord] = []

    def add(self, report: dict) -> None:
        key = split_worker_request_id
        self.records.append(SwapRecord(report["version"],
                                       {key(rid): n for rid, n in (report.get("swap") or {}).items()},
                                       {key(rid): v for rid, v in report.get("started") or ()}))

    def token_versions(self, request_id: str, n_tokens: int, index: int = 0) -> list[int]:
        """Version of each of the `n_tokens` output tokens of sample `index` of request `request_id`."""
        k = (request_id, index)
        start = next((i for i, r in enumerate(self.records) if k in r.started), None)
        if start is None:  # started after the last install we know of
            return [self.records[-1].version] * n_tokens if self.records else []
        v, pos, out = self.records[start].started[k], 0, []
        for r in self.records[start:]:
            if k not in r.swap:
                break  # finished before this install
            n = min(r.swap[k], n_tokens)
            out += [v] * (n - pos)
            pos, v = n, r.version
        return out + [v] * (n_tokens - pos)

    def prune(self, live: Container[str]) -> None:
        """Drop the records that no request in `live` (caller request ids that may still ask) can need. A request
        reads the records from the first one listing it as started; one not listed yet (it started after the last
        install) reads only the last record, and later ones. So everything before the first record that lists a
        live request goes, except the last record."""
        keep = next((i for i, r in enumerate(self.records) if any(rid in live for rid, _ in r.started)),
                    len(self.records) - 1)
        if keep > 0:
            del self.records[:keep]


class SwapTracker:
    """The generator's in-place swap bookkeeping. Thread-safe: reports come from the engine loop (an install by
    engine call) or from the trainer's thread (a swap rung on the worker's doorbell, reported outside the engine's
    output stream).

    - `note`: an in-place install's report, into the `SwapLog` of its LoRA id; `versions`: a finished request's
      per-token versions (its start version throughout when its adapter was never swapped in place).
    - `begin` / `end`: a direct swap sent to the worker / its report handled. A finishing request awaits
      `settled` before asking for its versions, so they see every swap that landed before its last step.
    - `tracking(request_id, lora_id)`: the request may still ask, from its start until its versions are taken.
      A log keeps only the records such requests can need (`SwapLog.prune`), and goes once its id is `forget`-ten
      and none of them is left: memory stays bounded by the swaps during the longest request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.logs: dict[int, SwapLog] = {}
        self.pending = 0                      # direct swaps begun, not yet reported
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}       # caller request id -> its LoRA id
        self._forgotten: set[int] = set()     # LoRA ids no longer served whose log waits for its live requests
        self._settled: list[asyncio.Future] = []

    def note(self, lora_id: int, report: dict) -> None:
        with self._lock:
            self.logs.setdefault(lora_id, SwapLog()).add(report)
            self._prune(lora_id)

    def versions(self, lora_id: int | None, request_id: str, index: int, n_tokens: int,
                 version: int) -> tuple[int, ...]:
        """Versions of the `n_tokens` output tokens of sample `index` of request `request_id` on LoRA `lora_id`
        (None: the base model), which started as `version`."""
        with self._lock:
            log = self.logs.get(lora_id)
            if log is None:
                return (version,) * n_tokens
            return tuple(log.token_versions(request_id, n_tokens, index))

    @contextlib.contextmanager
    def tracking(self, request_id: str, lora_id: int | None) -> Iterator[None]:
        if lora_id is None:
            yield
            return
        with self._lock:
            self._live[request_id] = lora_id
        try:
            yield
        finally:
            with self._lock:
                del self._live[request_id]
                self._prune(lora_id)

    def forget(self, lora_id: int) -> None:
        """The engine no longer serves `lora_id` (no new request can start on it)."""
        with self._lock:
            self._forgotten.add(lora_id)
            self._prune(lora_id)

    def _prune(self, lora_id: int) -> None:
        live = {rid for rid, lid in self._live.items() if lid == lora_id}
        if lora_id in self._forgotten and not live:
            self._forgotten.discard(lora_id)
            self.logs.pop(lora_id, None)
        elif lora_id in self.logs:
            self.logs[lora_id].prune(live)

    def begin(self) -> None:
        with self._lock:
            self.pending += 1

    def end(self) -> None:
        with self._lock:
            self.pending -= 1
        try:
            self.loop.call_soon_threadsafe(self._wake_settled)
        except RuntimeError:  # the engine loop is closed: nobody waits
            pass

    def _wake_settled(self) -> None:
        if not self.pending:
            for f in self._settled:
                if not f.done():
                    f.set_result(None)
            self._settled.clear()

    async def settled(self) -> None:
        """Until no direct swap is in flight (on the engine loop)."""
        while self.pending:
            f = self.loop.create_future()
            self._settled.append(f)
            await f

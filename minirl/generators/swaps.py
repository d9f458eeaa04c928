"""Exact per-token versions across in-place adapter swaps (the `inflight` policy): the worker's install reports."""
from __future__ import annotations

import re


def split_worker_request_id(worker_id: str) -> tuple[str, int]:
    """vLLM's worker request id -> (the id the caller gave `generate`, sample index). vLLM appends '-<8 chars>' to
    the caller's id and prefixes '<j>_' for sample j of an n > 1 request."""
    m = re.match(r"^(?:(\d+)_)?(.+)-[0-9A-Za-z]{8}$", worker_id)
    if m is None:
        return worker_id, 0
    return m.group(2), int(m.group(1) or 0)


class SwapLog:
    """The worker's reports of installs on one LoRA id, in order, for exact per-token version tags across in-place
    swaps. Feed it every `minirl_install` report (`TensorSync.last`, or the `report` given to the generator's
    `serve_installed_async`), then ask `token_versions` for a finished request by the id the caller gave
    `AsyncLLM.generate` and the sample index. Ask only when no install is in flight (its report may concern the
    request)."""

    def __init__(self):
        self.records: list[dict] = []

    def add(self, report: dict) -> None:
        key = split_worker_request_id
        self.records.append({"version": report["version"], "prev": report.get("prev_version"),
                             "swap": {key(rid): n for rid, n in (report.get("swap") or {}).items()},
                             "started": {key(rid): v for rid, v in report.get("started") or ()}})

    def token_versions(self, request_id: str, n_tokens: int, index: int = 0) -> list[int]:
        """Version of each of the `n_tokens` output tokens of sample `index` of request `request_id`."""
        k = (request_id, index)
        start = next((i for i, r in enumerate(self.records) if k in r["started"]), None)
        if start is None:  # started after the last install we know of
            return [self.records[-1]["version"]] * n_tokens if self.records else []
        v, pos, out = self.records[start]["started"][k], 0, []
        for r in self.records[start:]:
            if k not in r["swap"]:
                break  # finished before this install
            n = min(r["swap"][k], n_tokens)
            out += [v] * (n - pos)
            pos, v = n, r["version"]
        return out + [v] * (n_tokens - pos)

    def prune(self, keep: int = 10_000) -> None:
        del self.records[:-keep]

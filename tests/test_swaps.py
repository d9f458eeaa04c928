"""`SwapTracker` (minirl.generation.swaps): per-token versions across in-place swaps stay exact while the swap log
is pruned to what running requests can need. A simulated worker (steps, installs between steps, requests of 1-2
samples that start and finish at random) stands for vLLM here; the same path against the real engine is
tests/test_sync_transports.py::test_rapid_inflight_syncs_during_generation_keep_exact_versions."""
import asyncio
import random

import pytest

from minirl.generation.swaps import SwapLog, SwapTracker

LORA = 7


class Sim:
    """A worker serving one LoRA id: an install (in-place swap) may land between two steps; each step samples one
    token per running sample with the weights in place. Reports are what `Receiver.install` reports."""

    def __init__(self, tracker: SwapTracker, seed: int, max_len: int):
        self.tracker, self.rng, self.max_len = tracker, random.Random(seed), max_len
        self.reference = SwapLog()  # every report, never pruned
        self.version = 1            # installed by engine call before the first step (not an in-place swap)
        self.started: list = []     # (worker request id, version) since the last install
        self.queued: list = []      # submitted, not yet given to the worker
        self.running: dict = {}     # request id -> {"samples": [[true version per token]], "want": [lengths], ...}
        self.finishing: list = []   # done in the worker, versions not asked yet: [steps left, request id, request]
        self.installs = 0
        self.checked = 0
        self.next_id = 0

    def install(self) -> None:
        self.version += 1
        self.installs += 1
        report = {"version": self.version, "prev_version": self.version - 1, "inplace": True,
                  "swap": {wid: len(toks) for r in self.running.values()
                           for wid, toks, want in zip(r["wids"], r["samples"], r["want"]) if len(toks) < want},
                  "started": self.started}
        self.started = []
        self.tracker.note(LORA, report)
        self.reference.add(report)

    def submit(self) -> None:
        self.next_id += 1
        rid, n = f"minirl-{self.next_id}", self.rng.choice((1, 2))
        wids = [f"{rid}-0123abcd"] if n == 1 else [f"{j}_{rid}-0123abcd" for j in range(n)]
        track = self.tracker.tracking(rid, LORA)
        track.__enter__()
        self.queued.append((rid, {"wids": wids, "samples": [[] for _ in wids], "track": track,
                                  "want": [self.rng.randint(1, self.max_len) for _ in wids], "since": self.installs,
                                  "acquired": self.version}))

    def step(self) -> None:
        for f in self.finishing:  # the caller takes the versions of a finished request a few steps later
            f[0] -= 1
        for _, rid, r in [f for f in self.finishing if f[0] < 0]:
            self.finish(rid, r)
        self.finishing = [f for f in self.finishing if f[0] >= 0]
        for rid, r in self.queued:  # the worker is given the new requests: each starts on the installed version
            self.started += [(wid, self.version) for wid in r["wids"]]
            self.running[rid] = r
        self.queued = []
        for rid, r in list(self.running.items()):
            for toks, want in zip(r["samples"], r["want"]):
                if len(toks) < want:
                    toks.append(self.version)
            if all(len(t) == w for t, w in zip(r["samples"], r["want"])):
                self.finishing.append([self.rng.choice((0, 0, 1, 3)), rid, self.running.pop(rid)])

    def finish(self, rid: str, r: dict) -> None:
        for j, toks in enumerate(r["samples"]):
            got = self.tracker.versions(LORA, rid, j, len(toks), r["acquired"])
            assert list(got) == toks, (rid, j, got, toks)
            if self.reference.records:
                assert self.reference.token_versions(rid, len(toks), j) == toks
            self.checked += 1
        r["track"].__exit__(None, None, None)

    def records(self) -> int:
        log = self.tracker.logs.get(LORA)
        return 0 if log is None else len(log.records)

    def bound(self) -> int:
        """Records the running requests can need: the last one, and those since the oldest request still live."""
        live = [r["since"] for _, r in self.queued] + [r["since"] for r in self.running.values()] + \
               [r["since"] for _, _, r in self.finishing]
        return 1 + (self.installs - min(live) if live else 0)


@pytest.mark.parametrize("seed,submit_p,max_len", [(0, 0.4, 24), (1, 0.4, 24), (2, 0.1, 4), (3, 0.1, 4)])
def test_swap_log_stays_bounded_and_versions_stay_exact(seed, submit_p, max_len):
    """Many concurrent requests, or few and short ones (so that a finished request is often the only one that
    needs an old record)."""
    tracker = SwapTracker(asyncio.new_event_loop())
    sim = Sim(tracker, seed, max_len)
    for _ in range(3000):
        if sim.rng.random() < 0.3:
            sim.install()
        if sim.rng.random() < submit_p:
            sim.submit()
        sim.step()
        assert sim.records() <= sim.bound()
    while sim.running or sim.queued or sim.finishing:
        sim.step()
    assert sim.installs > 800 and sim.checked > 300
    assert len(sim.reference.records) == sim.installs and sim.records() == 1  # the last install only
    assert max(max(len(r.swap), len(r.started)) for r in sim.reference.records) >= 2  # requests did overlap
    tracker.forget(LORA)
    assert tracker.logs == {}


def test_forgotten_log_goes_with_its_last_live_request():
    """A LoRA id the engine stopped serving keeps its log while a request on it may still ask (it finished, but
    its versions are not taken yet), and drops it after."""
    tracker = SwapTracker(asyncio.new_event_loop())
    with tracker.tracking("minirl-1", LORA):
        tracker.note(LORA, {"version": 2, "swap": {"minirl-1-0123abcd": 3}, "started": [("minirl-1-0123abcd", 1)]})
        tracker.note(LORA, {"version": 3, "swap": {}, "started": []})
        tracker.forget(LORA)
        assert tracker.versions(LORA, "minirl-1", 0, 5, 1) == (1, 1, 1, 2, 2)
    assert tracker.logs == {}
    assert tracker.versions(LORA, "minirl-2", 0, 2, 4) == (4, 4)  # no log: the version it started on


def test_pruning_keeps_what_a_live_request_needs():
    """The pruning is not vacuous: the records from the first one listing a live request as started are kept;
    with no live request only the last one is."""
    log = SwapLog()
    log.add({"version": 2, "swap": {}, "started": [("a-0123abcd", 1)]})
    log.add({"version": 3, "swap": {"a-0123abcd": 2, "b-0123abcd": 1}, "started": [("b-0123abcd", 2)]})
    log.add({"version": 4, "swap": {"a-0123abcd": 4, "b-0123abcd": 2}, "started": []})
    log.prune({"a", "b"})
    assert [r.version for r in log.records] == [2, 3, 4]
    log.prune({"b"})
    assert [r.version for r in log.records] == [3, 4] and log.token_versions("b", 3) == [2, 3, 4]
    log.prune(set())
    assert [r.version for r in log.records] == [4]

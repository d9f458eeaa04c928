"""Issue 51 item 4: no reward value can stall scoring. Each fault is injected and seen refused or recorded, the
scorer returning while the value's own methods still wait (they wait on an event, set once the test is done)."""
import os
import pickle
import struct
import sys
import threading

import numpy as np
import pytest

from minirl.rewards import Scorer
from minirl.rewards.workers import RewardCall, RewardWorkers
from minirl.types import Completion, Group, Prompt

release = threading.Event()  # what the hostile values' methods wait for: a new one for each test, set after it
HANG = 60  # bounds a wait only where the old code ran a value's method in the trainer: the test then fails, late


@pytest.fixture(autouse=True)
def _release():
    global release
    release = threading.Event()
    yield
    release.set()


def _group(texts):
    return Group(Prompt(0, (1, 2), "q"), tuple(Completion((5,), (-1.0,), (0,), t, "stop") for t in texts))


def _score(values: dict, workers: int, timeout_s: float = 5.0):
    scorer = Scorer([("r", lambda p, c, **_: values[c]())], [1.0], timeout_s=timeout_s, workers=workers)
    try:
        return scorer.score_group(_group(list(values)))
    finally:
        scorer.close()


def test_a_list_sharing_its_halves_40_levels_deep_from_two_workers_is_a_failure_at_once():
    """The issue's value (2**40 leaves, 160 bytes pickled): refused by its type where it was returned."""
    def deep():
        x = [0.0]
        for _ in range(40):
            x = [x, x]
        return x
    g = _score({"deep": deep, "ok": lambda: 1.0}, workers=2)
    assert g.rewards == (None, 1.0) and [f.reason for f in g.failures] == [
        "returned list of 2 items, expected a float or None"]


class SlowFloat(float):
    def __float__(self):
        release.wait(HANG)
        return 1.0


class SlowClass:
    """isinstance() asks an object that is not an int or float for its __class__."""
    @property
    def __class__(self):
        release.wait(HANG)
        return float


class NumpyLookalike:
    __module__ = "numpy"

    @property
    def dtype(self):
        release.wait(HANG)
        return np.dtype("f8")


class SlowRepr:
    def __repr__(self):
        release.wait(HANG)
        return "slow"


class SlowEq(float):
    def __eq__(self, other):
        release.wait(HANG)
        return True

    __hash__ = float.__hash__


def test_in_process_the_conversion_to_a_number_runs_under_the_calls_timeout():
    """reward_workers 0: a returned value whose __float__, __class__ or dtype hangs is a timeout like a hung call;
    its __repr__ and __eq__ never run."""
    values = {"float": lambda: SlowFloat(2.0), "class": SlowClass, "numpy": NumpyLookalike, "repr": SlowRepr,
              "eq": lambda: SlowEq(0.5), "ok": lambda: 1.0}
    g = _score(values, workers=0, timeout_s=0.3)
    assert not release.is_set()
    assert g.rewards == (None, None, None, None, 0.5, 1.0)
    assert [(f.sample, f.reason) for f in g.failures] == [
        (0, "timeout after 0.3s"), (1, "timeout after 0.3s"), (2, "timeout after 0.3s"),
        (3, "returned SlowRepr (not shown), expected a float or None")]
    assert all(type(v) is float for v in g.per_reward["r"] if v is not None)


def test_in_a_worker_a_hanging_conversion_is_a_timeout_and_the_worker_is_replaced():
    class Stuck(float):  # defined here, so it travels by value (a worker never imports this module)
        def __float__(self):
            import time
            time.sleep(600)  # until its worker is killed

    g = _score({"float": lambda: Stuck(2.0), "ok": lambda: 1.0}, workers=1, timeout_s=1.0)
    assert g.rewards == (None, 1.0) and [f.reason for f in g.failures] == ["timeout after 1.0s"]


def test_numpy_scalars_and_bools_are_numbers_in_process_and_from_workers():
    """TRL turns its rewards into a float32 tensor, so a reward returning `answer in completion` (a bool) means 1.0
    or 0.0 there; so it does here, for Python's and numpy's bools alike."""
    values = {"f32": lambda: np.float32(0.5), "f64": lambda: np.float64(0.25), "i64": lambda: np.int64(2),
              "bool": lambda: np.bool_(True), "pybool": lambda: False}
    for workers in (0, 2):
        g = _score(values, workers=workers)
        assert g.rewards == (0.5, 0.25, 2.0, 1.0, 0.0), workers
        assert all(type(v) is float for v in g.per_reward["r"]) and not g.failures


def _nested_set_bomb() -> bytes:
    """A pickle of ({t}, None) where t is a tuple sharing its halves 40 levels deep: 2**40 leaves to hash when the
    set is built. A worker never sends it (its reward would hash t itself): a reward writing to its socket can."""
    ops = [pickle.PROTO, b"\x04", pickle.EMPTY_TUPLE, pickle.MEMOIZE]
    for i in range(40):
        ops += [pickle.BINGET, bytes([i]), pickle.BINGET, bytes([i]), pickle.TUPLE2, pickle.MEMOIZE]
    ops += [pickle.EMPTY_SET, pickle.MARK, pickle.BINGET, bytes([40]), pickle.ADDITEMS, pickle.NONE, pickle.TUPLE2,
            pickle.STOP]
    return b"".join(ops)


def _writes_its_own_reply(payload: bytes, claimed: int | None = None):
    """A reward that sends the trainer a frame of its own on its worker's socket (fd in argv), then answers 5.0."""
    def reward(p, c, **_):
        os.write(int(sys.argv[2]), struct.pack("!Q", len(payload) if claimed is None else claimed) + payload)
        return 5.0
    return reward


def test_a_worker_reply_is_bounded_in_bytes_and_objects_and_checked_by_type():
    """Whatever bytes a worker sends are a recorded failure, at once, and its worker is replaced: the next call
    gets its own answer, never the stale one the worker sent after."""
    hostile = {"bomb": _writes_its_own_reply(_nested_set_bomb()),
               "shape": _writes_its_own_reply(b'{"value": [1.0]}'),
               "int": _writes_its_own_reply(b"[1, null]"),
               "deep": _writes_its_own_reply(b"[" * 30_000 + b"]" * 30_000),
               "huge": _writes_its_own_reply(b"", claimed=1 << 40)}
    with RewardWorkers(list(hostile.items()) + [("ok", lambda p, c, **_: 1.0)], 1, 30.0) as rw:
        for name in hostile:
            [out] = rw.call_many([RewardCall(name, "p", "c")])
            assert out.value is None and out.error.startswith(
                "reply of 1099511627776 bytes is over the 65536-byte limit" if name == "huge" else
                "return value cannot come back from the worker ("), (name, out.error)
            assert [(o.value, o.error) for o in rw.call_many([RewardCall("ok", "p", "c")])] == [(1.0, None)], name


def test_torch_scalars_and_tensors_are_numbers_as_trl_takes_them_in_process_and_from_workers():
    """A 0-d tensor of a real dtype is a number (per sample, and as a batched entry); a batched reward may return a
    1-d tensor (TRL: torch.tensor(rewards)); a 0-d bool tensor is 1.0 / 0.0. A complex or 1-element 1-d tensor is
    refused, by its type, and a 1-d tensor of the wrong length is a wrong length."""
    import torch
    values = {"f32": lambda: torch.tensor(0.5), "i64": lambda: torch.tensor(2), "f16": lambda: torch.tensor(
        0.25, dtype=torch.float16), "grad": lambda: torch.tensor(1.5, requires_grad=True) * 1,
        "bool": lambda: torch.tensor(True), "cplx": lambda: torch.tensor(1j), "1d": lambda: torch.tensor([0.5])}

    def tensor(prompts, completions, **kwargs):
        return torch.tensor([float(len(c)) for c in completions])

    def entries(prompts, completions, **kwargs):
        return [torch.tensor(1.0)] + [None] * (len(completions) - 1)

    def short(prompts, completions, **kwargs):
        return torch.tensor([1.0])

    for workers in (0, 1):
        g = _score(values, workers=workers)
        assert g.rewards == (0.5, 2.0, 0.25, 1.5, 1.0, None, None), workers
        assert all(type(v) is float for v in g.rewards if v is not None)
        assert [f.reason for f in g.failures] == ["returned Tensor (not shown), expected a float or None"] * 2
        scorer = Scorer([("tensor", tensor), ("entries", entries), ("short", short)], [1.0, 1.0, 0.0], timeout_s=5.0,
                        workers=workers)
        try:
            g = scorer.score_group(_group(["a", "bb"]))
        finally:
            scorer.close()
        assert g.per_reward == {"tensor": (1.0, 2.0), "entries": (1.0, None), "short": (None, None)}, workers
        assert g.rewards == (2.0, 2.0)  # entries' None: TRL's nansum; `short` is a check (weight 0)
        assert [f.reason for f in g.failures] == ["wrong length: returned 1 values for 2 completions; a batched "
                                                  "reward gives one value (or None) per completion, in order"] * 2


def test_a_reward_that_edits_its_inputs_changes_nothing_another_reward_or_the_data_sees():
    """In-process as in a worker: a per-sample reward appending to a list column, and a batched one editing its
    lists (a column's entries, the completions), each get their own copy; the reward scored after them, the next
    sample and the group's columns see the data as it was."""
    def edits(prompt, completion, tests, meta, **_):
        tests.append("assert False")
        meta["seen"] = meta.get("seen", 0) + 1
        return 1.0

    def edits_batched(prompts, completions, tests, **kwargs):
        tests[0].clear()
        completions.append("extra")
        completions[0] = "changed"
        return [0.0] * (len(completions) - 1)

    def reads(prompt, completion, tests, meta, **_):
        return float(len(tests) + 10 * len(meta))

    def reads_batched(prompts, completions, tests, **kwargs):
        return [float(len(completions) + 10 * len(t)) + (c == "changed") for c, t in zip(completions, tests)]

    columns = {"tests": ["assert f(1) == 1"], "meta": {}}
    for workers in (0, 1):
        scorer = Scorer([("edits", edits), ("edits_batched", edits_batched), ("reads", reads),
                         ("reads_batched", reads_batched)], [1.0] * 4, timeout_s=5.0, workers=workers)
        group = Group(Prompt(0, (1, 2), "q", columns), tuple(Completion((5,), (-1.0,), (0,), t, "stop")
                                                               for t in ("a", "b")))
        try:
            g = scorer.score_group(group)
        finally:
            scorer.close()
        assert g.failures == () and g.per_reward["edits"] == (1.0, 1.0), workers
        assert g.per_reward["reads"] == (1.0, 1.0) and g.per_reward["reads_batched"] == (12.0, 12.0), workers
        assert columns == {"tests": ["assert f(1) == 1"], "meta": {}}
        assert [c.text for c in g.group.completions] == ["a", "b"]

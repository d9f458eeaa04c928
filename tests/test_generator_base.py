"""What the loop generators share (minirl/generators/base.py): the one per-request seed, the served-adapters table,
and stream / generate / submit / close on a loop thread, exercised with a generator that samples nothing."""
import asyncio

import pytest

from minirl.generation.base import LoopGenerator, ServedAdapters, request_seed
from minirl.types import Completion, Group, Prompt, SamplingParams


def test_request_seed_is_one_hash_for_prompts_turns_and_resubmits():
    assert request_seed(3, 7, 0) == request_seed(3, 7, 0) != request_seed(3, 7, 1)
    assert request_seed(3, 1) != request_seed(3, 1, 0) != request_seed(4, 1, 0)  # the key's length counts
    assert all(0 <= request_seed(s, i) < 2 ** 30 for s in range(5) for i in range(5))


def test_served_adapters_keep_a_replaced_adapter_until_its_last_request():
    t = ServedAdapters(lambda a: a)
    assert t.acquire() == (None, 0) and t.release(None) is False  # the base model is never counted nor removed
    assert t.serve("a", 1) is None  # replaced the base: nothing to remove
    a1, a2 = t.acquire(), t.acquire()
    assert a1 == a2 == ("a", 1) and t.in_flight() == {"a"}
    assert t.serve("b", 2) is None  # "a" is in use: it goes at its last release
    assert t.release("a") is False  # one request left on it
    assert t.release("a") is True  # the last: the caller removes it now
    assert t.in_flight() == set()
    assert t.serve("c", 3) == "b"  # idle: removable at once
    assert t.serve("c", 4) is None and t.version == 4  # the same engine adapter swapped in place stays
    t.acquire()
    assert t.release("c") is False  # still served


class Echo(LoopGenerator):
    """Each group's completions are the prompt's seed for this visit, one token each; `gate` holds prompt 1."""
    name = "echo"

    def __init__(self):
        super().__init__()
        self.adapters = ServedAdapters(lambda a: a)
        self.gate = asyncio.Event()

    async def generate_group(self, prompt, n, params):
        seed = self._next_seed(prompt, params)
        if prompt.index == 1:
            await self.gate.wait()
        return Group(prompt, tuple(Completion((seed or 0,), (0.0,), (self.version,), "", "stop") for _ in range(n)))


def _prompts(k):
    return [Prompt(i, (i,), str(i)) for i in range(k)]


def test_loop_generator_streams_in_finish_order_and_generates_in_prompt_order():
    with Echo() as gen:
        params = SamplingParams(seed=5)

        async def first_two():
            out = []
            async for g in gen.stream(_prompts(3), 2, params):
                out.append(g.prompt.index)
                if len(out) == 2:
                    gen.gate.set()
            return out
        assert gen.call(first_two())[:2] == [0, 2]  # prompt 1 waits for its gate: it finishes last
        groups = gen.generate(_prompts(3), 1, params)
        assert [g.prompt.index for g in groups] == [0, 1, 2]
        assert groups[0].completions[0].token_ids == (request_seed(5, 0, 1),)  # the prompt's second visit
        gen.restart_seeds()
        seen = []
        fut = gen.submit(_prompts(2), 1, params, on_group=lambda g: seen.append(g.prompt.index))
        assert [g.completions[0].token_ids for g in fut.result(30)] == [(request_seed(5, 0, 0),), (request_seed(5, 1, 0),)]
        assert sorted(seen) == [0, 1]
    assert gen.closed
    with pytest.raises(RuntimeError, match="closed"):
        gen.submit(_prompts(1), 1, params)

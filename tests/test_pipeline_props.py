"""Pipeline concurrency logic under adversarial timings, with a fake engine (controlled latencies).
The same paths run against the real engines in test_pipeline.py (transformers) and test_vllm.py (vLLM)."""
import asyncio
import random
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.pipeline.rollout import Pipeline
from minirl.rewards import Scorer
from minirl.types import Completion, Group, Prompt, SamplingParams


class FakeEngine:
    """A generator without a loop of its own (one `generate` at a time, as the transformers backend): its groups
    finish after random delays, out of order; tokens carry the version current when the request started."""
    name = "fake"
    loop = None

    def __init__(self, rng: random.Random, max_delay: float):
        self.rng, self.max_delay, self.version = rng, max_delay, 0
        self.max_seen_ahead = 0

    def load_adapter(self, path, version):
        self.version = version

    async def _one(self, p: Prompt, n: int):
        v = self.version
        await asyncio.sleep(self.rng.random() * self.max_delay)  # the thing under test: groups finish out of order
        comps = tuple(Completion((1, 2), (-0.5, -0.5), (v, v), f"{p.index}-{j}-{self.rng.random()}", "stop")
                      for j in range(n))
        return Group(p, comps)

    async def _all(self, prompts, n):
        return await asyncio.gather(*[self._one(p, n) for p in prompts])

    def generate(self, prompts, n, params):
        return asyncio.run(self._all(prompts, n))


def rand_reward(prompt, completion, **_):
    return float(hash(completion) % 3)


@settings(max_examples=25, deadline=None)
@given(K=st.integers(0, 3), S=st.one_of(st.none(), st.integers(0, 2)), P=st.integers(1, 4),
       steps=st.integers(1, 6), seed=st.integers(0, 10_000), train_delay=st.sampled_from([0.0, 0.002, 0.01]))
def test_staleness_bound_and_exact_accounting(K, S, P, steps, seed, train_delay):
    rng = random.Random(seed)
    eng = FakeEngine(rng, max_delay=0.01)
    prompts = [[Prompt(s * 10 + i, (1,), f"p{s}-{i}") for i in range(P)] for s in range(steps)]
    pipe = Pipeline(eng, Scorer([("r", rand_reward)], [1.0], 5.0), lambda s: prompts[s],
                    lambda s: SamplingParams(), 2, P, steps, K)
    version, seen = 0, []
    try:
        for step in range(steps):
            groups = pipe.take(step)
            assert groups is not None
            # a batch holds exactly its step's prompts, in order, each once
            assert [g.group.prompt.index for g in groups] == [p.index for p in prompts[step]]
            for g in groups:
                assert version - g.group.oldest_version <= K  # the depth bound
            kept, dropped = pipe.filter_stale(groups, version, S)
            if S is not None:
                assert all(version - g.group.oldest_version <= S for g in kept)
            seen += [c.text for g in kept for c in g.group.completions]
            time.sleep(train_delay)  # the thing under test: a slower or faster trainer than the generator
            version += 1
            eng.load_adapter(None, version)
            pipe.signal_version()
    finally:
        pipe.close()
    acc = pipe.accounting
    assert acc["generated"] == acc["trained"] + acc["dropped_stale"] + acc["unused"] == steps * P
    assert acc["unused"] == 0
    assert len(seen) == len(set(seen))  # nothing duplicated


def test_generation_error_reaches_the_trainer_with_its_traceback():
    class Broken(FakeEngine):
        def generate(self, prompts, n, params):
            raise ZeroDivisionError("engine exploded")

    pipe = Pipeline(Broken(random.Random(0), 0.0), Scorer([("r", rand_reward)], [1.0], 5.0),
                    lambda s: [Prompt(0, (1,), "p")], lambda s: SamplingParams(), 2, 1, 3, 1)
    try:
        try:
            pipe.take(0)
        except ZeroDivisionError as e:
            assert "engine exploded" in str(e) and e.__traceback__ is not None
        else:
            raise AssertionError("the error did not reach the trainer")
    finally:
        pipe.close()


def test_a_slow_reward_does_not_hold_the_next_steps_generation():
    """K = 1 on a one-request-at-a-time generator: step 1's generation starts while step 0 is still being scored.
    The reward of step 0 waits (up to 20 s) for step 1's generation to begin; on code that scores inside the
    generator's turn it never begins, so the wait runs out and the reward records it."""
    import threading

    started = {s: threading.Event() for s in range(2)}

    class Serial:
        name, loop, version = "serial", None, 0

        def generate(self, prompts, n, params):
            step = prompts[0].index // 10
            started[step].set()
            return [Group(p, tuple(Completion((1,), (-0.5,), (self.version,), f"{p.index}-{j}", "stop")
                                   for j in range(n))) for p in prompts]

    overlapped = []

    def slow_reward(prompt, completion, **_):
        if completion.startswith("0-"):  # a completion of step 0
            overlapped.append(started[1].wait(20.0))
        return 1.0

    prompts = [[Prompt(s * 10, (1,), f"p{s}")] for s in range(2)]
    pipe = Pipeline(Serial(), Scorer([("r", slow_reward)], [1.0], 60.0), lambda s: prompts[s],
                    lambda s: SamplingParams(), 2, 1, 2, 1)
    try:
        assert pipe.take(0) is not None and pipe.take(1) is not None
    finally:
        pipe.close()
    assert overlapped and all(overlapped), "step 1's generation waited for step 0's reward"

"""Issue 37, item 3: dynamic sampling (DAPO). Groups without reward spread are replaced by groups of fresh prompts
until the step holds prompts_per_step informative groups or max_resample_rounds is reached; the same prompts land in
the same slots whatever K and timing are, and a resumed run draws those of an unbroken one."""
import asyncio
import random
from functools import partial

import pytest
from conftest import TOY_ROWS

import minirl
from minirl.data import rows as D
from minirl.pipeline.rollout import Pipeline
from minirl.rewards import Scorer
from minirl.rewards.advantages import informative
from minirl.types import Completion, Group, Prompt, SamplingParams


class Engine:
    """A generator without a loop of its own whose groups finish after random delays; a completion's text is its
    prompt index, its place in the group and the request's seed."""
    name, loop = "fake", None

    def __init__(self, seed: int):
        self.rng, self.version = random.Random(seed), 0

    async def _one(self, p: Prompt, n: int, seed):
        await asyncio.sleep(self.rng.random() * 0.005)
        return Group(p, tuple(Completion((1, 2), (-0.5, -0.5), (self.version,) * 2, f"{p.index} {j} {seed}", "stop")
                              for j in range(n)))

    def generate(self, prompts, n, params):
        async def all_():
            return await asyncio.gather(*[self._one(p, n, params.seed) for p in prompts])
        return asyncio.run(all_())


def spread_unless_third(prompt, completion, **_):
    """No spread for prompts whose index is a multiple of 3; otherwise 0/1 by the completion's place in the group."""
    index, j, _ = completion.split()
    return 0.0 if int(index) % 3 == 0 else float(int(j) % 2)


POOL = [Prompt(i, (1,), f"p{i}") for i in range(40)]


def _expected(step_prompts, step, P, rounds, seed, informative=lambda p: p.index % 3 != 0):
    """The slots of a step as the docs say: first its own prompts; each round refills the slots still without
    spread, in slot order, with the informative prompts of `refill_prompts`, in their order."""
    slots = list(step_prompts)
    used = {p.index for p in slots}
    resampled = 0
    for rnd in range(1, rounds + 1):
        held = [i for i, p in enumerate(slots) if not informative(p)]
        if not held:
            break
        fresh = D.refill_prompts(POOL, seed, step, rnd, len(held), used)
        used |= {p.index for p in fresh}
        resampled += len(fresh)
        for p in fresh:
            if informative(p) and held:
                slots[held.pop(0)] = p
    return [p.index for p in slots], resampled


@pytest.mark.parametrize("K", [0, 1, 2])
def test_groups_without_spread_are_replaced_in_the_same_slots_at_any_k(K):
    P, steps, rounds, seed = 4, 5, 2, 7
    plan = [POOL[s * P:(s + 1) * P] for s in range(steps)]  # prompts 0, 3, 6, ... have no spread
    scorer = Scorer([("r", spread_unless_third)], [1.0], 5.0)
    pipe = Pipeline(Engine(K), scorer, lambda s: plan[s], lambda s: SamplingParams(seed=100 + s), 2, P, steps, K,
                    refill=partial(D.refill_prompts, POOL, seed), max_rounds=rounds)
    try:
        for step, kept, gen in pipe.batches(lambda: pipe.gen.version, None, lambda: True):
            want, resampled = _expected(plan[step], step, P, rounds, seed)
            assert [g.group.prompt.index for g in kept] == want
            assert gen["batch/resampled_groups"] == resampled
            assert gen["batch/informative_groups"] == sum(informative(g.rewards) for g in kept) == sum(
                i % 3 != 0 for i in want)
            pipe.gen.version += 1
            pipe.signal_version()
    finally:
        pipe.close()
    acc = pipe.accounting
    assert acc["generated"] == acc["trained"] + acc["dropped_stale"] + acc["unused"] + acc["dropped_no_spread"]
    assert acc["dropped_no_spread"] > 0 and acc["trained"] == steps * P


def test_rounds_end_at_max_resample_rounds_and_the_step_keeps_its_size():
    """Nothing has spread: every round refills every slot, and after max_resample_rounds the step trains the
    groups it has (without spread), still prompts_per_step of them."""
    scorer = Scorer([("r", lambda prompt, completion, **_: 1.0)], [1.0], 5.0)
    pipe = Pipeline(Engine(0), scorer, lambda s: POOL[:3], lambda s: SamplingParams(seed=s), 2, 3, 1, 0,
                    refill=partial(D.refill_prompts, POOL, 0), max_rounds=3)
    try:
        ((step, kept, gen),) = list(pipe.batches(lambda: 0, None, lambda: True))
    finally:
        pipe.close()
    assert [g.group.prompt.index for g in kept] == [0, 1, 2] and gen["batch/resampled_groups"] == 9
    assert gen["batch/informative_groups"] == 0 and pipe.accounting["dropped_no_spread"] == 9


def test_refill_prompts_are_fresh_and_a_function_of_seed_step_and_round():
    a = D.refill_prompts(POOL, 0, 3, 1, 5, {0, 1, 2})
    assert len(a) == 5 and not {p.index for p in a} & {0, 1, 2}
    assert a == D.refill_prompts(POOL, 0, 3, 1, 5, {0, 1, 2}) != D.refill_prompts(POOL, 0, 3, 2, 5, {0, 1, 2})
    assert len(D.refill_prompts(POOL[:4], 0, 0, 1, 5, {0, 1})) == 2  # fewer when the data has fewer


def answer_mod_3(prompt, completion, answer, **_):
    """Tiny-model reward: no spread when the answer is a multiple of 3, else the completion's length parity."""
    return 0.0 if int(answer) % 3 == 0 else float(len(completion) % 2)


def _steps(run):
    return [h for h in run.history if "step" in h]


def test_a_resumed_run_draws_the_prompts_of_an_unbroken_one(toy_cfg, tmp_path):
    cfg = toy_cfg.replace(steps=4, dynamic_sampling=True, max_resample_rounds=2, reward_workers=0, eval_size=0,
                          checkpoint_every=2, max_async_steps=0)
    ref = minirl.Run(cfg.replace(out_dir=str(tmp_path / "ref")), data=TOY_ROWS, rewards=[answer_mod_3])
    ref.run()
    part = cfg.replace(out_dir=str(tmp_path / "part"))
    minirl.Run(part.replace(steps=2), data=TOY_ROWS, rewards=[answer_mod_3]).run()
    resumed = minirl.Run(part, data=TOY_ROWS, rewards=[answer_mod_3], resume=True)
    resumed.run()
    a, b = _steps(ref), _steps(resumed)
    assert [h["step"] for h in b] == [0, 1, 2, 3]
    assert [h["prompt_ids"] for h in a] == [h["prompt_ids"] for h in b]
    assert [h["batch/resampled_groups"] for h in a] == [h["batch/resampled_groups"] for h in b]
    assert sum(h["batch/resampled_groups"] for h in a[2:]) > 0  # the resumed steps did refill: a real comparison
    for h in a:
        assert h["batch/informative_groups"] == cfg.prompts_per_step or h["batch/resampled_groups"] > 0


class OneReply(minirl.Env):
    """One reply per episode; its reward is `answer_mod_3` of the reply."""

    def reset(self, row):
        self.answer = row["answer"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, reply):
        return minirl.EnvStep(messages=[], reward=answer_mod_3("", reply, self.answer), done=True)


def test_dynamic_sampling_with_an_environment_one_step_ahead(toy_cfg):
    run = minirl.Run(toy_cfg.replace(steps=2, dynamic_sampling=True, max_async_steps=1, reward_workers=0,
                                     eval_size=0, max_turns=1, max_episode_tokens=32),
                     data=TOY_ROWS[:40], env=OneReply, rewards=[])
    s = run.run()
    steps = _steps(run)
    assert s["steps"] == 2 and sum(h["batch/resampled_groups"] for h in steps) > 0
    for h in steps:
        assert len(h["prompt_ids"]) == toy_cfg.prompts_per_step and h["staleness/max"] <= 1
    acc = s["accounting"]
    assert acc["generated"] == acc["trained"] + acc["dropped_stale"] + acc["unused"] + acc["dropped_no_spread"]
    assert acc["dropped_no_spread"] == sum(h["batch/resampled_groups"] for h in steps)

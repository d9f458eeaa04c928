"""Issue 55, items 1-2: advantage estimators ('group', 'rloo', 'reinforce++') with every scale_rewards they take,
and per-reward normalisation (GDPO), each against numbers computed by hand; failed rewards and groups without spread;
the config's resolution and checks; dynamic sampling and the run loop use the same settings."""
import math
from functools import partial

import pytest
import torch
from conftest import TOY_ROWS
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dynamic_sampling import POOL, Engine, _expected

import minirl
from minirl import Config
from minirl.config import ConfigError
from minirl.data import rows as D
from minirl.pipeline.rollout import Pipeline
from minirl.rewards import Scorer
from minirl.rewards.advantages import AdvantageSettings, informative, step_advantages
from minirl.types import Completion, Group, Prompt, SamplingParams

R3, R6, R7 = math.sqrt(3), math.sqrt(6), math.sqrt(7)


def _group(n: int, index: int = 0) -> Group:
    return Group(Prompt(index, (1, 2), f"p{index}"), tuple(Completion((3,), (-1.0,), (0,), str(j), "stop")
                                                        for j in range(n)))


def scored(*tables, weights=None):
    """One group per table; a table maps reward name -> the values of the group's samples (None: the reward skips
    that sample, so its total is None)."""
    names = list(tables[0])
    scorer = Scorer([(n, lambda prompt, completion, _n=n, **_: table_of[prompt][_n][int(completion)])
                     for n in names], weights or [1.0] * len(names))
    table_of = {f"p{k}": t for k, t in enumerate(tables)}
    return scorer.score_groups([_group(len(t[names[0]]), k) for k, t in enumerate(tables)])


A, B, C = [1.0, 0.0, 0.0, 1.0], [0.5, None, 1.0, 0.0], [3.0, 1.0]


def adv(estimator, scale, *groups, normalization="sum"):
    s = AdvantageSettings(estimator, scale, normalization)
    return [list(g.advantages) for g in step_advantages(scored(*({"r": g} for g in groups)), s)]


# The step [A, B, C]. Group means 0.5, 0.5, 2; population stds 1/2, 1/sqrt(6), 1. Its nine valid rewards have
# mean 7.5/9 and std sqrt(7)/3 ('batch'); their group-centred values (+-1/2 four times; 0, +-1/2; +-1) have mean 0
# and std sqrt(3.5/9) = sqrt(7/18) ('reinforce++'). RLOO multiplies the centred values by n/(n-1): 4/3, 3/2, 2.
EXPECTED = {
    ("group", "group"): [[1, -1, -1, 1], [0, 0, R6 / 2, -R6 / 2], [1, -1]],
    ("group", "batch"): [[x * 1.5 / R7 for x in (1, -1, -1, 1)], [0, 0, 1.5 / R7, -1.5 / R7], [3 / R7, -3 / R7]],
    ("group", "none"): [[0.5, -0.5, -0.5, 0.5], [0, 0, 0.5, -0.5], [1, -1]],
    ("rloo", "group"): [[4 / 3, -4 / 3, -4 / 3, 4 / 3], [0, 0, 0.75 * R6, -0.75 * R6], [2, -2]],
    ("rloo", "batch"): [[x * 2 / R7 for x in (1, -1, -1, 1)], [0, 0, 2.25 / R7, -2.25 / R7], [6 / R7, -6 / R7]],
    ("rloo", "none"): [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0.75, -0.75], [2, -2]],
    ("reinforce++", "batch"): [[x * 0.5 * math.sqrt(18 / 7) for x in (1, -1, -1, 1)],
                               [0, 0, 0.5 * math.sqrt(18 / 7), -0.5 * math.sqrt(18 / 7)], [math.sqrt(18 / 7),
                                                                                           -math.sqrt(18 / 7)]],
}


@pytest.mark.parametrize("estimator,scale", list(EXPECTED))
def test_every_estimator_and_scale_by_hand(estimator, scale):
    """Rewards [1, 0, 0, 1], [0.5, None, 1, 0] and [3, 1]. RLOO by its definition: in [0.5, None, 1, 0] the sample
    with 1 gets 1 - mean(0.5, 0) = 0.75, the one with 0 gets 0 - mean(0.5, 1) = -0.75; the failed sample 0."""
    got = adv(estimator, scale, A, B, C)
    for g, want in zip(got, EXPECTED[estimator, scale]):
        assert g == pytest.approx(want, rel=1e-5, abs=1e-9), (estimator, scale)


def test_reinforce_pp_divides_by_the_std_of_the_centred_values_not_of_the_rewards():
    """The two 'batch' divisors differ once groups have different means: sqrt(7/18) against sqrt(7)/3, a ratio of
    sqrt(2) between the advantages."""
    rpp, trl = (sum(adv(e, "batch", A, B, C), []) for e in ("reinforce++", "group"))
    assert [a / b for a, b in zip(rpp, trl) if b] == pytest.approx([math.sqrt(2)] * 8, rel=1e-5)
    with pytest.raises(ValueError, match="scale_rewards must be 'batch'"):
        AdvantageSettings("reinforce++", "group")


def test_failed_rewards_are_out_of_every_baseline_and_std():
    """A failed sample changes nothing for the others (same numbers as the group without it) and gets 0."""
    for est, scale in EXPECTED:
        with_failure = adv(est, scale, [1.0, None, 0.0, 0.0, 1.0], C)
        without = adv(est, scale, A, C)
        assert with_failure[0] == pytest.approx([without[0][0], 0.0, *without[0][1:]], rel=1e-6), (est, scale)


@pytest.mark.parametrize("estimator,scale", list(EXPECTED))
def test_groups_without_spread_are_all_zeros(estimator, scale):
    got = adv(estimator, scale, [2.0, 2.0, 2.0], [None, 1.0, None], [None, None], A)
    assert got[:3] == [[0.0] * 3, [0.0] * 3, [0.0] * 2] and any(got[3])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=8), st.sampled_from(["group", "none"]))
def test_rloo_is_g_over_g_minus_1_times_the_group_centred_advantages(rewards, scale):
    """A known identity: r_i - mean_{j!=i} r_j = G/(G-1) (r_i - mean_j r_j), for groups without failures."""
    G = len(rewards)
    [rloo] = adv("rloo", scale, rewards)
    [grpo] = adv("group", scale, rewards)
    assert rloo == pytest.approx([a * G / (G - 1) for a in grpo], rel=1e-9, abs=1e-9)


# ---- per-reward normalisation (GDPO) -------------------------------------------------------------------------

# 'correct' is 0/1; 'length' spans 0..10, ten times wider. The only correct sample is short.
CORRECT, LENGTH = [1.0, 0.0, 0.0, 0.0], [0.0, 10.0, 0.0, 10.0]


def test_a_reward_with_a_wide_range_no_longer_drowns_the_others():
    """'sum': totals [1, 10, 0, 10], mean 5.25: the correct sample gets -4.25 (pushed down), the long wrong ones
    +4.75. 'per-reward': correct is centred on 1/4 and divided by sqrt(3)/4 -> [sqrt3, -1/sqrt3 x3]; length on 5,
    by 5 -> [-1, 1, -1, 1]; summed: [sqrt3 - 1, 1 - 1/sqrt3, -1 - 1/sqrt3, 1 - 1/sqrt3]: the correct sample is the
    most advantaged."""
    groups = scored({"correct": CORRECT, "length": LENGTH})
    [s] = step_advantages(groups, AdvantageSettings(scale_rewards="none"))
    assert s.advantages == pytest.approx([-4.25, 4.75, -5.25, 4.75])
    [p] = step_advantages(groups, AdvantageSettings(scale_rewards="none", reward_normalization="per-reward"))
    want = [R3 - 1, 1 - 1 / R3, -1 - 1 / R3, 1 - 1 / R3]
    assert p.advantages == pytest.approx(want, rel=1e-5)
    assert max(range(4), key=p.advantages.__getitem__) == 0
    assert p.rewards == s.rewards == (1.0, 10.0, 0.0, 10.0)  # the logged reward stays the weighted sum
    # TRL's normalize_then_sum: the config's default scale with 'per-reward' is 'batch', here the std of `want`
    cfg = Config(reward_normalization="per-reward", rewards=["correct", "length"])
    assert cfg.recipe.scale_rewards == "batch" and AdvantageSettings.from_config(cfg).scale_rewards == "batch"
    [b] = step_advantages(groups, AdvantageSettings.from_config(cfg))
    sd = torch.tensor(want, dtype=torch.float64).std(unbiased=False).item()
    assert b.advantages == pytest.approx([w / sd for w in want], rel=1e-5)


def test_per_reward_weights_failures_and_logged_only_rewards():
    """Weight 2 on 'correct' doubles its part; a weight-0 reward (logged only) takes no part; a sample whose
    weighted reward failed is out of every function's baseline and gets 0 (the same numbers as without it)."""
    wild = [1e5, -3.0, 7.0, 0.0, 42.0]
    groups = scored({"correct": CORRECT + [None], "length": LENGTH + [10.0], "logged": wild}, weights=[2.0, 1.0, 0.0])
    assert groups[0].rewards[4] is None
    [p] = step_advantages(groups, AdvantageSettings(scale_rewards="none", reward_normalization="per-reward"))
    zc, zl = [R3, -1 / R3, -1 / R3, -1 / R3], [-1, 1, -1, 1]
    assert p.advantages == pytest.approx([2 * c + ln for c, ln in zip(zc, zl)] + [0.0], abs=1e-5)


def test_per_reward_judges_spread_on_what_the_estimator_sees():
    """correct [1, 0], length [0, 2]: the totals [1, 2] have spread but the normalised ones cancel (+-1 each):
    zeros. With weight 2 on correct the totals [2, 2] have none, the normalised ones do: [1, -1]."""
    per = AdvantageSettings(scale_rewards="none", reward_normalization="per-reward")
    [cancel] = scored({"correct": [1.0, 0.0], "length": [0.0, 2.0]})
    assert informative(cancel.rewards) and not per.informative(cancel)
    assert step_advantages([cancel], per)[0].advantages == (0.0, 0.0)
    [collapse] = scored({"correct": [1.0, 0.0], "length": [0.0, 2.0]}, weights=[2.0, 1.0])
    assert not informative(collapse.rewards) and per.informative(collapse)
    assert step_advantages([collapse], per)[0].advantages == pytest.approx([1.0, -1.0], rel=1e-5)
    assert step_advantages([collapse], "group")[0].advantages == (0.0, 0.0)  # 'sum': GRPO's reward collapse


def test_dynamic_sampling_replaces_the_groups_per_reward_leaves_without_spread():
    """Prompts 0, 3, 6, ...: correct [1, 0], length [0, 2] (totals with spread that per-reward cancels); the others
    length [0, 0]. With the run's per-reward settings as `spread`, the pipeline replaces exactly the first kind."""
    def correct(prompt, completion, **_):
        return float(completion.split()[1] == "0")

    def length(prompt, completion, **_):
        index, j, _ = completion.split()
        return 2.0 * (j == "1") if int(index) % 3 == 0 else 0.0
    P, steps, rounds, seed = 4, 3, 2, 7
    plan = [POOL[s * P:(s + 1) * P] for s in range(steps)]
    per = AdvantageSettings(scale_rewards="none", reward_normalization="per-reward")
    pipe = Pipeline(Engine(0), Scorer([("correct", correct), ("length", length)], [1.0, 1.0], 5.0), lambda s: plan[s],
                    lambda s: SamplingParams(seed=100 + s), 2, P, steps, 0,
                    refill=partial(D.refill_prompts, POOL, seed), max_rounds=rounds, spread=per.informative)
    try:
        for step, kept, gen in pipe.batches(lambda: pipe.gen.version, None, lambda: True):
            want, resampled = _expected(plan[step], step, P, rounds, seed)
            assert [g.group.prompt.index for g in kept] == want and gen["batch/resampled_groups"] == resampled
            assert gen["batch/informative_groups"] == sum(i % 3 != 0 for i in want)
            assert all(any(g.advantages) == per.informative(g) for g in step_advantages(kept, per))
            pipe.gen.version += 1
            pipe.signal_version()
    finally:
        pipe.close()
    assert pipe.accounting["dropped_no_spread"] > 0


# ---- the config -----------------------------------------------------------------------------------------------

def test_config_resolution_and_checks():
    assert Config().recipe.scale_rewards == "group" and AdvantageSettings.from_config(Config()) == AdvantageSettings()
    rloo = Config(advantage_estimator="rloo")
    assert rloo.recipe.scale_rewards == "none"  # plain RLOO, as TRL's RLOOTrainer and SkyRL
    assert "scale_rewards: null  # none from advantage_estimator rloo" in rloo.to_yaml()
    assert Config(advantage_estimator="rloo", scale_rewards="group").recipe.scale_rewards == "group"  # yours wins
    assert Config(advantage_estimator="reinforce++").recipe.scale_rewards == "batch"
    assert Config(advantage_estimator="reinforce++", scale_rewards="batch").recipe.scale_rewards == "batch"
    assert Config(loss_type="dr_grpo", reward_normalization="per-reward").recipe.scale_rewards == "batch"
    for kw, line in [(dict(advantage_estimator="ppo"), "advantage_estimator='ppo': use 'group', 'rloo' or "
                      "'reinforce++'"),
                     (dict(reward_normalization="gdpo"), "reward_normalization='gdpo': use 'sum' or 'per-reward'"),
                     (dict(advantage_estimator="reinforce++", scale_rewards="group"),
                      "advantage_estimator='reinforce++' divides by the step's std of its centred values itself: "
                      "leave scale_rewards unset (or 'batch'), not 'group'")]:
        with pytest.raises(ConfigError) as e:
            Config(**kw)
        assert str(e.value) == line
    c = Config(advantage_estimator="rloo", reward_normalization="per-reward")
    assert Config.from_dict(c.to_dict()) == c and AdvantageSettings.from_config(c) == AdvantageSettings("rloo", "none",
                                                                                                     "per-reward")


def test_a_run_trains_on_rloo_advantages(toy_cfg, monkeypatch):
    """The run loop makes each step's advantages with the config's settings: 'rloo' with scale_rewards unset reaches
    the trainer as plain RLOO, G/(G-1) times the group-centred rewards."""
    import minirl.training.trainer as T
    seen = []
    real = T.Trainer.step
    monkeypatch.setattr(T.Trainer, "step", lambda self, groups: seen.append(groups) or real(self, groups))
    minirl.Run(toy_cfg.replace(steps=1, advantage_estimator="rloo", reward_workers=0), data=TOY_ROWS).run()
    (groups,) = seen
    assert any(max(g.rewards) > min(g.rewards) for g in groups)  # some spread: the check means something
    for g in groups:
        G, mean = len(g.rewards), sum(g.rewards) / len(g.rewards)
        spread = max(g.rewards) > min(g.rewards)
        assert g.advantages == pytest.approx([(r - mean) * G / (G - 1) if spread else 0.0 for r in g.rewards])

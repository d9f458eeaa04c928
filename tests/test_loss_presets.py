"""Issue 37, item 1: `loss_type` presets, GSPO's sequence-level ratio (off-policy, by hand), `scale_rewards`."""
import argparse
import dataclasses
import math

import pytest
import torch
import yaml
from conftest import TOY_ROWS

import minirl
from minirl import Config, ConfigError
from minirl.config import add_cli_args, overrides_from_args
from minirl.config.presets import LOSS_FIELDS, PRESETS
from minirl.rewards import Scorer
from minirl.rewards.advantages import group_advantages, step_advantages
from minirl.training.loss import LossSettings, policy_loss, token_weights
from minirl.types import Completion, Group, Prompt

# Two sequences (the second one token shorter), OFF-policy: the trainer's logprobs moved since the proximal policy
# (`old`, as in a second ppo epoch) and the proximal policy differs from the one that sampled (`behav`, K >= 1).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
OLD = [[-1.1, -0.45, -2.05], [-0.1, -0.8, 0.0]]
BEHAV = [[-1.05, -0.5, -2.0], [-0.3, -1.1, 0.0]]
ADV = [1.0, -0.5]
GSPO = LossSettings(clip_low=0.2, clip_high=0.28, tis_cap=1.2, behav_clip=True, importance_level="sequence")


def _loss(settings, agg="seq-mean"):
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    w = token_weights(MASK, agg).to(torch.float64)
    out = policy_loss(logp, torch.tensor(OLD, dtype=torch.float64), torch.tensor(BEHAV, dtype=torch.float64),
                      torch.tensor(ADV, dtype=torch.float64), w, MASK, settings)
    out.loss.backward()
    return out, logp.grad


def _mean(row, xs, ys):
    n = int(MASK[row].sum())
    return sum(xs[row][t] - ys[row][t] for t in range(n)) / n


def _hand_gspo():
    """GSPO by hand: s_i = exp(mean_t(logp - old)), the IS weight min(exp(mean_t(old - behav)), cap), seq-mean
    weights 1 / (|y_i| * 2). Sequence 0 (A = 1): s = exp(0.1 / 3) in [0.8, 1.28]: the unclipped branch, each
    token's gradient -w * A * s * is. Sequence 1 (A = -0.5): s = exp(-0.3) < 0.8: clipped (min picks 0.8 * A):
    constant, no gradient; its IS weight exp(0.25) = 1.28 hits the cap 1.2."""
    loss, grad = 0.0, [[0.0] * 3, [0.0] * 3]
    for i in range(2):
        n = int(MASK[i].sum())
        s = math.exp(_mean(i, LOGP, OLD))
        is_w = min(math.exp(_mean(i, OLD, BEHAV)), 1.2)
        clipped = min(max(s, 0.8), 1.28)
        surr = min(s * ADV[i], clipped * ADV[i])
        loss += -is_w * surr * (n * (1 / (n * 2)))
        if s * ADV[i] <= clipped * ADV[i]:  # the unclipped branch is the min: the gradient flows through s
            for t in range(n):
                grad[i][t] = -is_w * ADV[i] * s / (n * 2)
    return loss, grad


def test_gspo_loss_and_gradient_by_hand_off_policy():
    hand_loss, hand_grad = _hand_gspo()
    assert math.exp(_mean(0, LOGP, OLD)) != 1.0 and math.exp(_mean(1, LOGP, OLD)) < 0.8  # off-policy, one clipped
    out, grad = _loss(GSPO)
    assert out.loss.item() == pytest.approx(hand_loss, rel=1e-6)  # (token_weights are float32)
    torch.testing.assert_close(grad, torch.tensor(hand_grad, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    assert out.clipped == 2 and out.is_truncated == 2  # sequence 1 whole: clipped and capped
    # the gradient is that of GSPO's sequence objective (1/G) sum_i is_i * min(s_i A_i, clip(s_i) A_i) itself
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    obj = 0.0
    for i in range(2):
        n = int(MASK[i].sum())
        s = torch.exp((logp[i, :n] - torch.tensor(OLD[i][:n], dtype=torch.float64)).mean())
        is_w = min(math.exp(_mean(i, OLD, BEHAV)), 1.2)
        obj = obj - is_w * torch.minimum(s * ADV[i], s.clamp(0.8, 1.28) * ADV[i]) / 2
    obj.backward()
    torch.testing.assert_close(grad, logp.grad, rtol=1e-6, atol=1e-9)


def test_the_token_level_ratio_fails_the_gspo_hand_value():
    """The same batch at importance_level 'token' (each token its own ratio, IS weight and clip) gives another loss
    and gradient: the hand value above tells the two apart (on-policy at one epoch it could not)."""
    hand_loss, hand_grad = _hand_gspo()
    out, grad = _loss(LossSettings(clip_low=0.2, clip_high=0.28, tis_cap=1.2, importance_level="token"))
    assert abs(out.loss.item() - hand_loss) > 1e-3
    assert (grad - torch.tensor(hand_grad, dtype=torch.float64)).abs().max() > 1e-3
    assert grad[1, 0] != 0  # a token of sequence 1 is inside the clip range on its own


def test_sequence_level_behav_clip_masks_whole_sequences():
    """behav_clip at sequence level: a token far past the trust region inside a sequence whose mean is not keeps its
    gradient; a sequence whose mean moved past it (in its advantage's direction) loses all of it."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    behav = torch.zeros(2, 3, dtype=torch.float64) - 1.0
    logp = torch.tensor([[-0.5, -1.2, -1.2], [-0.6, -0.6, -0.6]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    w = token_weights(mask, "token-mean").to(torch.float64)
    seq = policy_loss(logp, logp.detach(), behav, adv, w, mask, LossSettings(tis_cap=None, importance_level="sequence"))
    seq.loss.backward()
    assert seq.behav_clipped == 3  # sequence 1: mean log ratio 0.4 > log 1.28; sequence 0: mean 0.0333
    assert (logp.grad[1] == 0).all() and (logp.grad[0] != 0).all()
    logp.grad = None
    tok = policy_loss(logp, logp.detach(), behav, adv, w, mask, LossSettings(tis_cap=None))
    tok.loss.backward()
    assert tok.behav_clipped == 4 and logp.grad[0, 0] == 0  # token level: sequence 0's first token is masked


def test_presets_fill_the_unset_fields_and_a_set_one_wins():
    for name, fields in PRESETS.items():
        r = Config(loss_type=name).recipe
        assert {k: getattr(r, k) for k in fields} == fields and r.preset == name
    assert PRESETS["bnpo"] == PRESETS["dapo"]  # said in the docs: the same settings here
    assert {k: getattr(Config().recipe, k) for k in LOSS_FIELDS} == PRESETS["dapo"]  # no preset: dapo's
    g = Config(loss_type="gspo")
    assert (g.clip_low, g.clip_high) == (None, None)  # the config holds what was set; the recipe resolves the rest
    assert (LossSettings.from_config(g).clip_low, LossSettings.from_config(g).importance_level) == (3e-4, "sequence")
    c = Config(loss_type="gspo", clip_high=0.28, scale_rewards="group")  # set to a default value: still set
    assert (c.recipe.clip_low, c.recipe.clip_high, c.recipe.importance_level) == (3e-4, 0.28, "sequence")
    d = c.replace(loss_type="dr_grpo")
    assert (d.recipe.loss_agg, d.recipe.scale_rewards, d.recipe.clip_high, d.recipe.clip_low) == (
        "constant", "group", 0.28, 0.2)
    with pytest.raises(ConfigError, match="loss_type='ppo'"):
        Config(loss_type="ppo")
    with pytest.raises(ConfigError, match="loss_agg='sum'"):
        Config(loss_agg="sum")


def _flags(*argv):
    ap = argparse.ArgumentParser()
    add_cli_args(ap)
    return overrides_from_args(ap.parse_args(list(argv)))


@pytest.mark.parametrize("given", [{}, {"clip_high": 0.01, "lr": 1e-4}, {"loss_agg": "constant", "clip_low": 0.1}])
@pytest.mark.parametrize("start", [None, *PRESETS])
def test_a_saved_config_then_another_loss_type_is_that_preset_plus_the_fields_set(tmp_path, start, given):
    """Issue 50: save (config.yaml as a run writes it), reload, replace(loss_type=X) == Config(loss_type=X) plus the
    same fields set, for every pair of presets; and the same through `minirl train CONFIG --loss-type X` flags."""
    saved = tmp_path / "config.yaml"
    Config(loss_type=start, **given).to_yaml(saved)
    loaded = Config.from_yaml(saved)
    assert loaded == Config(loss_type=start, **given)
    for x in PRESETS:
        want = Config(loss_type=x, **given)
        assert loaded.replace(loss_type=x) == want
        assert loaded.replace(**_flags("--loss-type", x)) == want
        assert loaded.replace(loss_type=x).recipe == want.recipe


def test_config_yaml_says_which_loss_fields_the_user_set_and_which_the_preset(tmp_path):
    text = Config(loss_type="gspo", clip_high=0.001).to_yaml()
    lines = {line.split(":")[0]: line for line in text.splitlines()}
    assert lines["clip_high"] == "clip_high: 0.001"
    assert lines["clip_low"] == "clip_low: null  # 0.0003 from loss_type gspo"
    assert lines["importance_level"] == "importance_level: null  # sequence from loss_type gspo"
    # a user who edits loss_type in the saved file gets the new preset for every field they did not set
    (tmp_path / "c.yaml").write_text(text.replace("loss_type: gspo", "loss_type: dr_grpo"))
    edited = Config.from_yaml(tmp_path / "c.yaml").recipe
    assert (edited.loss_agg, edited.clip_low, edited.clip_high, edited.importance_level) == (
        "constant", 0.2, 0.001, "token")
    assert yaml.safe_load(text)["clip_low"] is None


def test_config_coerces_what_it_is_given_before_its_init():
    """Issue 50: values are coerced before the dataclass's __init__ and never written after (test_layers: no
    object.__setattr__ in the config)."""
    c = Config(lr="1e-4", rewards="arithmetic_correct", max_async_steps="1", loss_type="grpo")
    assert (c.lr, c.rewards, c.max_async_steps) == (1e-4, ["arithmetic_correct"], 1)
    assert Config(**{f: getattr(c, f) for f in c.to_dict()}) == c and dataclasses.replace(c) == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.lr = 1.0


def test_scale_adv_by_std_still_loads_as_scale_rewards(tmp_path):
    (tmp_path / "old.yaml").write_text("scale_adv_by_std: false\n")
    assert Config.from_yaml(tmp_path / "old.yaml").scale_rewards == "none"
    assert Config(scale_adv_by_std=True).scale_rewards == "group" and Config(scale_rewards="batch").scale_adv_by_std is False
    assert Config(loss_type="grpo", scale_adv_by_std=False).recipe.scale_rewards == "none"  # explicit under its old name
    with pytest.raises(ConfigError, match="give only scale_rewards"):
        Config(scale_adv_by_std=False, scale_rewards="group")
    with pytest.raises(ConfigError, match="scale_rewards='std'"):
        Config(scale_rewards="std")


def _scored(scale):
    table = {"a": [1.0, 0.0, 0.0, 0.0], "b": [3.0, 1.0]}

    def r(prompt, completion, **_):
        return table[prompt][int(completion)]
    groups = [Group(Prompt(i, (1,), p), tuple(Completion((1,), (-1.0,), (0,), str(j), "stop")
                                              for j in range(len(table[p]))))
              for i, p in enumerate(table)]
    return step_advantages(Scorer([("r", r)], [1.0], 5.0).score_groups(groups), scale)


def test_scale_rewards_group_and_batch_by_hand():
    """Rewards [1, 0, 0, 0] and [3, 1]. 'group': each group by its own std (sqrt(3)/4 and 1); 'batch': centred on
    each group's mean, divided by the std of all six rewards, sqrt(41)/6; 'none': centred only."""
    group = _scored("group")
    s1 = math.sqrt(3) / 4
    assert group[0].advantages == pytest.approx([0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1], rel=1e-5)
    assert group[1].advantages == pytest.approx([1.0, -1.0], rel=1e-5)
    batch = _scored("batch")
    sb = math.sqrt(41) / 6
    assert batch[0].advantages == pytest.approx([0.75 / sb, -0.25 / sb, -0.25 / sb, -0.25 / sb], rel=1e-5)
    assert batch[1].advantages == pytest.approx([1.0 / sb, -1.0 / sb], rel=1e-5)
    assert _scored("none")[1].advantages == pytest.approx([1.0, -1.0])
    assert group_advantages([2.0, 2.0]) == [0.0, 0.0]  # no spread stays zero at every scale


def test_a_run_trains_on_the_advantages_its_scale_rewards_asks_for(toy_cfg, monkeypatch):
    """The run loop makes each step's advantages once (`step_advantages`) with the config's recipe: 'batch' reaches
    the trainer as each group centred on its own mean and divided by the std of every reward of the step."""
    import minirl.training.trainer as T
    seen = []
    real = T.Trainer.step
    monkeypatch.setattr(T.Trainer, "step", lambda self, groups: seen.append(groups) or real(self, groups))
    minirl.Run(toy_cfg.replace(steps=1, scale_rewards="batch", reward_workers=0), data=TOY_ROWS).run()
    (groups,) = seen
    rewards = [r for g in groups for r in g.rewards]
    sb = torch.tensor(rewards, dtype=torch.float64).std(unbiased=False).item() + 1e-6
    assert sb > 1e-3  # the toy's rewards have a spread: the check means something
    for g in groups:
        mean = sum(g.rewards) / len(g.rewards)
        spread = max(g.rewards) > min(g.rewards)
        assert g.advantages == pytest.approx([(r - mean) / sb if spread else 0.0 for r in g.rewards], rel=1e-9)


def test_the_trainer_refuses_groups_whose_advantages_were_not_made(tiny_model):
    from minirl.training.trainer import Trainer
    raw = Scorer([("r", lambda prompt, completion, **_: float(completion == "1"))], [1.0]).score_groups(
        [Group(Prompt(0, (1,), "p"), tuple(Completion((1,), (-1.0,), (0,), str(j), "stop") for j in range(2)))])
    with pytest.raises(ValueError, match="step_advantages"):
        Trainer(Config(model=tiny_model, backend="hf", lora_rank=4, max_tokens=8)).step(raw)


def _scored_with_a_solved_group():
    """Group 'a' rewards [1, 0, 0, 0]; group 'c' [2, 2]: no spread, advantages zero. One-token completions, so the
    token-mean's denominator is the number of samples trained."""
    table = {"a": [1.0, 0.0, 0.0, 0.0], "c": [2.0, 2.0]}
    groups = [Group(Prompt(i, (1, 2), p), tuple(Completion((3,), (-1.0,), (0,), str(j), "stop")
                                                for j in range(len(table[p]))))
              for i, p in enumerate(table)]
    return step_advantages(Scorer([("r", lambda prompt, completion, **_: table[prompt][int(completion)])], [1.0],
                                  5.0).score_groups(groups), "group")


def test_train_zero_adv_counts_the_solved_group_in_the_denominator_as_trl_does(tiny_model):
    """The solved group adds no gradient of its own; it only grows token-mean's denominator from 4 tokens to 6,
    so the whole gradient (its norm, before clipping) is 4/6 of the one without it."""
    from minirl.training.trainer import Trainer
    out = {}
    for on in (False, True):
        torch.manual_seed(0)
        tr = Trainer(Config(model=tiny_model, backend="hf", lora_rank=4, max_tokens=8, train_zero_adv=on, seed=0))
        out[on] = tr.step(_scored_with_a_solved_group())
    assert out[False]["train/samples"] == 4 and out[True]["train/samples"] == 6
    assert out[False]["grad_norm"] > 0
    assert out[True]["grad_norm"] == pytest.approx(out[False]["grad_norm"] * 4 / 6, rel=1e-4)

"""Loss and advantage math against values computed by hand on small tensors."""
import math

import pytest
import torch

from minirl.rewards.advantages import group_advantages
from minirl.training.loss import LossSettings, policy_loss, token_weights


def test_group_advantages_by_hand():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=True, eps=0.0)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0])
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=False)
    assert adv == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_group_advantages_excludes_none_and_degenerate_groups():
    adv = group_advantages([1.0, None, 0.0], scale_by_std=False)
    assert adv == pytest.approx([0.5, 0.0, -0.5])  # baseline is over the two valid samples only
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, None, None]) == [0.0, 0.0, 0.0]


def test_token_weights_aggregation_modes():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    tm = token_weights(mask, "token-mean")
    assert tm[0, 0].item() == pytest.approx(1 / 4) and tm[0, 3] == 0 and tm[1, 0].item() == pytest.approx(1 / 4)
    sm = token_weights(mask, "seq-mean")
    assert sm[0, 0].item() == pytest.approx(1 / 3 / 2) and sm[1, 0].item() == pytest.approx(1 / 2)
    c = token_weights(mask, "constant", max_tokens=8)
    assert c[0, 0].item() == pytest.approx(1 / 16) and c[1, 1] == 0
    with pytest.raises(ValueError, match="loss_agg"):
        token_weights(mask, "nope")


def _loss(logp, old, behav, adv, mask, ref_logp_B_T=None, **kw):
    """The loss with the by-hand tests' settings: symmetric clip 0.2, no behav_clip, unless a test says otherwise."""
    w = token_weights(mask, "token-mean")
    return policy_loss(logp, old, behav, adv, w, mask, LossSettings(**{"clip_high": 0.2, "behav_clip": False, **kw}),
                       ref_logp_B_T)


def test_loss_settings_defaults_are_the_configs():
    from minirl import Config
    assert LossSettings.from_config(Config()) == LossSettings()


def test_policy_loss_on_policy_equals_minus_mean_advantage():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)  # first position is a prompt token
    out = _loss(logp, logp, logp, torch.tensor([2.0]), mask)
    assert out.loss.item() == pytest.approx(-2.0)  # ratio 1, IS weight 1: -(A) averaged over 2 tokens
    assert out.n_tokens == 2 and out.clipped == 0


def test_policy_loss_clipping_asymmetric_by_hand():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    mask = torch.ones(1, 2, dtype=torch.bool)
    # positive advantage: min(1.5*A, 1.28*A) = 1.28A ; min(0.5A, 0.8A) = 0.5A  -> mean -(1.28+0.5)/2
    out = _loss(logp, old, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert out.loss.item() == pytest.approx(-(1.28 + 0.5) / 2, rel=1e-5)
    assert out.clipped == 1
    # negative advantage: min(-1.5, -1.28) = -1.5 ; min(-0.5, -0.8) = -0.8  -> mean (1.5+0.8)/2
    out = _loss(logp, old, old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert out.loss.item() == pytest.approx((1.5 + 0.8) / 2, rel=1e-5)
    assert out.clipped == 1


def test_truncated_importance_weights_by_hand():
    logp = torch.log(torch.tensor([[0.6, 0.6]]))
    behav = torch.log(torch.tensor([[0.5, 0.1]]))  # pi/mu = 1.2 and 6.0 -> truncated at 2
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = _loss(logp, logp, behav, torch.tensor([1.0]), mask, tis_cap=2.0)
    assert out.loss.item() == pytest.approx(-(1.2 + 2.0) / 2, rel=1e-5)
    assert out.is_truncated == 1 and out.is_weight_sum == pytest.approx(3.2, rel=1e-5)
    out = _loss(logp, logp, behav, torch.tensor([1.0]), mask, tis_cap=None)
    assert out.loss.item() == pytest.approx(-(1.2 + 6.0) / 2, rel=1e-5)


def test_kl_to_reference_k3_by_hand():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = _loss(logp, logp, logp, torch.tensor([0.0]), mask, ref_logp_B_T=ref, kl_coef=0.1)
    k3 = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1 with d = log(0.25/0.5)
    assert out.loss.item() == pytest.approx(0.1 * k3, rel=1e-5)
    assert out.kl_ref_sum == pytest.approx(k3, rel=1e-5)


def test_padding_and_prompt_tokens_do_not_count():
    logp = torch.tensor([[-1.0, -2.0, -3.0, 100.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0]], dtype=torch.bool)
    out = _loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0]), mask)
    out.loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 3] == 0
    assert logp.grad[0, 1].item() == pytest.approx(-0.5) and logp.grad[0, 2].item() == pytest.approx(-0.5)


def test_opsm_masks_stale_negative_sequences():
    logp = torch.zeros(2, 2)
    behav = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])  # mean |log ratio| = 1 for both rows
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = _loss(logp, logp, behav, torch.tensor([1.0, -1.0]), mask, tis_cap=None, opsm_delta=0.5)
    # row 0 (positive adv) kept: -e per token * 1/4 weight * 2 tokens; row 1 masked
    assert out.loss.item() == pytest.approx(-math.e / 2, rel=1e-5)


def test_behav_clip_masks_tokens_already_pushed_past_the_trust_region():
    """PPO's clip against the sampling policy: with one update per batch the proximal ratio is 1, so only
    `behav_clip` stops a stale batch from pushing a token further than [1 - clip_low, 1 + clip_high] of its sampling
    probability; tokens it would push back, and on-policy tokens, keep their gradient."""
    # per token pi/mu: 1.5 (above 1.28), 0.5 (below 0.8), 1.0
    behav = torch.log(torch.tensor([[1 / 1.5, 1 / 0.5, 1.0]])).repeat(2, 1)
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    out = _loss(logp, logp.detach(), behav, adv, mask, tis_cap=None, behav_clip=True)
    out.loss.backward()
    g = logp.grad
    # advantage > 0: the token already at 1.5x gets nothing; the one at 0.5x is pushed up with IS weight 0.5
    assert g[0, 0] == 0 and g[0, 1].item() == pytest.approx(-0.5 / 6) and g[0, 2].item() == pytest.approx(-1 / 6)
    # advantage < 0: the token already at 0.5x gets nothing; the one at 1.5x is pushed down with IS weight 1.5
    assert g[1, 1] == 0 and g[1, 0].item() == pytest.approx(1.5 / 6) and g[1, 2].item() == pytest.approx(1 / 6)
    assert out.behav_clipped == 2
    on = _loss(logp.detach(), logp.detach(), logp.detach(), adv, mask, behav_clip=True)
    off = _loss(logp.detach(), logp.detach(), logp.detach(), adv, mask, behav_clip=False)
    assert on.behav_clipped == 0 and on.loss.item() == off.loss.item()

"""Issue 55 (the loss side): objective 'cispo', the entropy bonus, top_entropy_quantile, the masked IS band and a
user's loss_fn, each against values computed by hand on small tensors (on- and off-policy, token and sequence
level), then in the trainer on a captured batch (padded, split into micro-batches, and shared-prefix packed)."""
import math
import sys
from pathlib import Path

import pytest
import torch
from test_packing import lora_trainer

from minirl import Config, ConfigError
from minirl.benchmarks.trainer_step import load_batches
from minirl.config.presets import PRESETS
from minirl.training.batch import Batch, completion_logprobs, hidden_logprobs, make_batch
from minirl.training.loss import LossInputs, LossSettings, decoupled_loss, policy_loss, token_weights
from minirl.training.loss_fn import resolve_loss_fn, run_loss, top_entropy_masks
from minirl.training.trainer import Trainer

DATA = Path(__file__).parent / "data"
F64 = torch.float64
# Two rows (the second one token shorter); off-policy: trainer != proximal (`old`) != behaviour.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
OLD = [[-1.1, -0.3, -2.05], [-0.1, -0.8, 0.0]]
BEHAV = [[-1.05, -0.5, -2.0], [-0.3, -1.1, 0.0]]
ADV = [1.0, -0.5]
PLAIN = dict(tis_cap=None, behav_clip=False)  # no IS cap, no trust region: each test turns on what it checks


def _t(x):
    return torch.tensor(x, dtype=F64)


def _run(settings, logp=LOGP, old=OLD, behav=BEHAV, agg="token-mean", **extra):
    lp = _t(logp).requires_grad_(True)
    w = token_weights(MASK, agg).to(F64)
    out = policy_loss(lp, _t(old), _t(behav), _t(ADV), w, MASK, settings, **extra)
    out.loss.backward()
    return out, lp.grad


def _cells():
    return [(i, t) for i in range(2) for t in range(3) if MASK[i, t]]


# --- CISPO -----------------------------------------------------------------------------------------------------

def test_cispo_on_policy_is_minus_a_logp_and_every_token_has_its_gradient():
    """Ratios 1: the weight is 1, the loss -sum w A logp, each token's gradient -w A."""
    out, g = _run(LossSettings(objective="cispo", **PLAIN), old=LOGP, behav=LOGP)
    w = 1 / 5  # token-mean over 5 tokens
    assert out.loss.item() == pytest.approx(sum(-w * ADV[i] * LOGP[i][t] for i, t in _cells()), rel=1e-6)
    for i, t in _cells():
        assert g[i, t].item() == pytest.approx(-w * ADV[i], rel=1e-6)
    assert out.clipped == 0


def test_cispo_off_policy_token_level_by_hand_clipped_tokens_keep_their_gradient():
    """Token ratios exp(logp - old): 1.105, 0.819, 1.051 | 0.819, 0.670. Clipped to [0.85, 1.08]: four tokens at a
    bound. Each token's gradient is -w * IS * clip(r) * A (IS = min(exp(old - behav), 1.2)), never 0, while PPO's
    clip zeroes the clipped tokens' gradients on the same batch."""
    s = LossSettings(objective="cispo", cispo_min=0.85, cispo_max=1.08, tis_cap=1.2, behav_clip=False)
    out, g = _run(s)
    loss, n_clipped = 0.0, 0
    for i, t in _cells():
        r = math.exp(LOGP[i][t] - OLD[i][t])
        c = min(max(r, 0.85), 1.08)
        n_clipped += c != r
        is_w = min(math.exp(OLD[i][t] - BEHAV[i][t]), 1.2)
        loss += -is_w * c * ADV[i] * LOGP[i][t] / 5
        assert g[i, t].item() == pytest.approx(-is_w * c * ADV[i] / 5, rel=1e-6)
        assert g[i, t] != 0
    assert out.loss.item() == pytest.approx(loss, rel=1e-6)
    assert out.clipped == n_clipped == 4
    _, g_ppo = _run(LossSettings(clip_low=0.15, clip_high=0.08, tis_cap=1.2, behav_clip=False))
    assert (g_ppo[MASK] == 0).sum() >= 1  # PPO drops a clipped token's gradient; CISPO kept all five


def test_cispo_sequence_level_by_hand():
    """importance_level 'sequence': each row's weight is its clipped, detached length-normalised ratio: row 0's
    exp(-0.05 / 3) = 0.983 is capped at 0.9 (its three tokens count as clipped), row 1's exp(-0.3) = 0.741 stays
    (no lower bound with cispo_min 0), and every token keeps a gradient; the IS weight is the row's too."""
    s = LossSettings(objective="cispo", cispo_max=0.9, importance_level="sequence", **PLAIN)
    out, g = _run(s, agg="seq-mean")
    loss = 0.0
    for i in range(2):
        n = int(MASK[i].sum())
        r = math.exp(sum(LOGP[i][t] - OLD[i][t] for t in range(n)) / n)
        c = min(r, 0.9)
        is_w = math.exp(sum(OLD[i][t] - BEHAV[i][t] for t in range(n)) / n)  # the row's IS weight, uncapped
        for t in range(n):
            loss += -is_w * c * ADV[i] * LOGP[i][t] / (n * 2)
            assert g[i, t].item() == pytest.approx(-is_w * c * ADV[i] / (n * 2), rel=1e-6)
    assert out.loss.item() == pytest.approx(loss, rel=1e-6)
    assert out.clipped == 3 and (g[MASK] != 0).all()


def test_cispo_keeps_behav_clip_and_the_preset_sets_the_objective():
    """behav_clip applies as documented: a token already moved past the trust region around the behaviour policy
    in its advantage's direction gets no gradient under CISPO too."""
    behav = [[-1.5, -0.5, -2.0], [-0.3, -1.2, 0.0]]  # row 0 token 0: pi / mu = e^0.5 > 1.28 with A > 0
    _, g = _run(LossSettings(objective="cispo", tis_cap=None, behav_clip=True), old=LOGP, behav=behav)
    assert g[0, 0] == 0 and (g[MASK].abs() > 0).sum() == 4
    assert Config(loss_type="cispo").recipe.objective == "cispo" and Config().recipe.objective == "ppo-clip"
    assert LossSettings.from_config(Config(loss_type="cispo")).objective == "cispo"
    assert Config(loss_type="cispo", objective="ppo-clip").recipe.objective == "ppo-clip"  # a set field wins
    assert {p["objective"] for p in PRESETS.values()} == {"ppo-clip", "cispo"}
    with pytest.raises(ConfigError, match="objective='ppo': use 'ppo-clip' or 'cispo'"):
        Config(objective="ppo")


# --- masked IS band ----------------------------------------------------------------------------------------------

def test_masked_is_band_token_level_by_hand():
    """IS weights exp(old - behav) = 1.2, 6.0, 0.3 | 2.5, 1.0. Band [0.5, 3.0], cap 2: 6.0 and 0.3 are masked
    (weight 0, no gradient), 2.5 is truncated to 2, the rest kept. On-policy (old = behav) nothing is masked."""
    old = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    behav = [[-math.log(1.2), -math.log(6.0), -math.log(0.3)], [-math.log(2.5), 0.0, 0.0]]
    s = LossSettings(tis_cap=2.0, behav_clip=False, is_mask_low=0.5, is_mask_high=3.0, clip_high=100.0)
    out, g = _run(s, logp=old, old=old, behav=behav)
    kept = {(0, 0): 1.2, (1, 0): 2.0, (1, 1): 1.0}
    assert out.loss.item() == pytest.approx(sum(-kept[c] * ADV[c[0]] / 5 for c in kept), rel=1e-6)
    for i, t in _cells():
        assert g[i, t].item() == pytest.approx(-kept.get((i, t), 0.0) * ADV[i] / 5, rel=1e-6)
    assert out.is_masked == 2 and out.is_truncated == 1 and out.is_weight_sum == pytest.approx(4.2)
    on, _ = _run(s, logp=old, old=old, behav=old)
    assert on.is_masked == 0
    # the KL term stays on a masked token (as TRL, which masks the policy term only)
    ref = [[-0.5] * 3, [-0.5] * 3]
    lp = _t(old).requires_grad_(True)
    s_kl = LossSettings(tis_cap=2.0, behav_clip=False, is_mask_low=0.5, is_mask_high=3.0, kl_coef=0.1)
    policy_loss(lp, _t(old), _t(behav), _t(ADV), token_weights(MASK, "token-mean").to(F64), MASK, s_kl,
                _t(ref)).loss.backward()
    assert lp.grad[0, 1] != 0  # masked by the band, still pulled by the KL term


def test_masked_is_band_sequence_level_masks_whole_sequences():
    """At sequence level the band tests each row's length-normalised IS weight exp(mean(old - behav)): row 0's
    exp(0.1 / 3) = 1.034 and row 1's exp(0.5 / 2) = 1.284 are both above 1.03: every token masked. With the band's
    top at 1.05 row 0 is kept whole (each token's gradient -IS * A * w), row 1 still masked whole."""
    s = LossSettings(behav_clip=False, tis_cap=None, importance_level="sequence", is_mask_low=0.9, is_mask_high=1.03)
    out, g = _run(s, logp=OLD)  # trainer = proximal: the ratio to it is 1, the IS weight exp(mean(old - behav))
    assert out.is_masked == 5 and (g[MASK] == 0).all()
    s2 = LossSettings(behav_clip=False, tis_cap=None, importance_level="sequence", is_mask_low=0.9, is_mask_high=1.05)
    out2, g2 = _run(s2, logp=OLD)
    is0 = math.exp(sum(OLD[0][t] - BEHAV[0][t] for t in range(3)) / 3)
    assert out2.is_masked == 2 and (g2[1, :2] == 0).all()
    for t in range(3):
        assert g2[0, t].item() == pytest.approx(-is0 * ADV[0] / 5, rel=1e-6)


def test_bad_band_and_cispo_bounds_are_one_line():
    with pytest.raises(ConfigError, match="is_mask_low=2.0 is not below is_mask_high=1.5"):
        Config(is_mask_low=2.0, is_mask_high=1.5)
    with pytest.raises(ConfigError, match="cispo_min=1.0 is not below cispo_max=1.0"):
        Config(cispo_min=1.0, cispo_max=1.0)
    with pytest.raises(ConfigError, match="top_entropy_quantile=1.5: accepted range"):
        Config(top_entropy_quantile=1.5)


# --- entropy bonus and top_entropy_quantile --------------------------------------------------------------------

def _logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 5, generator=g, dtype=F64)


def test_entropy_bonus_gradient_is_the_hand_derivative_on_and_off_policy():
    """loss = policy term - c * sum(w * H). d/dz of H = -sum p log p is -p (log p + H); the policy term's, at ratio
    r and IS weight 1, -w A r (onehot - p) (unclipped). Checked at ratio 1 and at old != logp (ratios != 1)."""
    tgt = torch.tensor([[0, 3, 1], [2, 2, 4]])
    c = 0.05
    for old_shift in (0.0, 0.07):
        z = _logits().requires_grad_(True)
        logp_V = torch.log_softmax(z, -1)
        logp = logp_V.gather(-1, tgt[..., None]).squeeze(-1)
        ent = -(logp_V.exp() * logp_V).sum(-1)
        old = logp.detach() + old_shift
        w = token_weights(MASK, "seq-mean").to(F64)
        s = LossSettings(entropy_coef=c, tis_cap=None, behav_clip=False, clip_low=0.5, clip_high=0.5)
        out = policy_loss(logp, old, old, _t(ADV), w, MASK, s, entropy_B_T=ent)
        out.loss.backward()
        with torch.no_grad():
            p, lpv = logp_V.exp(), logp_V
            H = -(p * lpv).sum(-1, keepdim=True)
            r = torch.exp(logp - old)[..., None]
            onehot = torch.nn.functional.one_hot(tgt, 5).to(F64)
            wm = (w * MASK)[..., None]
            hand = -wm * _t(ADV)[:, None, None] * r * (onehot - p) + c * wm * p * (lpv + H)
            hand_loss = (-(w * MASK) * _t(ADV)[:, None] * r[..., 0]).sum() - c * (w * MASK * H[..., 0]).sum()
        torch.testing.assert_close(z.grad, hand, rtol=1e-6, atol=1e-9)
        assert out.loss.item() == pytest.approx(hand_loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match="entropy_B_T"):
        policy_loss(logp.detach(), old, old, _t(ADV), w, MASK, s)


@pytest.mark.parametrize("min_p", [0.0, 0.3])
def test_per_token_entropy_with_gradient_from_the_lm_head_chunks(min_p):
    """batch.hidden_logprobs(with_entropy='grad'), checkpointed: each target's entropy of the processed
    distribution (temperature, min_p's renormalised cut) and its gradient equal a direct computation; 'tokens' is
    the same values without a graph, True their sum."""
    from minirl.core.logits import Processing, processed_logits
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(4, 7, bias=False, dtype=F64)
    h = torch.randn(5, 4, generator=g, dtype=F64, requires_grad=True)
    tgt_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    rows = Batch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), tgt_mask,
                 torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.long), torch.zeros(2), torch.zeros(2, 4),
                 torch.ones(2))
    targets = torch.tensor([0, 3, 6, 1, 2])
    temp = torch.full((5,), 0.7)
    proc = Processing(min_p=min_p)
    with torch.no_grad():  # min_p must not cut a target here
        z0 = processed_logits(head(h).float(), temp, proc)
        targets = z0.argmax(-1)
    lp, ent = hidden_logprobs(h, targets, temp, head, rows, with_entropy="grad", proc=proc)
    z = processed_logits(head(h).float(), temp, proc)
    want = torch.distributions.Categorical(logits=z).entropy()
    torch.testing.assert_close(ent[tgt_mask].double(), want.double(), rtol=1e-5, atol=1e-6)
    (gh,) = torch.autograd.grad(ent.sum(), h)
    (wh,) = torch.autograd.grad(want.sum(), h)
    assert torch.isfinite(gh).all()
    torch.testing.assert_close(gh, wh, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        _, e_tok = hidden_logprobs(h, targets, temp, head, rows, with_entropy="tokens", proc=proc)
        _, e_sum = hidden_logprobs(h, targets, temp, head, rows, with_entropy=True, proc=proc)
    assert not e_tok.requires_grad and e_sum == pytest.approx(float(want.detach().sum()), rel=1e-5)
    torch.testing.assert_close(e_tok[tgt_mask].double(), want.double(), rtol=1e-5, atol=1e-6)


def test_top_entropy_masks_keep_the_step_quantile_across_micro_batches():
    """Six targets over two micro-batches with entropies 0.1 .. 0.9: rho = 0.4 keeps those >= the 0.6 quantile
    (linear interpolation, as torch.quantile and TRL: 0.5 here), i.e. 0.5, 0.7, 0.9: three tokens, two of them in
    the first micro-batch. rho = 1 keeps every target; rho = 0 the highest only. Padding is never kept."""
    e1 = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.0, 7.0]])
    m1 = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    e2 = torch.tensor([[0.7, 0.2]])
    m2 = torch.tensor([[1, 1]], dtype=torch.bool)
    k1, k2 = top_entropy_masks([e1, e2], [m1, m2], 0.4)
    assert torch.quantile(torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7, 0.2]), 0.6).item() == pytest.approx(0.5)
    assert k1.tolist() == [[False, True, True], [False, False, False]] and k2.tolist() == [[True, False]]
    a1, a2 = top_entropy_masks([e1, e2], [m1, m2], 1.0)
    assert a1.tolist() == m1.tolist() and a2.tolist() == m2.tolist()
    z1, z2 = top_entropy_masks([e1, e2], [m1, m2], 0.0)
    assert z1.sum() == 1 and z1[0, 2] and z2.sum() == 0


def test_top_entropy_mask_drops_the_policy_term_of_the_other_tokens_only():
    """A dropped token gets no policy gradient; the kept ones get exactly what they get without the mask (the
    denominator is unchanged, as TRL's); the entropy bonus sums over the kept tokens only; KL stays on all."""
    keep = torch.tensor([[True, False, True], [False, True, False]])
    ent = _t([[0.3, 0.2, 0.1], [0.4, 0.5, 0.0]])
    s = LossSettings(tis_cap=None, behav_clip=False, entropy_coef=0.1)
    full, g_full = _run(s, entropy_B_T=ent)
    out, g = _run(s, entropy_B_T=ent, top_entropy_B_T=keep)
    assert (g[MASK & ~keep] == 0).all()
    torch.testing.assert_close(g[keep], g_full[keep])
    w = 1 / 5

    def ppo(i, t):  # a token's PPO term at the default clip 0.2 / 0.28, with its (uncapped) IS weight
        r = math.exp(LOGP[i][t] - OLD[i][t])
        return -math.exp(OLD[i][t] - BEHAV[i][t]) * min(r * ADV[i], min(max(r, 0.8), 1.28) * ADV[i]) * w
    dropped_policy = sum(ppo(i, t) for i, t in _cells() if not keep[i, t])
    assert full.loss.item() == pytest.approx(sum(ppo(i, t) for i, t in _cells())
                                             - 0.1 * w * float(ent[MASK].sum()), rel=1e-6)
    dropped_bonus = -0.1 * w * sum(float(ent[i, t]) for i, t in _cells() if not keep[i, t])
    assert out.loss.item() == pytest.approx(full.loss.item() - dropped_policy - dropped_bonus, rel=1e-6)


# --- loss_fn ------------------------------------------------------------------------------------------------------

LOSS_MODULE = '''
import torch
from minirl.training.loss import LossInputs, LossOut, decoupled_loss

SEEN = []


def scaled(inputs):
    SEEN.append(inputs)
    return 3.0 * (inputs.logp_B_T * inputs.weight_B_T * inputs.mask_B_T).sum() * -inputs.adv_B.mean()


def wrapped(inputs: LossInputs) -> LossOut:
    return decoupled_loss(inputs)


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def loss_module(tmp_path, monkeypatch):
    (tmp_path / "my_losses_55.py").write_text(LOSS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_losses_55", None)
    yield
    sys.modules.pop("my_losses_55", None)


def test_a_loss_fn_is_called_with_the_documented_inputs_and_its_loss_used(loss_module):
    fn = resolve_loss_fn("my_losses_55:scaled")
    lp = _t(LOGP).requires_grad_(True)
    w = token_weights(MASK, "token-mean").to(F64)
    inp = LossInputs(lp, _t(OLD), _t(BEHAV), _t(ADV), w, MASK, LossSettings())
    out = run_loss(fn, inp)
    import my_losses_55
    assert my_losses_55.SEEN == [inp] and out.n_tokens == 5 and out.clipped == 0
    assert out.loss.item() == pytest.approx(3 * sum(LOGP[i][t] / 5 for i, t in _cells()) * -0.25, rel=1e-6)
    # the built-in, through the same interface, is the default loss_fn and the loss the tensors' function gives
    assert resolve_loss_fn(None) is decoupled_loss
    a = run_loss(resolve_loss_fn("my_losses_55:wrapped"), inp)
    b = policy_loss(lp, _t(OLD), _t(BEHAV), _t(ADV), w, MASK)
    assert a.loss.item() == b.loss.item() and a.clipped == b.clipped


def test_a_bad_loss_fn_is_one_config_error_line_before_the_model_loads(loss_module, tiny_model, monkeypatch):
    import minirl.training.trainer as T
    monkeypatch.setattr(T, "build_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=r"loss_fn='my_losses_55': give 'module:function'"):
        Config(loss_fn="my_losses_55")
    for ref, why in (("no_such_module_55:f", "cannot be imported"), ("my_losses_55:nope", "cannot be imported"),
                     ("my_losses_55:NOT_A_FUNCTION", "not a function")):
        with pytest.raises(ConfigError, match=why) as e:
            Trainer(Config(model=tiny_model, backend="hf", lora_rank=4, max_tokens=6, loss_fn=ref))
        assert "\n" not in str(e.value) and ref in str(e.value)


# --- in the trainer -----------------------------------------------------------------------------------------------

def _trainer(tiny_model, **kw):
    return lora_trainer(tiny_model, **kw)


def _step(tr, groups):
    m = tr.step(groups)
    return m, {n: p.grad.clone() for n, p in tr.model.named_parameters() if "lora" in n}


EXTRAS = dict(loss_type="cispo", cispo_max=1.5, entropy_coef=0.02, top_entropy_quantile=0.5, is_mask_low=0.5,
              is_mask_high=1.8)


def test_the_features_give_one_loss_and_gradient_padded_split_and_packed(tiny_model, monkeypatch):
    """cispo + entropy bonus + top_entropy_quantile + the IS band on a captured batch: the padded step in one
    micro-batch, in several (the entropy quantile is over the step, so micro-batching changes nothing) and
    shared-prefix packed give the same loss and every LoRA gradient; the band's metric counts the tokens whose IS
    weight (trainer / behaviour logprobs) leaves it; the entropy bonus changes the gradient."""
    import minirl.training.batch as B
    _, steps = load_batches(DATA / "trainer_batches_tiny.json")
    groups = steps[0]
    asked = []
    real = B._chunk_logp
    monkeypatch.setattr(B, "_chunk_logp", lambda *a, **k: asked.append(a[4]) or real(*a, **k))
    runs = {}
    for name, kw in (("one", dict(packing="padded", token_budget=100_000)),
                     ("split", dict(packing="padded", token_budget=16)),
                     ("packed", dict(packing="shared-prefix", token_budget=128))):
        tr = _trainer(tiny_model, **EXTRAS, **kw)
        runs[name] = (*_step(tr, groups), tr)
    m1, g1, tr1 = runs["one"]
    assert runs["split"][0]["train/micro_batches"] > 2
    assert "grad" in asked and "tokens" in asked
    for name in ("split", "packed"):
        m, g, _ = runs[name]
        for k in ("loss", "entropy", "is_weight/masked_frac", "is_weight/mean", "clip_frac"):
            assert m[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), (name, k)
        for n, x in g1.items():
            torch.testing.assert_close(g[n], x, rtol=1e-4, atol=1e-7, msg=f"{name} {n}")
    # the band's count, by hand from the trainer's logprobs before the step (the proximal policy)
    fresh = _trainer(tiny_model, **EXTRAS, packing="padded", token_budget=100_000)
    batch = make_batch(fresh.samples(groups), fresh.tokenizer.pad_token_id, "token-mean", 6)
    with torch.no_grad():
        lp, _ = completion_logprobs(fresh.model, batch)
    is_w = torch.exp(lp - batch.behav_logp_B_L)[batch.tgt_mask_B_L]
    n_out = int(((is_w < 0.5) | (is_w > 1.8)).sum())
    assert 0 < n_out < is_w.numel()
    assert m1["is_weight/masked_frac"] == pytest.approx(n_out / is_w.numel())
    # the entropy bonus is in the gradient; without it no token entropy with a graph is asked for
    asked.clear()
    m0, g0 = _step(_trainer(tiny_model, **{**EXTRAS, "entropy_coef": 0.0}, packing="padded", token_budget=100_000),
                   groups)
    assert "grad" not in asked
    assert any((g0[n] - g1[n]).abs().max() > 1e-6 for n in g1)


def test_a_loss_fn_trains_in_the_trainer_with_the_step_inputs(tiny_model, loss_module):
    """The trainer calls the user's function once per micro-batch with LossInputs (logp with grad, the config's
    LossSettings) and trains on its loss: the step's loss is the sum of what it returned."""
    _, steps = load_batches(DATA / "trainer_batches_tiny.json")
    tr = _trainer(tiny_model, loss_fn="my_losses_55:scaled", packing="padded", token_budget=16)
    m = tr.step(steps[0])
    import my_losses_55
    seen = my_losses_55.SEEN
    assert len(seen) == m["train/micro_batches"] > 1
    assert all(isinstance(x, LossInputs) and x.logp_B_T.requires_grad and x.settings == LossSettings.from_config(
        tr.cfg) and x.entropy_B_T is None and x.top_entropy_B_T is None for x in seen)
    want = sum(3.0 * float((x.logp_B_T.detach() * x.weight_B_T * x.mask_B_T).sum() * -x.adv_B.mean()) for x in seen)
    assert m["loss"] == pytest.approx(want, rel=1e-6) and m["grad_norm"] > 0

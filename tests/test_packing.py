"""Shared-prefix packing: the same loss and every LoRA gradient as the padded path on batches captured from real
runs (tests/data/, written by scripts/capture_trainer_batches.py), with gradient checkpointing on and off, with a
KL term, and on episodes with masked environment tokens; the packed layout itself (mask, budget, splits)."""
from pathlib import Path

import pytest
import torch

from minirl import Config, ConfigError
from minirl.benchmarks.trainer_step import load_batches
from minirl.training.batch import Sample, completion_logprobs, make_batch
from minirl.training.packing import pack, packed_completion_logprobs
from minirl.training.trainer import Trainer

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread: these models are tiny, and on a loaded machine two threads waiting on each other per op
    made a step ~30x slower here."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _trainer(tiny_model, packing, gc, kl, budget=128):
    return lora_trainer(tiny_model, token_budget=budget, packing=packing, gradient_checkpointing=gc, kl_coef=kl)


def lora_trainer(tiny_model, **kw):
    """A trainer on the tiny model whose LoRA weights all get gradients (also used by tests/test_loss_extras.py)."""
    tr = Trainer(Config(model=tiny_model, backend="hf", lora_rank=8, lora_alpha=16, max_tokens=6, seed=0,
                        max_grad_norm=1e9, **kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at zero: make it non-zero so that every LoRA weight gets a gradient
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return tr


def _layer_calls(tr):
    """Counts the first decoder layer's forward starts (twice per micro-batch pass with checkpointing)."""
    calls = []
    tr.model.get_base_model().get_decoder().layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.parametrize("gc", [False, True], ids=["no_ckpt", "ckpt"])
@pytest.mark.parametrize("kl", [0.0, 0.05], ids=["kl0", "kl"])
@pytest.mark.parametrize("name", ["trainer_batches_tiny.json", "trainer_batches_tiny_episodes.json"])
def test_packed_step_has_the_padded_loss_and_every_lora_gradient(tiny_model, name, kl, gc):
    head, steps = load_batches(DATA / name)
    groups = steps[0]
    if "episodes" in name:  # the stored episode batch really has environment tokens the loss must skip
        assert any(c.mask is not None and not all(c.mask) for g in groups for c in g.group.completions)
    out, grads, calls = {}, {}, {}
    for packing in ("padded", "shared-prefix"):
        tr = _trainer(tiny_model, packing, gc, kl)
        assert tr.packing == packing and tr.checkpointing == gc
        assert tr.model.get_base_model().is_gradient_checkpointing == gc
        n_calls = _layer_calls(tr)
        out[packing] = tr.step(groups)
        calls[packing] = len(n_calls)
        grads[packing] = {n: p.grad.clone() for n, p in tr.model.named_parameters() if "lora" in n}
    pad, pk = out["padded"], out["shared-prefix"]
    assert pk["train/forward_tokens"] < pad["train/forward_tokens"]  # each prompt computed once, no padding
    assert pk["train/tokens"] == pad["train/tokens"] and pk["train/samples"] == pad["train/samples"]
    for k in ("loss", "kl_ref", "entropy", "logprob_mismatch", "is_weight/mean", "clip_frac/behav"):
        assert pk[k] == pytest.approx(pad[k], rel=1e-5, abs=1e-7), k
    if kl:
        assert pad["kl_ref"] > 0
    assert grads["padded"].keys() == grads["shared-prefix"].keys()
    assert len(grads["padded"]) == 2 * 7 * 2  # lora_A and lora_B of 7 linear layers in 2 decoder layers
    for n, g in grads["padded"].items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(grads["shared-prefix"][n], g, rtol=1e-4, atol=1e-7, msg=n)
    per_pass = (2 if gc else 1) + (1 if kl else 0)  # checkpointing recomputes the forward in backward
    assert calls["shared-prefix"] == per_pass * pk["train/micro_batches"]
    assert calls["padded"] == per_pass * pad["train/micro_batches"]


def _samples():
    """Three prompts (one visited twice), completions of varied lengths, an episode with masked env tokens, and a
    group sampled at another temperature."""
    g = torch.Generator().manual_seed(0)
    out = []
    prompts = [tuple(torch.randint(5, 60, (n,), generator=g).tolist()) for n in (4, 7, 5)]
    for k, p in enumerate(prompts + prompts[:1]):
        for j in range(4):
            c = tuple(torch.randint(5, 60, (1 + (j * 3 + k) % 6,), generator=g).tolist())
            mask = tuple(t == 0 or (t + j) % 3 != 0 for t in range(len(c))) if k == 1 else None
            out.append(Sample(p, c, tuple((-torch.rand(len(c), generator=g)).tolist()), (0,) * len(c),
                              float(j) - 1.5, 0.7 if k == 2 else 1.0, mask))
    return out


def test_packed_layout_mask_positions_and_budget():
    s = _samples()
    batch = make_batch(s, 0, "token-mean", 8)
    mbs = pack(s, batch, 20)
    assert sorted(i for mb in mbs for i in mb.sample_R.tolist()) == list(range(len(s)))  # every sample once
    for mb in mbs:  # the loss's view is the padded batch's rows (its batch-wide weights included)
        torch.testing.assert_close(mb.rows.weight_B_L, batch.weight_B_L[mb.sample_R][:, :mb.rows.weight_B_L.shape[1]])
    real = sum(len(x.completion_ids) for x in s)
    prompts = sum(mb.n_real_tokens for mb in mbs) - real
    assert all(mb.n_real_tokens <= 20 for mb in mbs)
    assert prompts < sum(len(x.prompt_ids) for x in s)  # prompts are shared...
    assert prompts >= 4 + 7 + 5  # ...each at least once
    mb = mbs[0]
    m = mb.attention_mask(torch.float32)[0, 0] == 0  # True: attends
    seg, comp, pos = mb.segment_T, mb.completion_T, mb.position_ids_1_T[0]
    for i in range(mb.n_real_tokens):
        for j in range(mb.n_real_tokens):
            sees = seg[i] == seg[j] and j <= i and (comp[j] < 0 or comp[i] == comp[j])
            assert bool(m[i, j]) == bool(sees)
        if comp[i] >= 0:  # a completion's positions continue from its prompt's end, as in its padded row
            n_prompt = int(((seg == seg[i]) & (comp < 0)).sum())
            first = int(torch.nonzero(comp == comp[i])[0])
            assert int(pos[i]) == n_prompt + i - first


def test_a_group_longer_than_the_budget_is_split_and_each_part_repeats_its_prompt():
    p = (5, 6, 7)
    s = [Sample(p, (9,) * 6, (-1.0,) * 6, (0,) * 6, 1.0) for _ in range(4)]
    mbs = pack(s, make_batch(s, 0, "token-mean", 8), 16)  # prompt 3 + 2 completions of 6 = 15 fit
    assert [mb.n_real_tokens for mb in mbs] == [15, 15]


@pytest.mark.parametrize("budget", [12, 1000])
def test_packed_logprobs_equal_padded_on_varied_lengths(tiny_model, budget):
    tr = _trainer(tiny_model, "shared-prefix", False, 0.0)
    s = _samples()
    batch = make_batch(s, 0, "seq-mean", 8)
    with torch.no_grad():
        want, ent_want = completion_logprobs(tr.model, batch, with_entropy=True)
        got, ent = torch.full_like(want, float("nan")), 0.0
        for mb in pack(s, batch, budget):
            lp, e = packed_completion_logprobs(tr.model, mb, with_entropy=True)
            got[mb.sample_R, :lp.shape[1]] = lp
            ent += e
    torch.testing.assert_close(got[batch.tgt_mask_B_L], want[batch.tgt_mask_B_L], rtol=1e-5, atol=1e-5)
    assert ent == pytest.approx(ent_want, rel=1e-5)


def test_bad_packing_and_checkpointing_settings_are_one_clear_line():
    with pytest.raises(ConfigError, match="packing='fast': use 'shared-prefix' or 'padded'"):
        Config(packing="fast")
    with pytest.raises(ConfigError, match="gradient_checkpointing='sometimes': use 'auto', true or false"):
        Config(gradient_checkpointing="sometimes")
    assert [Config(gradient_checkpointing=v).gradient_checkpointing for v in ("true", "no", "auto", False)] == [
        True, False, "auto", False]  # a CLI flag or a quoted YAML value


@pytest.mark.parametrize("attn", ["eager", "flex_attention"])
def test_attention_without_custom_masks_falls_back_to_padded(tiny_model, attn, monkeypatch, capsys):
    """eager takes the additive mask (the same loss as padded); flex-attention is not given one: the trainer says
    so in one line and trains padded."""
    import transformers
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: real(*a, **{**k, "attn_implementation": attn}))
    head, steps = load_batches(DATA / "trainer_batches_tiny.json")
    tr = _trainer(tiny_model, "shared-prefix", False, 0.0)
    want = "padded" if attn == "flex_attention" else "shared-prefix"
    assert tr.packing == want
    said = capsys.readouterr().out
    assert ("training uses packing 'padded'" in said) == (want == "padded")
    if attn != "eager":  # flex-attention has no backward on CPU
        return
    m = tr.step(steps[0])
    ref = _trainer(tiny_model, "padded", False, 0.0).step(steps[0])
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)


def test_checkpointing_auto_is_on_for_gpu_training_only():
    from minirl.training.models import checkpointing_on
    assert checkpointing_on(Config(), "cuda") and checkpointing_on(Config(), "cuda:0")
    assert not checkpointing_on(Config(), "cpu")
    assert checkpointing_on(Config(gradient_checkpointing=True), "cpu")
    assert not checkpointing_on(Config(gradient_checkpointing=False), "cuda")

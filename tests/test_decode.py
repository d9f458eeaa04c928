"""The transformers generator's own decoding loop (`hf.decode`): rows that end leave the batch and the KV cache,
and the rows that go on are decoded exactly as `generate` decodes them."""
import pytest
import torch

from minirl.generation import hf as H
from minirl.generation.hf import HFGenerator
from minirl.training.trainer import Trainer
from minirl.types import SamplingParams


@pytest.fixture(scope="module")
def trainer(tiny_model, tmp_path_factory):
    from minirl.config import Config
    t = Trainer(Config(model=tiny_model, lora_rank=8, lora_alpha=16, out_dir=str(tmp_path_factory.mktemp("d"))))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter, so the LoRA path matters
        for n, p in t.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return t


def _prompts(trainer):
    from minirl.data.rows import to_prompts  # different lengths: rows are left-padded
    rows = ["What is 1 + 1 ?", "What is 12 + 30 and then what is 7 + 5 ?", "3 + 4 ?", "What is 9 + 9 ?"]
    return to_prompts([{"prompt": r} for r in rows], trainer.tokenizer)


class _Tok:
    """The tokenizer, with another token as its end of sequence."""
    def __init__(self, tok, eos):
        self._tok, self.eos_token_id = tok, eos

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _eos_that_splits(gen, prompts, n, params=SamplingParams(temperature=0, max_tokens=10)):
    """A token id that decoding emits early in some rows and never in others: used as the end of sequence, the
    rows end at different steps (a random tiny model rarely samples its real eos)."""
    rows = [c.token_ids for g in gen.generate(prompts, n, params) for c in g.completions]
    for tok in {t for r in rows for t in r[1:5]}:
        ends = [r.index(tok) if tok in r else None for r in rows]
        if any(e is None for e in ends) and any(e is not None and 0 < e < 5 for e in ends):
            return tok
    pytest.skip("no token splits the rows on this tiny model")


def test_greedy_decode_equals_generate_as_rows_end_at_different_steps(trainer):
    gen = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version)
    prompts = _prompts(trainer)
    gen.tok = _Tok(trainer.tokenizer, _eos_that_splits(gen, prompts, 1))
    sizes = []
    hook = trainer.model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]),
                                                   with_kwargs=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=10)
        fast = [(c.token_ids, c.finish_reason) for g in gen.generate(prompts, 1, params) for c in g.completions]
    finally:
        hook.remove()
    assert sizes[0] == 4 and min(sizes) < 4  # the batch shrank as rows ended
    gen.compact = False
    ref = [(c.token_ids, c.finish_reason) for g in gen.generate(prompts, 1, params) for c in g.completions]
    assert fast == ref
    assert {f for _, f in fast} == {"stop", "length"}


def test_sampled_logprobs_are_the_trainers_for_rows_that_outlive_others(trainer, monkeypatch):
    """The behaviour logprobs of every row, those decoded after others left the batch included, are the trainer's
    own logprobs of those tokens. A compaction that keeps the wrong cache rows fails this (checked below)."""
    gen = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version)
    prompts = _prompts(trainer)
    params = SamplingParams(temperature=0.7, max_tokens=10, seed=3)
    gen.tok = _Tok(trainer.tokenizer, _eos_that_splits(gen, prompts, 3, params))

    def worst(groups):
        out = 0.0
        for g in groups:
            for c in g.completions:
                want = trainer.logprobs(list(g.prompt.token_ids), list(c.token_ids), 0.7)
                out = max(out, max(abs(a - b) for a, b in zip(c.logprobs, want)))
        return out
    groups = gen.generate(prompts, 3, params)
    lengths = {len(c.token_ids) for g in groups for c in g.completions}
    assert len(lengths) > 1 and max(lengths) == 10  # rows ended at different steps; some ran on
    assert worst(groups) < 1e-4

    # the fault this guards against: rows dropped from the batch but the wrong rows kept in the cache
    from transformers import DynamicCache
    real = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices", lambda self, idx: real(self, idx.flip(0)))
    assert worst(gen.generate(prompts, 3, params)) > 1e-2


def test_top_k_one_samples_the_greedy_tokens(trainer):
    gen = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version)
    prompts = _prompts(trainer)
    greedy = [c.token_ids for g in gen.generate(prompts, 1, SamplingParams(temperature=0, max_tokens=6))
              for c in g.completions]
    top1 = gen.generate(prompts, 1, SamplingParams(temperature=1.0, top_k=1, max_tokens=6, seed=0))
    assert [c.token_ids for g in top1 for c in g.completions] == greedy
    assert all(lp == pytest.approx(0.0, abs=1e-6) for g in top1 for c in g.completions for lp in c.logprobs)


def test_stop_strings_go_through_decode(trainer, monkeypatch):
    """`decode` ends a row at a stop string (its `stopped` check): a request with stop strings no longer goes to
    transformers' `generate`, so its rows leave the batch as they end."""
    gen = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version)
    calls = []
    monkeypatch.setattr(H, "decode", lambda *a, **k: calls.append(("decode", a[-1])) or ([[5]] * 2, [[-1.0]] * 2))
    monkeypatch.setattr(gen, "_generate", lambda *a, **k: calls.append("generate") or ([[5]] * 2, [[-1.0]] * 2))
    gen.generate(_prompts(trainer)[:1], 2, SamplingParams(max_tokens=4, stop=("zzz",), seed=0))
    gen.generate(_prompts(trainer)[:1], 2, SamplingParams(max_tokens=4, seed=0))
    assert [c[0] for c in calls] == ["decode", "decode"] and callable(calls[0][1]) and calls[1][1] is None


def test_one_prefill_per_prompt_samples_what_one_prefill_per_sample_did(trainer):
    """`generate(prompts, n)` prefills each prompt once and gives its KV cache to its n samples: the first forward
    has one row per prompt, then n per prompt; same seed, the same tokens and logprobs as prefilling every sample
    (`decode` on the prompts repeated, n=1: the previous way)."""
    gen = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version)
    prompts = _prompts(trainer)
    params = SamplingParams(temperature=0.9, max_tokens=8, seed=5)
    sizes = []
    hook = trainer.model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape),
                                                   with_kwargs=True)
    try:
        groups = gen.generate(prompts, 3, params)
    finally:
        hook.remove()
    assert sizes[0][0] == 4 and sizes[0][1] > 1 and sizes[1] == (12, 1)  # 4 prefills, then 12 rows decode
    ids = [list(p.token_ids) for p in prompts for _ in range(3)]
    width = max(map(len, ids))
    pad = trainer.tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    torch.manual_seed(5)
    trainer.model.eval()
    with H.merged_lora(trainer.model, {}, 0):
        toks, lps = H.decode(trainer.model, input_ids, attn, params, trainer.tokenizer.eos_token_id)
    eos = trainer.tokenizer.eos_token_id
    got = [c for g in groups for c in g.completions]
    for c, t, lp in zip(got, toks, lps):
        t = t[: t.index(eos) + 1] if eos in t else t
        assert list(c.token_ids) == t
        assert list(c.logprobs) == pytest.approx(lp[: len(t)], abs=1e-5)

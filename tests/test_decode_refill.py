# ruff: noqa: F811 - `trainer` is test_decode's fixture, imported and taken as an argument
"""Continuous refill on the static path (minirl/generation/slots.py): with fewer cache slots than samples, a slot
whose sample ended (end of sequence, stop string, max_tokens) takes the next waiting sample. On CPU (the CUDA
graph's twin): every sample answered once, each the loop's (`hf.decode`) greedy tokens or carrying the trainer's
own logprobs; a stop string that ends a row early hands its slot on; the step is captured once for the call."""
import pytest
import torch
from test_decode import _eos_that_splits, _prompts, _Tok, trainer  # noqa: F401 - the loop's tests' own

from minirl.core.logits import Processing
from minirl.generation import fast_decode as F
from minirl.generation.hf import HFGenerator, merged_lora
from minirl.training.batch import sequence_logprobs
from minirl.types import SamplingParams


def _gen(trainer, **kw):
    return HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version, **kw)


def _out(groups):
    return [(c.token_ids, c.finish_reason, c.text) for g in groups for c in g.completions]


@pytest.mark.parametrize("slots", [1, 5])
def test_more_samples_than_slots_gives_the_loops_greedy_samples(trainer, slots):
    """12 samples (4 prompts x 3) in 1 or 5 slots, rows ending at different steps: every sample comes back, with
    the loop's tokens, finish reasons and texts; the batch stays `slots` rows wide after the prompts' one
    prefill; 12 - slots samples were refilled into freed slots; versions exact."""
    static, loop = _gen(trainer, decode_mode="static", slots=slots), _gen(trainer, decode_mode="loop")
    prompts = _prompts(trainer)
    static.tok = loop.tok = _Tok(trainer.tokenizer, _eos_that_splits(loop, prompts, 3))
    sizes = []
    hook = trainer.model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]),
                                                   with_kwargs=True)
    params = SamplingParams(temperature=0, max_tokens=10)
    try:
        got = static.generate(prompts, 3, params)
    finally:
        hook.remove()
    assert sizes[0] == 4 and set(sizes[1:]) == {slots}
    assert static.last_decode["slots"] == slots and static.last_decode["refills"] == 12 - slots
    assert _out(got) == _out(loop.generate(prompts, 3, params))
    assert {f for _, f, _ in _out(got)} == {"stop", "length"}
    assert all(c.versions == (trainer.version,) * len(c.token_ids) for g in got for c in g.completions)


def test_refilled_samples_carry_the_trainers_logprobs(trainer):
    """Sampled with the knobs the trainer re-applies (temperature, min_p, repetition penalty), 16 samples in 3
    slots: each sample's behaviour logprobs are the trainer's `sequence_logprobs` of its tokens (bound 1e-4 nats,
    float32): a refilled slot sees its own prompt and tokens only, never its previous sample's."""
    static = _gen(trainer, decode_mode="static", slots=3)
    params = SamplingParams(temperature=0.7, max_tokens=10, seed=3, min_p=0.2, repetition_penalty=1.5)
    prompts = _prompts(trainer)
    static.tok = _Tok(trainer.tokenizer, _eos_that_splits(static, prompts, 4, params))
    groups = static.generate(prompts, 4, params)
    assert static.last_decode["refills"] == 13
    lengths = {len(c.token_ids) for g in groups for c in g.completions}
    assert len(lengths) > 1 and max(lengths) == 10  # samples ended at different steps; some ran on
    trainer.model.eval()
    for g in groups:
        assert len(g.completions) == 4
        for c in g.completions:
            want = sequence_logprobs(trainer.model, list(g.prompt.token_ids), list(c.token_ids), 0.7,
                                     Processing(0.2, 1.5))
            assert max(abs(a - b) for a, b in zip(c.logprobs, want)) < 1e-4


def _decode(trainer, prompts, params, **kw):
    ids = [list(p.token_ids) for p in prompts]
    width = max(map(len, ids))
    pad = trainer.tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    model = trainer.model.eval()
    with merged_lora(model, {}, 0):
        return F.static_decode(model, input_ids, attn, params, eos=-1, **kw)


def test_a_stop_string_ending_a_row_early_hands_its_slot_on(trainer):
    """One slot, two prompts, max_tokens 24: the first row reaches a stop string at its third token; at the host's
    next look its slot takes the second prompt (one refill), which then decodes exactly as it does alone (the
    first row's cache columns hidden from it): the whole call takes fewer steps than the first row's 24 and the
    second's together."""
    prompts = _prompts(trainer)[1:3]
    params = SamplingParams(temperature=0, max_tokens=24)
    alone = [_decode(trainer, [p], params) for p in prompts]
    word = trainer.tokenizer.decode(alone[0][0][0][2:3])

    def stopped(t):
        return word in trainer.tokenizer.decode(t[-4:])
    first = next(k for k in range(1, 25) if stopped(alone[0][0][0][:k]))
    report = {}
    rows, lps = _decode(trainer, prompts, params, stopped=stopped, check_every=2, slots=1, report=report)
    assert rows == [alone[0][0][0][:first], alone[1][0][0]]
    assert lps[1] == pytest.approx(alone[1][1][0], abs=1e-5)
    assert report["refills"] == 1 and report["host_looks"] >= 1 and report["steps"] < 24 + 24


def test_every_request_is_answered_once_through_many_refills(trainer):
    """Eight requests (four prompts, two samples each) through two slots, rows cut by a stop string, max_tokens
    or neither: eight answers in request order, each the greedy decoding of its own prompt alone (a slot that
    leaked, a sample answered twice or given another's slot fails this)."""
    prompts = _prompts(trainer)
    params = SamplingParams(temperature=0, max_tokens=9)
    alone = [_decode(trainer, [p], params)[0][0] for p in prompts]
    word = trainer.tokenizer.decode(alone[0][6:7])  # 'the' on the tiny model: within no other token's text

    def stopped(t):
        return word in trainer.tokenizer.decode(t[-4:])
    cut = [r[: next((k for k in range(1, len(r) + 1) if stopped(r[:k])), len(r))] for r in alone]
    report = {}
    rows, lps = _decode(trainer, prompts, params, n=2, stopped=stopped, check_every=3, slots=2, report=report)
    assert rows == [r for r in cut for _ in range(2)]
    assert len(lps) == 8 and [len(x) for x in lps] == [len(r) for r in rows]
    assert report["refills"] == 6 and report["slots"] == 2
    assert len({len(r) for r in rows}) > 1


def test_refills_need_no_new_capture(trainer, monkeypatch):
    """The step is captured once per call, refills included (fixed shapes; each slot's column, position and mask
    are tensors changed in place): checked on CPU with dynamo tracing the step whole (fullgraph), whose tokens and
    logprobs are the eager step's with every knob on."""
    captures = []

    def compiled(step, report):
        captures.append(1)
        report["graphs"] = "traced"
        return torch.compile(step, fullgraph=True, backend="eager")
    monkeypatch.setattr(F, "capture_step", compiled)
    prompts = _prompts(trainer)[:3]
    params = SamplingParams(temperature=0.7, max_tokens=6, top_k=8, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                            seed=0)
    outs, reports = [], [{}, {}]
    for graphs, report in zip((True, False), reports):
        torch.manual_seed(0)
        outs.append(_decode(trainer, prompts, params, n=2, graphs=graphs, slots=4, report=report))
    assert captures == [1] and reports[0]["graphs"] == "traced" and reports[0]["refills"] == 2
    assert outs[0][0] == outs[1][0]
    assert [x for r in outs[0][1] for x in r] == pytest.approx([x for r in outs[1][1] for x in r], abs=1e-5)

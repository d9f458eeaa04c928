# ruff: noqa: F811 - `trainer` is test_decode's fixture, imported and taken as an argument
"""The transformers generator's static decoding path (`hf_decode: static`, minirl/generation/fast_decode.py), on
CPU (the CUDA graph's twin: the same step, eager): greedy tokens equal the loop's (`hf.decode`), sampled tokens
carry the trainer's own logprobs, and every knob, stop strings, max_tokens and the end of sequence end rows
where the loop ends them."""
import math

import pytest
import torch
from test_decode import _eos_that_splits, _prompts, _Tok, trainer  # noqa: F401 - the loop's tests' own
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from minirl.core.logits import min_p_cut, penalise, seen_tokens
from minirl.generation import fast_decode as F
from minirl.generation.hf import HFGenerator, merged_lora
from minirl.types import SamplingParams


def _gens(trainer):
    return (HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version, decode_mode="static"),
            HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version, decode_mode="loop"))


def _out(groups):
    return [(c.token_ids, c.finish_reason, c.text) for g in groups for c in g.completions]


@pytest.mark.parametrize("n", [1, 3])
def test_greedy_static_equals_the_loop_as_rows_end_at_different_steps(trainer, n):
    """The same tokens, finish reasons and texts as the loop, while rows end at different steps (the loop drops
    them from its batch; the static path keeps every row at a fixed shape and cuts on the host); versions exact."""
    static, loop = _gens(trainer)
    prompts = _prompts(trainer)
    static.tok = loop.tok = _Tok(trainer.tokenizer, _eos_that_splits(loop, prompts, n))
    sizes = []
    hook = trainer.model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]),
                                                   with_kwargs=True)
    params = SamplingParams(temperature=0, max_tokens=10)
    try:
        got = static.generate(prompts, n, params)
    finally:
        hook.remove()
    assert sizes[0] == 4 and set(sizes[1:]) == {4 * n}  # one prefill per prompt, then every row at each step
    assert static.last_decode["decode"] == "static" and static.last_decode["graphs"] == "off"
    assert _out(got) == _out(loop.generate(prompts, n, params))
    assert {f for _, f, _ in _out(got)} == {"stop", "length"}
    assert all(c.versions == (trainer.version,) * len(c.token_ids) for g in got for c in g.completions)


def _reference_logprobs(trainer, prompt, toks, params: SamplingParams) -> list[float]:
    """Each token's logprob computed from scratch (no cache: the model on prompt + tokens so far, LoRA unmerged),
    processed as transformers' `generate` processes it: repetition penalty, temperature, top-k, top-p, min-p."""
    model = trainer.model.eval()
    ids = torch.tensor([list(prompt) + list(toks)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    out = []
    for j, t in enumerate(toks):
        row = logits[j: j + 1]
        hist = ids[:, : len(prompt) + j]
        if params.repetition_penalty != 1.0:
            row = penalise(row, seen_tokens(hist, torch.ones_like(hist), row.shape[-1]), params.repetition_penalty)
        row = TemperatureLogitsWarper(params.temperature)(hist, row)
        if params.top_k:
            row = TopKLogitsWarper(params.top_k)(hist, row)
        if params.top_p < 1.0:
            row = TopPLogitsWarper(params.top_p)(hist, row)
        out.append(float(torch.log_softmax(min_p_cut(row, params.min_p), -1)[0, t]))
    return out


KNOBS = [dict(), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8), dict(min_p=0.3),
         dict(repetition_penalty=1.8), dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.1, repetition_penalty=1.3)]


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: ",".join(k) or "plain")
def test_sampled_logprobs_are_the_processed_distributions(trainer, knob):
    """Every sampled token's behaviour logprob is its logprob under the processed distribution computed from
    scratch (bound 1e-4 nats: float32, a static vs an uncached attention and the merged vs unmerged LoRA differ
    by ~1e-6), no token falls outside a top-k / top-p / min-p cut (its logprob would be -inf), and the same
    seed gives the same tokens."""
    static, _ = _gens(trainer)
    prompts = _prompts(trainer)
    params = SamplingParams(**{"temperature": 1.0, **knob}, max_tokens=8, seed=7)
    groups = static.generate(prompts, 3, params)
    worst = 0.0
    for g in groups:
        for c in g.completions:
            want = _reference_logprobs(trainer, g.prompt.token_ids, c.token_ids, params)
            assert all(math.isfinite(x) for x in want)
            worst = max([worst] + [abs(a - b) for a, b in zip(c.logprobs, want)])
    assert worst < 1e-4, worst
    assert _out(static.generate(prompts, 3, params)) == _out(groups)
    assert len({c.token_ids for g in groups for c in g.completions}) > 1  # it sampled


def test_behaviour_logprobs_are_the_trainers(trainer):
    """With the knobs the trainer re-applies (temperature, min_p, repetition penalty), the behaviour logprobs are
    the trainer's own `sequence_logprobs` on the same tokens (bound 1e-4 nats, float32)."""
    from minirl.core.logits import Processing
    from minirl.training.batch import sequence_logprobs
    static, _ = _gens(trainer)
    params = SamplingParams(temperature=0.7, max_tokens=10, seed=3, min_p=0.2, repetition_penalty=1.5)
    groups = static.generate(_prompts(trainer), 4, params)
    trainer.model.eval()
    for g in groups:
        for c in g.completions:
            want = sequence_logprobs(trainer.model, list(g.prompt.token_ids), list(c.token_ids), 0.7,
                                     Processing(0.2, 1.5))
            assert max(abs(a - b) for a, b in zip(c.logprobs, want)) < 1e-4


@pytest.mark.parametrize("knob", [dict(repetition_penalty=1.8), dict(repetition_penalty=0.6), dict(top_k=1)])
def test_penalised_greedy_and_top_k_one_give_the_loops_tokens(trainer, knob):
    """Where the draw is no draw (greedy with a repetition penalty; top_k=1 sampling), the static path's tokens
    are the loop's exactly, whatever the random streams."""
    static, loop = _gens(trainer)
    prompts = _prompts(trainer)
    params = SamplingParams(**{"temperature": 0 if "repetition_penalty" in knob else 1.0, **knob}, max_tokens=12,
                            seed=0)
    got = static.generate(prompts, 2, params)
    assert _out(got) == _out(loop.generate(prompts, 2, params))
    if "top_k" in knob:
        assert all(lp == pytest.approx(0.0, abs=1e-6) for g in got for c in g.completions for lp in c.logprobs)


def test_stop_strings_and_max_tokens_end_rows_where_the_loop_ends_them(trainer):
    """A stop string ends a row at its first appearance, as the loop ends it (greedy: the same tokens, finish
    'stop', the loop's text); the others run to max_tokens ('length')."""
    static, loop = _gens(trainer)
    prompts = _prompts(trainer)
    free = static.generate(prompts, 1, SamplingParams(temperature=0, max_tokens=20))
    word = trainer.tokenizer.decode([free[1].completions[0].token_ids[6]])
    params = SamplingParams(temperature=0, max_tokens=20, stop=(word,))
    got = static.generate(prompts, 1, params)
    assert _out(got) == _out(loop.generate(prompts, 1, params))
    c = got[1].completions[0]
    assert c.finish_reason == "stop" and len(c.token_ids) <= 7 and word not in c.text.split()
    assert all(len(c.token_ids) == 20 for g in got for c in g.completions if c.finish_reason == "length")
    assert all(len(c.token_ids) <= 20 for g in free for c in g.completions)


def test_the_hosts_look_ends_decoding_once_every_row_stopped(trainer):
    """The host looks every `check_every` steps: rows that reached a stop string end there, and once no row goes
    on decoding stops (fewer steps than max_tokens); how often it looks changes no token."""
    prompts = _prompts(trainer)[2:3]
    tok = trainer.tokenizer
    ids = torch.tensor([list(prompts[0].token_ids)])
    attn = torch.ones_like(ids)
    params = SamplingParams(temperature=0, max_tokens=24)
    stop_after = 3  # the row's text reaches "the stop" at its third token
    model = trainer.model.eval()
    with merged_lora(model, {}, 0):
        (free,), _ = F.static_decode(model, ids, attn, params, eos=-1)
        word = tok.decode(free[stop_after - 1: stop_after])

        def stopped(t):
            return word in tok.decode(t[-4:])
        first = next(k for k in range(1, 25) if stopped(free[:k]))
        runs = {}
        for every in (2, 100):
            report = {}
            runs[every] = F.static_decode(model, ids, attn, params, eos=-1, stopped=stopped, check_every=every,
                                          report=report)
            runs[every] = (runs[every], report)
    (rows2, lps2), rep2 = runs[2]
    (rows100, lps100), rep100 = runs[100]
    assert rows2 == rows100 == [free[:first]] and lps2 == lps100
    assert rep2["steps"] < 24 and rep2["host_looks"] >= 1
    assert rep100["steps"] == 24 and rep100["host_looks"] == 0


def test_a_failed_graph_capture_runs_the_same_step_eagerly(trainer):
    """The CUDA graph's fault: a capture that cannot happen (here: no CUDA) is reported and the eager step
    decodes the same tokens."""
    prompts = _prompts(trainer)
    ids = torch.tensor([list(prompts[0].token_ids)])
    params = SamplingParams(temperature=0, max_tokens=8)
    model = trainer.model.eval()
    reports = [{}, {}]
    outs = [F.static_decode(model, ids, torch.ones_like(ids), params, eos=-1, graphs=g, report=r)
            for g, r in zip((True, False), reports)]
    assert outs[0] == outs[1]
    assert reports[0]["graphs"].startswith("capture failed, eager:") and reports[1]["graphs"] == "off"


def test_the_exponential_race_draws_from_the_distribution():
    """`sample`: argmax(p / E), E ~ Exp(1), picks token i with probability p_i (hand-set p = .5 / .3 / .2 / 0;
    20000 draws, within 0.015); a token of probability 0 (-inf score) is never drawn; greedy is the argmax."""
    torch.manual_seed(0)
    scores = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.0])).expand(20000, 4).contiguous()
    freq = torch.bincount(F.sample(scores, greedy=False), minlength=4).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.015), freq
    assert freq[3] == 0
    assert F.sample(scores[:2], greedy=True).tolist() == [0, 0]


def test_hf_decode_is_a_config_choice(trainer, tiny_model):
    """Config.hf_decode reaches the run's transformers generator; 'auto' is the loop for now; a bad value is one
    line naming the field."""
    from minirl.config import Config
    from minirl.generation.factory import make_generator
    cfg = Config(model=tiny_model, backend="hf", hf_decode="static")
    gen, _, _ = make_generator(cfg, trainer, "hf", asynchronous=False, gen_devices=None)
    assert gen.decode_mode == "static"
    gen, _, _ = make_generator(cfg.replace(hf_decode="auto"), trainer, "hf", asynchronous=False, gen_devices=None)
    assert gen.decode_mode == "loop" and F.resolve_decode("auto", "cuda") == "loop"
    with pytest.raises(Exception, match="hf_decode='fast': use 'auto', 'loop' or 'static'"):
        Config(model=tiny_model, hf_decode="fast")


def test_the_step_traces_as_one_graph_without_a_host_sync(trainer, monkeypatch):
    """What a CUDA graph needs of the step, checked on CPU: dynamo traces it whole, with every knob on (fullgraph:
    Python branching on a tensor's value, e.g. `if live.any():` in the step, breaks the graph and fails here --
    injected once by hand; a value read back and left unused is not caught), and the traced step decodes the
    eager step's tokens."""
    def compiled(step, report):
        report["graphs"] = "traced"
        return torch.compile(step, fullgraph=True, backend="eager")
    monkeypatch.setattr(F, "capture_step", compiled)
    ids = torch.tensor([list(_prompts(trainer)[0].token_ids)])
    model = trainer.model.eval()
    for params in (SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3),
                   SamplingParams(temperature=0.7, max_tokens=6, top_k=8, top_p=0.9, min_p=0.1, seed=0)):
        report, outs = {}, []
        for graphs in (True, False):
            torch.manual_seed(0)
            outs.append(F.static_decode(model, ids, torch.ones_like(ids), params, eos=-1, graphs=graphs,
                                        report=report if graphs else None))
        assert report["graphs"] == "traced" and outs[0][0] == outs[1][0]
        assert outs[0][1][0] == pytest.approx(outs[1][1][0], abs=1e-5)

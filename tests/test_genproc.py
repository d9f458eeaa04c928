"""The transformers generator in its own process (the CPU pipeline's generation side): the pushed adapter is what
it serves, versions are exact, and a dead or closed process never leaves a caller waiting."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from minirl.core.adapter import adapter_params
from minirl.generation.hf import HFGenerator
from minirl.generation.hf_process import GeneratorProcessError, ProcGenerator
from minirl.sync.local import ShmSync
from minirl.training.trainer import Trainer
from minirl.types import SamplingParams


@pytest.fixture
def trainer(toy_cfg):
    return Trainer(toy_cfg)


def _prompts(trainer, n=2):
    from minirl.data.rows import to_prompts
    return to_prompts([{"prompt": f"What is {i} + 1 ?"} for i in range(n)], trainer.tokenizer)


def _bump(trainer, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    trainer.version += 1


def test_pushed_adapter_is_served_with_exact_versions(trainer, toy_cfg):
    gen = ProcGenerator(toy_cfg, adapter_params(trainer.model))
    sync = ShmSync()
    try:
        prompts = _prompts(trainer)
        params = SamplingParams(temperature=1.0, max_tokens=6, seed=5)
        local = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version)
        before = gen.generate(prompts, 3, params)
        for seed in (1, 2):
            _bump(trainer, seed)
            st = sync.push(trainer, gen)
            assert st.version == gen.version == trainer.version and st.bytes > 0 and st.transport == "shm"
            got = gen.generate(prompts, 3, params)
            want = local.generate(prompts, 3, params)  # the trainer's own model, same seed
            assert got == want  # tokens, logprobs, versions, text: bit for bit
            assert all(v == trainer.version for g in got for c in g.completions for v in c.versions)
            probe = (list(prompts[0].token_ids), list(got[0].completions[0].token_ids) or [1])
            assert gen.score(*probe, 1.0) == pytest.approx(trainer.logprobs(*probe, 1.0), abs=1e-5)
        assert got != before
    finally:
        gen.close()
        sync.close()
    assert gen.proc.poll() is not None


def test_merged_generation_samples_the_trainers_policy_and_leaves_its_weights_untouched(trainer, monkeypatch):
    from contextlib import contextmanager

    import minirl.generation.hf as H
    from minirl.generation.hf import _mergeable_lora_layers
    merges, real, caches = [], H.merged_lora, []

    @contextmanager
    def counting(model, cache, version=0):  # how many layers each call ran merged
        with real(model, cache, version):
            merges.append(len(cache.get("bufs", {})))
            caches.append(cache)
            yield
    monkeypatch.setattr(H, "merged_lora", counting)
    _bump(trainer, 3)
    assert _mergeable_lora_layers(trainer.model) is not None
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    prompts = _prompts(trainer, 3)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=7)
    merged = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version)
    plain = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version, merge=False)
    got = merged.generate(prompts, 2, params)
    assert merges == [len(_mergeable_lora_layers(trainer.model))]  # it did run merged
    assert caches and not caches[-1]  # on the trainer's model the merged copy is not kept beside training
    for g in got:
        for c in g.completions:  # the behaviour logprobs are the trainer's (unmerged) policy's
            assert c.logprobs == pytest.approx(trainer.logprobs(list(g.prompt.token_ids), list(c.token_ids), 1.0),
                                               abs=1e-4)
    assert [c.token_ids for g in got for c in g.completions] == \
        [c.token_ids for g in plain.generate(prompts, 2, params) for c in g.completions]
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())  # base and LoRA untouched
    # new weights (with or without a version bump): the cached merge is recomputed, never reused stale
    for seed, bump_version in ((4, True), (5, False)):
        _bump(trainer, seed)
        trainer.version -= 0 if bump_version else 1
        again = merged.generate(prompts, 2, params)
        c = again[0].completions[0]
        assert c.logprobs == pytest.approx(
            trainer.logprobs(list(again[0].prompt.token_ids), list(c.token_ids), 1.0), abs=1e-4)


def test_an_interrupt_to_the_process_group_leaves_the_generator_serving(trainer, toy_cfg):
    """A notebook's "interrupt kernel" sends SIGINT to the kernel's process group, the generator process included;
    it once died of it (exit -6) and the background run with it."""
    control = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdout.write('up\\n'); "
                                "sys.stdout.flush(); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert control.stdout.readline() == "up\n"
    control.send_signal(signal.SIGINT)
    assert control.wait(timeout=60) != 0  # the control: a process with Python's own handler dies of it
    gen = ProcGenerator(toy_cfg, adapter_params(trainer.model))
    try:
        params = SamplingParams(temperature=1.0, max_tokens=4, seed=1)
        gen.generate(_prompts(trainer, 1), 2, params)  # serving
        os.kill(gen.proc.pid, signal.SIGINT)
        got = gen.generate(_prompts(trainer, 1), 2, params)
        assert gen.proc.poll() is None and len(got[0].completions) == 2
    finally:
        gen.close()


def test_a_dead_generator_process_raises_a_clear_error(trainer, toy_cfg):
    gen = ProcGenerator(toy_cfg, adapter_params(trainer.model))
    try:
        os.kill(gen.proc.pid, signal.SIGKILL)
        t0 = time.perf_counter()
        with pytest.raises(GeneratorProcessError, match="generator process"):
            gen.generate(_prompts(trainer), 2, SamplingParams(max_tokens=4))
        with pytest.raises(GeneratorProcessError):
            _bump(trainer, 3)
            ShmSync().push(trainer, gen)
        assert time.perf_counter() - t0 < 30
    finally:
        gen.close()
    assert gen.proc.poll() is not None


def test_errors_inside_the_process_reach_the_caller_with_their_traceback(trainer, toy_cfg):
    gen = ProcGenerator(toy_cfg, adapter_params(trainer.model))
    try:
        with pytest.raises(GeneratorProcessError, match="Traceback"):
            gen.score([10**9], [1], 1.0)  # a token id outside the vocabulary
        out = gen.generate(_prompts(trainer), 2, SamplingParams(max_tokens=4))  # still serving
        assert len(out) == 2
    finally:
        gen.close()


def test_the_served_version_is_answered_while_a_long_generation_runs(trainer, toy_cfg):
    """The sync check asks the process which version its next request runs on right after a push; with K >= 1 a
    generation may be running then (minutes on a long tail). The answer comes from the staged adapter, without
    waiting behind it (it used to queue behind the generation and time out after 30 s)."""
    import threading
    gen = ProcGenerator(toy_cfg, adapter_params(trainer.model))
    sync = ShmSync()
    try:
        long = threading.Thread(target=gen.generate, args=(_prompts(trainer, 8), 16,
                                                           SamplingParams(max_tokens=400, seed=0)))
        long.start()
        _bump(trainer, 9)
        sync.push(trainer, gen)
        assert gen.served_version() == trainer.version
        assert long.is_alive()  # answered before the generation ended
        long.join()
        probe = (list(_prompts(trainer)[0].token_ids), [5, 6, 7])  # the next request runs on the pushed adapter
        assert gen.score(*probe, 1.0) == pytest.approx(trainer.logprobs(*probe, 1.0), abs=1e-5)
    finally:
        gen.close()
        sync.close()


def test_a_script_with_no_main_guard_runs_with_the_generator_process(tiny_model, tmp_path):
    """`python train.py` whose run starts at the top level, no `if __name__ == "__main__":` (as `auto` gives a CPU of
    2+ cores K = 1): the generator process is a fresh interpreter that never runs the script, so the run trains.
    Under multiprocessing's spawn the child re-ran the script and the run stopped (MAIN_GUARD)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import minirl\n"
        f"cfg = minirl.Config(model={tiny_model!r}, backend='hf', data='unused', rewards=['arithmetic_correct'], "
        "steps=2, prompts_per_step=2, group_size=2, max_tokens=4, eval_size=0, max_async_steps=1, reward_workers=0, "
        f"checkpoint_every=0, lora_rank=8, out_dir={str(tmp_path / 'run')!r})\n"
        "run = minirl.Run(cfg, data=[{'prompt': f'What is {a} + 1 ?', 'answer': a + 1} for a in range(8)])\n"
        "run.run()\n"
        "print('trained', run.summary['steps'], run.summary['max_async_steps'])\n")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "trained 2 1" in out.stdout and "__main__" not in out.stdout + out.stderr

"""`gen_workers`: transformers generation split across processes (`generators/hf_pool.py`): every worker serves
the adapter pushed, groups come back in prompt order, a worker left on an old adapter fails the sync check by
name, and a run with two workers trains."""
import pytest
import torch

from conftest import TOY_ROWS
from minirl.adapter import adapter_params
from minirl.config import ConfigError
from minirl.generators import split_devices
from minirl.generators.hf import HFGenerator
from minirl.generators.hf_pool import ProcPool, shares
from minirl.sync import SyncVerificationError, make_probe, verify
from minirl.sync.local import ShmSync
from minirl.trainer import Trainer
from minirl.types import SamplingParams


def _bump(trainer, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    trainer.version += 1


def _places(n=2):
    return [[int(c) for c in p.split(",")] for p in split_devices(None, n, False)]


def test_shares_are_contiguous_and_even():
    assert shares(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert shares([0, 1], 3) == [[0], [1]]  # never an empty share
    assert [x for s in shares(list(range(9)), 4) for x in s] == list(range(9))


@pytest.fixture
def trainer(toy_cfg):
    return Trainer(toy_cfg)


def test_every_worker_serves_the_pushed_adapter_in_prompt_order(trainer, toy_cfg):
    from minirl.data import to_prompts
    pool = ProcPool(toy_cfg, adapter_params(trainer.model), _places())
    sync = ShmSync()
    try:
        prompts = to_prompts([{"prompt": f"What is {i} + 1 ?"} for i in range(5)], trainer.tokenizer)
        _bump(trainer, 1)
        assert sync.push(trainer, pool).bytes == pool.nbytes > 0
        assert pool.served_version() == pool.version == trainer.version
        params = SamplingParams(temperature=1.0, max_tokens=6, seed=5)
        got = pool.generate(prompts, 2, params)
        assert [g.prompt.index for g in got] == [p.index for p in prompts]  # worker 0 had 3, worker 1 had 2
        local = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version)
        threads = torch.get_num_threads()
        torch.set_num_threads(len(pool.workers[0].cores))  # the worker's thread count: the same float sums
        try:
            assert got[:3] == local.generate(prompts[:3], 2, params)  # worker 0: the step's seed, bit for bit
        finally:
            torch.set_num_threads(threads)
        for g in got:  # both workers: the trainer's policy, the version pushed
            for c in g.completions:
                assert c.versions == (trainer.version,) * len(c.token_ids)
                if c.token_ids:
                    want = trainer.logprobs(g.prompt.token_ids, c.token_ids, 1.0)
                    assert list(c.logprobs) == pytest.approx(want, abs=1e-5)
        other = pool.generate(prompts, 2, params)[3:]
        assert other == got[3:]  # worker 1's seed is derived from the step's: repeatable
    finally:
        pool.close()
    assert not any(w.proc.is_alive() for w in pool.workers)


def test_a_worker_left_on_an_old_adapter_fails_the_check_by_name(trainer, toy_cfg):
    pool = ProcPool(toy_cfg, adapter_params(trainer.model), _places())
    sync = ShmSync()
    try:
        tok = trainer.tokenizer
        probe = make_probe(trainer.model, tok("What is 2 + 3 ?")["input_ids"], 8, 0, tok.all_special_ids, len(tok))
        first = {w.url: verify(w, probe, trainer.logprobs(*probe, 1.0), 0) for w in pool.replicas}
        _bump(trainer, 1)
        sync.push(trainer, pool)
        want = trainer.logprobs(*probe, 1.0)
        checks = {w.url: verify(w, probe, want, trainer.version, first[w.url]) for w in pool.replicas}
        assert all(c.verified and c.new_diff < 1e-5 for c in checks.values())
        stale = pool.workers[1]
        stale.packer.pack = lambda: None  # the fault: worker 1's buffer keeps the old adapter, its version moves on
        _bump(trainer, 2)
        sync.push(trainer, pool)
        want = trainer.logprobs(*probe, 1.0)
        assert pool.served_version() == trainer.version  # the version alone cannot tell
        verify(pool.workers[0], probe, want, trainer.version, checks[pool.workers[0].url])
        with pytest.raises(SyncVerificationError, match="stale"):
            verify(stale, probe, want, trainer.version, checks[stale.url])
        assert stale.url.startswith("generator process 1")
    finally:
        pool.close()


def test_a_run_with_two_generator_processes_trains(toy_cfg):
    from minirl import Run
    run = Run(toy_cfg.replace(gen_workers=2, steps=2, eval_every=0), data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:48])
    s = run.run()
    assert "2 transformers generator processes" in run._sync_why and run.sync.transport == "shm"
    assert [h["step"] for h in run.history] == [0, 1] and all(h["staleness/max"] == 0 for h in run.history)
    assert all(len(h["prompt_ids"]) == toy_cfg.prompts_per_step for h in run.history)
    assert s["steps"] == 2 and set(run._verified) == {w.url for w in run.generator.workers}  # each one checked


@pytest.mark.parametrize("kw,match", [
    (dict(gen_workers=0), "gen_workers=0"),
    (dict(gen_workers="two"), "gen_workers"),
    (dict(gen_workers=2, backend="vllm"), "leave it at 1"),
])
def test_bad_gen_workers_is_one_line(toy_cfg, kw, match):
    with pytest.raises(ConfigError, match=match):
        toy_cfg.replace(**kw)


def test_an_env_run_refuses_several_generator_processes(toy_cfg):
    from minirl import Run
    with pytest.raises(ConfigError, match="set gen_workers=1"):
        Run(toy_cfg.replace(gen_workers=2), env="retry")

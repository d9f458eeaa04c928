"""Models of published shapes without a hub (issue 36 item 5): the shapes' parameter counts are the published ones,
and a tiny Qwen2 built the same way runs through both backends."""
import importlib.util

import pytest

from minirl.training.models import synthetic
from minirl.training.shapes.synthetic import NAMES, shape_config

ROWS = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(6) for b in range(6)]
# The published parameter counts (the models' cards / safetensors metadata).
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512,
             "llama-3.2-1b": 1_235_814_400}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shape_has_the_published_parameter_count(name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape_config(name)))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


def test_unknown_shape_is_one_line():
    with pytest.raises(ValueError, match="unknown model shape 'qwen9'.*qwen2.5-1.5b"):
        shape_config("qwen9")
    assert "qwen2-tiny" in NAMES


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory):
    return str(synthetic("qwen2-tiny", tmp_path_factory.mktemp("synthetic") / "qwen2-tiny"))


def test_synthetic_folder_is_a_normal_hf_folder(qwen_tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen_tiny)
    model = AutoModelForCausalLM.from_pretrained(qwen_tiny)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.eos_token_id == tok.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed")])])
def test_tiny_qwen2_runs_two_steps(qwen_tiny, toy_cfg, backend):
    import minirl
    cfg = toy_cfg.replace(model=qwen_tiny, backend=backend, steps=2, eval_size=0, eval_fraction=0.0,
                          checkpoint_every=0, kv_cache_gb=1, max_prompt_tokens=64)
    run = minirl.Run(cfg, data=ROWS)
    s = run.run()
    assert s["steps"] == 2 and s["backend"] == backend
    assert run.trainer.adapter_is_finite() and len(run.history) == 2

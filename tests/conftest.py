import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer, built in code (no download)."""
    from minirl.models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def embedded_model():
    from minirl.models import resolve_model
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tok(embedded_model):
    """The embedded model's tokenizer."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedded_model)


@pytest.fixture(scope="module")
def prompts(tok, request):
    """The test module's QUESTIONS as chat prompts of the embedded model."""
    from minirl.types import Prompt
    out = []
    for i, q in enumerate(request.module.QUESTIONS):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        out.append(Prompt(i, tuple(ids), q))
    return out


@pytest.fixture(scope="module")
def base(embedded_model):
    """The embedded model in float32 (transformers), for reference logprobs."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(embedded_model, dtype=torch.float32).eval()


def yes_reward(prompt, completion, **_):
    """Toy task for tiny models: did the completion say 'yes'?"""
    return 1.0 if "yes" in completion.split() else 0.0


@pytest.fixture
def toy_cfg(tiny_model, tmp_path):
    from minirl import Config
    return Config(model=tiny_model, backend="hf", data="unused", rewards=["yes_reward"], steps=2,
                  prompts_per_step=4, group_size=4, max_tokens=6, lr=1e-2, eval_size=8, out_dir=str(tmp_path / "run"),
                  lora_rank=8, lora_alpha=16, seed=0)


TOY_ROWS = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(8) for b in range(8)]

from minirl import reward as _reg  # noqa: E402
_reg(yes_reward)

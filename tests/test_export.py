"""Export (issue 37 item 7): a trained run's adapter merged into its base model, saved with its tokenizer, scores
prompts as base + adapter does (fp32, within 1e-4) and decodes the same greedy tokens; a QLoRA run's merge says
in one line that it used the full-precision base; the CLI and `Run.export` write the same folder."""
import json
from pathlib import Path

import pytest
import torch
from conftest import TOY_ROWS

from minirl import Config, Run
from minirl.cli import main
from minirl.run.export import export_merged

PROMPTS = ["What is 1 + 2 ?", "What is 7 + 5 ? Answer", "yes no the a b"]


def _logprobs(model, tok, text):
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0], ids


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """A real run of the tiny model (2 steps at lr 1e-2: the adapter's B matrices move away from 0)."""
    out = tmp_path_factory.mktemp("export") / "run"
    cfg = Config(model=tiny_model, backend="hf", rewards=["yes_reward"], steps=2, prompts_per_step=4, group_size=4,
                 max_tokens=6, lr=1e-2, eval_size=0, out_dir=str(out), lora_rank=8, lora_alpha=16, seed=0,
                 dtype="float32", reward_workers=0)
    run = Run(cfg, data=TOY_ROWS)
    run.run()
    return run, out


def test_merged_model_scores_and_decodes_as_base_plus_adapter(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run, out = trained
    info = run.export(str(tmp_path / "merged"))
    assert info["merged"] == str(tmp_path / "merged") and info["dtype"] == "float32" and "note" not in info
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tok.chat_template == AutoTokenizer.from_pretrained(run.cfg.model).chat_template
    assert not any("lora" in k for k in merged.state_dict())  # a plain model, no peft layers
    base = AutoModelForCausalLM.from_pretrained(run.cfg.model, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(run.cfg.model, dtype=torch.float32).eval()
    lora = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    moved = 0.0
    for text in PROMPTS:
        want, ids = _logprobs(lora, tok, text)
        got, _ = _logprobs(merged, tok, text)
        assert (got - want).abs().max() < 1e-4, text
        moved = max(moved, (want - _logprobs(plain, tok, text)[0]).abs().max().item())
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            assert merged.generate(ids, **kw).tolist() == lora.generate(input_ids=ids, **kw).tolist(), text
    assert moved > 1e-3  # the adapter changed the model: the comparison above could fail


def test_cli_export_and_its_one_line_errors(trained, tmp_path, capsys):
    _, out = trained
    assert main(["export", str(out), "--merged", str(tmp_path / "m")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["merged"] == str(tmp_path / "m") and (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "m" / "tokenizer.json").exists()
    assert main(["export", str(out), "--merged", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err.strip().endswith("already exists and is not empty; give a new folder for the "
                                                    "merged model")
    assert main(["export", str(tmp_path), "--merged", str(tmp_path / "n")]) == 2
    assert "is not a minirl run folder (no config.yaml)" in capsys.readouterr().err
    assert not (tmp_path / "n").exists()


def test_the_merged_folder_gets_the_usual_permissions(trained, tmp_path):
    """As a run's adapter: the folder and every file readable as a new one of this user's is (the umask's), not
    private (mkdtemp's 0700 folder, safetensors' 0600 weights), so a server run by another user can load it."""
    _, out = trained
    merged = Path(export_merged(out, tmp_path / "m")["merged"])
    (tmp_path / "new_dir").mkdir()
    (tmp_path / "new_file").touch()
    folder, file = (tmp_path / "new_dir").stat().st_mode & 0o777, (tmp_path / "new_file").stat().st_mode & 0o777
    assert merged.stat().st_mode & 0o777 == folder
    assert {f.name: f.stat().st_mode & 0o777 for f in merged.iterdir()} == {f.name: file for f in merged.iterdir()}


def test_a_qlora_run_merges_into_the_full_precision_base_and_says_so(trained, tmp_path, capsys):
    """The merge of a run that trained on the 4-bit base (its config says load_in_4bit) loads the base unquantised."""
    _, out = trained
    q = tmp_path / "qrun"
    (q / "adapter").mkdir(parents=True)
    for f in (out / "adapter").iterdir():
        (q / "adapter" / f.name).write_bytes(f.read_bytes())
    Config.from_yaml(out / "config.yaml").replace(load_in_4bit=True).to_yaml(q / "config.yaml")
    from minirl.run.export import export_merged
    info = export_merged(q, tmp_path / "m")
    said = [ln for ln in capsys.readouterr().out.splitlines() if "QLoRA" in ln]
    assert said == [info["note"]] and "merged into the full-precision base" in said[0]
    assert info["dtype"] == "float32"
    cfg = json.loads((Path(tmp_path / "m") / "config.json").read_text())
    assert "quantization_config" not in cfg

"""The embedded model through `minirl export --gguf`: a run folder with a fresh adapter (B = 0, so the merged model
is the base), exported as GGUF f16 and q8_0, read back by transformers; greedy answers to a few chat prompts
compared with the safetensors model (docs/runs.md, "Exporting a run").

    python scripts/gguf_check.py [--out /tmp/gguf-check] [--tokens 40]
Prints each answer and whether each GGUF type gives the same tokens, then the counts.
"""
import argparse
import shutil
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from minirl import Config
from minirl.run.gguf_export import export_gguf
from minirl.training.models import resolve_model

QUESTIONS = ["What is 17 + 25?", "What is 9 * 8? Answer with a number.", "Name the capital of France.",
             "Write one sentence about the sea.", "What is 123 - 45?", "List three colors."]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gguf-check")
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    run = root / "run"
    run.mkdir(parents=True)
    cfg = Config(model="smollm2-135m-instruct", out_dir=str(run))
    cfg.to_yaml(run / "config.yaml")
    base_dir = resolve_model(cfg.model)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=cfg.target_modules,
                      task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), lora).save_pretrained(run / "adapter")
    kinds = ("f16", "q8_0")
    for kind in kinds:
        info = export_gguf(run, root / f"model-{kind}.gguf", kind)
        print(kind, f"{info['bytes'] / 1e6:.1f} MB", info["tensors"], flush=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(base_dir)
    models = {k: AutoModelForCausalLM.from_pretrained(root, gguf_file=f"model-{k}.gguf", dtype=torch.float32).eval()
              for k in kinds}
    gguf_tok = AutoTokenizer.from_pretrained(root, gguf_file="model-f16.gguf")
    same = dict.fromkeys(kinds, 0)
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt")["input_ids"]
        assert gguf_tok(text, return_tensors="pt")["input_ids"].tolist() == ids.tolist(), "the tokenizers differ"
        kw = dict(max_new_tokens=args.tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            want = base.generate(ids, **kw)[0, ids.shape[1]:].tolist()
            print(f"{q!r}: {tok.decode(want, skip_special_tokens=True)[:80]!r}")
            for k, m in models.items():
                got = m.generate(ids, **kw)[0, ids.shape[1]:].tolist()
                same[k] += got == want
                said = "same tokens" if got == want else repr(tok.decode(got, skip_special_tokens=True)[:80])
                print(f"    {k}: {said}")
    print("same greedy answers:", {k: f"{v}/{len(QUESTIONS)}" for k, v in same.items()})


if __name__ == "__main__":
    main()

"""Issue 55's GGUF check on a trained run: does the GGUF file answer the run's held-out problems as the merged model
does? (BENCHMARKS.md, "GGUF export".)

    python scripts/gguf_heldout.py RUN [--out DIR] [--types f16,q8_0]

RUN is a finished run folder (e.g. `minirl demo --out RUN`). Writes DIR/merged (`minirl export RUN --merged`) and
DIR/model-<type>.gguf (`minirl export RUN --gguf`), reads each GGUF back with transformers (`gguf_file=`, its own
tokenizer from the file) into DIR/gguf-<type>, then runs `minirl eval`'s greedy evaluation on the run's own held-out
problems (its config: task, seed, eval split) with the run's adapter, the merged model and each GGUF model. Prints
and writes DIR/gguf_heldout.json: each one's accuracy with its standard error, and per GGUF type how many problems
it scored as the merged model did.
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minirl import Run
from minirl.run.evaluation import eval_options, evaluate
from minirl.run.export import check_run, export_merged
from minirl.run.gguf_export import export_gguf


def held_out(cfg, adapter: Path | None = None) -> dict:
    """`minirl eval`'s greedy evaluation (the same steps as `minirl.cli._eval`), with each problem's score."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    run = Run(cfg.replace(steps=0))
    run.load()
    try:
        if adapter:
            set_peft_model_state_dict(run.trainer.model, load_file(str(adapter / "adapter_model.safetensors")))
            run.trainer.version = 1
            run.sync.push(run.trainer, run.generator)
        res = evaluate(run.rollouts, run.eval_prompts, run.scorer, cfg.max_tokens, **eval_options(cfg, 0))
        return {"eval_size": len(run.eval_prompts), **res.fields(), "problems": list(res.problems),
                "backend": run.backend}
    finally:
        run.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--out", default="/tmp/gguf-heldout")
    ap.add_argument("--types", default="f16,q8_0")
    args = ap.parse_args()
    run, root = Path(args.run), Path(args.out)
    cfg = check_run(run)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    export_merged(run, root / "merged")
    folders = {"merged": root / "merged"}
    for kind in args.types.split(","):
        info = export_gguf(run, root / f"model-{kind}.gguf", kind)
        print(kind, f"{info['bytes'] / 1e6:.1f} MB", flush=True)
        model = AutoModelForCausalLM.from_pretrained(root, gguf_file=f"model-{kind}.gguf", dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(root, gguf_file=f"model-{kind}.gguf")
        assert tok.chat_template, f"the {kind} GGUF carries no chat template"
        # transformers will not save a model it read from GGUF: the same weights into a plain model of its config
        config = model.config
        del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(root / f"gguf-{kind}")
        tok.save_pretrained(root / f"gguf-{kind}")
        folders[f"gguf-{kind}"] = root / f"gguf-{kind}"
    cfg = cfg.replace(out_dir=str(root / "eval-run"))
    results = {"adapter": held_out(cfg, run / "adapter")}
    for name, folder in folders.items():
        results[name] = held_out(cfg.replace(model=str(folder)))
        print(name, results[name]["accuracy"], flush=True)
    solved = {name: [p["scores"]["accuracy"] for p in sorted(r["problems"], key=lambda p: p["index"])]
              for name, r in results.items()}
    out = {"run": str(run), "model": cfg.model, "eval_size": results["merged"]["eval_size"],
           "accuracy": {name: [r["accuracy"], r["accuracy_se"]] for name, r in results.items()},
           "same_score_as_merged": {name: sum(a == b for a, b in zip(s, solved["merged"]))
                                    for name, s in solved.items() if name != "merged"}}
    print(json.dumps(out, indent=2))
    (root / "gguf_heldout.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""TRL's GRPOTrainer on a task minirl also runs, for `minirl bench trl` (minirl/benchmarks/trl.py).

Runs in a virtual environment of its own that has TRL (`python -m minirl.benchmarks.trl --setup` makes it):
TRL is a benchmark dependency, never a runtime one, so this file imports neither minirl nor anything TRL's
environment lacks. Input: one JSON spec (argv[1]) written by the benchmark — the model folder, the training rows
in the order to use them, the settings, the seed, the steps after which to save the adapter. Output, in the
spec's `out` folder: `adapters/step-N` (peft format, evaluated afterwards by the benchmark with minirl's own
evaluator, the same one for both toolkits), and `trl.json`: seconds of each optimizer step, peak resident memory.
"""
from __future__ import annotations

import json
import re
import resource
import sys
import time
from pathlib import Path


def last_integer(text: str) -> int | None:
    """The last integer in `text` (minirl.rewards.builtin.last_integer, restated: this file imports no minirl)."""
    m = re.findall(r"-?\d+", text.replace(",", ""))
    return int(m[-1]) if m else None


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s, out = spec["settings"], Path(spec["out"])
    torch.manual_seed(spec["seed"])
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": int(r["answer"])} for r in spec["rows"]]

    def correct(completions, answer, **_):
        return [float(last_integer(c[-1]["content"]) == a) for c, a in zip(completions, answer)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            times.append(time.perf_counter() - self.t0)  # generation, scoring and the optimizer step
            if state.global_step in spec["save_steps"]:
                model.save_pretrained(out / "adapters" / f"step-{state.global_step}")

    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    batch = s["prompts_per_step"] * s["group_size"]
    args = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=spec["steps"], learning_rate=s["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=s["max_grad_norm"], per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=s["group_size"], num_iterations=1,
        max_completion_length=s["max_tokens"], temperature=s["temperature"], top_p=1.0, beta=0.0,
        loss_type=s.get("loss_type", "dapo"), scale_rewards=s.get("scale_rewards", "group"),
        shuffle_dataset=False, seed=spec["seed"], use_cpu=True, bf16=False, fp16=False, logging_steps=1,
        save_strategy="no", report_to=[], dataloader_num_workers=0, remove_unused_columns=False)
    lora = LoraConfig(r=s["lora_rank"], lora_alpha=s["lora_alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[correct], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, peft_config=lora, callbacks=[Clock()])
    if 0 in spec["save_steps"]:
        trainer.model.save_pretrained(out / "adapters" / "step-0")
    t0 = time.perf_counter()
    trainer.train()
    (out / "trl.json").write_text(json.dumps({
        "step_s": times, "train_s": time.perf_counter() - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "log": trainer.state.log_history}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])

"""`minirl bench trl`: minirl against TRL's GRPOTrainer on the same task, the same rows in the same order, the
same settings, seeds interleaved (TRL seed s, minirl seed s, TRL seed s + 1, ...).

TRL is a benchmark dependency, never a runtime one: it runs from a virtual environment of its own (`.venv-trl`,
made by `setup_trl_venv` with the same torch, transformers and peft versions as minirl's) through
`scripts/trl_grpo.py`. Both toolkits save the adapter at the same steps; every adapter is then scored by one
evaluator (minirl's greedy held-out accuracy on the same problems), so the figures differ only by training.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

TEMPLATE = "What is {a} + {b}? Answer with just the number."

# The settings both toolkits run (issue 43): the embedded SmolLM2-135M-Instruct in float32, 8 prompts x 8
# completions per step, 32 new tokens at temperature 1, LoRA r 16 / alpha 32 on every linear layer, AdamW at a
# constant lr, gradient clip 1.0, no KL, one optimizer step per batch.
SETTINGS: dict[str, Any] = dict(prompts_per_step=8, group_size=8, max_tokens=32, temperature=1.0, lr=2e-4,
                                lora_rank=16, lora_alpha=32, max_grad_norm=1.0)
TRL_VERSIONS = ("trl==1.16.0",)


def task_rows(seed: int, eval_size: int = 256, hi: int = 49) -> tuple[list[dict], list[dict]]:
    """(train rows in the order both toolkits take them for `seed`, held-out rows). Addition of a, b in 0..hi; the
    held-out problems are the same for every seed, and no unordered pair of theirs is trained on."""
    pairs = [(a, b) for a in range(hi + 1) for b in range(hi + 1)]
    random.Random(10_000).shuffle(pairs)
    held, seen = [], set()
    for a, b in pairs:
        if len(held) == eval_size:
            break
        if (min(a, b), max(a, b)) not in seen:
            seen.add((min(a, b), max(a, b)))
            held.append((a, b))
    train = [(a, b) for a, b in pairs if (min(a, b), max(a, b)) not in seen]
    random.Random(seed).shuffle(train)

    def row(a: int, b: int) -> dict:
        return {"prompt": TEMPLATE.format(a=a, b=b), "answer": a + b}
    return [row(a, b) for a, b in train], [row(a, b) for a, b in held]


def trl_spec(model: str, seed: int, steps: int, save_steps: list[int], out: Path, **settings: Any) -> dict:
    """The JSON spec `scripts/trl_grpo.py` runs: the rows TRL takes, in order, for `steps` steps."""
    s = {**SETTINGS, **settings}
    train, _ = task_rows(seed)
    return {"model": model, "rows": train[:steps * s["prompts_per_step"]], "seed": seed, "steps": steps,
            "save_steps": save_steps, "out": str(out), "settings": s}


def run_trl(python: str, spec: dict) -> dict:
    """Run TRL's side in its own environment; returns its trl.json (seconds per step, peak memory)."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    script = Path(__file__).resolve().parents[2] / "scripts" / "trl_grpo.py"
    with open(out / "trl.log", "w") as log:
        subprocess.run([python, str(script), str(out / "spec.json")], stdout=log, stderr=subprocess.STDOUT,
                       check=True)
    return json.loads((out / "trl.json").read_text())


if __name__ == "__main__":  # python -m minirl.benchmarks.trl trl OUT SEED: TRL's side alone (for a background run)
    from ..models import resolve_model
    what, out, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    steps = 10
    spec = trl_spec(str(resolve_model("smollm2-135m-instruct")), seed, steps, [0, 2, 4, 6, 8, 10],
                    out / f"trl_s{seed}")
    print(json.dumps({k: v for k, v in run_trl(str(Path(".venv-trl/bin/python").absolute()), spec).items()
                      if k != "log"}))

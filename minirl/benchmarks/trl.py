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
from importlib import metadata
from pathlib import Path
from typing import Any

from minirl.data.rows import arithmetic_splits
from minirl.training.models import resolve_model

TEMPLATE = "What is {a} + {b}? Answer with just the number."

# The settings both toolkits run (issue 43): the embedded SmolLM2-135M-Instruct in float32, 8 prompts x 8
# completions per step, 32 new tokens at temperature 1, LoRA r 16 / alpha 32 on every linear layer, AdamW at a
# constant lr, gradient clip 1.0, no KL, one optimizer step per batch.
SETTINGS: dict[str, Any] = dict(prompts_per_step=8, group_size=8, max_tokens=32, temperature=1.0, lr=2e-4,
                                lora_rank=16, lora_alpha=32, max_grad_norm=1.0)
# the demo's task (`minirl demo`: a, b in 0..30) runs at the demo's own length and lr
DEMO_SETTINGS: dict[str, Any] = dict(max_tokens=24, lr=5e-4)
TASKS = ("addition", "demo")
TRL_VERSIONS = ("trl==1.16.0",)
# installed in TRL's environment at the versions minirl's own environment has, so both run the same kernels
SHARED_PACKAGES = ("torch", "transformers", "peft", "accelerate", "datasets", "safetensors")
ROOT = Path(__file__).resolve().parents[2]
TRL_VENV = ROOT / ".venv-trl"


def _public(version: str) -> str:
    return version.split("+")[0]  # torch 2.13.0+cpu -> 2.13.0 (pip then takes the build the wheel folder has)


def trl_requirements() -> list[str]:
    """TRL pinned, and the shared packages at the versions installed here."""
    return [*TRL_VERSIONS, *(f"{p}=={_public(metadata.version(p))}" for p in SHARED_PACKAGES)]


def _venv_versions(python: Path) -> dict[str, str]:
    code = ("import json; from importlib import metadata as m; "
            f"print(json.dumps({{p: m.version(p) for p in {list(SHARED_PACKAGES) + ['trl']!r}}}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def setup_trl_venv(path: str | Path = TRL_VENV, nice: int = 10) -> Path:
    """TRL's own virtual environment at `path` (made once; kept when it already has the pinned versions), with
    torch, transformers, peft, accelerate, datasets and safetensors at the versions minirl's environment has.
    Returns its python. Raises, naming the package, when the environment ends up with another version."""
    path = Path(path)
    python = path / "bin" / "python"
    want = {r.split("==")[0]: r.split("==")[1] for r in trl_requirements()}

    def wrong(have: dict[str, str]) -> list[str]:
        return [f"{p} {have.get(p, 'missing')} (want {v})" for p, v in want.items() if _public(have.get(p, "")) != v]
    if python.exists() and not wrong(_venv_versions(python)):
        return python
    prefix = ["nice", "-n", str(nice)] if nice else []
    if not python.exists():
        subprocess.run([*prefix, sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([*prefix, str(python), "-m", "pip", "install", *trl_requirements()], check=True)
    bad = wrong(_venv_versions(python))
    if bad:
        raise RuntimeError(f"TRL's environment {path} has {', '.join(bad)}: delete {path} and run again")
    return python


def task_rows(seed: int, eval_size: int = 256, hi: int = 49, task: str = "addition") -> tuple[list[dict], list[dict]]:
    """(train rows in the order both toolkits take them for `seed`, held-out rows). Addition of a, b in 0..hi; the
    held-out problems are the same for every seed, and no unordered pair of theirs is trained on. task 'demo': the
    demo's own problems instead (`minirl.data.rows.arithmetic_splits`, a, b in 0..30, its seed-0 held-out split for
    every seed), the training rows in the order of a shuffle seeded by `seed`."""
    if task == "demo":
        train, held = arithmetic_splits(eval_size, 0)
        random.Random(seed).shuffle(train)
        return [{"prompt": r["prompt"], "answer": r["answer"]} for r in train], \
            [{"prompt": r["prompt"], "answer": r["answer"]} for r in held]
    if task != "addition":
        raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
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


def trl_spec(model: str, seed: int, steps: int, save_steps: list[int], out: Path, task: str = "addition",
             **settings: Any) -> dict:
    """The JSON spec `scripts/trl_grpo.py` runs (and minirl's side, `trl_bench.run_minirl`): the rows taken, in
    order, for `steps` steps."""
    s = {**SETTINGS, **(DEMO_SETTINGS if task == "demo" else {}), **settings}
    train, _ = task_rows(seed, task=task)
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


if __name__ == "__main__":  # python -m minirl.benchmarks.trl --setup: TRL's environment alone
    if sys.argv[1] == "--setup":
        print(setup_trl_venv())
        sys.exit(0)
    what, out, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    steps = 10
    spec = trl_spec(str(resolve_model("smollm2-135m-instruct")), seed, steps, [0, 2, 4, 6, 8, 10],
                    out / f"trl_s{seed}")
    print(json.dumps({k: v for k, v in run_trl(str(setup_trl_venv()), spec).items()
                      if k != "log"}))

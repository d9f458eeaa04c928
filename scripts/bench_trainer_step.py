"""Time `Trainer.step` on stored batches, padded vs shared-prefix packed, in interleaved rounds; one JSON.

    python scripts/bench_trainer_step.py [--batches tests/data/trainer_batches_demo.json] [--rounds 4]
        [--threads N] [--token-budget N] [--gradient-checkpointing] [--kl-coef X] [--out bench/trainer_step.json]

The batches are captured from a real run by scripts/capture_trainer_batches.py (the demo's: embedded model, 8
prompts x 8 completions). Both sides are trainers of this commit: 'padded' is the unchanged padded path (main's
layout), 'shared-prefix' the packed one. Speed is measured here, never asserted in a test."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from minirl.benchmarks.trainer_step import bench_trainer_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" /
                                             "trainer_batches_demo.json"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--token-budget", type=int, default=None, help="default: the captured run's")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=None, help="only the first N stored steps (default: all)")
    ap.add_argument("--model", default=None, help="default: the captured run's model")
    ap.add_argument("--out", default="bench/trainer_step.json")
    a = ap.parse_args()
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(res: dict) -> None:  # after every round: a run cut short keeps its finished rounds
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"round {res['rounds']}: {res['median_s']}", flush=True)
    res = bench_trainer_step(a.batches, rounds=a.rounds, model=a.model, token_budget=a.token_budget,
                             gradient_checkpointing=a.gradient_checkpointing, kl_coef=a.kl_coef, steps=a.steps,
                             progress=save)
    print(json.dumps({k: res[k] for k in ("median_s", "ratio_packed_over_padded", "forward_tokens", "micro_batches")}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Capture the scored groups real runs hand to `Trainer.step`, as JSON under tests/data/ (see
minirl/benchmarks/trainer_step.py for the format). The equal-math tests (tests/test_packing.py) and
`scripts/bench_trainer_step.py` load them.

    python scripts/capture_trainer_batches.py tiny   # tiny test model: a single-turn run and an episode run
    python scripts/capture_trainer_batches.py demo   # the embedded model on the demo's config (slow: ~1 min/step)

The tiny model is `minirl.training.models.build_tiny_model` (seed 0: the tests build the same weights)."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import minirl
import minirl.training.trainer as T
from minirl.benchmarks.trainer_step import dump_groups
from minirl.config import DEMO
from minirl.training.models import build_tiny_model

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
ROWS = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(8) for b in range(8)]


@minirl.reward
def says_yes(prompt, completion, **_):
    return 1.0 if "yes" in completion.split() else 0.0


class Count(minirl.Env):
    """Three replies, each answered 'no' by the env: episodes with masked environment tokens."""

    def reset(self, row):
        self.n = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, reply):
        self.n += 1
        return minirl.EnvStep(messages=[{"role": "user", "content": "no"}], reward=float("yes" in reply.split()),
                              done=self.n >= 3)


def capture(cfg, **run_kw) -> list[list[dict]]:
    steps: list[list[dict]] = []
    real = T.Trainer.step

    def spy(self, groups):
        steps.append(dump_groups(groups))
        return real(self, groups)
    T.Trainer.step = spy
    try:
        minirl.Run(cfg, **run_kw).run()
    finally:
        T.Trainer.step = real
    return steps


def save(name: str, cfg, steps) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    head = {"model": cfg.model if not Path(cfg.model).exists() else "tiny",
            "settings": {k: getattr(cfg, k) for k in ("max_tokens", "token_budget", "loss_agg", "group_size",
                                                         "prompts_per_step", "temperature", "seed")}}
    (DATA / name).write_text(json.dumps({**head, "steps": steps}, separators=(",", ":")) + "\n")
    print(f"wrote {DATA / name}: {len(steps)} steps")


def main(which: str) -> None:
    tmp = Path(tempfile.mkdtemp())
    if which == "tiny":
        model = str(build_tiny_model(tmp / "tiny"))
        cfg = minirl.Config(model=model, backend="hf", data="unused", rewards=["says_yes"], steps=2,
                            prompts_per_step=4, group_size=8, max_tokens=6, lr=1e-2, eval_size=0,
                            out_dir=str(tmp / "run"), lora_rank=8, lora_alpha=16, seed=0, reward_workers=0,
                            token_budget=64, temperature=0.9)
        save("trainer_batches_tiny.json", cfg, capture(cfg, data=ROWS[:32]))
        ecfg = cfg.replace(steps=1, max_turns=3, max_episode_tokens=48, max_tokens=5, out_dir=str(tmp / "env"))
        save("trainer_batches_tiny_episodes.json", ecfg, capture(ecfg, data=ROWS[:32], env=Count))
    elif which == "demo":
        cfg = minirl.Config(**{**DEMO, "steps": 2, "eval_size": 0, "out_dir": str(tmp / "demo"), "checkpoint_every": 0,
                               "reward_workers": 0})
        save("trainer_batches_demo.json", cfg, capture(cfg))
    else:
        raise SystemExit("usage: capture_trainer_batches.py tiny|demo")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny")

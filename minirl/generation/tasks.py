"""Built-in multi-turn tasks: an env, its train and held-out rows, and the demo's settings
(`minirl demo --task NAME`, or `env: NAME` in a config).

sums: "What is 23 + 48 + 17?" with an `add(a, b)` tool. The model calls the tool (plain-text call format: the
      embedded SmolLM2's template has no tool format), reads each result (with the numbers it has not added yet: the
      untrained model otherwise stops after one call), and answers with the total; the episode
      ends at the first reply that calls no tool, with reward 1 if its last number is the sum. A worked example
      opens every episode (few-shot), which is what a 135M model needs to call a tool at all.
retry: the demo's arithmetic with a second chance: a wrong (or missing) answer hears "That is not right. Try
      again." and the model answers once more; reward 1 for a right answer in either turn. The arithmetic demo's
      rows and held-out split (by unordered pair), two turns per episode.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from minirl.data.rows import arithmetic_splits
from minirl.generation.envs import Env, EnvStep, tool
from minirl.rewards.builtin import last_integer
from minirl.rewards.registry import import_ref

SUMS_EXAMPLE = [
    {"role": "user", "content": "What is 4 + 15 + 31? Use add to add two numbers at a time."},
    {"role": "assistant", "content": "add(4, 15)"},
    {"role": "user", "content": "add result: 19 (still to add: 31)"},
    {"role": "assistant", "content": "add(19, 31)"},
    {"role": "user", "content": "add result: 50 (all numbers added)"},
    {"role": "assistant", "content": "50"},
]


class Sums(Env):
    """Sums of three or four numbers; `add(a, b)` is the tool, the final reply is the answer."""

    @tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        for n in (a, b):  # what the model has not added yet, said with each result (its scratchpad)
            if n in self.left:
                self.left.remove(n)
        left = ", ".join(map(str, self.left))
        return f"{a + b} (still to add: {left})" if left else f"{a + b} (all numbers added)"

    def reset(self, row: dict) -> list[dict]:
        self.answer, self.left = int(row["answer"]), list(row["numbers"])
        return [*SUMS_EXAMPLE, {"role": "user", "content": row["prompt"]}]

    def step(self, reply: str) -> EnvStep:
        messages = self.call_tool(reply)
        if messages is not None:
            return EnvStep(messages=messages)
        return EnvStep(reward=float(last_integer(reply) == self.answer), done=True)


class Retry(Env):
    """An addition problem; a wrong first answer is told so and gets one more try."""

    def reset(self, row: dict) -> list[dict]:
        self.answer, self.tries = int(row["answer"]), 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, reply: str) -> EnvStep:
        self.tries += 1
        if last_integer(reply) == self.answer:
            return EnvStep(reward=1.0, done=True)
        if self.tries >= 2:
            return EnvStep(reward=0.0, done=True)
        return EnvStep(messages=[{"role": "user", "content": "That is not right. Try again."}])


def sums_rows(n: int, seed: int, exclude: set | None = None) -> list[dict]:
    """`n` distinct problems: three or four numbers in 10..99."""
    rng = random.Random(seed)
    seen, rows = set(exclude or ()), []
    while len(rows) < n:
        nums = tuple(rng.randint(10, 99) for _ in range(rng.choice((3, 4))))
        if nums in seen:
            continue
        seen.add(nums)
        rows.append({"prompt": f"What is {' + '.join(map(str, nums))}? Use add to add two numbers at a time.",
                     "answer": sum(nums), "numbers": list(nums)})
    return rows


def sums_splits(eval_size: int, seed: int = 0, train_size: int = 600) -> tuple[list[dict], list[dict]]:
    held = sums_rows(eval_size, seed=10_000 + seed)
    return sums_rows(train_size, seed, exclude={tuple(r["numbers"]) for r in held}), held


@dataclass(frozen=True)
class Task:
    """A built-in env task: the env class, `splits(eval_size, seed) -> (train rows, held-out rows)`, and the
    settings `minirl demo --task NAME` runs it with (over the arithmetic demo's)."""
    env: Callable[[], Env]
    splits: Callable[[int, int], tuple[list[dict], list[dict]]]
    demo: dict = field(default_factory=dict)


TASKS: dict[str, Task] = {
    "sums": Task(Sums, sums_splits, dict(max_tokens=16, max_turns=5, max_episode_tokens=96, out_dir="runs/demo-sums")),
    "retry": Task(Retry, arithmetic_splits, dict(max_turns=2, max_episode_tokens=128, out_dir="runs/demo-retry")),
}


def resolve_env(ref: str | Callable) -> tuple[str, Callable[[], Env]]:
    """(name, factory) for `env=`: a class or factory, a built-in task's name (`TASKS`), or 'module:Class'."""
    if callable(ref):
        return getattr(ref, "__name__", type(ref).__name__), ref
    if ref in TASKS:
        return ref, TASKS[ref].env
    if ":" in ref:
        name, obj = import_ref(ref, "env", "module:Class")
        if not callable(obj):
            raise ValueError(f"env {ref!r} is {type(obj).__name__}, not a class or factory; name a minirl.Env "
                             "subclass")
        return name, obj
    raise ValueError(f"unknown env {ref!r}: built-in tasks are {sorted(TASKS)}; or give 'module:Class'")

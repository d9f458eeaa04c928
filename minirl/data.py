"""Prompts: from a `datasets.Dataset`, a list of dicts, a JSONL path, or the built-in arithmetic task.

The prompt column (text, or a list of chat messages) goes through the tokenizer's chat template; every other
column travels with the prompt and reaches the reward functions as keyword arguments.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from .types import Prompt

ARITHMETIC_TEMPLATE = "What is {a} + {b}? Answer with just the number."


def arithmetic_rows(n: int, seed: int, lo: int = 0, hi: int = 30, exclude: set | None = None) -> list[dict]:
    """`n` distinct addition problems; `exclude` keeps the held-out split disjoint from training."""
    rng = random.Random(seed)
    seen, rows = set(exclude or ()), []
    while len(rows) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"prompt": ARITHMETIC_TEMPLATE.format(a=a, b=b), "answer": a + b, "a": a, "b": b})
    return rows


def arithmetic_splits(eval_size: int, seed: int = 0, train_size: int = 600) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows of the built-in task; no (a, b) pair appears in both."""
    held = arithmetic_rows(eval_size, seed=10_000 + seed)
    train = arithmetic_rows(train_size, seed=seed, exclude={(r["a"], r["b"]) for r in held})
    return train, held


def load_rows(source: Any) -> list[dict]:
    """Rows from a Dataset, a list of dicts, or a JSONL path, with one clear error when that fails."""
    if isinstance(source, (str, Path)):
        p = Path(source)
        if not p.exists():
            raise ValueError(f"data {str(source)!r}: no such file; give a JSONL path or the built-in 'arithmetic'")
        rows = []
        for k, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{k}: not valid JSON ({e.msg}); each line must be one JSON object") from None
    elif hasattr(source, "to_list"):  # datasets.Dataset
        rows = source.to_list()
    else:
        rows = list(source)
    if not rows:
        raise ValueError("the dataset is empty: give at least one prompt")
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError("each data row must be a dict (a JSON object) with a prompt column")
    return rows


def to_prompts(rows: Sequence[dict], tokenizer, prompt_column: str = "prompt", system_prompt: str | None = None,
               max_prompt_tokens: int | None = None, start_index: int = 0) -> list[Prompt]:
    """Apply the chat template and tokenize. Errors name the row and the fix."""
    if prompt_column not in rows[0]:
        raise ValueError(f"the data has no {prompt_column!r} column (columns: {sorted(rows[0])}); "
                         "set prompt_column to the column holding the prompts")
    limit = max_prompt_tokens or getattr(tokenizer, "model_max_length", None) or 10**9
    out = []
    for i, row in enumerate(rows):
        content = row[prompt_column]
        msgs = content if isinstance(content, list) else [{"role": "user", "content": str(content)}]
        if system_prompt:
            msgs = [{"role": "system", "content": system_prompt}] + msgs
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        else:
            text = "\n".join(m["content"] for m in msgs) + "\n"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > limit:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than the limit {limit}; "
                             "shorten it or raise max_prompt_tokens")
        cols = {k: v for k, v in row.items() if k != prompt_column}
        out.append(Prompt(start_index + i, tuple(ids), str(content if isinstance(content, str) else msgs[-1]["content"]), cols))
    return out


def prompt_stream(prompts: Sequence[Prompt], seed: int) -> Iterator[Prompt]:
    """Endless shuffled passes over the prompts (a new permutation each epoch, seeded)."""
    rng = random.Random(seed)
    epoch = list(prompts)
    while True:
        rng.shuffle(epoch)
        yield from epoch


def take(it: Iterable, n: int) -> list:
    return [x for _, x in zip(range(n), it)]

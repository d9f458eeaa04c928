"""Prompts: from a `datasets.Dataset`, a list of dicts, a file or `hf:` name (`sources.py`), or a built-in task
('arithmetic', 'code').

The prompt column (text, or a list of chat messages) goes through the tokenizer's chat template; every other
column travels with the prompt and reaches the reward functions as keyword arguments. `make_splits` decides what
is trained on and what is held out; `PromptStream` is the seeded order prompts are trained in, whose whole state is
one integer (a checkpoint's data position).
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from minirl.data.sources import read_source
from minirl.types import Prompt

ARITHMETIC_TEMPLATE = "What is {a} + {b}? Answer with just the number."


def _free_pairs(lo: int, hi: int, exclude: set) -> int:
    """How many ordered problems (a, b) in lo..hi are not excluded (by unordered pair)."""
    return sum((min(a, b), max(a, b)) not in exclude for a in range(lo, hi + 1) for b in range(lo, hi + 1))


def arithmetic_rows(n: int, seed: int, lo: int = 0, hi: int = 30, exclude: set | None = None) -> list[dict]:
    """`n` distinct addition problems (a, b); `exclude` holds unordered pairs (min, max): neither order is drawn."""
    exclude = exclude or set()
    free = _free_pairs(lo, hi, exclude)
    if n > free:
        raise ValueError(f"the built-in arithmetic task has {free} problems left to draw, not {n}: use a smaller "
                         f"eval_size, or your own data and eval_data files")
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) in seen or (min(a, b), max(a, b)) in exclude:
            continue
        seen.add((a, b))
        rows.append({"prompt": ARITHMETIC_TEMPLATE.format(a=a, b=b), "answer": a + b, "a": a, "b": b})
    return rows


def arithmetic_splits(eval_size: int, seed: int = 0, train_size: int = 600) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows of the built-in task, disjoint by unordered pair: when (a, b) is held out, neither
    (a, b) nor (b, a) (the same sum) is trained on. A large held-out set leaves fewer than `train_size` problems to
    train on (256 held out leave ~450): train takes all that are left."""
    held = arithmetic_rows(eval_size, seed=10_000 + seed)
    exclude = {(min(r["a"], r["b"]), max(r["a"], r["b"])) for r in held}
    return arithmetic_rows(min(train_size, _free_pairs(0, 30, exclude)), seed=seed, exclude=exclude), held


CODE_TEMPLATE = "Write a Python function {sig} that {what}. Reply with only the code."
# (signature, what it does with k, its body with k, test inputs): the built-in code task's families
_CODE_FAMILIES = [
    ("f(x)", "returns x plus {k}", "x + {k}", [0, 5, -3]),
    ("f(x)", "returns x times {k}", "x * {k}", [0, 4, -2]),
    ("f(x)", "returns x minus {k}", "x - {k}", [0, 10, -1]),
    ("f(x)", "returns the remainder of x divided by {k}", "x % {k}", [0, 17, 100]),
    ("f(x)", "returns True if x is greater than {k}, else False", "x > {k}", ["0", "{k}", "{k} + 1"]),
    ("f(x)", "returns x squared plus {k}", "x * x + {k}", [0, 3, -4]),
    ("f(s)", "returns the string s repeated {k} times", "s * {k}", ["'ab'", "''", "'x'"]),
    ("f(s)", "returns the first {k} characters of the string s", "s[:{k}]", ["'abcdefghijklmn'", "'hi'", "''"]),
    ("f(xs)", "returns the sum of the list xs plus {k}", "sum(xs) + {k}", ["[1, 2, 3]", "[]", "[-5]"]),
    ("f(xs)", "returns the largest number in the list xs times {k}", "max(xs) * {k}", ["[1, 9, 3]", "[-2, -7]", "[4]"]),
]


def code_rows() -> list[dict]:
    """The built-in code task: 120 small functions to write (10 families x k = 1..12), each checked by three
    asserts run in `minirl.rewards.sandbox` (reward `code_tests_pass`). Held out like any data: a carved split of
    distinct prompts (so a held-out k of a family may be trained on with another k)."""
    rows = []
    for sig, what, body, inputs in _CODE_FAMILIES:
        arg = sig[2:-1]
        for k in range(1, 13):
            fn = eval(f"lambda {arg}: {body.format(k=k)}")  # our own constant bodies: the expected values
            args = [str(x).format(k=k) for x in inputs]
            tests = [f"assert f({a}) == {fn(eval(a))!r}" for a in args]
            rows.append({"prompt": CODE_TEMPLATE.format(sig=sig, what=what.format(k=k)), "tests": tests})
    return rows


BUILTIN_DATA = {"code": code_rows}  # 'arithmetic' has its own fixed held-out split (`arithmetic_splits`)


def load_rows(source: Any, prompt_column: str | None = None, answer_column: str | None = None,
              field: str = "data") -> list[dict]:
    """Rows from a Dataset, a list of dicts, a file, a saved dataset folder or an `hf:` name (`sources.py`), with
    one clear error naming the file and line (or row) when that fails. With `prompt_column`, every row must have
    it; with `answer_column`, that column is renamed 'answer' (the keyword rewards receive)."""
    names = None  # how an error names row i: its file and line, else its position
    if isinstance(source, str) and source in BUILTIN_DATA:
        return BUILTIN_DATA[source]()
    if isinstance(source, (str, Path)):
        rows, names = read_source(source, field)
    elif hasattr(source, "to_list"):  # datasets.Dataset
        rows = source.to_list()
    else:
        rows = list(source)
    if not rows:
        raise ValueError(f"the dataset{f' {source!s}' if isinstance(source, (str, Path)) else ''} is empty: "
                         "give at least one prompt")
    for i, r in enumerate(rows):
        name = names[i] if names is not None else f"data row {i}"
        if not isinstance(r, dict):
            raise ValueError(f"{name}: each row must be a dict (a JSON object) with a prompt column, "
                             f"got {type(r).__name__}")
        if prompt_column is not None and prompt_column not in r:
            raise ValueError(f"{name}: no {prompt_column!r} column (columns: {sorted(r)}); every row needs one, "
                             "or set prompt_column to the column holding the prompts")
    if answer_column and answer_column != "answer":
        rows = [_rename_answer(r, answer_column, names[i] if names is not None else f"data row {i}")
                for i, r in enumerate(rows)]
    return rows


def _rename_answer(row: dict, column: str, name: str) -> dict:
    """`row` with `column` renamed 'answer' (a row already renamed passes unchanged)."""
    if column not in row:
        if "answer" in row:
            return row
        raise ValueError(f"{name}: no {column!r} column (columns: {sorted(row)}); set answer_column to the column "
                         "holding the answers")
    if "answer" in row:
        raise ValueError(f"{name}: has both {column!r} and 'answer'; answer_column renames {column!r} to 'answer': "
                         "drop one of the two columns, or unset answer_column")
    return {("answer" if k == column else k): v for k, v in row.items()}


@dataclass(frozen=True)
class Splits:
    """What a run trains on and evaluates on. `*_ids` are the rows' positions in their source (a step event's
    `prompt_ids` are train ids); `note` says where the held-out prompts come from."""
    train: list[dict]
    train_ids: list[int]
    eval: list[dict]
    eval_ids: list[int]
    note: str

    @property
    def fingerprint(self) -> str:
        """A hash of both splits: a resumed run checks that its data did not change."""
        h = hashlib.sha1()
        for rows in (self.train, self.eval):
            h.update(json.dumps(rows, sort_keys=True, default=str).encode())
        return h.hexdigest()[:16]


def held_out(rows: Sequence[dict], prompt_column: str, fraction: float, cap: int, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, eval ids) of `rows`: a seeded choice of distinct prompts, `fraction` of them (at least one),
    at most `cap`. Rows with the same prompt stay on the same side, so nothing held out is ever trained on."""
    keys: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        keys.setdefault(json.dumps(r[prompt_column], sort_keys=True, default=str), []).append(i)
    distinct = list(keys)
    if len(distinct) < 2:
        raise ValueError(f"the data has {len(distinct)} distinct prompt(s): too few to hold some out for evaluation; "
                         "give eval_data, or set eval_size: 0 to train without evaluation")
    n = min(cap, max(1, round(fraction * len(distinct))), len(distinct) - 1)
    chosen = set(random.Random(f"eval-split:{seed}").sample(distinct, n))
    eval_ids = sorted(keys[k][0] for k in chosen)
    train_ids = [i for k in distinct if k not in chosen for i in keys[k]]
    return sorted(train_ids), eval_ids


def make_splits(data: Any, eval_data: Any, *, prompt_column: str, eval_fraction: float, eval_size: int,
                seed: int, answer_column: str | None = None) -> Splits:
    """Training rows from `data` and held-out rows: from `eval_data` when given (its first `eval_size` rows; the
    built-in task's held-out problems for 'arithmetic'), else the built-in task's own held-out problems, else a
    split carved from `data` (`held_out`). eval_size = 0 (or eval_fraction = 0 with nothing else given) means no
    evaluation, said in `note`."""
    builtin = isinstance(data, str) and data == "arithmetic"
    eval_builtin = isinstance(eval_data, str) and eval_data == "arithmetic"
    if builtin:
        train, held = arithmetic_splits(eval_size, seed)
        train_ids = list(range(len(train)))
    else:
        train, train_ids = load_rows(data, prompt_column, answer_column), None
    if eval_size == 0:
        ev, ev_ids, note = [], [], "no held-out evaluation (eval_size=0)"
    elif eval_data is not None and not eval_builtin:
        ev = load_rows(eval_data, prompt_column, answer_column, field="eval_data")[:eval_size]
        ev_ids, note = list(range(len(ev))), f"{len(ev)} held-out prompts from eval_data"
    elif builtin or eval_builtin:
        held = held if builtin else arithmetic_splits(eval_size, seed)[1]
        ev, ev_ids = held[:eval_size], list(range(len(held[:eval_size])))
        note = f"{len(ev)} held-out arithmetic problems"
    elif eval_fraction == 0:
        ev, ev_ids, note = [], [], "no held-out evaluation (eval_fraction=0 and no eval_data)"
    else:
        train_ids, ev_ids = held_out(train, prompt_column, eval_fraction, eval_size, seed)
        ev = [train[i] for i in ev_ids]
        train = [train[i] for i in train_ids]
        note = f"{len(ev)} held-out prompts carved from data (eval_fraction={eval_fraction}, never trained on)"
    if train_ids is None:
        train_ids = list(range(len(train)))
    return Splits(train, train_ids, ev, ev_ids, note)


def to_prompts(rows: Sequence[dict], tokenizer, prompt_column: str = "prompt", system_prompt: str | None = None,
               max_prompt_tokens: int | None = None, start_index: int = 0,
               indices: Sequence[int] | None = None, template_kwargs: dict | None = None) -> list[Prompt]:
    """Apply the chat template (with `template_kwargs`: Config.chat_template_kwargs) and tokenize. A prompt's index
    is `indices[i]` (its row in the source) when given, else `start_index + i`. Errors name the row and the fix."""
    limit = max_prompt_tokens or getattr(tokenizer, "model_max_length", None) or 10**9
    out = []
    for i, row in enumerate(rows):
        index = indices[i] if indices is not None else start_index + i
        if prompt_column not in row:
            raise ValueError(f"data row {index}: no {prompt_column!r} column (columns: {sorted(row)}); "
                             "set prompt_column to the column holding the prompts")
        content = row[prompt_column]
        msgs = content if isinstance(content, list) else [{"role": "user", "content": str(content)}]
        if system_prompt:
            msgs = [{"role": "system", "content": system_prompt}] + msgs
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                                 **(template_kwargs or {}))
        else:
            text = "\n".join(m["content"] for m in msgs) + "\n"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > limit:
            raise ValueError(f"prompt {index} has {len(ids)} tokens, more than the limit {limit}; "
                             "shorten it or raise max_prompt_tokens")
        cols = {k: v for k, v in row.items() if k != prompt_column}
        out.append(Prompt(index, tuple(ids), str(content if isinstance(content, str) else msgs[-1]["content"]), cols,
                          tuple(msgs) if isinstance(content, list) else None))
    return out


class PromptStream:
    """Endless shuffled passes over the prompts: epoch e is the seeded shuffle of epoch e - 1's order. The order is
    a function of (seed, position), so `position` (prompts handed out so far) is the stream's whole state: a
    stream made with the position a checkpoint saved continues exactly where the run left off. `shuffle=False`
    takes the prompts in their given order, pass after pass (the same rows in the same order as another trainer)."""

    def __init__(self, prompts: Sequence[Prompt], seed: int, position: int = 0, shuffle: bool = True):
        if not prompts:
            raise ValueError("no training prompts: the data is empty after holding out the evaluation split")
        self._rng = random.Random(seed)
        self._shuffle = shuffle
        self._order = list(prompts)
        self._epoch = -1
        self._next_epoch()
        self.position = 0
        self.skip(position)

    def _next_epoch(self) -> None:
        if self._shuffle:
            self._rng.shuffle(self._order)
        self._epoch += 1

    def skip(self, n: int) -> None:
        while self.position + n >= (self._epoch + 1) * len(self._order):
            n -= (self._epoch + 1) * len(self._order) - self.position
            self.position = (self._epoch + 1) * len(self._order)
            self._next_epoch()
        self.position += n

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            out.append(self._order[self.position - self._epoch * len(self._order)])
            self.skip(1)
        return out


def refill_prompts(prompts: Sequence[Prompt], seed: int, step: int, rnd: int, n: int,
                   exclude: set[int]) -> list[Prompt]:
    """Dynamic sampling's fresh prompts for refill round `rnd` of step `step`: the first `n` of a shuffle seeded by
    (seed, step, rnd) that are not in `exclude` (the indices the step holds already); fewer when the data has
    fewer. A function of its arguments only (not of the stream's position or of timing), so a resumed run and a
    K >= 1 pipeline draw what an unbroken synchronous run draws."""
    order = list(prompts)
    random.Random(f"refill:{seed}:{step}:{rnd}").shuffle(order)
    return [p for p in order if p.index not in exclude][:n]

"""Reward prototyping before (and after) training.

    check(my_reward, [dict(completion="The answer is 12", answer=12, expect=1.0), ...])   # hand-written cases
    p = preview([my_reward], "arithmetic", n=4)      # the current model's samples, scored; p is a table
    p.rescore([my_reward_v2])                        # same samples, edited reward: no regeneration
    rescore("runs/demo", my_reward_v2)               # cached rollouts of a run (its log's "samples" events)

Every scored row records the source hash of the reward version that scored it (`minirl.rewards.source_hash`).
Tables are lists of dicts with an HTML view for notebooks (no pandas needed; `pandas.DataFrame(t.rows)` works).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from minirl.core.metrics import load_events
from minirl.data import rows as D
from minirl.generation.hf import HFGenerator
from minirl.rewards import Scorer, check_columns, check_data_columns, resolve_reward, source_hash
from minirl.rewards.advantages import step_advantages
from minirl.rewards.registry import accepted_keywords, reward_form
from minirl.rewards.scorer import check_value
from minirl.rewards.worker_main import call_in_thread, reason, run_batched, run_call
from minirl.training.models import load_tokenizer, resolve_model
from minirl.types import Completion, Group, Prompt, SamplingParams

# --- a small table type ---------------------------------------------------------------------------------------

class Table:
    """Rows (dicts) with a text and an HTML view. `columns` fixes the order; long text is shortened on display."""

    def __init__(self, rows: list[dict], columns: Sequence[str] | None = None, title: str = "", width: int = 70):
        self.rows = rows
        self.columns = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
        self.title, self.width = title, width

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def _cell(self, v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.3g}"
        if isinstance(v, dict):
            return ", ".join(f"{k}={self._cell(x)}" for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return "; ".join(self._cell(x) for x in v)
        t = " ".join(str("" if v is None else v).split())
        return t if len(t) <= self.width else t[: self.width - 1] + "…"

    def __repr__(self) -> str:
        cols = self.columns
        cells = [[self._cell(r.get(c)) for c in cols] for r in self.rows]
        widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
        lines = [self.title] if self.title else []
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(self._cell(r.get(c)))}</td>" for c in self.columns)
                       + "</tr>" for r in self.rows)
        title = f"<b>{html.escape(self.title)}</b><br>" if self.title else ""
        return (f"{title}<table style='font-size:12px;border-collapse:collapse' border='1' cellpadding='3'>"
                f"<tr>{head}</tr>{body}</table>")


# --- check: a reward against hand-written cases ------------------------------------------------------------

@dataclass
class CheckReport:
    reward: str
    version: str
    results: list[dict]

    @property
    def failures(self) -> list[dict]:
        return [r for r in self.results if not r["ok"]]

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> Table:
        return Table(self.results, ["ok", "completion", "expect", "got", "why"],
                     f"check {self.reward} (version {self.version}): {len(self.results) - len(self.failures)}"
                     f"/{len(self.results)} cases pass")

    def assert_ok(self) -> "CheckReport":
        if not self.ok:
            raise AssertionError(str(self))
        return self

    def __repr__(self) -> str:
        lines = [f"check {self.reward} (version {self.version}): {len(self.results) - len(self.failures)}/"
                 f"{len(self.results)} cases pass"]
        for r in self.failures:
            lines.append(f"  FAIL case {r['case']}: completion {r['completion']!r} -> {r['got']!r}, "
                         f"expected {r['expect']!r} ({r['why']})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        color = "#2a7d2a" if self.ok else "#b00020"
        return f"<div style='color:{color}'>{'all cases pass' if self.ok else 'FAILURES'}</div>" + self.table()._repr_html_()


def check(reward_fn: Callable | str, cases: Sequence[dict | tuple], *, tol: float = 1e-6,
          strict: bool = False, conversational: bool = False, timeout_s: float | None = 60.0) -> CheckReport:
    """Run a reward on hand-written cases and report each mismatch clearly.

    A case is a dict: `completion`, `expect` (a number, `None` for "should skip", or a callable predicate on the
    score), optional `prompt`, and any dataset columns the reward needs (`answer=12`). A tuple
    `(completion, expect)` or `(completion, expect, columns)` works too. The value is taken as a run's scorer takes
    it: an async reward is awaited, a numpy number or 0-d tensor is a number, and a case whose call raises (its
    reason "raised ...") or whose value the scorer would record as a failure (NaN, inf, beyond reward_clip's
    default 1e6, a non-number) fails with that reason, whatever `expect` says; so does a predicate that raises,
    and a call still running after `timeout_s` (60 s, room for a judge's own timeout; None: no limit): "timeout
    after ...", the cell going on to the next case (the call's thread is left to finish). `strict=True` raises
    AssertionError when any case fails.

    A batched (TRL-style) reward is called once per case, on lists of one: `prompts=[prompt]`,
    `completions=[completion]`, each column as `[value]`, `completion_ids=[[]]` (a written case has no tokens) and a
    `trainer_state` with `global_step=0`. Its prompt and completion are messages, as for a conversational dataset,
    when the case gives its prompt as a list of messages or `conversational=True` (a text prompt becomes one user
    message, a text completion `[{"role": "assistant", "content": completion}]`)."""
    name, fn = resolve_reward(reward_fn)
    batched = reward_form(fn, name) == "batched"
    results = []
    for i, case in enumerate(cases):
        if isinstance(case, tuple):
            completion, expect, *rest = case
            cols = dict(rest[0]) if rest else {}
            prompt = cols.pop("prompt", "")
        else:
            cols = dict(case)
            completion = cols.pop("completion")
            expect = cols.pop("expect")
            prompt = cols.pop("prompt", "")
        got, err = _case_value(fn, batched, prompt, completion, cols, conversational, timeout_s)
        if not (expect is None or callable(expect) or isinstance(expect, (int, float))):
            ok, why = False, (f"expect is {type(expect).__name__} {expect!r}: give a number, None (a skip) or a "
                              "predicate (a tuple case is (completion, expect[, columns]))")
        elif err:
            ok, why = False, err
        elif callable(expect):
            try:
                ok = bool(expect(got))
                why = "" if ok else "predicate is false"
            except Exception as e:  # noqa: BLE001 - `lambda v: v > 0.5` on a skip: the case's failure, not a raise
                ok, why = False, f"predicate raised {reason(e)}" + (" (the reward returned None: a skip)"
                                                                    if got is None else "")
        elif expect is None:
            ok = got is None
            why = "" if ok else "expected a skip (None)"
        elif got is None:
            ok, why = False, "returned None (a skip), expected a number"
        else:
            ok = abs(got - expect) <= tol
            why = "" if ok else f"off by {got - expect:+.3g}"
        results.append({"case": i, "ok": ok, "prompt": prompt, "completion": completion,
                        "expect": getattr(expect, "__name__", expect) if callable(expect) else expect,
                        "got": got, "why": why})
    rep = CheckReport(name, source_hash(fn), results)
    if strict:
        rep.assert_ok()
    return rep


def _case_value(fn: Callable, batched: bool, prompt: Any, completion: Any, cols: dict,
                conversational: bool, timeout_s: float | None) -> tuple[float | None, str | None]:
    """(value, None) or (None, why) of one case, called and taken as a run's scorer does in-process (`call_in_thread`
    over `run_call` / `run_batched`): a numpy number or 0-d tensor is a number; what it raises, SystemExit included,
    is "raised ..."; NaN, inf, a value beyond the default reward_clip or a non-number is a failure with its reason."""

    def run() -> tuple[Any, Any]:
        if not batched:
            return run_call(fn, prompt, completion, cols)
        values, why = run_batched(fn, *_batched_args(fn, prompt, completion, cols, conversational), 1)
        return (None, why) if values is None else (values[0], why[0])
    value, why = call_in_thread(run, timeout_s, "minirl-check")
    return (None, why) if why is not None else check_value(value)


def _batched_args(fn: Callable, prompt: Any, completion: Any, cols: dict, conversational: bool) -> tuple:
    """The prompts, completions and keywords a batched reward is given on one case (a batch of one)."""
    if conversational or isinstance(prompt, list) or isinstance(completion, list):
        prompt = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}] if prompt else []
        completion = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    takes = accepted_keywords(fn)
    extra = {"completion_ids": [[]], "trainer_state": SimpleNamespace(global_step=0)}
    kw = {**{k: [v] for k, v in cols.items()}, **{k: v for k, v in extra.items() if takes is None or k in takes}}
    return [prompt], [completion], kw


# --- preview: score the current model's samples -------------------------------------------------------------

_MODELS: dict[tuple, tuple] = {}  # (model path, adapter) -> (model, tokenizer): notebooks call preview often


def load_policy(model: str = "smollm2-135m-instruct", adapter: str | Path | None = None):
    """The model (+ optional peft adapter) and its tokenizer, loaded once per process."""
    key = (model, str(adapter) if adapter else None)
    if key not in _MODELS:

        tok = load_tokenizer(model)
        m = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32)
        if adapter:
            m = PeftModel.from_pretrained(m, str(adapter))
        _MODELS[key] = (m.eval(), tok)
    return _MODELS[key]


@dataclass
class Preview:
    """Samples from the current model, scored. `rows`: one per completion; `groups`: the ScoredGroups."""
    groups: list
    reward_names: list[str]
    versions: dict[str, str]
    _groups_raw: list[Group] = field(default_factory=list, repr=False)

    @property
    def rows(self) -> list[dict]:
        out = []
        for gi, sg in enumerate(self.groups):
            for i, c in enumerate(sg.group.completions):
                row = {"group": gi, "prompt": sg.group.prompt.text, "completion": c.text}
                for n in self.reward_names:
                    row[n] = sg.per_reward[n][i]
                row["reward"] = sg.rewards[i]
                row["advantage"] = sg.advantages[i]
                row["cut"] = c.truncated
                row["failures"] = [f"{f.reward}: {f.reason}" for f in sg.failures if f.sample == i]
                row["reward_versions"] = dict(sg.reward_versions)
                out.append(row)
        return out

    @property
    def zero_variance_share(self) -> float:
        """Share of groups whose completions all got the same reward: they teach nothing (zero advantage)."""
        return sum(g.zero_advantage for g in self.groups) / max(1, len(self.groups))

    @property
    def mean_reward(self) -> float:
        vals = [r for g in self.groups for r in g.rewards if r is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    def table(self) -> Table:
        cols = ["group", "prompt", "completion", *self.reward_names, "reward", "advantage", "cut", "failures"]
        return Table(self.rows, cols, self.headline())

    def headline(self) -> str:
        vs = ", ".join(f"{k}@{v}" for k, v in self.versions.items())
        return (f"{len(self.groups)} prompts × {len(self.groups[0].group.completions) if self.groups else 0} samples · "
                f"mean reward {self.mean_reward:.3g} · zero-variance groups {self.zero_variance_share:.0%} · "
                f"rewards {vs}")

    def rescore(self, rewards: Sequence[str | Callable], weights: Sequence[float] | None = None,
                scale_rewards: str = "group", timeout_s: float = 10.0) -> "Preview":
        """The same samples scored by other (edited) rewards, without generating again."""
        scorer = Scorer.from_config(rewards, weights, timeout_s)
        raw = self._groups_raw or [g.group for g in self.groups]
        return Preview(step_advantages([scorer.score_group(g) for g in raw], scale_rewards),
                       [n for n, _ in scorer.rewards], dict(scorer.versions), raw)

    def __repr__(self) -> str:
        return repr(self.table())

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()


def preview(rewards: Sequence[str | Callable] | str | Callable, data: Any = "arithmetic", *,
            model: str = "smollm2-135m-instruct", adapter: str | Path | None = None, prompts: int = 4, n: int = 4,
            max_tokens: int = 32, temperature: float = 1.0, weights: Sequence[float] | None = None,
            prompt_column: str = "prompt", system_prompt: str | None = None, seed: int = 0,
            scale_rewards: str = "group", timeout_s: float = 10.0) -> Preview:
    """Generate `n` completions for each of `prompts` prompts with the current model (+ adapter) and score them
    with `rewards`. `data`: 'arithmetic', a list of dicts, a JSONL path, or a datasets.Dataset."""

    if callable(rewards) or isinstance(rewards, str):
        rewards = [rewards]
    scorer = Scorer.from_config(rewards, weights, timeout_s)
    rows = D.arithmetic_splits(0, seed)[0] if isinstance(data, str) and data == "arithmetic" else D.load_rows(data)
    cols = check_data_columns([k for k in rows[0] if k != prompt_column])
    for name, fn in scorer.rewards:
        check_columns(fn, name, cols)
    m, tok = load_policy(model, adapter)
    ps = D.to_prompts(rows[:prompts], tok, prompt_column, system_prompt)
    # one small generate on a fresh model: merging the LoRA first would cost more than it saves
    groups = HFGenerator(m, tok, merge=False).generate(ps, n, SamplingParams(temperature=temperature,
                                                                             max_tokens=max_tokens, seed=seed))
    scored = step_advantages([scorer.score_group(g) for g in groups], scale_rewards)
    return Preview(scored, [n_ for n_, _ in scorer.rewards], dict(scorer.versions), groups)


# --- rescore: cached rollouts of a run, with an edited reward -----------------------------------------------

def _columns_lookup(start: dict, data: Any, prompt_column: str) -> dict[str, dict]:
    """prompt text -> dataset columns, for logs whose samples do not carry their columns."""
    rows: list[dict] = []
    if data is not None:
        rows = D.arithmetic_splits(0)[0] if isinstance(data, str) and data == "arithmetic" else D.load_rows(data)
    else:
        cfg = start.get("config") or {}
        if cfg.get("data") == "arithmetic":
            train, held = D.arithmetic_splits(cfg.get("eval_size", 64), cfg.get("seed", 0))
            rows = train + held
    return {str(r.get(prompt_column)): {k: v for k, v in r.items() if k != prompt_column} for r in rows}


def rescore(source: Any, rewards: Sequence[str | Callable] | str | Callable, *, data: Any = None,
            prompt_column: str = "prompt", timeout_s: float = 10.0) -> Table:
    """Score a run's cached rollouts (its log's "samples" events) with other, e.g. edited, rewards.

    `source`: a Run, its out_dir, or its metrics.jsonl. Each row holds the logged score and reward versions, and
    the new scores with the new rewards' source hashes, so old and new are never confused. Dataset columns come
    from the samples (when logged), else from `data`, else from the run's own built-in task."""

    if callable(rewards) or isinstance(rewards, str):
        rewards = [rewards]
    resolved = [resolve_reward(r) for r in rewards]
    for name, fn in resolved:
        reward_form(fn, name)
    versions = {n: source_hash(f) for n, f in resolved}
    scorer = Scorer(resolved, [1.0] * len(resolved), timeout_s)
    events = load_events(source)
    start = next((e for e in events if e.get("event") == "start"), {})
    lookup: dict[str, dict] | None = None
    out = []
    for e in events:
        if e.get("event") != "samples":
            continue
        for x in e.get("samples", []):
            cols = x.get("columns")
            if cols is None:
                if lookup is None:
                    lookup = _columns_lookup(start, data, prompt_column)
                cols = lookup.get(x.get("prompt"), {})
            msgs = x.get("messages")
            g = Group(Prompt(-1, (), x.get("prompt", ""), dict(cols), tuple(msgs) if msgs else None),
                      (Completion((), (), (), x.get("completion", ""), "stop"),))
            sg = scorer.score_group(g)
            row = {"step": e.get("step"), "prompt": x.get("prompt"), "completion": x.get("completion"),
                   "old_reward": x.get("reward"), "old_versions": e.get("reward_versions") or {}}
            for n, _ in resolved:
                row[n] = sg.per_reward[n][0]
            row["new_reward"] = sg.rewards[0]
            row["changed"] = (row["new_reward"] is None) != (x.get("reward") is None) or (
                row["new_reward"] is not None and x.get("reward") is not None
                and abs(row["new_reward"] - x["reward"]) > 1e-9)
            row["failures"] = [f"{f.reward}: {f.reason}" for f in sg.failures]
            row["reward_versions"] = dict(versions)
            out.append(row)
    changed = sum(r["changed"] for r in out)
    title = (f"re-scored {len(out)} cached samples with {', '.join(f'{k}@{v}' for k, v in versions.items())}: "
             f"{changed} changed")
    cols = ["step", "prompt", "completion", "old_reward", *[n for n, _ in resolved], "new_reward", "changed", "failures"]
    return Table(out, cols, title)

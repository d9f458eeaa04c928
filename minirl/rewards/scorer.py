"""The scorer: reward functions on each group, their weighted totals (advantages: `advantages.py`, once per step).

A reward is a plain function `(prompt, completion, **columns) -> float | None` (sync or async). `None` means
"skip this sample". A batched reward (TRL's `(prompts, completions, **kwargs) -> list[float | None]`) is called
once per group, its lists in TRL's form (`_batch_call`); its `None` means "does not apply to this sample": left out
of that sample's weighted sum, as TRL's nansum does (a sample where every weighted reward says None is skipped,
where TRL would give it 0). Rewards combine by weight. A reward of weight 0 is a *check*: scored and logged
(`reward/<name>`, the samples) but never trained on: left out of the summed reward that makes advantages, and its
failure never fails a sample's trained reward (the reward-hacking watch, core/hacking.py, compares them). A reward
call that raises (SystemExit and KeyboardInterrupt included), ends or crashes its process, times out, prints a
flood, or returns something that is not a finite number within `reward_clip` is a *failure*: recorded with its
reason, its sample excluded from the group's baseline and the loss, and the run goes on. Nothing is turned silently
into 0.0. A batched call that fails as a whole fails each of its samples; an entry that is not a usable number fails
its sample only (an exception given as the entry fails it with that exception's reason: `llm_judge`).

With `workers > 0` the calls run in reward worker processes (`workers.py`): a group's calls in parallel, each with
its own timeout, a hung or crashed worker killed and replaced (`score_groups`: several groups' calls at once). `workers=0` runs them in this process, one after
another (the opt-in for pure, cheap rewards: a hung call is abandoned, not stopped).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from minirl.rewards.llm_judge import start_judges
from minirl.rewards.registry import BATCH_NAMES, accepted_keywords, is_batched, resolve_reward, reward_form, source_hash
from minirl.rewards.sandbox.process import ENABLE_SANDBOX
from minirl.rewards.worker_main import number
from minirl.rewards.workers import RewardCall, RewardWorkers
from minirl.types import Group, RewardFailure, ScoredGroup


@dataclass
class Scorer:
    """Runs the reward functions of a run off the generation loop, each call with a timeout."""
    rewards: list[tuple[str, Callable]]
    weights: list[float]
    timeout_s: float = 10.0
    workers: int = 0              # reward worker processes; 0 = in this process
    reward_clip: float = 1e6      # |value| above this is a failure (so advantages stay finite)
    memory_mb: int | None = 2048  # per worker process
    stop_after_failing_steps: int = 3  # a weighted reward failing every call this many steps in a row stops a run
    _pool: RewardWorkers | None = field(default=None, init=False, repr=False)
    _failing_steps: Counter = field(default_factory=Counter, init=False, repr=False)
    _skipping_steps: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.versions = {n: source_hash(f) for n, f in self.rewards}
        self._takes = {n: accepted_keywords(f) for n, f in self.rewards}  # None: every keyword
        self._batched = {n for n, f in self.rewards if is_batched(f)}

    @classmethod
    def from_config(cls, refs: Sequence[str | Callable], weights: Sequence[float] | None, timeout_s: float,
                    workers: int = 0, reward_clip: float = 1e6,
                    memory_mb: int | None = 2048) -> "Scorer":
        if not refs:
            raise ValueError("no reward functions: set `rewards` to at least one reward")
        if weights and not any(weights):
            raise ValueError(ALL_CHECKS)
        resolved = [resolve_reward(r) for r in refs]
        for name, fn in resolved:
            reward_form(fn, name)  # neither form: one line, before anything starts
        return cls(resolved, list(weights) if weights else [1.0] * len(resolved), timeout_s,
                   workers, reward_clip, memory_mb)

    @property
    def checks(self) -> list[str]:
        """The rewards of weight 0: logged, never trained on."""
        return [n for (n, _), w in zip(self.rewards, self.weights) if w == 0]

    @property
    def pool(self) -> RewardWorkers:
        """The reward workers, started on first use (a reward that cannot reach a worker fails here, by name)."""
        if self._pool is None:
            start_judges(self.rewards)  # judges' arguments checked, their servers started: the workers inherit them
            self._pool = RewardWorkers(self.rewards, self.workers, self.timeout_s, memory_mb=self.memory_mb)
        return self._pool

    def start(self) -> "Scorer":
        """Start the workers now (a run does, before loading the model, so a bad reward fails fast)."""
        _ = self.pool
        return self

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def check_value(self, v: Any) -> tuple[float | None, str | None]:
        """`check_value` with this scorer's reward_clip."""
        return check_value(v, self.reward_clip)

    def watch(self, scored: Sequence[ScoredGroup]) -> None:
        """Called by a run after each step: raises RewardsFailing once a weighted reward has failed every call for
        `stop_after_failing_steps` steps in a row (a code reward where no sandbox works, a judge that is down):
        such a run would go on training on nothing."""
        calls = sum(len(g.group.completions) for g in scored)
        for (name, _), weight in zip(self.rewards, self.weights):
            reasons = [f.reason for g in scored for f in g.failures if f.reward == name]
            if weight == 0 or not calls:
                continue
            self._failing_steps[name] = self._failing_steps[name] + 1 if len(reasons) == calls else 0
            if self._failing_steps[name] >= self.stop_after_failing_steps:
                raise RewardsFailing(_stop_line(name, self._failing_steps[name], reasons[-1]))
        # every sample skipped (None from every reward), nothing failed: a reward that forgot its `return`
        if calls:
            skipped = all(v is None for g in scored for v in g.rewards) and not any(g.failures for g in scored)
            self._skipping_steps = self._skipping_steps + 1 if skipped else 0
            if self._skipping_steps >= self.stop_after_failing_steps:
                names = [n for (n, _), w in zip(self.rewards, self.weights) if w]
                raise RewardsFailing(
                    f"every sample of {self._skipping_steps} steps in a row was skipped: {_names(names)} returned "
                    "None (None means 'skip this sample') for all of them, so the run trains on nothing; stopping "
                    "the run: return a number (a missing `return`? try the reward on samples with minirl.check)")

    def score_group(self, group: Group, names: Sequence[str] | None = None) -> ScoredGroup:
        """Every reward (or only `names`) on every completion of `group`."""
        return self.score_groups([group], names)[0]

    def score_groups(self, groups: Sequence[Group], names: Sequence[str] | None = None) -> list[ScoredGroup]:
        """`score_group` for several groups, their calls sent to the workers together (a slow reward -- a remote
        judge, tests to run -- waits once per batch of calls, not once per group)."""
        rewards = [(n, f) for n, f in self.rewards if names is None or n in names]
        keys = [(k, name, i) for k, g in enumerate(groups) for name, _ in rewards if name not in self._batched
                for i in range(len(g.completions))]
        batch_keys = [(k, name) for k, g in enumerate(groups) for name, _ in rewards
                      if name in self._batched and g.completions]
        outcomes = self.pool.call_many([RewardCall(name, groups[k].prompt.text, groups[k].completions[i].text,
                                                   _columns(dict(groups[k].prompt.columns), groups[k].completions[i],
                                                            self._takes[name]))
                                        for k, name, i in keys]
                                       + [_batch_call(name, groups[k], self._takes[name]) for k, name in batch_keys])
        per: list[dict[str, list[float | None]]] = [{n: [None] * len(g.completions) for n, _ in rewards}
                                                     for g in groups]
        failures: list[list[RewardFailure]] = [[] for _ in groups]
        for (k, name, i), out in zip(keys, outcomes):
            self._record(per[k][name], failures[k], name, i, out.value, out.error)
        for (k, name), out in zip(batch_keys, outcomes[len(keys):]):
            for i in range(len(groups[k].completions)):
                self._record(per[k][name], failures[k], name, i, *((None, out.error) if out.values is None else
                                                                   (out.values[i], out.errors[i])))
        return [self._finish(g, rewards, p, f) for g, p, f in zip(groups, per, failures)]

    def _record(self, values: list, failures: list[RewardFailure], name: str, i: int, value: Any,
                error: str | None) -> None:
        v, why = (None, error) if error is not None else self.check_value(value)
        if why is not None:
            failures.append(RewardFailure(name, i, why))
        values[i] = v

    def _finish(self, group: Group, rewards, per: dict, failures: list[RewardFailure]) -> ScoredGroup:
        """A group's weighted totals from its per-reward values (a sample with a failed weighted reward: None). The
        checks (weight 0) are left out of the sum: their values and failures are recorded, never trained on."""
        weights = dict(zip((n for n, _ in self.rewards), self.weights))
        failed = {(f.reward, f.sample) for f in failures}
        totals: list[float | None] = []
        for i in range(len(group.completions)):
            vals = [(per[n][i], weights[n]) for n, _ in rewards if weights[n] != 0
                    if not (per[n][i] is None and n in self._batched and (n, i) not in failed)]  # TRL's nansum
            skipped = not vals and any(weights[n] != 0 for n, _ in rewards)
            totals.append(None if skipped or any(v is None for v, _ in vals) else sum(v * w for v, w in vals))
        return ScoredGroup(group, tuple(totals), {n: tuple(v) for n, v in per.items()}, (), tuple(failures),
                           dict(self.versions), {n: weights[n] for n in per})


def check_value(v: Any, reward_clip: float = 1e6) -> tuple[float | None, str | None]:
    """(value, None) for a usable reward value or an explicit skip (None); (None, reason) otherwise, also for a
    value that float() cannot take (10**400): never an exception. The pool's values are floats already
    (`worker_main.number` ran under the call's timeout), so no code of a returned value runs here."""
    v, why = number(v)
    if v is None:
        return None, why
    if not math.isfinite(v):
        return None, f"returned non-finite {v}"
    if abs(v) > reward_clip:
        return None, f"returned {v:.3g}, beyond reward_clip={reward_clip:g}"
    return v, None


def _columns(columns: dict, completion, takes: set[str] | None = None) -> dict:
    """A completion's reward keywords: the dataset columns, its `completion_tokens` (sampled tokens) and
    `finish_reason`, and for an episode its transcript and env reward (`Episode.columns`: messages, env_reward,
    env_error, turns); only those in `takes` (None: all)."""
    n = len(completion.token_ids) if completion.mask is None else sum(completion.mask)
    kw = {**columns, "completion_tokens": n, "finish_reason": completion.finish_reason}
    if completion.episode is not None:
        kw.update(completion.episode.columns())
    return kw if takes is None else {k: v for k, v in kw.items() if k in takes}


def _batch_call(name: str, group: Group, takes: set[str] | None) -> RewardCall:
    """A batched reward's call on a group, as TRL makes it: the prompt repeated per completion, the completions,
    each dataset column (and `completion_tokens`, `finish_reason`, an episode's keywords) as a list of one entry per
    completion, `completion_ids` and `trainer_state` (its `global_step`: the newest policy version that sampled
    the group, TRL's global_step when generation is on-policy). A conversational prompt (the dataset gave
    messages: `Prompt.messages`) comes as its messages and each completion as [{"role": "assistant", ...}]."""
    msgs = group.prompt.messages
    n = len(group.completions)
    prompts = [list(map(dict, msgs)) if msgs is not None else group.prompt.text for _ in range(n)]
    completions = [[{"role": "assistant", "content": c.text}] if msgs is not None else c.text
                   for c in group.completions]
    each = [_columns(dict(group.prompt.columns), c) for c in group.completions]
    kw = {k: [e[k] for e in each] for k in each[0] if k not in BATCH_NAMES} if each else {}
    kw["completion_ids"] = [list(c.token_ids) for c in group.completions]
    step = max((v for c in group.completions for v in c.sampled_versions), default=0)
    kw["trainer_state"] = SimpleNamespace(global_step=step)
    return RewardCall(name, prompts, completions, kw if takes is None else {k: v for k, v in kw.items() if k in takes},
                      batch=n)


ALL_CHECKS = ("reward_weights are all 0: every reward is a check (logged, never trained on), so nothing is "
              "trained; give the reward to train on a weight, e.g. reward_weights: [1, 0]")


class RewardsFailing(RuntimeError):
    """A weighted reward failed every call for several steps in a row; the message says which, why, and the fix."""


def _names(names: Sequence[str]) -> str:
    return f"reward {names[0]!r}" if len(names) == 1 else "rewards " + ", ".join(map(repr, names))


def _stop_line(name: str, steps: int, last: str) -> str:
    if "SandboxUnavailable" in last:  # the cause, then the fix once (the reason, cut at 300 characters, repeats it)
        last, fix = last.partition("; " + ENABLE_SANDBOX[:11])[0], f"to get a sandbox, {ENABLE_SANDBOX}"
    else:
        fix = "fix the reward (try it on samples with minirl.check) or give it weight 0"
    return f"reward {name!r} failed every call for {steps} steps in a row, last: {last}; stopping the run: {fix}"


def failure_kinds(groups: Sequence[ScoredGroup]) -> dict[str, int]:
    """How many reward failures of each kind ("timeout", "SystemExit", "worker died", ...) these groups hold."""
    def kind(reason: str) -> str:
        for k in ("timeout", "worker died", "output flood", "non-finite", "beyond reward_clip", "expected a float",
                  "expected a list", "float() cannot take", "cannot come back"):
            if k in reason:
                return k
        return reason.removeprefix("raised ").split(":")[0].split("(")[0].strip() or "error"
    return dict(Counter(kind(f.reason) for g in groups for f in g.failures))

"""The built-in tasks' reward functions."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Any

from minirl.rewards.registry import reward

# --- the built-in arithmetic task's reward -------------------------------------------------------------------

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


@reward
def arithmetic_correct(prompt: str, completion: str, answer: int, **_: Any) -> float:
    """1.0 if the last integer in the completion equals the answer, else 0.0."""
    return 1.0 if last_integer(completion) == int(answer) else 0.0


# --- recipes: length and format (set their parameters as `name(key=value)` in `rewards`, or `bind_reward`) ----------

@reward
def overlong_penalty(prompt: str, completion: str, completion_tokens: int, *, max_length: int, cache_length: int,
                     **_: Any) -> float:
    """DAPO's soft overlong punishment: 0 for up to max_length - cache_length tokens, then falling linearly to -1
    at max_length, -1 beyond. Usually max_length = max_tokens, so a completion cut by max_tokens gets -1. Use it
    beside a correctness reward (DAPO adds the two), e.g. `overlong_penalty(max_length=48, cache_length=16)`.
    Counts the completion's sampled tokens (an episode's replies, not the environment's messages)."""
    if not 0 < cache_length <= max_length:
        raise ValueError(f"overlong_penalty: cache_length={cache_length} must be in (0, max_length={max_length}]")
    start = max_length - cache_length
    if completion_tokens <= start:
        return 0.0
    return max(-1.0, (start - completion_tokens) / cache_length)


@reward
def format_match(prompt: str, completion: str, *, pattern: str, **_: Any) -> float:
    """1.0 if `re.search(pattern, completion, re.DOTALL)` finds the regex, else 0.0; anchor it (^...$) to require
    the whole completion's format, e.g. `format_match(pattern='^<think>.*</think>.*\\d+$')`."""
    return 1.0 if re.search(pattern, completion, re.DOTALL) else 0.0


# --- the built-in code task's reward ---------------------------------------------------------------------------

_SANDBOX_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox")


@reward
def code_tests_pass(prompt: str, completion: str, tests: list[str] | str, entry_point: str | None = None,
                    **_: Any) -> float:
    """The fraction of the row's tests that the completion passes, judged by `minirl.rewards.sandbox.run_tests` (the
    solution in a sandboxed process of its own, its answers compared as plain data; see its docstring). `tests`: a
    list of asserts, or one HumanEval test program calling `check(candidate)` with the `entry_point` column's
    function. Raises where no sandbox works here, or for `tests` of another kind, so the failure is recorded
    instead of scored 0."""
    return _sandbox().run_tests(completion, tests, entry_point=entry_point, timeout_s=5).fraction


def _sandbox():
    """`minirl.rewards.sandbox`; in a reward worker, which never imports minirl (nor torch with it: see
    `minirl.rewards.workers`), loaded from its folder as a package of its own (it imports nothing from minirl)."""
    if "minirl.rewards.sandbox" in sys.modules:
        return sys.modules["minirl.rewards.sandbox"]
    if "minirl_sandbox" not in sys.modules:
        spec = importlib.util.spec_from_file_location("minirl_sandbox", os.path.join(_SANDBOX_DIR, "__init__.py"),
                                                      submodule_search_locations=[_SANDBOX_DIR])
        sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["minirl_sandbox"]


# --- environments: the episode's own reward ------------------------------------------------------------------

class EnvError(RuntimeError):
    """The env of an episode raised (or answered with something that is not an EnvStep)."""


@reward(name="env")
def env_total(prompt: str, completion: str, env_reward: float, env_error: str | None = None, **_: Any) -> float:
    """The sum of an episode's step rewards: the first reward of every environment run (`minirl.generation.episodes`). An
    episode whose env failed fails here, so the failure is recorded and its sample left out of the loss."""
    if env_error is not None:
        raise EnvError(env_error)
    return env_reward

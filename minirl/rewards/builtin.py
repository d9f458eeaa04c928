"""The built-in tasks' reward functions."""
from __future__ import annotations

import re
from typing import Any

from .registry import reward

# --- the built-in arithmetic task's reward -------------------------------------------------------------------

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


@reward
def arithmetic_correct(prompt: str, completion: str, answer: int, **_: Any) -> float:
    """1.0 if the last integer in the completion equals the answer, else 0.0."""
    return 1.0 if last_integer(completion) == int(answer) else 0.0


# --- the built-in code task's reward ---------------------------------------------------------------------------

@reward
def code_tests_pass(prompt: str, completion: str, tests: list[str], **_: Any) -> float:
    """The fraction of the row's asserts that the completion's function passes, run in `minirl.sandbox` (no
    network, private filesystem, resource limits; see its docstring). Raises where no sandbox works here, so the
    failure is recorded instead of scored 0."""
    from .sandbox import run_tests
    return run_tests(completion, list(tests), entry_point="f", timeout_s=5).fraction


# --- environments: the episode's own reward ------------------------------------------------------------------

class EnvError(RuntimeError):
    """The env of an episode raised (or answered with something that is not an EnvStep)."""


@reward(name="env")
def env_total(prompt: str, completion: str, env_reward: float, env_error: str | None = None, **_: Any) -> float:
    """The sum of an episode's step rewards: the first reward of every environment run (`minirl.episodes`). An
    episode whose env failed fails here, so the failure is recorded and its sample left out of the loss."""
    if env_error is not None:
        raise EnvError(env_error)
    return env_reward

"""The built-in tasks' reward functions."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
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

_SANDBOX_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sandbox")


@reward
def code_tests_pass(prompt: str, completion: str, tests: list[str] | str, entry_point: str | None = None,
                    **_: Any) -> float:
    """The fraction of the row's tests that the completion passes, judged by `minirl.sandbox.run_tests` (the
    solution in a sandboxed process of its own, its answers compared as plain data; see its docstring). `tests`: a
    list of asserts, or one HumanEval test program calling `check(candidate)` with the `entry_point` column's
    function. Raises where no sandbox works here, or for `tests` of another kind, so the failure is recorded
    instead of scored 0."""
    return _sandbox().run_tests(completion, tests, entry_point=entry_point, timeout_s=5).fraction


def _sandbox():
    """`minirl.sandbox`; in a reward worker, which never imports minirl (nor torch with it: 2 s and 230 MB a
    worker), loaded from its folder as a package of its own (it imports nothing from minirl)."""
    if "minirl.sandbox" in sys.modules:
        return sys.modules["minirl.sandbox"]
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
    """The sum of an episode's step rewards: the first reward of every environment run (`minirl.episodes`). An
    episode whose env failed fails here, so the failure is recorded and its sample left out of the loss."""
    if env_error is not None:
        raise EnvError(env_error)
    return env_reward

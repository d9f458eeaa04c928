"""Calls into a user's env, guarded: the env made and opened once before the model loads (`check_env_opens`), and
the transformers runner's reset / step calls on one thread of their own with a timeout (`EnvThread`), so a step
that hangs or calls exit() fails its episode instead of stopping the run."""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from minirl.generation.envs import Env, tool_schema

STEP_TIMEOUT_S = 60.0  # a step (its tools included) that takes longer fails its episode


class StepTimeout(TimeoutError):
    """An env's step did not return within the runner's `step_timeout_s`."""


def step_timeout(seconds: float, call: str = "step") -> StepTimeout:
    return StepTimeout(f"{call} did not return within {seconds:g} s (step_timeout_s); a {call} or tool that can hang "
                       "needs a timeout of its own")


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise TypeError(f"{where} must give a list of messages like {{'role': 'user', 'content': '...'}}, "
                        f"got {messages!r:.80}")
    return list(messages)


def cannot_make(e: BaseException) -> str:
    return (f"the env could not be made ({one_line(e)}): env= takes a class or factory called with no arguments, "
            "once per episode; bind arguments with functools.partial(MyEnv, ...) or a lambda")


def check_env_opens(make_env: Callable[[], Env], row: dict) -> None:
    """One env made and opened on `row` without a model: `make_env()` (a class whose constructor needs arguments fails
    here), `reset(row)` (messages), its tools' schemas. A ValueError of one line naming the part to fix; a run calls
    it before the model loads."""
    try:
        env = make_env()
    except Exception as e:
        raise ValueError(cannot_make(e)) from e
    if not callable(getattr(env, "step", None)):
        raise ValueError(f"the env factory made {type(env).__name__}, which has no step(reply); subclass minirl.Env")
    try:
        check_messages(env.reset(dict(row)), "reset(row)")
        for f in env.tools():
            tool_schema(f)
    except Exception as e:
        raise ValueError(f"the env could not open an episode on the first training row ({one_line(e)}); fix its "
                         "reset or its tools") from e


class EnvThread:
    """A daemon thread that runs calls in turn (daemon: one stuck in a step never holds the process at exit)."""
    HUNG = object()

    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="minirl-env").start()

    def _loop(self) -> None:
        while (job := self.q.get()) is not None:
            fn, box, done = job
            try:
                box.append(fn())
            except BaseException as ex:  # noqa: BLE001 - returned to the caller (SystemExit too: it ends a thread)
                box.append(ex)
            finally:
                done.set()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        box: list = []
        done = threading.Event()
        self.q.put((fn, box, done))
        return box[0] if done.wait(timeout) else self.HUNG

    def stop(self) -> None:
        self.q.put(None)

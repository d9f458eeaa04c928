"""The reward registry: a reward is a plain function `(prompt, completion, **columns) -> float | None`, registered by
name with `@minirl.reward`, or given as a callable or a 'module:function' path."""
from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol, Sequence


class RewardFn(Protocol):
    def __call__(self, prompt: str, completion: str, **columns: Any) -> float | None: ...


REGISTRY: dict[str, Callable] = {}


def reward(fn: Callable | None = None, *, name: str | None = None):
    """Register a reward function under its name (`@minirl.reward` or `@minirl.reward(name="x")`)."""
    def wrap(f: Callable) -> Callable:
        REGISTRY[name or f.__name__] = f
        return f
    return wrap(fn) if fn is not None else wrap


@contextmanager
def working_folder_last() -> Iterator[None]:
    """The working folder on `sys.path` after everything else (site-packages included), only inside the block: a
    'module:function' in it can be imported, while a file there named like an installed package (a `cloudpickle.py`)
    cannot shadow that package, then or later. Where the interpreter already put it first ('' in `python -c`, a
    notebook) nothing changes."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            del sys.path[len(sys.path) - 1 - sys.path[::-1].index(cwd)]


def import_ref(ref: str, what: str, form: str) -> tuple[str, Any]:
    """(attr, object) for 'module:attr' (a reward, an env), or one line naming the reference and what went wrong:
    not importable, or the module raised while importing (SyntaxError, NameError, KeyError, RuntimeError...)."""
    mod, _, attr = ref.partition(":")
    try:
        with working_folder_last():
            module = importlib.import_module(mod)
        return attr, getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {ref!r} cannot be imported ({_one_line(e)}); check the {form!r} path") from None
    except Exception as e:  # noqa: BLE001 - the module's own code failed; named, without a traceback
        raise ValueError(f"{what} {ref!r}: importing module {mod!r} raised {type(e).__name__}: {_one_line(e)}; "
                         "fix the module (import it in Python to see the traceback)") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or repr(e)


def resolve_reward(ref: str | Callable) -> tuple[str, Callable]:
    if callable(ref):
        return getattr(ref, "__name__", repr(ref)), ref
    if ref in REGISTRY:
        return ref, REGISTRY[ref]
    if ":" in ref:
        return import_ref(ref, "reward", "module:function")
    raise ValueError(f"unknown reward {ref!r}: registered rewards are {sorted(REGISTRY)}; "
                     "register one with @minirl.reward or pass 'module:function'")


def source_hash(fn: Callable) -> str:
    """A short hash of a reward's source, so every score records which version of the reward made it."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        src = repr(fn)
    return hashlib.sha1(src.encode()).hexdigest()[:10]


def check_columns(fn: Callable, name: str, columns: Sequence[str]) -> None:
    """Fail before training when a reward needs a keyword the data does not have."""
    sig = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        needed = [p.name for p in list(sig.parameters.values())[2:]
                  if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    else:
        needed = [p.name for p in list(sig.parameters.values())[2:] if p.default is p.empty]
    missing = [n for n in needed if n not in columns]
    if missing:
        raise ValueError(f"reward {name!r} needs column(s) {missing} that the data lacks "
                         f"(columns: {sorted(columns)}); add them to the dataset or give them defaults")

"""The reward registry: a reward is a plain function `(prompt, completion, **columns) -> float | None`, registered by
name with `@minirl.reward`, or given as a callable or a 'module:function' path. A *batched* reward is TRL's form,
`(prompts, completions, **kwargs) -> list[float | None]`, called once per group (`reward_form`, `is_batched`; what it
receives: docs/coming-from-trl.md).

Besides the dataset's columns every reward may take `completion_tokens` (the completion's sampled tokens) and
`finish_reason` ('stop', or 'length' when cut by max_tokens); a reward receives only the keywords its signature
accepts (all of them with `**kwargs`). A reward's keyword arguments can be fixed by name: `name(key=value, ...)` in
a config's `rewards` (values are Python literals), `bind_reward(name_or_fn, key=value)` in Python; a fixed keyword
is no longer filled from a column."""
from __future__ import annotations

import ast
import difflib
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


def reward(fn: Callable | None = None, *, name: str | None = None, batched: bool = False):
    """Register a reward function under its name (`@minirl.reward` or `@minirl.reward(name="x")`). `batched=True`
    marks a batched (TRL-style) reward whose parameters are not named `completions`: it is called
    `f(prompts, completions, **kwargs)` once per group and returns one value per completion."""
    def wrap(f: Callable) -> Callable:
        if batched:
            f.minirl_batched = True
        REGISTRY[name or f.__name__] = f
        return f
    return wrap(fn) if fn is not None else wrap


BATCH_KEYWORDS = ("completion_ids", "trainer_state")  # what a batched reward receives besides the columns (TRL's)
BATCH_NAMES = ("prompts", "completions")  # a batched reward's own parameters, never filled from a column


def _params(fn: Callable) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def is_batched(fn: Callable) -> bool:
    """A batched (TRL-style) reward: marked `@minirl.reward(batched=True)`, or with a parameter named
    `completions` (TRL's `f(prompts, completions, **kwargs)`, Unsloth's `f(completions, **kwargs)`)."""
    if getattr(fn, "minirl_batched", False):
        return True
    params = _params(fn)
    return params is not None and any(p.name == "completions" for p in params)


def reward_form(fn: Callable, name: str) -> str:
    """'batched' or 'sample' (`(prompt, completion, **columns)`: two positional parameters, or *args); a signature
    that fits neither is one line showing both forms."""
    if is_batched(fn):
        return "batched"
    params = _params(fn)
    if params is None or any(p.kind is p.VAR_POSITIONAL for p in params) or \
            sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2:
        return "sample"
    raise ValueError(f"reward {name!r} takes {inspect.signature(fn)}, neither form of a reward: per sample "
                     "f(prompt, completion, **columns) -> float | None, or batched as in TRL "
                     "f(prompts, completions, **kwargs) -> list[float | None]; give it one of these signatures")


def _own_params(fn: Callable, params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """The parameters after a reward's own (prompt, completion), or a batched one's (prompts, completions): those
    the columns and the completion keywords fill."""
    if not is_batched(fn):
        return params[2:]
    if any(p.name == "completions" for p in params):
        return [p for p in params if p.name not in BATCH_NAMES]
    return params[2:]


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
        if mod.endswith(".py") or "/" in mod:  # a file path ('rewards/my.py:f'), not a module name
            path = mod.removesuffix(".py")
            name, where = (path.rsplit("/", 1)[-1], "run from the folder that holds it") if \
                path.startswith(("/", ".", "~")) else (path.replace("/", "."), "imported from the current folder")
            raise ValueError(f"{what} {ref!r} cannot be imported: {mod!r} is a file path, not a module name; write "
                             f"'{name}:{attr}' (a module's dotted name without '.py', {where})") from None
        raise ValueError(f"{what} {ref!r} cannot be imported ({_one_line(e)}); check the {form!r} path") from None
    except Exception as e:  # noqa: BLE001 - the module's own code failed; named, without a traceback
        raise ValueError(f"{what} {ref!r}: importing module {mod!r} raised {type(e).__name__}: {_one_line(e)}; "
                         "fix the module (import it in Python to see the traceback)") from None


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or repr(e)


COMPLETION_KEYWORDS = ("completion_tokens", "finish_reason")  # what every reward may take besides the columns


class BoundReward:
    """A reward with some keyword arguments fixed (`overlong_penalty(max_length=48, cache_length=16)`). Its
    signature is the reward's without them, so no column of the same name reaches it."""

    def __init__(self, fn: Callable, params: dict[str, Any], name: str):
        sig = inspect.signature(fn)
        takes = [p.name for p in _own_params(fn, list(sig.parameters.values()))
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [k for k in params if k not in takes]
        if unknown:
            raise ValueError(f"reward {name!r}: no parameter(s) {unknown}; it takes {takes}")
        self.fn, self.params, self.__name__ = fn, dict(params), name
        self.minirl_batched = is_batched(fn)
        self.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in params])

    def __call__(self, *args: Any, **columns: Any) -> Any:
        return self.fn(*args, **{**columns, **self.params})


def bind_reward(ref: str | Callable, **params: Any) -> BoundReward:
    """A reward (a name, a 'module:function' path or a callable) with `params` fixed: the Python form of
    `name(key=value)` in a config's `rewards`."""
    name, fn = resolve_reward(ref)
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
    return BoundReward(fn, params, f"{name}({shown})")


def parse_call(ref: str) -> tuple[str, dict[str, Any]]:
    """'name(key=value, ...)' -> (name, {key: value}); values are Python literals."""
    head = ref[:ref.index("(")].strip()
    try:
        call = ast.parse(f"_f{ref[ref.index('('):]}", mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            raise ValueError("give key=value pairs only")
        return head, {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"reward {ref!r}: cannot read its parameters ({_one_line(e)}); write "
                         "name(key=value, ...) with literal values, e.g. format_match(pattern='^<answer>')") from None


def resolve_reward(ref: str | Callable) -> tuple[str, Callable]:
    if isinstance(ref, str) and ref.rstrip().endswith(")") and "(" in ref:
        name, params = parse_call(ref)
        _, fn = resolve_reward(name)
        return ref, BoundReward(fn, params, ref)
    if callable(ref):
        return getattr(ref, "__name__", repr(ref)), ref
    if ref in REGISTRY:
        return ref, REGISTRY[ref]
    if ":" in ref:
        name, fn = import_ref(ref, "reward", "module:function")
        if not callable(fn):  # a constant, a list of rewards: it would fail on every sample, after the model loaded
            raise ValueError(f"reward {ref!r} is {_a(type(fn).__name__)}, not a function; point it at a function "
                             "f(prompt, completion, **columns) -> float (or TRL's batched f(prompts, completions, "
                             "**kwargs))")
        return name, fn
    if "," in ref and all(p.strip() in REGISTRY or ":" in p for p in ref.split(",")):
        names = [p.strip() for p in ref.split(",")]
        raise ValueError(f"reward {ref!r} names {len(names)} rewards in one string: give a list, rewards: {names} "
                         f"(a flag: --rewards \"[{', '.join(names)}]\")")
    close = difflib.get_close_matches(ref, REGISTRY, 1)
    meant = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown reward {ref!r}{meant}: registered rewards are {sorted(REGISTRY)}; "
                     "register one with @minirl.reward or pass 'module:function'")


def source_hash(fn: Callable) -> str:
    """A short hash of a reward's source, so every score records which version of the reward made it."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        src = repr(fn)
    return hashlib.sha1(src.encode()).hexdigest()[:10]


def accepted_keywords(fn: Callable) -> set[str] | None:
    """The keywords a reward takes after (prompt, completion), or a batched one's besides (prompts, completions);
    None: any (it has **kwargs, or no signature)."""
    params = _params(fn)
    if params is None or any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in _own_params(fn, params) if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_data_columns(columns: Sequence[str]) -> list[str]:
    """The keywords rewards can take (the columns and COMPLETION_KEYWORDS); a column named like one of
    COMPLETION_KEYWORDS is an error (it would hide what the completion was)."""
    clash = [c for c in columns if c in COMPLETION_KEYWORDS]
    if clash:
        raise ValueError(f"the data has column(s) {clash}, the name(s) of what every reward receives about its "
                         f"completion ({', '.join(COMPLETION_KEYWORDS)}); rename the column(s)")
    return list(columns) + list(COMPLETION_KEYWORDS)


# column names other datasets give the answers (GSM8K's 'answer', MATH's 'solution', TRL examples' 'ground_truth')
ANSWER_LIKE = ("solution", "solutions", "label", "labels", "target", "ground_truth", "gold", "answers", "output",
               "expected", "expected_answer", "final_answer", "reference", "result")


def check_columns(fn: Callable, name: str, columns: Sequence[str]) -> None:
    """Fail before training when a reward needs a keyword the data does not have (a batched reward also gets
    BATCH_KEYWORDS)."""
    reward_form(fn, name)
    params = _params(fn) or []
    own = _own_params(fn, params)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        needed = [p.name for p in own if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    else:
        needed = [p.name for p in own if p.default is p.empty]
    columns = [*columns, *BATCH_KEYWORDS] if is_batched(fn) else columns
    missing = [n for n in needed if n not in columns]
    if missing:
        # the answers under another name ('solution', 'label'): answer_column renames that column to 'answer'
        like = next((c for c in columns if c.lower() in ANSWER_LIKE), None)
        renames = "" if "answer" not in missing else f"; the answers in {like!r}? set answer_column: {like}" if like \
            else "; answers in another column? set answer_column to its name"
        raise ValueError(f"reward {name!r} needs column(s) {missing} that the data lacks "
                         f"(columns: {sorted(columns)}); add them to the dataset, give them defaults, or fix them in "
                         f"`rewards` as {name.partition('(')[0]}({missing[0]}=...){renames}")

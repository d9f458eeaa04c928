"""Environments: multi-turn episodes and tools, as small as a notebook cell.

    class Guess(minirl.Env):
        def reset(self, row):                  # the chat messages that open the episode
            self.secret = row["secret"]
            return [{"role": "user", "content": "Guess my number between 1 and 50."}]
        def step(self, reply):                 # each model reply -> the env's messages, a reward, or the end
            n = minirl.rewards.last_integer(reply)
            if n == self.secret:
                return minirl.EnvStep(reward=1.0, done=True)
            return minirl.EnvStep(messages=[{"role": "user", "content": "higher" if (n or 0) < self.secret else "lower"}])

    run = minirl.Run(cfg, data=rows, env=Guess)       # one Guess object per episode

Tools are plain functions with type hints and a docstring: `minirl.tools([add])` is an env whose episodes open with
the row's prompt and run the tool each reply calls (a reply that calls none ends the episode, and the reward
functions score it); in an `Env`, methods decorated with `@minirl.tool` are its tools and the default `step` does
the same. The schemas reach the model through the chat template's tool format where it has one (`tools=`), else
through a system message in the plain-text format: a call is the reply `name(arg=value, ...)` (Python literals).
A call in the template formats is parsed too: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` or a bare
JSON object with "name" and "arguments" (or "parameters"). A tool that raises, or a call that cannot be parsed,
answers the model with the error as text (counted in `episode/tool_errors`).

The episode runner is `minirl.generation.episodes`; the rendering of turns as token ids, `minirl.generation.chat`.
"""
from __future__ import annotations

import ast
import functools
import inspect
import json
import re
import typing
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class EnvStep:
    """An env's answer to one reply: messages to append (user or tool messages), a reward (summed over the
    episode's steps), and whether the episode is over."""
    messages: Sequence[dict] = ()
    reward: float | None = None
    done: bool = False


def tool(fn: Callable) -> Callable:
    """Mark an `Env` method as a tool (type hints and a docstring make its schema)."""
    fn.__minirl_tool__ = True
    return fn


class Env:
    """One episode of an environment. A run makes a fresh object per episode (`env=` a class or any factory), so
    episode state lives on `self`. `reset(row)` gets the dataset row and returns the opening messages: they must
    depend on the row only (the G episodes of a row share them as the group's prompt; keep hidden state, such as
    a secret drawn at random, out of them). `step(reply)` may also be `async def`."""

    prompt_column = "prompt"
    tool_calls = 0   # counted by `call_tool`; the runner reads them into the episode record
    tool_errors = 0

    def reset(self, row: dict) -> list[dict]:
        """Default: the row's prompt column as one user message (or as the message list it holds)."""
        content = row[self.prompt_column]
        return list(content) if isinstance(content, list) else [{"role": "user", "content": str(content)}]

    def step(self, reply: str) -> EnvStep:
        """Default: run the tool the reply calls and answer with its result; a reply that calls none ends the
        episode."""
        messages = self.call_tool(reply)
        return EnvStep(done=True) if messages is None else EnvStep(messages=messages)

    def tools(self) -> list[Callable]:
        """The methods decorated with `@minirl.tool` (bound to this episode)."""
        return [getattr(self, n) for n, f in inspect.getmembers(type(self)) if getattr(f, "__minirl_tool__", False)]

    def call_tool(self, reply: str) -> list[dict] | None:
        """The tool call in `reply` run, its result (or its error, as text) as one 'tool' message; None when the
        reply calls no tool."""
        fns = {f.__name__: f for f in self.tools()}
        call = parse_tool_call(reply, fns)
        if call is None:
            return None
        self.tool_calls += 1
        name, args = call
        try:
            if isinstance(args, str):  # what could not be parsed, as the error
                raise ValueError(args)
            out = fns[name](**args)
            text = out if isinstance(out, str) else json.dumps(out, default=str)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the model reads the error and may try again (a tool
            self.tool_errors += 1                # that runs the model's code in-process sees exit() as SystemExit)
            text = f"error: {type(e).__name__}: {e}"
        return [{"role": "tool", "name": name, "content": text}]


class ToolEnv(Env):
    """The env of `minirl.tools(functions)`: the row's prompt, then the tools the replies call."""

    def __init__(self, functions: Sequence[Callable]):
        self._functions = list(functions)

    def tools(self) -> list[Callable]:
        return list(self._functions)


def tools(functions: Sequence[Callable]) -> Callable[[], Env]:
    """An env factory whose episodes open with the row's prompt and let the model call `functions` (plain
    functions with type hints and a docstring); a reply that calls no tool ends the episode."""
    functions = list(functions)
    names = [tool_schema(f)["function"]["name"] for f in functions]  # a function that cannot be a tool fails here
    if clash := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"two tools are named {clash[0]!r}: the model calls a tool by its name; rename one (its "
                         "__name__) or pass it once")
    factory = functools.partial(ToolEnv, functions)
    factory.__name__ = f"tools({', '.join(f.__name__ for f in functions)})"
    return factory


# --- schemas ------------------------------------------------------------------------------------------------

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of a tool in the common `{"type": "function", "function": {...}}` form: the name, the
    docstring's first paragraph, one property per parameter (its type hint; its line under "Args:", if any)."""
    name = fn.__name__
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {name!r} has no docstring; write one: it tells the model what the tool does")
    hints = typing.get_type_hints(fn)
    arg_docs = dict(re.findall(r"^\s*(\w+)(?:\s*\([^)]*\))?\s*:\s*(.+)$", doc.split("Args:", 1)[1], re.M)) \
        if "Args:" in doc else {}
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {name!r}: *{p.name} cannot be described to the model; name each parameter")
        if p.name not in hints:
            raise ValueError(f"tool {name!r}: parameter {p.name!r} has no type hint; tools need type hints "
                             "(they become the schema the model sees)")
        t = typing.get_origin(hints[p.name]) or hints[p.name]
        props[p.name] = {"type": _JSON_TYPES.get(t, "string")}
        if p.name in arg_docs:
            props[p.name]["description"] = arg_docs[p.name].strip()
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "function", "function": {"name": name, "description": doc.split("\n\n")[0].split("Args:")[0].strip(),
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


_EXAMPLE = {"integer": [2, 3, 5], "number": [1.5, 2.5, 0.5], "string": ['"text"'] * 3, "boolean": ["True"] * 3}


def plain_tool_prompt(fns: Sequence[Callable]) -> str:
    """The system message that describes tools in the plain-text call format (templates without a tool format)."""
    lines = ["You can call these tools:"]
    for f in fns:
        s = tool_schema(f)["function"]
        params = ", ".join(f"{k}: {v['type']}" for k, v in s["parameters"]["properties"].items())
        lines.append(f"- {s['name']}({params}): {s['description']}")
    s = tool_schema(fns[0])["function"]
    props = s["parameters"]["properties"]
    example = ", ".join(str(_EXAMPLE.get(v["type"], ["x"] * 3)[i % 3]) for i, v in enumerate(props.values()))
    lines.append(f"To call a tool, reply with only the call, for example: {s['name']}({example})")
    lines.append("The result comes back in the next message. When you know the answer, reply without a call.")
    return "\n".join(lines)


# --- parsing calls --------------------------------------------------------------------------------------------

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_tool_call(reply: str, fns: dict[str, Callable]) -> tuple[str, dict | str] | None:
    """The first tool call in `reply` as (name, arguments), None if it calls no tool. A call that names a tool but
    cannot be read comes back as (name, reason): the caller answers the model with the reason."""
    if not fns:
        return None
    m = _TAGGED.search(reply)
    if m:
        return _json_call(m.group(1), fns)
    text = reply.strip()
    if text.startswith("{") and '"name"' in text:
        return _json_call(text, fns)
    m = re.search(r"\b(" + "|".join(re.escape(n) for n in fns) + r")\s*\(", reply)
    if m is None:
        return None
    name, depth, end = m.group(1), 0, None
    for k in range(m.end() - 1, len(reply)):
        depth += {"(": 1, ")": -1}.get(reply[k], 0)
        if depth == 0:
            end = k + 1
            break
    if end is None:
        return name, f"the call {reply[m.start():].strip()!r} is not closed; write {name}(...)"
    try:
        node = ast.parse(reply[m.start():end], mode="eval").body
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    except (SyntaxError, ValueError) as e:
        return name, f"cannot read the call {reply[m.start():end]!r}: arguments must be literals ({e})"
    params = list(inspect.signature(fns[name]).parameters)
    if len(args) > len(params):
        return name, f"{name} takes {len(params)} arguments, got {len(args)}"
    return name, {**dict(zip(params, args)), **kwargs}


def _json_call(text: str, fns: dict[str, Callable]) -> tuple[str, dict | str]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return "?", f"the tool call is not valid JSON ({e.msg})"
    name = obj.get("name") if isinstance(obj, dict) else None
    if name not in fns:
        return "?", f"no tool named {name!r}; the tools are {sorted(fns)}"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return (name, args) if isinstance(args, dict) else (name, "the arguments must be a JSON object")

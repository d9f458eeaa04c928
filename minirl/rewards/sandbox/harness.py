"""The two programs `run_tests` runs in the sandbox, and the plain-data codec that both ends of their channels use.
Standard library only: this file's source, followed by one call (`program`), is each program's text.

A channel is JSON lines: requests on the program's fd 3, replies on its fd 4.
- The solution's process holds the solution and nothing else. `{"id", "names": true}` is answered with
  `{"id", "names": [its top-level callables]}`; `{"id", "call": name, "args", "kwargs"}` with `{"id", "value"}`,
  `{"id", "raised": [the exception's class names, most derived first], "message"}` or `{"id", "not_plain": why}`
  (which fails the test, in the judge: the tests' process cannot catch it);
  when the solution did not load, every request with `{"id", "failed": why}`.
- The tests' process holds the test code, with a `Proxy` in place of each function of the solution (their names
  come first: `{"names": [...]}`). `{"id", "run": i}` runs test i; each proxy call in it is `{"call", "args",
  "kwargs"}`, answered with the solution's reply; the verdict is `{"id", "ok", "error"}`.
Plain data: None, bool, int, float, str and list travel as JSON; tuple, set, frozenset, dict, bytes and complex as
one-key objects (`{"tuple": [...]}`, `{"dict": [[key, value], ...]}`, ...); nothing else does.
"""
import builtins
import functools
import os
from json import dumps, loads

REQUESTS, REPLIES = 3, 4
MAX_DEPTH = 100
_SEQUENCES = {tuple: "tuple", set: "set", frozenset: "frozenset"}
_BASES = (int, float, str, list, tuple, dict, set, frozenset, bytes, complex)


class NotPlainData(ValueError):
    """A value the codec does not carry (no JSON data, nor a tuple, set, dict, bytes or complex of it); the
    message names it."""


def encode(value, depth=0):
    """`value` as JSON data. A subclass of a built-in type goes as that type (an int subclass as its int value,
    whatever its `__eq__` says); any other object raises NotPlainData."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if depth > MAX_DEPTH:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH}")
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind in _SEQUENCES:
        return {_SEQUENCES[kind]: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    base = next((b for b in _BASES if isinstance(value, b)), None)
    if base is None:
        raise NotPlainData(f"a {kind.__module__}.{kind.__qualname__}")
    return encode(base(value), depth + 1)


def decode(data, depth=0):
    """The value `encode` made `data` from, built of built-in types only; NotPlainData for anything else."""
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if depth > MAX_DEPTH + 1:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH}")
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is dict and len(data) == 1:
        (tag, body), = data.items()
        try:
            if tag == "bytes" and type(body) is str:
                return bytes.fromhex(body)
            if type(body) is list:
                if tag == "complex" and len(body) == 2 and all(type(x) in (int, float) for x in body):
                    return complex(*body)
                if tag == "dict" and all(type(kv) is list and len(kv) == 2 for kv in body):
                    return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
                made = {"tuple": tuple, "set": set, "frozenset": frozenset}.get(tag)
                if made is not None:
                    return made(decode(v, depth + 1) for v in body)
        except (TypeError, ValueError, ArithmeticError) as e:  # an unhashable key or member, bad hex, 10**400j
            raise NotPlainData(f"{tag}: {e}") from None
    raise NotPlainData(dumps(data)[:80])


def describe(e: BaseException) -> str:
    """One line: the exception's type and message (its message cut at 300 characters)."""
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - a message that cannot be made still has a type
        text = ""
    return " ".join(f"{type(e).__name__}: {text}".split())[:300] if text else type(e).__name__


def _incoming():
    with open(REQUESTS, "rb", closefd=False) as requests:
        for line in requests:
            try:
                yield loads(line)
            except ValueError:
                continue


def _send(message: dict) -> None:
    data = (dumps(message) + "\n").encode()
    while data:
        data = data[os.write(REPLIES, data):]


# ---- the solution's process ----

def serve_solution(setup: str, code: str) -> None:
    namespace = {"__name__": "solution"}
    try:
        exec(compile(setup + "\n" + code, "solution.py", "exec"), namespace)
        failed = None
    except BaseException as e:  # noqa: BLE001 - the solution's fault, reported for every test
        failed = describe(e) + " (in the solution)"
    for request in _incoming():
        _send(_answer(namespace, request) if failed is None else {"id": request.get("id"), "failed": failed})


def _answer(namespace: dict, request: dict) -> dict:
    rid = request.get("id")
    if request.get("names"):
        return {"id": rid, "names": sorted(n for n, v in namespace.items() if callable(v) and n.isidentifier())}
    name = request.get("call")
    if not callable(fn := namespace.get(name)):
        return {"id": rid, "raised": ["NameError"], "message": f"name {name!r} is not defined in the solution"}
    try:
        value = fn(*decode(request["args"]), **decode(request["kwargs"]))
    except BaseException as e:  # noqa: BLE001 - SystemExit included: the test fails, the process goes on
        return {"id": rid, "raised": [c.__name__ for c in type(e).__mro__], "message": describe(e).partition(": ")[2]}
    try:
        reply = {"id": rid, "value": encode(value)}
        dumps(reply)  # an int too long to write, say
        return reply
    except BaseException as e:  # noqa: BLE001 - anything that cannot go as plain data fails its test
        return {"id": rid, "not_plain": str(e) if isinstance(e, NotPlainData) else describe(e)}


# ---- the tests' process ----

class SolutionError(BaseException):
    """Raised by a proxy when the solution raised something that is no built-in Exception (its own class, say,
    or SystemExit); a test's `except Exception` does not catch it."""


class NoAnswer(BaseException):
    """Raised by a proxy whose call got no answer a test may judge (a value that is not plain data, no reply, a
    solution that did not load). Not an Exception, so no `except ValueError` / `except Exception` takes it for
    the error a test expects; and whatever the test does with it, the judge outside has already failed the
    test (`code_tests._Judge`): this process cannot undo that."""


class Proxy:
    """A function of the solution, in the tests' process: a call goes to the solution's process, its arguments
    and its result as plain data; an exception it raised comes back as its nearest built-in Exception class."""

    def __init__(self, name: str, requests):
        self.__name__, self._requests = name, requests

    def __call__(self, *args, **kwargs):
        _send({"call": self.__name__, "args": encode(list(args)), "kwargs": encode(kwargs)})
        reply = next(self._requests, None) or {}
        if isinstance(reply.get("raised"), list):
            raise _exception(reply["raised"], str(reply.get("message", "")))
        try:
            if "value" in reply:
                return decode(reply["value"])
        except NotPlainData:
            pass
        raise NoAnswer(f"the answer of {self.__name__}() is not plain data: {reply.get('not_plain', 'no reply')}")


def _exception(names: list, message: str) -> BaseException:
    for name in names:
        cls = getattr(builtins, str(name), None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                return cls(message)
            except Exception:  # noqa: BLE001 - a class wanting other arguments (UnicodeDecodeError)
                break
    return SolutionError(f"{names[0] if names else 'error'}: {message}")


def serve_tests(setup: str, tests: list, entry_point) -> None:
    requests = _incoming()
    namespace = {"__name__": "tests"}
    try:
        exec(compile(setup, "setup.py", "exec"), namespace)
        failed = None
    except BaseException as e:  # noqa: BLE001 - every test fails with it
        failed = describe(e) + " (in the setup)"
    taken = set(namespace) | set(dir(builtins))  # a solution's `len` or `set` never stands in for the real one
    names = next(requests, {}).get("names", [])  # the first request: the solution's functions
    namespace.update({n: Proxy(n, requests) for n in names if n.isidentifier() and n not in taken})
    for request in requests:
        verdict = {"ok": False, "error": failed} if failed else _run_test(namespace, request["run"],
                                                                         tests[request["run"]], entry_point, requests)
        _send({"id": request.get("id"), **verdict})


def _run_test(namespace: dict, i: int, test: str, entry_point, requests) -> dict:
    where = " ".join(test.split())[:300]
    try:
        exec(compile(test, f"<test {i}>", "exec"), namespace)
        if "check" in namespace:
            if entry_point is None:
                raise ValueError("the test defines check(candidate) but run_tests got no entry_point to call it with")
            namespace.pop("check")(Proxy(entry_point, requests))
        return {"ok": True}
    except AssertionError as e:
        return {"ok": False, "error": "assertion failed: " + where + (f" ({e})" if str(e) else "")}
    except BaseException as e:  # noqa: BLE001 - the test fails with its reason
        return {"ok": False, "error": f"{describe(e)} in: {where}"}


def program(serve: str, **arguments) -> str:
    """The text of a program: this file, then `serve(**arguments)` (arguments: str, list, None)."""
    return f"{_source()}\n{serve}(**{arguments!r})\n"


@functools.cache
def _source() -> str:
    with open(__file__, encoding="utf-8") as f:
        return f.read()

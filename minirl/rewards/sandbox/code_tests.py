"""`run_tests`: a completion's code against MBPP / HumanEval-style tests, judged outside the judged program.

The solution runs in its own sandboxed process (`harness.serve_solution`) and answers calls -- a function's name
and its arguments -- with results, both ways as plain data (`harness.encode`). The expected values never enter it:
- An MBPP assert of the shape `assert f(<literals>) == <literal>` (either way round; also `is None/True/False`,
  `assert f(...)` and `assert not f(...)`) is split here (`split_assert`) into its call and its expected value;
  the call goes to the solution's process, and this process compares the answer with the expected value.
- Any other test (HumanEval's `def check(candidate): ...`, an assert around `math.isclose`, ...) runs in a second
  sandboxed process (`harness.serve_tests`), in which each function of the solution is a proxy whose calls this
  process relays to the solution's process.
A result that is not plain data fails its test; a solution that exits, crashes or runs out of time fails every
test not yet answered. What a score proves and what it does not: docs/safety.md, "Code rewards and the sandbox".
"""
from __future__ import annotations

import ast
import json
import re
import reprlib
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

from . import harness
from .harness import NotPlainData, decode, encode
from .process import Sandboxed, SandboxResult, pump, start


@dataclass(frozen=True)
class TestsResult:
    """The tests of one completion: how many passed, the first failure's reason ("" when all passed), and how
    the solution's process ended (its output included)."""
    passed: int
    total: int
    first_failure: str
    run: SandboxResult

    @property
    def fraction(self) -> float:
        return self.passed / self.total

    @property
    def all_passed(self) -> bool:
        return self.passed == self.total


@dataclass(frozen=True)
class SplitAssert:
    """An MBPP assert as data: the call `name(*args, **kwargs)`, and how its answer must compare with
    `expected` (`op`: "==", "is", "truthy", "falsy")."""
    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    op: str = "truthy"
    expected: Any = None

    def holds(self, value: Any) -> bool:
        """Whether the assert holds for the answer `value` (plain data: no user code runs here)."""
        if self.op == "==":
            return value == self.expected
        if self.op == "is":
            return value is self.expected
        return bool(value) == (self.op == "truthy")


_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The code of a completion: its first ```python fenced block (failing that, its first unlabeled fenced
    block; a fence left open runs to the end), else the whole text."""
    blocks = _FENCE.findall(completion)
    labeled = [body for label, body in blocks if label] or [body for _, body in blocks]
    return labeled[0] if labeled else completion


def as_programs(tests: Any) -> list[str]:
    """`tests` as a list of test programs: a list (or tuple) of strings is one program each (MBPP's asserts), one
    string is one program (HumanEval's `test`); anything else is an error naming what it got."""
    if isinstance(tests, str):
        tests = [tests] if tests.strip() else []
    elif not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
        got = type(tests).__name__ if not isinstance(tests, (list, tuple)) else \
            f"a {type(tests).__name__} holding {sorted({type(t).__name__ for t in tests if not isinstance(t, str)})}"
        raise TypeError(f"run_tests: tests must be a list of test strings (MBPP asserts) or one string (a HumanEval "
                        f"test program), got {got}")
    if not tests:
        raise ValueError("run_tests: tests is empty; pass at least one test")
    return list(tests)


def run_tests(completion: str, tests: list[str] | str, *, entry_point: str | None = None, setup: str = "",
              timeout_s: float = 5, memory_mb: float = 512, allow_unsandboxed: bool = False) -> TestsResult:
    """Run the completion's code (see `extract_code`, after `setup`) against `tests` (see `as_programs`): MBPP
    asserts (`assert f(1) == 2`), or HumanEval test code defining `check(candidate)`, called with the solution's
    `entry_point` function. `setup` also runs before the tests. `timeout_s` is for all the tests together;
    `memory_mb` per process. A reward can use `fraction` or `all_passed`. Raises where no sandbox can run."""
    programs = as_programs(tests)
    if not isinstance(completion, str) or not isinstance(setup, str):
        raise TypeError("run_tests: completion and setup must be str")
    if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
        raise ValueError(f"run_tests: entry_point must be a function name, got {entry_point!r}")
    judge = _Judge(extract_code(completion), setup, programs, entry_point,
                   dict(timeout_s=timeout_s, memory_mb=memory_mb, allow_unsandboxed=allow_unsandboxed))
    try:
        failures = [judge.check(i) for i in range(len(programs))]
    finally:
        run = judge.close()
    return TestsResult(failures.count(None), len(programs), next((f for f in failures if f), ""), run)


def split_assert(test: str) -> SplitAssert | None:
    """The call and expected value of an MBPP assert of a shape this process can judge alone (see the module's
    docstring), else None (the test then runs in the tests' process)."""
    try:
        body = ast.parse(test).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if len(body) != 1 or not isinstance(body[0], ast.Assert) or body[0].msg is not None:
        return None
    node, op = body[0].test, "truthy"
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node, op = node.operand, "falsy"
    if isinstance(node, ast.Call):
        call = _literal_call(node)
        return SplitAssert(*call, op=op) if call else None
    if op != "truthy" or not isinstance(node, ast.Compare) or len(node.ops) != 1:
        return None
    eq = isinstance(node.ops[0], ast.Eq)
    if not eq and not isinstance(node.ops[0], ast.Is):
        return None
    for side, other in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
        call, (ok, expected) = _literal_call(side), _literal(other)
        if call and ok and (eq or any(expected is c for c in (None, True, False))):
            return SplitAssert(*call, op="==" if eq else "is", expected=expected)
    return None


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _literal_call(node: ast.AST) -> tuple[str, tuple, dict] | None:
    """(name, args, kwargs) of a call `name(<literals>)` whose arguments are plain data, else None."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return None
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return None
    values = [_literal(a) for a in [*node.args, *(k.value for k in node.keywords)]]
    if not all(ok for ok, _ in values):
        return None
    args = tuple(v for _, v in values[:len(node.args)])
    kwargs = {k.arg: v for k, (_, v) in zip(node.keywords, values[len(node.args):])}
    try:
        encode([args, kwargs])
    except NotPlainData:  # an Ellipsis, say
        return None
    return node.func.id, args, kwargs


class _Judge:
    """One completion's tests: the solution's process, the tests' process (started by the first test that needs
    it), and the relay between them. Mutable."""

    def __init__(self, code: str, setup: str, tests: list[str], entry_point: str | None, options: dict):
        self.tests, self.entry_point, self.options = tests, entry_point, options
        self.splits = [split_assert(t) for t in tests]
        self.solution = start(harness.program("serve_solution", setup=setup, code=code), channel=True, **options)
        self.tester = None  # started with the solution (its start-up overlaps) if some test needs it
        if None in self.splits:
            self.tester = start(harness.program("serve_tests", setup=setup, tests=tests, entry_point=entry_point),
                                channel=True, **options)
        self.named = False  # the tests' program has been told the solution's names
        self.failed = ""  # the solution did not load (or lacks the entry point): every test fails with this
        self.gone = ""    # why a program stopped answering: every test not yet answered fails with this

    def check(self, i: int) -> str | None:
        """Test i: None when it passed, else why not (one line)."""
        if self.failed:
            return self.failed
        if self.gone:
            return f"test {i} did not finish: {self.gone}"
        split = self.splits[i]
        if split is None:
            return self._run_program(i)
        reply = self._ask(self.solution, {"call": split.name, "args": encode(list(split.args)),
                                          "kwargs": encode(split.kwargs)})
        return self._gone(i, self.solution) if reply is None else self._judged(reply, split, _where(self.tests[i]))

    def close(self) -> SandboxResult:
        """Let both programs end (until the deadline); how the solution's ended."""
        programs = self._programs()
        for p in programs:
            p.end_requests()
        try:
            pump(programs)
        finally:
            results = [p.finish() for p in programs]
        return results[0]

    def _judged(self, reply: dict, split: SplitAssert, where: str) -> str | None:
        if "failed" in reply:
            self.failed = _line(reply["failed"])
            return self.failed
        if "raised" in reply:
            names = reply["raised"] if isinstance(reply["raised"], list) and reply["raised"] else ["error"]
            return _line(f"{names[0]}: {reply.get('message', '')}".rstrip(": ") + f" in: {where}")
        try:
            if "value" not in reply:
                raise NotPlainData(reply.get("not_plain", "no value in the reply"))
            value = decode(reply["value"])
        except NotPlainData as e:
            return _line(f"{where}: the answer is not plain data: {e}")
        return None if split.holds(value) else _line(f"assertion failed: {where} (returned {_short(value)})")

    def _run_program(self, i: int) -> str | None:
        """Test i in the tests' process, relaying its calls of the solution."""
        if not self.named:  # the solution's functions, for the tests' proxies
            reply = self._ask(self.solution, {"names": True})
            if reply is None:
                return self._gone(i, self.solution)
            names = reply.get("names") if isinstance(reply.get("names"), list) else []
            names = [n for n in names if isinstance(n, str)]
            if "failed" in reply or self.entry_point not in [*names, None]:
                self.failed = _line(reply.get("failed") or
                                    f"NameError: the entry point {self.entry_point!r} is not defined (in the solution)")
                return self.failed
            self.tester.send({"names": names})
            self.named = True
        rid, fault = secrets.token_hex(8), ""
        self.tester.send({"id": rid, "run": i})
        while (message := self._next(self.tester, lambda m: m.get("id") == rid or "call" in m)) is not None:
            if message.get("id") == rid:
                return _line(fault) if fault else None if message.get("ok") is True else _line(message.get("error"))
            reply = self._ask(self.solution, {k: message.get(k) for k in ("call", "args", "kwargs")})
            if reply is None:
                return self._gone(i, self.solution)
            # judged here, where the test's code cannot reach: a call with no plain answer fails the test, whatever
            # the test then does with the proxy's NoAnswer (catch it, expect it)
            fault = fault or _no_answer(reply, message.get("call"), _where(self.tests[i]))
            self.tester.send(reply)
        return self._gone(i, self.tester)

    def _ask(self, program: Sandboxed, message: dict) -> dict | None:
        """Send `message` with a fresh id; the reply bearing it (other lines are skipped), or None if the program
        ended first."""
        rid = secrets.token_hex(8)
        program.send({**message, "id": rid})
        return self._next(program, lambda m: m.get("id") == rid)

    def _next(self, program: Sandboxed, wanted: Callable[[dict], bool]) -> dict | None:
        found: list[dict] = []

        def arrived() -> bool:
            while program.lines and not found:
                message = _parse(program.lines.popleft())
                if message is not None and wanted(message):
                    found.append(message)
            return bool(found) or program.done
        pump(self._programs(), arrived)
        return found[0] if found else None

    def _gone(self, i: int, program: Sandboxed) -> str:
        """Test i failed because `program` stopped answering; so will every later one. A sandbox that could not
        be set up is no verdict on the solution: that raises."""
        for p in self._programs():  # both go: the tests cannot go on without the solution, nor the reverse
            if p is not program:
                p.kill("stopped")
        result = program.finish()
        if result.reason.startswith("sandbox setup failed"):
            raise RuntimeError(f"run_tests: {result.reason}")
        whose = "the solution" if program is self.solution else "the tests' program"
        if program.killed == "timeout":
            self.gone = f"timeout after {self.options['timeout_s']:g}s"
        else:
            self.gone = f"{whose} ended ({result.reason or 'exit code 0'})"
        return f"test {i} did not finish: {self.gone}"

    def _programs(self) -> list[Sandboxed]:
        return [p for p in (self.solution, self.tester) if p is not None]


def _no_answer(reply: dict, name: Any, where: str) -> str:
    """Why `reply` is no answer a test may judge (a plain value, or a raised exception); empty when it is one."""
    if isinstance(reply.get("raised"), list):
        return ""
    try:
        if "value" not in reply:
            raise NotPlainData(reply.get("not_plain") or reply.get("failed") or "no value in the reply")
        decode(reply["value"])
        return ""
    except NotPlainData as e:
        return f"{where}: the answer of {_line(name, 80)}() is not plain data: {e}"


def _parse(line: bytes) -> dict | None:
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def _where(test: str) -> str:
    return " ".join(test.split())[:300]


def _line(text: Any, limit: int = 500) -> str:
    return " ".join(str(text).split())[:limit]


def _short(value: Any) -> str:
    try:
        return reprlib.repr(value)
    except ValueError:  # an int too long to write
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else "a value too long to show"

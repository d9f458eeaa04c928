"""`run_tests` against hostile solutions: the verdict is decided outside the judged program, so each solution of
the battery scores exactly the fraction of tests it truly passes. Plus the shapes of `tests`, the split of MBPP
asserts, the plain-data codec, and HumanEval test programs run beside the solution with a proxy."""
import math

import pytest

from minirl.rewards.builtin import code_tests_pass
from minirl.rewards.sandbox.code_tests import SplitAssert
from minirl.rewards.sandbox.harness import NotPlainData, decode, encode
from minirl.sandbox import as_programs, isolation, run_tests, split_assert

needs_isolation = pytest.mark.skipif(isolation() == "none", reason=f"no sandbox here: {isolation()}")

ADD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(3, 4) == 7", "assert add(5, 5) == 10"]
CHECK = ("def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(3, 4) == 7\n"
         "    assert candidate(5, 5) == 10\n")


def cheat_at_3(body: str) -> str:
    """`add`, right except for a == 3 (the second test), where it runs `body` instead."""
    return "def add(a, b):\n    if a == 3:\n" + "".join(f"        {line}\n" for line in body.splitlines()) + \
        "    return a + b\n"


FIND_EXPECTED = '''\
def _expected_in(text, a, b):
    import re
    m = re.search(r"\\w+\\(%d, %d\\) == (-?\\d+)" % (a, b), text)
    return int(m.group(1)) if m else None
'''
# Each cheats on the second test. The true fraction: 2/3, or 1/3 where it ends its process there (a solution that
# exits fails every test not yet answered). Each scored 3/3 on the harness that ran the tests in the solution's
# process (7c1e0b5 and before).
HOSTILE = {
    "the __main__ hook": (cheat_at_3(
        "import __main__\n"
        "real = getattr(__main__, '_report', None)\n"
        "if real is not None:\n"
        "    __main__._report = lambda **f: real(**{**f, 'ok': True})\n"
        "return None"), 2 / 3),
    "frame walking to the caller": (FIND_EXPECTED + cheat_at_3(
        "import sys\n"
        "frame = sys._getframe(1)\n"
        "while frame is not None:\n"
        "    for v in [*frame.f_locals.values(), *frame.f_globals.values(), *frame.f_code.co_consts]:\n"
        "        if isinstance(v, str) and _expected_in(v, a, b) is not None:\n"
        "            return _expected_in(v, a, b)\n"
        "    frame = frame.f_back\n"
        "return None"), 2 / 3),
    "gc scanning for the expected values": (FIND_EXPECTED + cheat_at_3(
        "import gc\n"
        "for obj in gc.get_objects():\n"
        "    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()\n"
        "    for v in list(items):\n"
        "        if isinstance(v, str) and _expected_in(v, a, b) is not None:\n"
        "            return _expected_in(v, a, b)\n"
        "return None"), 2 / 3),
    "writing to inherited or guessed fds": (cheat_at_3(
        "import __main__, json, os\n"
        "nonce = getattr(__main__, '_nonce', '')\n"
        "lines = [nonce + ' ' + json.dumps({'i': i, 'ok': True}) for i in range(3)]\n"
        "lines += ['exit 0', json.dumps({'ok': True}), json.dumps({'value': 7}), json.dumps({'passed': True})]\n"
        "blob = ('\\n' + '\\n'.join(lines) + '\\n').encode()\n"
        "for fd in range(256):\n"
        "    try:\n"
        "        os.write(fd, blob)\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)"), 1 / 3),
    "patching builtins": (
        "import builtins, json\n"
        "_dumps = json.dumps\n"
        "json.dumps = lambda obj, *a, **k: _dumps({**obj, 'ok': True} if isinstance(obj, dict) else obj, *a, **k)\n"
        "_print = builtins.print\n"
        "builtins.print = lambda *a, **k: _print('{\"ok\": true}')\n"
        "builtins.AssertionError = type('AssertionError', (Exception,), {})\n"
        + cheat_at_3("return -1"), 2 / 3),
    "an always-equal object": (
        "class Equal:\n    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n" + cheat_at_3("return Equal()"), 2 / 3),
    "an always-equal int": (
        "class Equal(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        + cheat_at_3("return Equal(0)"), 2 / 3),
    "os._exit(0) after some tests pass": (cheat_at_3(
        "import __main__, os\n"
        "for i in range(3):\n"
        "    try:\n"
        "        __main__._report(i=i, ok=True)\n"
        "    except Exception:\n"
        "        pass\n"
        "os._exit(0)"), 1 / 3),
    "printing a fake verdict": (cheat_at_3(
        "import __main__, atexit, json, sys\n"
        "nonce = getattr(__main__, '_nonce', 'none')\n"
        "fake = ''.join('\\n' + nonce + ' ' + json.dumps({'i': i, 'ok': True}) + '\\n' for i in range(3))\n"
        "fake += ''.join(json.dumps({'id': i, 'value': 7, 'ok': True}) + '\\n' for i in range(3))\n"
        "atexit.register(lambda: (sys.stdout.write(fake), sys.stdout.flush()))\n"
        "print(fake)\n"
        "return -1"), 2 / 3),
}


@needs_isolation
@pytest.mark.parametrize("trick", HOSTILE)
def test_a_hostile_solution_scores_exactly_what_it_passes(trick):
    code, truth = HOSTILE[trick]
    r = run_tests(code, ADD_TESTS, timeout_s=3)
    assert r.passed / r.total == pytest.approx(truth), (r.passed, r.first_failure, r.run)
    assert r.first_failure.startswith(("assertion failed: assert add(3, 4) == 7", "assert add(3, 4) == 7: the answer",
                                       "test 1 did not finish: the solution ended (exit code 0)")), r.first_failure


@needs_isolation
@pytest.mark.parametrize("trick", ["frame walking to the caller", "gc scanning for the expected values",
                                   "an always-equal object", "os._exit(0) after some tests pass"])
def test_a_hostile_solution_fails_a_humaneval_check(trick):
    """The check runs in its own process; the solution's process sees only the calls."""
    r = run_tests(HOSTILE[trick][0], CHECK, entry_point="add")
    assert (r.passed, r.total) == (0, 1), r
    assert run_tests(ADD, CHECK, entry_point="add").all_passed


@needs_isolation
def test_always_true_objects_fail_truth_asserts():
    code = ("class Yes:\n    def __bool__(self):\n        return True\n"
            "    def __eq__(self, other):\n        return True\n"
            "def is_pos(x):\n    return Yes() if x == 2 else x > 0\n")
    r = run_tests(code, ["assert is_pos(1)", "assert is_pos(2)", "assert not is_pos(-3)", "assert is_pos(2) is True"])
    assert (r.passed, r.total) == (2, 4), r
    assert r.first_failure == "assert is_pos(2): the answer is not plain data: a solution.Yes"


# ---- the shapes of tests ----

@needs_isolation
def test_one_string_is_one_test_program():
    assert (run_tests(ADD, CHECK, entry_point="add").passed, run_tests(ADD, CHECK, entry_point="add").total) == (1, 1)
    r = run_tests("def add(a, b):\n    return a - b", CHECK, entry_point="add")
    assert (r.passed, r.total) == (0, 1) and r.first_failure.startswith("assertion failed: def check(candidate):")
    assert code_tests_pass("", ADD, CHECK, entry_point="add") == 1.0  # HumanEval's `test` and `entry_point` columns


def test_tests_of_another_kind_are_an_error_naming_what_came():
    for tests, error, message in [
            (5, TypeError, "run_tests: tests must be a list of test strings (MBPP asserts) or one string (a HumanEval "
                           "test program), got int"),
            ({"a": "assert True"}, TypeError, "got dict"),
            (["assert True", 3, None], TypeError, "got a list holding ['NoneType', 'int']"),
            (None, TypeError, "got NoneType"),
            ([], ValueError, "run_tests: tests is empty; pass at least one test"),
            ("  \n", ValueError, "tests is empty")]:
        with pytest.raises(error) as e:
            as_programs(tests)
        assert message in str(e.value)
        with pytest.raises(error):
            code_tests_pass("", ADD, tests)  # the reward raises: a recorded failure, never a silent score
    assert as_programs(("assert True", "assert 1")) == ["assert True", "assert 1"]


@needs_isolation
def test_a_check_without_an_entry_point_fails_instead_of_passing_unrun():
    r = run_tests(ADD, CHECK)
    assert r.passed == 0 and "no entry_point" in r.first_failure, r


# ---- the split of MBPP asserts, and the codec ----

def test_split_assert_takes_calls_of_literals_against_literals():
    assert split_assert("assert add(1, 2) == 3") == SplitAssert("add", (1, 2), {}, "==", 3)
    assert split_assert("assert [1, (2,)] == f(x={1: 'a'}, y=b'z')") == \
        SplitAssert("f", (), {"x": {1: "a"}, "y": b"z"}, "==", [1, (2,)])
    assert split_assert("assert not is_odd(-4)") == SplitAssert("is_odd", (-4,), {}, "falsy")
    assert split_assert("assert is_odd(3)") == SplitAssert("is_odd", (3,), {}, "truthy")
    assert split_assert("assert f(1) is None") == SplitAssert("f", (1,), {}, "is", None)
    for other in ("assert f(1) is 3", "assert f(x) == 1", "assert math.isclose(f(1), 2)", "assert f(1) == 2, 'msg'",
                  "assert f(*a) == 1", "assert f(1) != 2", "assert set(f(1)) == {1}", "x = 1\nassert f(x) == 1",
                  "def check(candidate): pass", "assert f(...) == 1", "assert f(1) == 2 == 2", "assert (",
                  "assert o.f(1) == 2"):
        assert split_assert(other) is None, other
    assert SplitAssert("f", (), op="==", expected=(1, 2)).holds((1, 2))
    assert not SplitAssert("f", (), op="==", expected=(1, 2)).holds([1, 2])  # as Python's == says
    assert SplitAssert("f", (), op="==", expected=1).holds(1.0) and SplitAssert("f", (), op="falsy").holds([])


def test_the_codec_carries_plain_data_and_nothing_else():
    values = [None, True, 0, -7, 10**30, 1.5, math.inf, "é\n\udc80", [1, [2]], (1, (2,)), {1, "a"}, frozenset({3}),
              {"a": [1], 2: (3,), (4, 5): None}, b"\x00\xff", 1 + 2j, [], ()]
    for v in values:
        assert decode(encode(v)) == v and type(decode(encode(v))) is type(v)
    from collections import OrderedDict, namedtuple
    point = namedtuple("point", "x y")
    assert decode(encode(point(1, 2))) == (1, 2) and type(decode(encode(point(1, 2)))) is tuple
    assert decode(encode(OrderedDict(a=1))) == {"a": 1}
    for v in (object(), print, [1, object()], {"a": {1, 2, 3.0, ...}}, type, iter([])):
        with pytest.raises(NotPlainData):
            encode(v)
    deep = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(NotPlainData, match="nested deeper"):
        encode(deep)
    for junk in ({"tuple": 1}, {"set": [[1]]}, {"dict": [[[1], 2]]}, {"bytes": "zz"}, {"a": 1, "b": 2}, {"eval": []},
                 {"complex": ["1", 2]}):
        with pytest.raises(NotPlainData):
            decode(junk)


# ---- HumanEval test programs: proxies, exceptions, state ----

@needs_isolation
def test_a_proxy_raises_the_solutions_builtin_exceptions_and_nothing_else_is_caught():
    raises = "def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError:\n        return\n" \
             "    raise AssertionError('no ValueError')\n"
    own = "class Bad(ValueError):\n    pass\ndef f(x):\n    raise Bad('negative')\n"
    assert run_tests(own, raises, entry_point="f").all_passed  # its own class, seen as the built-in it derives from
    exits = "def f(x):\n    raise SystemExit(0)\n"
    catch_all = "def check(candidate):\n    try:\n        candidate(-1)\n    except Exception:\n        pass\n"
    r = run_tests(exits, catch_all, entry_point="f")
    assert r.passed == 0 and "SolutionError: SystemExit" in r.first_failure, r


@needs_isolation
def test_mixed_tests_keep_their_order_and_the_solutions_state():
    counter = "n = 0\ndef tick():\n    global n\n    n += 1\n    return n\n"
    tests = ["assert tick() == 1", "assert tick() + 0 == 2", "assert tick() == 3",
             "import math\nassert math.isclose(tick(), 4)"]
    r = run_tests(counter, tests)
    assert (r.passed, r.total) == (4, 4), r


@needs_isolation
def test_a_solutions_names_never_shadow_the_tests_builtins_or_setup():
    cheat = "def set(x):\n    return 1\ndef isclose(*a, **k):\n    return True\ndef f(x):\n    return [x, 0]\n"
    r = run_tests(cheat, ["assert set(f(1)) == set([1, 2])", "assert isclose(f(1)[0], 2)"],
                  setup="from math import isclose")
    assert r.passed == 0, r


@needs_isolation
def test_run_tests_names_the_failed_test_and_uses_setup():
    r = run_tests(ADD, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    assert (r.passed, r.total, r.first_failure, r.fraction, r.all_passed) == (2, 2, "", 1.0, True)
    r = run_tests(ADD, ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(1) == 1"])
    assert (r.passed, r.total, r.all_passed) == (1, 3, False)
    assert r.first_failure == "assertion failed: assert add(2, 2) == 5 (returned 4)"
    r = run_tests(ADD, ["assert add(1) == 1"])
    assert r.first_failure == "TypeError: add() missing 1 required positional argument: 'b' in: assert add(1) == 1"
    r = run_tests("def add(a, b) return a + b", ["assert add(1, 2) == 3"])
    assert r.passed == 0 and r.first_failure.startswith("SyntaxError") and "(in the solution)" in r.first_failure
    r = run_tests("def area(r):\n    return pi * r * r", ["assert round(area(1), 2) == 3.14"],
                  setup="from math import pi")
    assert r.all_passed, r


@needs_isolation
def test_humaneval_entry_point_and_partial_credit_on_timeout():
    r = run_tests(ADD, CHECK, entry_point="plus")
    assert r.passed == 0 and "plus" in r.first_failure
    r = run_tests(ADD, ["assert add(1, 1) == 2", "while True: pass", "assert add(0, 0) == 0"], timeout_s=1.5)
    assert (r.passed, r.first_failure) == (1, "test 1 did not finish: timeout after 1.5s")
    r = run_tests("def add(a, b):\n    while a: pass\n    return b", ADD_TESTS[:1] + ["assert add(0, 2) == 2"],
                  timeout_s=1.5)
    assert (r.passed, r.first_failure) == (0, "test 0 did not finish: timeout after 1.5s")


@needs_isolation
def test_a_solution_flooding_its_channel_is_stopped():
    flood = "import os\ndef add(a, b):\n    if a == 3:\n        os.write(4, b'x' * (17 << 20))\n    return a + b\n"
    r = run_tests(flood, ADD_TESTS, timeout_s=10)
    assert (r.passed, r.first_failure) == (1, "test 1 did not finish: the solution ended (channel limit)"), r


@needs_isolation
@pytest.mark.parametrize("forged", ["{'names': None, 'value': {'complex': [10**400, 0]}}",
                                    "{'raised': 5, 'message': None}", "{'failed': 7}",
                                    "{'value': {'set': [[1]]}, 'names': 'add'}", "{'value': eval('[' * 5000 + ']' * 5000)}"])
def test_a_solution_answering_in_the_harness_place_only_fails_its_own_tests(forged):
    """The solution can replace the harness in its process and send any reply: junk fails its tests, and
    `run_tests` still returns a score (a raise would be a recorded failure, leaving the sample out of the loss)."""
    code = (f"import __main__\n__main__._answer = lambda namespace, request: {{'id': request.get('id'), **{forged}}}\n"
            "def add(a, b):\n    return a + b\n")
    r = run_tests(code, ADD_TESTS[:2] + ["import math\nassert math.isclose(add(1, 2), 3)"])
    assert (r.passed, r.total) == (0, 3), r


# ---- a call with no plain answer fails its test, whatever the test does with it (issue 51) ----

NOT_PLAIN = {"an object": "return object()", "a generator": "return (i for i in [x])",
             "a function": "return f", "a module": "import os\n    return os",
             "an int too long to write": "return 10 ** 5000", "a list holding an object": "return [1, object()]"}
EXPECTING = {  # tests that pass when f(-1) raises ValueError: each caught NotPlainData (a ValueError) at fb083f9
    "try/except ValueError/else": "try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False, 'no error'",
    "except Exception": "try:\n    f(-1)\n    ok = False\nexcept Exception:\n    ok = True\nassert ok",
    "except BaseException": "try:\n    f(-1)\n    ok = False\nexcept BaseException:\n    ok = True\nassert ok",
    "assertRaises(ValueError)": (
        "import unittest\nclass T(unittest.TestCase):\n    def test(self):\n        with self.assertRaises(ValueError):\n"
        "            f(-1)\nresult = unittest.TestResult()\nunittest.defaultTestLoader.loadTestsFromTestCase(T).run(result)\n"
        "assert result.wasSuccessful(), result.failures"),
    "a check that swallows everything": "def check(candidate):\n    try:\n        candidate(-1)\n    except BaseException:\n"
                                        "        return\n    raise AssertionError('no error')",
    "a caught call that then passes": "try:\n    f(-1)\nexcept BaseException:\n    pass\nassert f(2) == 2",
}


@needs_isolation
@pytest.mark.parametrize("test_name", EXPECTING)
def test_a_call_with_no_plain_answer_fails_whatever_the_test_catches(test_name):
    test = EXPECTING[test_name]
    honest = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n"
    assert run_tests(honest, [test], entry_point="f").all_passed  # the control: a real ValueError passes
    for what, body in NOT_PLAIN.items():
        forged = f"def f(x):\n    if x < 0:\n        {body}\n    return x\n"
        r = run_tests(forged, [test], entry_point="f")
        assert (r.passed, r.total) == (0, 1), (what, r)
        assert "the answer of f() is not plain data" in r.first_failure, (what, r.first_failure)


@needs_isolation
def test_a_solution_that_dies_or_stalls_inside_an_expecting_test_fails_it():
    test = EXPECTING["except BaseException"]
    dies = "import os\ndef f(x):\n    os._exit(0)\n"
    stalls = "def f(x):\n    while True: pass\n"
    r = run_tests(dies, [test], entry_point="f")
    assert r.passed == 0 and r.first_failure == "test 0 did not finish: the solution ended (exit code 0)", r
    r = run_tests(stalls, [test], entry_point="f", timeout_s=1.5)
    assert r.passed == 0 and r.first_failure == "test 0 did not finish: timeout after 1.5s", r

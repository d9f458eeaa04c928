"""Tools: schemas from type hints and docstrings, the plain-text and JSON call formats, errors returned as text."""
import pytest

import minirl
from minirl.generation.envs import ToolEnv, parse_tool_call, plain_tool_prompt, tool_schema


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b (int): the second number
    """
    return a + b


def scale(x: float, by: float = 2.0, label: str = "") -> str:
    """Multiply x."""
    return f"{label}{x * by}"


def boom(n: int) -> int:
    """Always fails."""
    raise ZeroDivisionError("no luck")


FNS = {"add": add, "scale": scale, "boom": boom}


def test_schema_from_hints_and_docstring():
    s = tool_schema(add)["function"]
    assert s["name"] == "add" and s["description"] == "Add two integers."
    assert s["parameters"]["properties"] == {"a": {"type": "integer", "description": "the first number"},
                                             "b": {"type": "integer", "description": "the second number"}}
    assert s["parameters"]["required"] == ["a", "b"]
    s = tool_schema(scale)["function"]
    assert [v["type"] for v in s["parameters"]["properties"].values()] == ["number", "number", "string"]
    assert s["parameters"]["required"] == ["x"]


def test_a_function_that_cannot_be_a_tool_fails_by_name():
    def nodoc(a: int) -> int:
        return a

    def nohint(a) -> int:
        """Doc."""
        return a

    def star(*a: int) -> int:
        """Doc."""
        return 0
    with pytest.raises(ValueError, match="'nodoc' has no docstring"):
        minirl.tools([nodoc])
    with pytest.raises(ValueError, match="parameter 'a' has no type hint"):
        minirl.tools([nohint])
    with pytest.raises(ValueError, match=r"\*a cannot be described"):
        tool_schema(star)


@pytest.mark.parametrize("reply,want", [
    ("add(2, 3)", ("add", {"a": 2, "b": 3})),
    ("Let me compute: add(a=2, b=3) then answer", ("add", {"a": 2, "b": 3})),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 4}}\n</tool_call>', ("add", {"a": 1, "b": 4})),
    ('{"name": "scale", "parameters": {"x": 1.5}}', ("scale", {"x": 1.5})),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', ("add", {"a": 1, "b": 2})),
    ("The answer is 42.", None),
    ("adder(1, 2) is not a tool", None),
])
def test_parse_calls(reply, want):
    assert parse_tool_call(reply, FNS) == want


@pytest.mark.parametrize("reply,why", [
    ("add(2, ", "not closed"),
    ("add(x + 1, 2)", "arguments must be literals"),
    ("add(1, 2, 3)", "takes 2 arguments, got 3"),
    ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "no tool named 'mul'"),
    ("<tool_call>{not json</tool_call>", "not valid JSON"),
])
def test_unreadable_calls_come_back_as_reasons(reply, why):
    name, reason = parse_tool_call(reply, FNS)
    assert isinstance(reason, str) and why in reason


def test_tool_results_and_errors_are_messages_and_counted():
    env = minirl.tools([add, scale, boom])()
    assert isinstance(env, ToolEnv) and [f.__name__ for f in env.tools()] == ["add", "scale", "boom"]
    assert env.call_tool("no call here") is None and env.tool_calls == 0
    assert env.call_tool("add(20, 22)") == [{"role": "tool", "name": "add", "content": "42"}]
    assert env.call_tool('scale(1.5, label="x")')[0]["content"] == "x3.0"
    assert env.call_tool("boom(1)")[0]["content"] == "error: ZeroDivisionError: no luck"
    assert env.call_tool("add(1)")[0]["content"].startswith("error: TypeError")
    assert env.call_tool("add(1, ")[0]["content"].startswith("error: ValueError: the call")
    assert (env.tool_calls, env.tool_errors) == (5, 3)
    st = env.step("add(1, 1)")
    assert not st.done and st.messages[0]["content"] == "2"
    assert env.step("it is 2").done


def test_env_methods_marked_as_tools():
    class Calc(minirl.Env):
        @minirl.tool
        def add(self, a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        def helper(self) -> int:  # not a tool
            return 0
    env = Calc()
    assert [f.__name__ for f in env.tools()] == ["add"]
    assert tool_schema(env.tools()[0])["function"]["parameters"]["required"] == ["a", "b"]  # no `self`
    assert env.step("add(2, 5)").messages[0]["content"] == "7"


def test_plain_prompt_names_every_tool_and_the_call_format():
    text = plain_tool_prompt([add, scale])
    assert "- add(a: integer, b: integer): Add two integers." in text
    assert "- scale(x: number, by: number, label: string): Multiply x." in text
    assert "for example: add(2, 3)" in text


def test_resolve_env_names():
    from minirl.generation.tasks import Sums, resolve_env
    assert resolve_env("sums") == ("sums", Sums)
    assert resolve_env("minirl.generation.tasks:Sums")[1] is Sums
    with pytest.raises(ValueError, match="unknown env 'nope'"):
        resolve_env("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_env("minirl.generation.tasks:Nope")


def test_sums_task_answers_each_call_with_what_is_left_and_rewards_the_total():
    from minirl.generation.tasks import Sums, sums_splits
    train, held = sums_splits(8, seed=0, train_size=50)
    assert not {tuple(r["numbers"]) for r in train} & {tuple(r["numbers"]) for r in held}
    env = Sums()
    env.reset({"prompt": "What is 14 + 98 + 25?", "answer": 137, "numbers": [14, 98, 25]})
    assert env.step("add(14, 98)").messages[0]["content"] == "112 (still to add: 25)"
    assert env.step("add(112, 25)").messages[0]["content"] == "137 (all numbers added)"
    assert env.step("add(1, two)").messages[0]["content"].startswith("error: ValueError: cannot read the call")
    assert env.step("The answer is 137").reward == 1.0 and (env.tool_calls, env.tool_errors) == (3, 1)
    env.reset({"prompt": "What is 1 + 2 + 3?", "answer": 6, "numbers": [1, 2, 3]})
    assert env.step("3").reward == 0.0


def test_retry_task_gives_a_wrong_answer_one_more_try():
    from minirl.generation.tasks import TASKS, Retry
    row = {"prompt": "What is 12 + 30? Answer with the number.", "answer": 42}
    env = Retry()
    assert env.reset(row) == [{"role": "user", "content": row["prompt"]}]
    first = env.step("It is 41.")
    assert not first.done and first.reward is None and first.messages[0]["content"] == "That is not right. Try again."
    assert env.step("42").reward == 1.0  # right on the second try
    env.reset(row)
    assert env.step("42").reward == 1.0
    env.reset(row)
    env.step("no idea")
    last = env.step("40")
    assert last.done and last.reward == 0.0
    train, held = TASKS["retry"].splits(16, 0)
    pairs = [{(min(r["a"], r["b"]), max(r["a"], r["b"])) for r in rows} for rows in (train, held)]
    assert pairs[0].isdisjoint(pairs[1])

"""Faulty rewards never kill a run or corrupt advantages; bad inputs give one clear error line."""
import math
import subprocess
import sys
import threading

import pytest
from conftest import TOY_ROWS

from minirl import Config, ConfigError, Run
from minirl.rewards import Scorer
from minirl.rewards.advantages import step_advantages
from minirl.types import Completion, Group, Prompt


def _group(texts, **cols):
    p = Prompt(0, (1, 2), "q", cols)
    return Group(p, tuple(Completion((5,), (-1.0,), (0,), t, "stop") for t in texts))


def good(prompt, completion, **_):
    return float(completion == "right")


def raises(prompt, completion, **_):
    if completion == "boom":
        raise ZeroDivisionError("bad luck")
    return 1.0


def returns_none(prompt, completion, **_):
    return None if completion == "skip" else 0.5


def returns_nan(prompt, completion, **_):
    return math.nan if completion == "nan" else 0.0


def returns_str(prompt, completion, **_):
    return "1.0"


RELEASE, HUNG_RETURNED = threading.Event(), []


def hangs(prompt, completion, **_):
    if completion == "hang":
        RELEASE.wait(600)  # until the test lets it go: a scorer that waited for it would wait that long
        HUNG_RETURNED.append(completion)
    return 0.0


def test_raising_reward_is_a_recorded_failure_excluded_from_baseline():
    s = Scorer([("good", good), ("raises", raises)], [1.0, 0.0], timeout_s=2)
    g = s.score_group(_group(["right", "wrong", "boom"]))
    # 'raises' has weight 0 (logged only): its failure is recorded but does not exclude the sample
    assert [f.reason for f in g.failures] == ["raised ZeroDivisionError: bad luck"]
    assert g.rewards == (1.0, 0.0, 0.0)
    s = Scorer([("good", good), ("raises", raises)], [1.0, 1.0], timeout_s=2)
    g = s.score_group(_group(["right", "wrong", "boom"]))
    assert g.rewards == (2.0, 1.0, None)
    [g] = step_advantages([g], "group")
    assert g.advantages[2] == 0.0 and g.advantages[0] == pytest.approx(1.0, abs=1e-4)  # baseline over 2 valid


def test_none_skips_without_failure():
    [g] = step_advantages([Scorer([("n", returns_none)], [1.0]).score_group(_group(["a", "skip", "b"]))], "group")
    assert g.rewards == (0.5, None, 0.5) and g.failures == () and g.advantages == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("fn,bad_text,reason", [
    (returns_nan, "nan", "non-finite"),
    (returns_str, "x", "expected a float"),
    (hangs, "hang", "timeout"),
])
def test_bad_reward_values_are_failures(fn, bad_text, reason):
    RELEASE.clear()
    try:
        g = Scorer([("f", fn)], [1.0], timeout_s=0.5).score_group(_group([bad_text, "ok", "ok2"]))
        assert not HUNG_RETURNED  # scoring gave up on the hung call at its timeout: the call has not returned
    finally:
        RELEASE.set()
    assert g.rewards[0] is None and reason in g.failures[0].reason
    assert all(math.isfinite(a) for a in step_advantages([g], "group")[0].advantages)


def test_async_reward_and_timeout():
    async def slow(prompt, completion, **_):
        import asyncio
        await asyncio.sleep(5 if completion == "slow" else 0)  # the thing under test: slower than the timeout
        return 1.0
    g = Scorer([("slow", slow)], [1.0], timeout_s=0.5).score_group(_group(["fast", "slow"]))
    assert g.rewards[0] == 1.0 and g.rewards[1] is None and "timeout" in g.failures[0].reason.lower()


def test_faulty_reward_does_not_kill_a_run(toy_cfg):
    calls = {"n": 0}

    def flaky(prompt, completion, **_):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("flaky")
        return float("yes" in completion)
    s = Run(toy_cfg.replace(steps=2), data=TOY_ROWS[:16], eval_data=TOY_ROWS[16:20], rewards=[flaky]).run()
    assert s["steps"] == 2
    from minirl.core.metrics import read_log
    ev = [e for e in read_log(toy_cfg.out_dir + "/metrics.jsonl") if e["event"] == "step"]
    assert sum(e["reward/failures"] for e in ev) > 0


def test_group_size_one_is_a_clear_error():
    with pytest.raises(ConfigError, match="group_size=1.*at least 2"):
        Config(group_size=1)


def test_unknown_config_field_suggests_the_right_one():
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        Config.from_dict({"stepz": 3})


@pytest.mark.parametrize("kw,match", [
    (dict(data=[]), "dataset is empty"),
    (dict(data=[{"prompt": "hi"}]), r"needs column\(s\) \['answer'\]"),
    (dict(data=[{"question": "hi", "answer": 1}]), "no 'prompt' column"),
    (dict(data=[{"prompt": "1 " * 600, "answer": 1}], eval_data=TOY_ROWS[:2]), "has .* tokens, more than the limit"),
    (dict(data=[{"prompt": "hi", "answer": 1}] * 3), "1 distinct prompt.*give eval_data, or set eval_size: 0"),
    (dict(data=TOY_ROWS[:1] + [{"answer": 2}]), r"data row 1: no 'prompt' column"),
])
def test_bad_data_is_a_clear_error(toy_cfg, kw, match):
    with pytest.raises(ValueError, match=match):
        Run(toy_cfg, rewards=["arithmetic_correct"], **kw).setup()


def test_unknown_model_is_a_clear_error(toy_cfg):
    with pytest.raises(ValueError, match="unknown model 'nonexistent-model'"):
        Run(toy_cfg.replace(model="nonexistent-model"), data=TOY_ROWS).setup()
    with pytest.raises(ValueError, match="does not exist"):
        Run(toy_cfg.replace(model="./no/such/dir"), data=TOY_ROWS).setup()


def test_unknown_reward_is_a_clear_error(toy_cfg):
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        Run(toy_cfg, data=TOY_ROWS, rewards=["nope"]).setup()


def test_cli_bad_input_prints_one_error_line():
    p = subprocess.run([sys.executable, "-m", "minirl.cli", "demo", "--group-size", "1"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("minirl: error: group_size=1")

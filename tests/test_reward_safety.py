"""A faulty reward never kills a run, never corrupts advantages or weights; a non-finite step is skipped, a
non-finite adapter never served or saved; closing a failed run never hides its error."""
import math
from decimal import Decimal

import pytest
import torch
from conftest import TOY_ROWS
from safetensors.torch import load_file

from minirl import Run
from minirl.core.metrics import read_log
from minirl.rewards import Scorer
from minirl.rewards.advantages import group_advantages, step_advantages
from minirl.rewards.builtin import code_tests_pass
from minirl.rewards.scorer import RewardsFailing, failure_kinds
from minirl.types import Completion, Group, Prompt, RewardFailure, ScoredGroup

FAULTS = ["raise", "hang", "sys.exit", "os._exit", "segfault", "nan", "inf", "1e308", "string", "none", "flood"]


def fuzzed(prompt, completion, fault, **_):
    """A reward with one fault per prompt (the row's `fault` column); 'ok' rows score 'yes' in the completion."""
    import ctypes
    import math
    import os
    import sys
    import time
    if fault == "raise":
        raise ZeroDivisionError("bad luck")
    if fault == "hang":
        while True:
            time.sleep(0.01)
    if fault == "sys.exit":
        sys.exit(0)
    if fault == "os._exit":
        os._exit(0)
    if fault == "segfault":
        ctypes.string_at(0)
    if fault == "flood":
        print("x" * (1 << 20))
    return {"nan": math.nan, "inf": math.inf, "1e308": 1e308, "string": "1.0", "none": None}.get(
        fault, float("yes" in completion.split()))


@pytest.mark.full("a real run through every reward fault at once: ~4 min; by default each fault is injected into the "
                  "scorer alone (test_errors.py, the tests below) and a run with failing rewards stops with the fix")
def test_reward_fuzz_on_a_real_run_counts_every_failure_and_ends_with_a_finite_adapter(toy_cfg):
    rows = [{"prompt": r["prompt"], "fault": f} for r, f in zip(TOY_ROWS, FAULTS)]
    rows += [{"prompt": r["prompt"], "fault": "ok"} for r in TOY_ROWS[20:33]]
    cfg = toy_cfg.replace(steps=2, prompts_per_step=12, group_size=4, reward_timeout_s=1.0, reward_workers=2,
                          eval_size=4)
    run = Run(cfg, data=rows, eval_data=[{"prompt": r["prompt"], "fault": "ok"} for r in TOY_ROWS[40:44]],
              rewards=[fuzzed])
    summary = run.run()
    assert summary["steps"] == 2
    kinds: dict[str, int] = {}
    for h in run.history:
        for k, n in h["reward/failure_kinds"].items():
            kinds[k] = kinds.get(k, 0) + n
    # every faulty prompt was trained on once (24 rows, 2 steps x 12): each of its 4 calls failed with its reason
    assert kinds == {"ZeroDivisionError": 4, "timeout": 4, "SystemExit": 4, "worker died": 8, "non-finite": 8,
                     "beyond reward_clip": 4, "expected a float": 4, "output flood": 4}, kinds
    assert sum(h["reward/failures"] for h in run.history) == 40  # 'none' is a skip, not a failure
    ad = load_file(str(run.out / "adapter" / "adapter_model.safetensors"))
    assert ad and all(torch.isfinite(t).all() for t in ad.values())
    assert any(h.get("train/tokens") for h in run.history)  # the healthy rows still trained


def _group(texts):
    return Group(Prompt(0, (1, 2), "q"), tuple(Completion((5,), (-1.0,), (0,), t, "stop") for t in texts))


def test_huge_finite_rewards_are_failures_and_advantages_stay_finite():
    assert any(math.isnan(a) for a in group_advantages([1e308, 1e308, 0.0, 0.0]))  # the fault the clip exists for
    g = Scorer([("big", lambda p, c, **_: 1e308 if c == "big" else float(c == "a"))], [1.0]).score_group(
        _group(["big", "big", "a", "b"]))
    [g] = step_advantages([g], "group")
    assert g.rewards == (None, None, 1.0, 0.0) and all(math.isfinite(a) for a in g.advantages)
    assert [f.reason for f in g.failures] == ["returned 1e+308, beyond reward_clip=1e+06"] * 2
    # even with the clip off, a group whose advantages come out non-finite is never trained on
    g = Scorer([("big", lambda p, c, **_: 1e308 if c == "big" else 0.0)], [1.0], reward_clip=math.inf).score_group(
        _group(["big", "big", "a", "b"]))
    for scale in ("group", "batch", "none"):
        [s] = step_advantages([g], scale)
        assert s.rewards == (None,) * 4 and s.advantages == (0.0,) * 4, scale
    [g] = step_advantages([g], "group")
    assert g.rewards == (None,) * 4 and g.advantages == (0.0,) * 4
    assert any("non-finite advantage" in f.reason for f in g.failures)


class Refuses(float):
    def __float__(self):
        raise ArithmeticError("no float for you")


def test_a_returned_value_is_never_walked_nor_asked_for_its_repr():
    """Issue 51 item 4 (its repr part): a list sharing its halves 40 levels deep (2**40 leaves, 160 bytes pickled)
    and an object whose __repr__ must not run are failures named by type and size, at once."""
    deep = [0.0]
    for _ in range(40):
        deep = [deep, deep]

    class Loud:
        def __repr__(self):
            raise AssertionError("the scorer ran a returned value's own __repr__")
    s = Scorer([("r", lambda p, c, **_: 0.0)], [1.0])
    assert s.check_value(deep) == (None, "returned list of 2 items, expected a float or None")
    assert s.check_value(Loud()) == (None, "returned Loud (not shown), expected a float or None")
    assert s.check_value("x" * 10**7) == (None, f"returned str '{'x' * 39}, expected a float or None")


def test_values_float_cannot_take_are_failures_with_their_reason():
    values = {"10**400": 10**400, "10**5000": 10**5000, "Decimal": Decimal("1e400"), "refuses": Refuses(2.0),
              "a": 1.0, "b": 0.0}
    [g] = step_advantages([Scorer([("r", lambda p, c, **_: values[c])], [1.0]).score_group(_group(list(values)))],
                          "group")
    assert g.rewards == (None, None, None, None, 1.0, 0.0) and all(math.isfinite(a) for a in g.advantages)
    assert [f.reason for f in g.failures] == [
        "returned int 1000000000000000000000000000000000000000, which float() cannot take (OverflowError: int too "
        "large to convert to float)",
        "returned int (cannot be shown), which float() cannot take (OverflowError: int too large to convert to float)",
        "returned Decimal Decimal('1E+400'), expected a float or None",
        "returned Refuses (not shown), which float() cannot take (ArithmeticError: no float for you)"]
    assert failure_kinds([g]) == {"float() cannot take": 3, "expected a float": 1}
    scorer = Scorer([("big", lambda p, c, **_: 10**400 if c == "big" else float(c == "a"))], [1.0], workers=1)
    g = scorer.score_group(_group(["big", "a", "b"]))  # from a worker process too
    assert g.rewards == (None, 1.0, 0.0) and "float() cannot take (OverflowError" in g.failures[0].reason


def _scored(failed: dict[str, int], n: int = 4) -> ScoredGroup:
    """A group of n samples in which reward `name` failed on the first `failed[name]` of them."""
    failures = tuple(RewardFailure(name, i, "ConnectionError: the judge is down") for name, k in failed.items()
                     for i in range(k))
    return ScoredGroup(_group(["x"] * n), (None,) * n, {}, (0.0,) * n, failures)


def test_a_reward_failing_every_call_for_three_steps_stops_with_the_cause_and_the_fix():
    scorer = Scorer([("judge", len), ("logged", len)], [1.0, 0.0])
    for _ in range(2):
        scorer.watch([_scored({"judge": 4, "logged": 4}), _scored({"judge": 4})])
    scorer.watch([])  # a step that scored nothing (all dropped as stale) counts neither way
    scorer.watch([_scored({"judge": 3}), _scored({"judge": 4})])  # one call went through: the count starts again
    for _ in range(2):
        scorer.watch([_scored({"judge": 4, "logged": 4})])
    with pytest.raises(RewardsFailing) as e:
        scorer.watch([_scored({"judge": 4, "logged": 4})])  # "logged" (weight 0) fails too, but trains nothing
    assert str(e.value) == ("reward 'judge' failed every call for 3 steps in a row, last: ConnectionError: the judge "
                            "is down; stopping the run: fix the reward (try it on samples with minirl.check) or give "
                            "it weight 0")


def forgot_return(prompt, completion):  # a module-level function: reward workers import it by name
    0.5 if "2" in completion else 0.0


def test_a_reward_that_returns_none_for_every_sample_stops_the_run_naming_it(toy_cfg):
    """None means "skip this sample"; a reward that forgot its `return` skips every sample, and nothing failed, so
    the failing rule above never fires: without this the run went on for all its steps training on nothing."""
    scorer = Scorer([("mine", len), ("logged", len)], [1.0, 0.0])
    skipped = ScoredGroup(_group(["x"] * 4), (None,) * 4, {"mine": (None,) * 4})
    scorer.watch([skipped, skipped])
    scorer.watch([skipped, ScoredGroup(_group(["x"] * 4), (None, 1.0, None, None), {})])  # one value: count restarts
    for _ in range(2):
        scorer.watch([skipped])
    with pytest.raises(RewardsFailing, match=r"^every sample of 3 steps in a row was skipped: reward 'mine' returned "
                       r"None .*a missing `return`\?"):
        scorer.watch([skipped])

    run = Run(toy_cfg.replace(steps=5, eval_size=0), data=TOY_ROWS[:24], rewards=[forgot_return])
    with pytest.raises(RewardsFailing, match="reward 'forgot_return' returned None"):
        run.run()
    assert len(run.history) == 2  # steps 0 and 1 ran on nothing; the third stopped the run


def test_a_code_reward_run_where_no_sandbox_works_stops_naming_how_to_get_one(toy_cfg, monkeypatch):
    from minirl.rewards.sandbox import process
    monkeypatch.setattr(process, "_probe", lambda: ("none", "none", "unshare: Operation not permitted"))
    rows = [{"prompt": r["prompt"], "tests": ["assert f(1) == 2"]} for r in TOY_ROWS[:24]]
    run = Run(toy_cfg.replace(steps=5, reward_workers=0, eval_size=0), data=rows, rewards=[code_tests_pass])
    with pytest.raises(RewardsFailing) as e:
        run.run()
    line = str(e.value)
    assert "\n" not in line and line.startswith("reward 'code_tests_pass' failed every call for 3 steps in a row, "
                                                 "last: raised SandboxUnavailable: no sandbox on this machine (unshare: ")
    assert line.count("CAP_SYS_ADMIN") == 1 and "operation not permitted); stopping the run" in line.lower()
    assert line.endswith("stopping the run: to get a sandbox, run as root with CAP_SYS_ADMIN (Docker: --cap-add "
                         "SYS_ADMIN), or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1;"
                         " Ubuntu 24.04: kernel.apparmor_restrict_unprivileged_userns=0)")
    assert len(run.history) == 2  # steps 0 and 1 ran (on nothing); the third failing step stopped the run


def test_a_nonfinite_step_is_skipped_and_the_adapter_kept(toy_cfg):
    from minirl.training.trainer import Trainer
    from minirl.types import ScoredGroup
    tr = Trainer(toy_cfg)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    c_ok = Completion((7, 8, 9), (-1.0, -1.0, -1.0), (0, 0, 0), "x", "stop")
    c_nan = Completion((7, 8, 9), (-1.0, math.nan, -1.0), (0, 0, 0), "y", "stop")
    bad = ScoredGroup(Group(Prompt(0, (5, 6), "q"), (c_ok, c_nan)), (1.0, 0.0), {}, (1.0, -1.0))
    m = tr.step([bad])
    assert m["train/skipped_nonfinite"] == 1 and m["version"] == 1
    after = {n: p.detach() for n, p in tr.model.named_parameters() if p.requires_grad}
    assert all(torch.equal(before[n], after[n]) for n in before)  # no update from a NaN step
    c_other = Completion((7, 9), (-1.0, -2.0), (0, 0), "z", "stop")
    good = ScoredGroup(Group(Prompt(0, (5, 6), "q"), (c_ok, c_other)), (1.0, 0.0), {}, (1.0, -1.0))
    m = tr.step([good])
    assert m["train/skipped_nonfinite"] == 0
    assert any(not torch.equal(before[n], p.detach()) for n, p in tr.model.named_parameters() if p.requires_grad)
    from minirl.ui import doctor
    assert "nonfinite_step" in [a.code for a in doctor([{"step": 0, "train/skipped_nonfinite": 1}])]


def test_a_nonfinite_adapter_is_never_pushed_or_saved(toy_cfg, monkeypatch):
    """A step that leaves a non-finite weight in the adapter stops the run before the push; the adapter of the
    last good step stands and no non-finite one is saved."""
    run = Run(toy_cfg.replace(steps=3), data=TOY_ROWS[:16], eval_data=TOY_ROWS[16:20])
    run.setup()
    real = run.trainer.step

    def poisoned(scored):
        m = real(scored)
        with torch.no_grad():
            next(p for p in run.trainer.model.parameters() if p.requires_grad).view(-1)[0] = math.nan
        return m
    monkeypatch.setattr(run.trainer, "step", poisoned)
    with pytest.raises(RuntimeError, match="non-finite weights"):
        run.run()
    assert not (run.out / "adapter").exists() and run.summary["adapter_not_saved"] == "non-finite weights"
    assert run.history == []  # the step never completed: nothing was pushed


def test_an_error_while_closing_never_hides_the_runs_own_error(toy_cfg, monkeypatch):
    run = Run(toy_cfg.replace(steps=2), data=TOY_ROWS[:16], eval_data=TOY_ROWS[16:20])
    run.setup()

    def own_error(rec):
        raise ValueError("the run's own error")

    def broken_close():
        raise OSError("disk full while closing")
    run.on_step.append(own_error)
    monkeypatch.setattr(run.generator, "close", broken_close)
    closed, close = [], run.scorer.close
    monkeypatch.setattr(run.scorer, "close", lambda: (closed.append(True), close()))
    with pytest.raises(ValueError, match="the run's own error"):
        run.run()
    assert closed  # closing went on past the failing step
    errors = [e["error"] for e in read_log(run.out / "metrics.jsonl") if e["event"] == "error"]
    assert any("the run's own error" in e for e in errors) and any("disk full while closing" in e for e in errors)

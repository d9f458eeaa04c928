"""The reward-hacking watch (minirl/core/hacking.py): checks (weight 0) are logged and never trained on; the doctor
warns, once per episode, when the trained reward rises while a check or the held-out accuracy does not, or while
the completion length climbs with it. Synthetic histories for the rules, then one hackable and one honest run."""
import random

import pytest
from conftest import TOY_ROWS

from minirl import Config, ConfigError, Run, Scorer, reward
from minirl.core.hacking import WINDOW, HackingWatch, episodes, failing_samples, trend
from minirl.core.metrics import read_log, repeats
from minirl.types import Completion, Group, Prompt
from minirl.ui import doctor
from minirl.ui.dashboard import failing_html


def history(n=20, reward=lambda i: 0.1 + 0.03 * i, length=lambda i: 20.0, checks=None, seed=0, noise=0.02):
    """n step records; `checks` maps a check's name to its value as a function of the step; seeded noise."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        h = {"step": i, "reward/mean": reward(i) + rng.gauss(0, noise), "length/mean": length(i) + rng.gauss(0, 0.5)}
        for name, f in (checks or {}).items():
            h[f"reward/{name}"] = f(i) + rng.gauss(0, noise)
        if checks:
            h["reward/checks"] = list(checks)
        out.append(h)
    return out


def watch_codes(hist, evals=()):
    return [a.code for a in doctor(hist, evals=evals) if a.code.startswith("hacking_")]


def test_trend_is_the_least_squares_slope_with_its_standard_error():
    # by hand: mean x 1.5, mean y 1.25, Sxx 5, Sxy 4.5 -> slope 0.9; residuals .1 .2 -.7 .4 -> SSR .70,
    # se = sqrt(.70 / 2 / 5) = sqrt(.07)
    t = trend([0, 1, 2, 3], [0, 1, 1, 3])
    assert t.slope == pytest.approx(0.9) and t.se == pytest.approx(0.07 ** 0.5) and t.n == 4
    assert t.rises  # 0.9 > 3 x 0.265
    # [0, 2, 0, 3]: Sxy 3.5 -> slope 0.7; residuals -.2 1.1 -1.6 .7 -> SSR 4.3, se = sqrt(.43) = 0.656: 0.7 < 3 x 0.656
    t = trend([0, 1, 2, 3], [0, 2, 0, 3])
    assert t.slope == pytest.approx(0.7) and t.se == pytest.approx(0.43 ** 0.5) and not t.rises
    assert trend([0, 1], [0, 1]) is None and trend([1, 1, 1], [0, 1, 2]) is None
    assert trend([0, 1, 2], [5, 5, 5]).constant


def test_reward_rising_while_a_check_falls_warns_once_naming_the_check():
    hist = history(checks={"no_yes": lambda i: 0.9 - 0.03 * i})
    alerts = [a for a in doctor(hist) if a.code == "hacking_check"]
    assert len(alerts) == 1
    a = alerts[0]
    assert a.check == "no_yes" and "'no_yes' falls" in a.title and a.step == WINDOW - 1 and a.level == "warn"
    assert "weight 0" in a.detail and "per step" in a.detail


def test_reward_rising_while_a_check_stays_flat_warns():
    hist = history(checks={"correct": lambda i: 0.4})
    assert "stays flat" in next(a.title for a in doctor(hist) if a.code == "hacking_check")


def test_reward_rising_with_its_check_is_quiet():
    hist = history(checks={"correct": lambda i: 0.05 + 0.03 * i})
    assert watch_codes(hist) == []


def test_noise_alone_is_quiet():
    hist = history(40, reward=lambda i: 0.5, length=lambda i: 20.0, checks={"correct": lambda i: 0.5}, seed=1,
                   noise=0.1)
    assert watch_codes(hist) == []


def test_a_check_at_the_same_value_throughout_says_nothing():
    hist = history(checks={"format": lambda i: 1.0}, noise=0.0)
    assert watch_codes(hist) == []


def test_length_climbing_with_the_reward_warns():
    hist = history(length=lambda i: 20.0 + 3 * i)
    assert watch_codes(hist) == ["hacking_length"]
    assert watch_codes(history()) == []  # the reward rising alone: quiet


def test_repeated_text_climbing_with_the_reward_warns():
    hist = history()
    for i, h in enumerate(hist):
        h["length/repeat_frac"] = 0.02 * i + (0.01 if i % 2 else 0.0)
    assert watch_codes(hist) == ["hacking_format"]
    assert repeats([5, 1, 2, 3, 4, 1, 2, 3, 4]) and repeats([7, 7, 7, 7, 7]) and not repeats([1, 2, 3, 4, 1, 2, 3])
    hist = history(reward=lambda i: 0.5)
    for i, h in enumerate(hist):
        h["length/repeat_frac"] = 0.02 * i
    assert watch_codes(hist) == []  # repetition rising alone is not the watch's business


def test_held_out_accuracy_flat_while_the_reward_rises_warns():
    hist = history(21)
    flat = [{"event": "eval", "step": s, "accuracy": 0.5, "n": 64} for s in (0, 10, 20)]
    assert watch_codes(hist, flat) == ["hacking_eval"]
    a = next(a for a in doctor(hist, evals=flat) if a.code == "hacking_eval")
    assert "stays flat" in a.title and a.step == 9  # judged at the evaluation after step 9 (step 10)
    # 0.5 -> 0.8 on 64 prompts: se = hypot(sqrt(.25/64), sqrt(.16/64)) = 0.08, a rise of 0.3 > 0.08
    up = [{"event": "eval", "step": s, "accuracy": 0.5 + 0.3 * (s // 10), "n": 64} for s in (0, 10, 20)]
    assert watch_codes(hist, up) == []
    # 0.5 -> 0.55 on 64 prompts: within its error (0.087)
    small = [{"event": "eval", "step": s, "accuracy": 0.5 + 0.05 * (s // 10), "n": 64} for s in (0, 10, 20)]
    assert watch_codes(hist, small) == ["hacking_eval"]
    # an accuracy at its ceiling cannot rise: nothing to say
    top = [{"event": "eval", "step": s, "accuracy": 1.0, "n": 64} for s in (0, 10, 20)]
    assert watch_codes(hist, top) == []
    fell = [{"event": "eval", "step": s, "accuracy": 1.0 if s == 0 else 0.0, "n": 64} for s in (0, 10, 20)]
    assert watch_codes(hist, fell) == ["hacking_eval"]
    # evaluations further apart than the window: still one warning while they agree
    far = [{"event": "eval", "step": s, "accuracy": 0.5, "n": 64} for s in (0, 20, 40, 60)]
    assert watch_codes(history(61), far) == ["hacking_eval"]
    # eval events may sit among the history's events, as in the log
    assert watch_codes(sorted(hist + flat, key=lambda e: e["step"])) == ["hacking_eval"]


def test_one_warning_per_episode_and_the_run_side_agrees_with_the_doctor():
    # the check falls for 20 steps (one episode), recovers for 20, falls again: two warnings, not one per step
    def check(i):
        return 0.9 - 0.03 * (i % 40) if i % 40 < 20 else 0.3 + 0.03 * (i % 40 - 20)
    hist = history(60, reward=lambda i: 0.1 + 0.03 * (i % 40) if i % 40 < 20 else 0.7, checks={"c": check})
    found = [(s, f.code) for s, f in episodes(hist)]
    assert found == [(9, "hacking_check"), (49, "hacking_check")]
    w = HackingWatch()
    logged = [(rec["at_step"], rec["code"]) for i in range(len(hist)) for rec in w.update(hist[:i + 1], [])]
    assert logged == found


def test_the_top_rewarded_samples_failing_a_check_are_shown():
    ev = [{"event": "samples", "step": s, "samples": [
        {"completion": f"yes yes {s}", "reward": 2.0 + s, "per_reward": {"no_yes": 0.0}},
        {"completion": "fine", "reward": 5.0, "per_reward": {"no_yes": 1.0}},
        {"completion": "<b>boom</b>", "reward": 0.5, "per_reward": {"no_yes": None}}]} for s in (1, 2)]
    rows = failing_samples(ev, "no_yes", k=3)
    assert [(r["step"], r["reward"]) for r in rows] == [(2, 4.0), (1, 3.0), (1, 0.5)]
    hist = history(checks={"no_yes": lambda i: 0.9 - 0.03 * i})
    html = failing_html(doctor(hist), ev)
    assert "yes yes 2" in html and "fine" not in html and "&lt;b&gt;boom" in html
    assert failing_html(doctor(history()), ev) == ""


# --- checks: weight 0 -----------------------------------------------------------------------------------------

def pays(prompt, completion, **_):
    return float(len(completion))


def judge_down(prompt, completion, **_):
    raise RuntimeError("judge down")


def test_a_check_is_scored_and_logged_but_never_trained_on_and_its_failure_fails_nothing():
    s = Scorer([("pays", pays), ("ok", lambda p, c, **_: 7.0), ("down", judge_down)], [1.0, 0.0, 0.0])
    assert s.checks == ["ok", "down"]
    g = Group(Prompt(0, (1,), "q"), tuple(Completion((1,) * len(t), (0.0,) * len(t), (0,) * len(t), t, "stop")
                                           for t in ("ab", "abc")))
    sg = s.score_group(g)
    assert sg.rewards == (2.0, 3.0)  # the check's 7 is not in the trained reward, its failure does not void it
    assert sg.per_reward["ok"] == (7.0, 7.0) and sg.per_reward["down"] == (None, None)
    assert [f.reward for f in sg.failures] == ["down", "down"]


def test_weights_all_zero_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"reward_weights are all 0.*e.g. reward_weights: \[1, 0\]"):
        Config(rewards=["arithmetic_correct", "format_match"], reward_weights=[0, 0])
    with pytest.raises(ValueError, match="reward_weights are all 0"):
        Scorer.from_config([pays], [0.0], 1.0)


# --- end to end: a reward hackable by construction, and an honest one -------------------------------------------

@reward
def yes_count(prompt, completion, **_):
    """Pays for every 'yes': what the policy learns to say."""
    return float(completion.split().count("yes"))


@reward
def no_yes(prompt, completion, **_):
    """The check the hackable run's reward works against: a completion must not say 'yes'."""
    return 0.0 if "yes" in completion.split() else 1.0


@reward
def said_yes(prompt, completion, **_):
    """The honest run's check: what the reward stands for (saying 'yes'), counted once."""
    return 1.0 if "yes" in completion.split() else 0.0


@pytest.mark.parametrize("check, fires", [("no_yes", True), ("said_yes", False)])
def test_the_watch_fires_on_a_hackable_run_and_not_on_an_honest_one(tiny_model, tmp_path, capsys, check, fires):
    cfg = Config(model=tiny_model, backend="hf", data="unused", rewards=[check, "yes_count"], reward_weights=[0, 1],
                 steps=30, prompts_per_step=8, group_size=8, max_tokens=6, lr=0.1, eval_size=16, eval_every=10,
                 seed=0, out_dir=str(tmp_path / "run"), lora_rank=8, lora_alpha=16, reward_workers=0,
                 max_async_steps=0)  # the synchronous loop: the same run each time
    run = Run(cfg, data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:56])  # eval/accuracy: the check's greedy mean
    run.run()
    assert all(h["reward/checks"] == [check] for h in run.history)
    events = read_log(run.out)
    warned = [e for e in events if e["event"] == "doctor" and e["code"].startswith("hacking_")]
    shown = [a for a in doctor(events) if a.code.startswith("hacking_")]
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("minirl doctor")]
    if not fires:
        assert warned == [] and shown == [] and printed == []
        return
    assert {e["code"] for e in warned} >= {"hacking_check", "hacking_eval"}  # the held-out check falls too
    first = next(e for e in warned if e["code"] == "hacking_check")
    assert first["code"] == "hacking_check" and first["check"] == "no_yes" and "'no_yes' falls" in first["title"]
    assert first["samples"] and all("yes" in s["completion"].split() and s["value"] == 0.0 for s in first["samples"])
    assert [(a.step, a.title) for a in shown if a.code == "hacking_check"][:1] == [(first["at_step"], first["title"])]
    assert len(printed) == len(warned) and "metrics.jsonl" in printed[0]
    # one warning per episode: never on two consecutive steps
    steps = [e["at_step"] for e in warned if e["code"] == "hacking_check"]
    assert all(b - a > 1 for a, b in zip(steps, steps[1:]))

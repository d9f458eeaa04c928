"""Dashboard: doctor rules on synthetic histories, render from a saved log, the live widget on a real tiny run,
and the reward prototyping helpers."""
import asyncio
import threading

import pytest
from conftest import TOY_ROWS, yes_reward

from minirl import Run
from minirl.core.metrics import LogTail, read_log
from minirl.ui import PANELS, Dashboard, check, doctor, preview, render, rescore, samples_html


def healthy(n=12, **over):
    """A run that learns and looks fine; `over` maps a metric to a function of the step index."""
    hist = []
    for i in range(n):
        h = {"event": "step", "step": i, "reward/mean": 0.2 + 0.05 * i, "reward/failures": 0, "entropy": 1.5 - 0.02 * i,
             "length/mean": 20.0 + (i % 3), "length/max": 30, "length/truncated_frac": 0.05,
             "logprob_mismatch": 0.01, "groups/zero_adv_frac": 0.2, "sync/ms": 40.0 + (i % 2), "loss": 0.01}
        for k, f in over.items():
            h[k] = f(i)
        hist.append(h)
    return hist


def codes(hist, **kw):
    return {a.code for a in doctor(hist, **kw)}


def test_doctor_is_quiet_on_a_healthy_run():
    assert doctor(healthy()) == []
    assert doctor([]) == []


@pytest.mark.parametrize("over, code", [
    ({"entropy": lambda i: 1.5 if i < 4 else 0.01}, "entropy_collapse"),
    ({"length/mean": lambda i: 20 + 10 * i, "length/truncated_frac": lambda i: min(1.0, 0.1 * i),
      "reward/mean": lambda i: 0.5}, "length_runaway"),  # reward flat: with it rising, the hacking watch speaks too
    ({"length/mean": lambda i: 20.0 if i < 4 else 2.0}, "length_collapse"),
    ({"logprob_mismatch": lambda i: 0.01 * (1 + i)}, "mismatch_growing"),
    ({"groups/zero_adv_frac": lambda i: 0.1 if i < 4 else 0.9}, "zero_advantage"),
    ({"reward/failures": lambda i: 3 if i == 10 else 0}, "reward_failures"),
    ({"sync/ms": lambda i: 40.0 if i < 11 else 900.0}, "sync_spike"),
])
def test_each_doctor_rule_fires_on_its_symptom_and_only_it(over, code):
    got = doctor(healthy(**over))
    assert {a.code for a in got} == {code}
    a = got[0]
    assert a.title and len(a.detail) > 40 and a.step == 11 and a.level in ("warn", "error")


def test_doctor_trend_rules_wait_for_enough_steps_but_failures_speak_at_once():
    short = healthy(3, entropy=lambda i: 1.5 if i == 0 else 0.001, **{"reward/failures": lambda i: 1})
    assert codes(short) == {"reward_failures"}


def test_zero_advantage_alert_says_whether_the_task_is_too_easy_or_too_hard():
    easy = healthy(**{"groups/zero_adv_frac": lambda i: 0.95, "reward/mean": lambda i: 1.0})
    hard = healthy(**{"groups/zero_adv_frac": lambda i: 0.95, "reward/mean": lambda i: 0.0})
    assert "too easy" in doctor(easy)[0].detail and "too hard" in doctor(hard)[0].detail


def test_zero_advantage_from_a_collapsed_policy_is_not_blamed_on_easy_prompts():
    """Rewards near their best step's while entropy collapsed (dapo-k1 seed 0: reward 0.83 of a best 0.98,
    entropy 1.76 -> 0.06, held-out accuracy 0.73): the groups agree because the policy is deterministic."""
    hist = healthy(**{"groups/zero_adv_frac": lambda i: 0.4 if i < 4 else 0.8,
                      "entropy": lambda i: 2.0 if i < 4 else 0.06, "reward/mean": lambda i: 0.98 if i == 8 else 0.83})
    za = next(a for a in doctor(hist) if a.code == "zero_advantage")
    assert "too easy;" not in za.detail and "nearly deterministic" in za.detail


def test_doctor_reads_a_finished_run_folder_or_its_log(tmp_path):
    """`minirl.doctor(out_dir)` as `plot`, `xray` and `compare` take one: the log's steps and its evaluations."""
    import json
    steps = healthy(**{"entropy": lambda i: 1.5 if i < 4 else 0.01})
    evals = [{"event": "eval", "step": 0, "accuracy": 0.5}, {"event": "eval", "step": 12, "accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [{"event": "start"}, *steps, *evals]))
    want = [a.code for a in doctor([*steps, *evals])]
    assert want and [a.code for a in doctor(str(tmp_path))] == want
    assert [a.code for a in doctor(tmp_path / "metrics.jsonl")] == want


def test_log_tail_reads_only_complete_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"event": "step", "step": 0}\n{"event": "st')
    t = LogTail(p)
    assert [e["step"] for e in t.poll()] == [0]
    with open(p, "a") as f:
        f.write('ep", "step": 1}\n')
    assert [e["step"] for e in t.poll()] == [1] and len(t.events) == 2
    p.write_text('{"event": "start"}\n')  # a new run rewrites the log
    assert [e["event"] for e in t.poll()] == ["start"] and len(t.events) == 1


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory):
    from minirl import Config
    out = tmp_path_factory.mktemp("dash") / "run"
    cfg = Config(model=tiny_model, backend="hf", data="unused", rewards=["yes_reward"], steps=3, prompts_per_step=4,
                 group_size=4, max_tokens=6, lr=1e-2, eval_size=4, out_dir=str(out), lora_rank=8, lora_alpha=16,
                 max_async_steps=1)
    r = Run(cfg, data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:44])
    r.run()
    return r


def test_render_from_a_saved_log_writes_a_png_with_every_panel(finished_run, tmp_path):
    png = tmp_path / "dash.png"
    fig = render(finished_run.out / "metrics.jsonl", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    titles = " ".join(ax.get_title(loc="left") for ax in fig.axes)
    for word in ("reward", "histogram", "length", "loss", "entropy", "importance", "staleness", "tokens / s",
                 "sync", "timeline"):
        assert word in titles, word
    # the same from the run folder, the Run, or a bare history list
    render(finished_run.out)
    render(finished_run)
    render(finished_run.history, panels=["reward", "loss"])
    with pytest.raises(FileNotFoundError, match="metrics log"):
        render(tmp_path / "nothing")


def test_samples_panel_escapes_html_and_shows_failures():
    ev = [{"event": "samples", "step": 2, "samples": [
        {"prompt": "<b>hi</b>", "completion": "x", "reward": None, "per_reward": {"r": None}, "advantage": 0.0,
         "failures": [{"reward": "r", "sample": 0, "reason": "ValueError: boom"}]}]}]
    h = samples_html(ev)
    assert "&lt;b&gt;hi" in h and "ValueError: boom" in h


def test_live_dashboard_refreshes_on_the_callers_thread_during_a_real_run(tiny_model, tmp_path, monkeypatch):
    import minirl.ui.dashboard as D
    from minirl import Config
    drawn_on = []
    real_figure = D.figure

    def spy(*a, **k):
        drawn_on.append((threading.current_thread().name, len(run.history)))
        return real_figure(*a, **k)
    monkeypatch.setattr(D, "figure", spy)
    cfg = Config(model=tiny_model, backend="hf", data="unused", rewards=["yes_reward"], steps=4, prompts_per_step=4,
                 group_size=4, max_tokens=6, lr=1e-2, eval_size=4, out_dir=str(tmp_path / "live"), lora_rank=8,
                 lora_alpha=16)
    run = Run(cfg, data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:44])
    hooks = list(run.on_step)
    dash = Dashboard(run, every=0.2)
    assert len(run.on_step) == len(hooks) + 1  # it listens to the run's steps (until closed)
    assert "not started" in dash.status.value
    run.start()
    summary = dash.wait(timeout=300)
    assert summary["steps"] == 4
    # while training, only the caller's thread draws (the run thread only saves the final PNGs at the end)
    assert dash.refreshes >= 2 and {t for t, n in drawn_on if n < 4} == {threading.main_thread().name}
    assert dash.image.value[:4] == b"\x89PNG"
    assert "finished" in dash.status.value and "step 4 / 4" in dash.status.value
    assert "<table" in dash.samples_box.value and "doctor" in dash.doctor_box.value
    # controls reach the run's safe knobs
    dash.lr.value = 1e-3
    assert run.cfg.lr == pytest.approx(1e-3, rel=1e-6)
    dash.close()
    assert run.on_step == hooks


def test_dashboard_timer_runs_on_an_event_loop_and_stops_after_the_run(tiny_model, tmp_path):
    from minirl import Config
    cfg = Config(model=tiny_model, backend="hf", data="unused", rewards=["yes_reward"], steps=3, prompts_per_step=2,
                 group_size=4, max_tokens=6, eval_size=2, out_dir=str(tmp_path / "timer"), lora_rank=8,
                 lora_alpha=16, max_async_steps=1)
    run = Run(cfg, data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:42])

    async def main():
        dash = Dashboard(run, every=0.1, controls=False)  # like a notebook cell: the kernel's loop is running
        run.start()
        while run.running:
            await asyncio.sleep(0.05)  # the "kernel" stays free meanwhile
        await asyncio.wait_for(dash.timer, 60)  # it ends by itself after the run
        return dash
    dash = asyncio.run(main())
    assert dash.timer.done() and dash.refreshes >= 2
    assert "finished" in dash.status.value and "step 3 / 3" in dash.status.value


# --- reward prototyping -----------------------------------------------------------------------------------------

def test_check_reports_each_failing_case_clearly():
    from minirl.rewards import arithmetic_correct

    def crashes(prompt, completion, **_):
        raise KeyError("answer")
    rep = check(arithmetic_correct, [dict(completion="12", answer=12, expect=1.0), ("The sum is 12.", 1.0, {"answer": 12}),
                                     dict(completion="12, no wait, 13", answer=12, expect=1.0)])
    assert not rep.ok and [f["case"] for f in rep.failures] == [2]
    assert "FAIL case 2" in repr(rep) and "'12, no wait, 13'" in repr(rep) and rep.version
    with pytest.raises(AssertionError, match="FAIL case 2"):
        rep.assert_ok()
    bad = check(crashes, [dict(completion="x", expect=1.0)])
    assert "raised KeyError" in bad.failures[0]["why"]
    assert check(lambda p, c, **_: None, [("x", None)]).ok
    assert check(lambda p, c, **_: 0.7, [("x", lambda v: v > 0.5)]).ok
    assert "<table" in rep._repr_html_()
    swapped = check(arithmetic_correct, [("What is 5 + 7?", "12", {"answer": 12})])  # (prompt, completion) by mistake
    assert not swapped.ok and "expect is str '12'" in swapped.failures[0]["why"]


def test_preview_scores_the_models_samples_and_rescore_reuses_them(tiny_model):
    p = preview([yes_reward], TOY_ROWS, model=tiny_model, prompts=3, n=4, max_tokens=5)
    assert len(p.rows) == 12 and len(p.groups) == 3
    row = p.rows[0]
    for k in ("prompt", "completion", "yes_reward", "reward", "advantage", "reward_versions"):
        assert k in row
    assert 0.0 <= p.zero_variance_share <= 1.0 and "zero-variance" in p.headline()

    def always(prompt, completion, **_):
        return 1.0
    q = p.rescore([always])
    assert [r["completion"] for r in q.rows] == [r["completion"] for r in p.rows]  # same samples
    assert q.zero_variance_share == 1.0 and q.rows[0]["reward_versions"]["always"] != row["reward_versions"]["yes_reward"]
    assert "<table" in p._repr_html_()


def test_rescore_cached_rollouts_of_a_run_records_the_new_reward_version(finished_run):
    from minirl.rewards import source_hash

    def says_yes_or_no(prompt, completion, **_):
        return 1.0 if {"yes", "no"} & set(completion.split()) else 0.0
    t = rescore(finished_run, says_yes_or_no)
    n_logged = sum(len(e["samples"]) for e in read_log(finished_run.out) if e["event"] == "samples")
    assert len(t) == n_logged > 0
    r = t.rows[0]
    assert r["reward_versions"] == {"says_yes_or_no": source_hash(says_yes_or_no)}
    assert r["old_versions"] == {"yes_reward": source_hash(yes_reward)}
    assert all(x["new_reward"] in (0.0, 1.0) for x in t.rows)
    same = rescore(finished_run.out / "metrics.jsonl", yes_reward)
    assert not any(x["changed"] for x in same.rows)  # the unchanged reward reproduces the logged scores


def test_panels_list_is_the_documented_one():
    assert PANELS[-1] == "timeline" and len(PANELS) == len(set(PANELS))


def test_a_crafted_metrics_log_injects_no_html_into_the_notebook(tmp_path):
    """Every value the samples panel and the status line show from metrics.jsonl is escaped: step numbers, reward
    names, rewards, advantages, failures. The log is a file anyone may have written (a shared run folder)."""
    import json
    evil = "<img src=x onerror=alert(1)>"
    events = [
        {"event": "start", "config": {"rewards": [evil], "steps": 3}},
        {"event": "step", "step": 1, "reward/mean": 0.5, "time/step_s": evil},
        {"event": "samples", "step": evil, "samples": [
            {"prompt": "p", "completion": "c", "reward": evil, "per_reward": {evil: 1.0, "ok": evil},
             "advantage": evil, "failures": [{"reward": evil, "reason": evil}, "not a dict"]}, "not a dict"]},
        {"event": "samples", "step": 2, "samples": evil},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    dash = Dashboard(tmp_path)
    shown = dash.samples_box.value + dash.status.value + dash.doctor_box.value
    assert "<img" not in shown and "&lt;img src=x onerror=alert(1)&gt;" in dash.samples_box.value
    assert samples_html(events[2:]).count("&lt;img") == 7  # step, reward, per-reward name and value, adv, failure


def test_a_resumed_runs_timeline_follows_the_part_before():
    """Each part of a resumed run logs seconds from its own start; the panel shows the second part after the first
    (it drew both from 0, one over the other), the live part shifted alike."""
    from minirl.ui.panels import View
    part = [{"event": "timeline", "side": "gen", "start": 0.0, "end": 2.0},
            {"event": "timeline", "side": "train", "start": 2.0, "end": 3.0}]
    events = [{"event": "start"}, *part, {"event": "resume", "step": 2}, *part, {"event": "resume", "step": 4}]
    v = View.from_events(events, live_timeline={"gen": [(0.0, 1.0), (1.5, 1.75)], "train": []})
    assert v.timeline == {"gen": [(0.0, 2.0), (3.0, 5.0), (6.0, 7.0), (7.5, 7.75)],
                          "train": [(2.0, 3.0), (5.0, 6.0)]}
    assert View.from_events(part).timeline == {"gen": [(0.0, 2.0)], "train": [(2.0, 3.0)]}

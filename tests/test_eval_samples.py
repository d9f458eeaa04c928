"""Sampled evaluation (`eval_samples: k`, `eval_temperature`): mean@k and pass@k per reward besides greedy
accuracy, in the eval events, summary.json and the dashboard's eval panel."""
import itertools
import json
from math import comb

import pytest
from conftest import TOY_ROWS

from minirl.rewards import Scorer
from minirl.run.evaluation import evaluate, pass_at_k
from minirl.types import Completion, Group, Prompt, SamplingParams


def test_pass_at_k_is_the_unbiased_estimator():
    """1 - C(n-c, k) / C(n, k) is the mean over every k-subset of the n samples of 'some sample in it passes'."""
    for n, c, k in [(5, 2, 2), (6, 1, 3), (4, 0, 2), (4, 4, 1), (7, 3, 7)]:
        outcomes = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / comb(n, k))
    assert pass_at_k(3, 1, 3) == 1.0 and pass_at_k(3, 0, 3) == 0.0  # n = k: "at least one of the k passes"


def _yes(prompt, completion, **_):
    return 1.0 if "yes" in completion.split() else 0.0


def _long(prompt, completion, **_):
    return len(completion.split()) / 10


class FakeSource:
    """Greedy: 'no'; sampled: prompt i's j-th completion says 'yes' when j < i (prompt 0 never does)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, params):
        self.calls.append((n, params))
        out = []
        for p in prompts:
            texts = ["no"] if params.temperature == 0 else ["yes a" if j < p.index else "no" for j in range(n)]
            out.append(Group(p, tuple(Completion((1,), (0.0,), (0,), t, "stop") for t in texts), params.temperature))
        return out


def test_sampled_eval_gives_mean_and_pass_at_k_per_reward():
    prompts = [Prompt(i, (1, 2), f"q{i}") for i in range(3)]
    scorer = Scorer.from_config([_yes, _long], None, 10.0)
    src = FakeSource()
    done = []
    res = evaluate(src, prompts, scorer, 8, lambda d, t: done.append((d, t)), chunk=2, samples=4, temperature=0.6,
                   base=SamplingParams(stop=("\n",)), seed=9)
    assert res.accuracy == 0.0 and res.greedy == {"_yes": 0.0, "_long": pytest.approx(0.1)}
    # sampled: prompt 0 says yes 0/4 times, prompt 1 once, prompt 2 twice
    assert res.k == 4 and res.mean_at_k["_yes"] == pytest.approx((0 + 1 + 2) / 4 / 3)
    assert res.pass_at_k["_yes"] == pytest.approx(2 / 3)
    assert res.pass_at_k["_long"] == 1.0  # every completion has a positive length reward
    assert res.mean_at_k["_long"] == pytest.approx((4 * 0.1 + (0.2 + 3 * 0.1) + (2 * 0.2 + 2 * 0.1)) / 4 / 3)
    greedy_calls = [p for n, p in src.calls if p.temperature == 0]
    sampled_calls = [(n, p) for n, p in src.calls if p.temperature != 0]
    assert all(p.stop == ("\n",) and p.max_tokens == 8 for _, p in src.calls)
    assert len(greedy_calls) == 2 and all(n == 4 and p.temperature == 0.6 and p.seed == 9 for n, p in sampled_calls)
    assert done[-1] == (6, 6)
    assert res.scalars()["eval/pass@k/_yes"] == pytest.approx(2 / 3)
    plain = evaluate(src, prompts, scorer, 8)
    assert plain.k == 0 and "pass_at_k" not in plain.fields()


def test_a_run_logs_sampled_eval_in_events_summary_and_the_eval_panel(toy_cfg):
    from matplotlib.figure import Figure

    from minirl import Run
    from minirl.core.metrics import METRICS
    from minirl.ui.panels import View, draw_panel, eval_lines
    cfg = toy_cfg.replace(steps=1, eval_size=4, eval_samples=3, eval_temperature=0.8)
    summary = Run(cfg, data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:44]).run()
    for key in ("eval_before", "eval_after"):
        ev = summary[key]
        assert ev["k"] == 3 and set(ev["pass_at_k"]) == set(ev["mean_at_k"]) == {"yes_reward"}
        assert 0 <= ev["mean_at_k"]["yes_reward"] <= ev["pass_at_k"]["yes_reward"] <= 1
    on_disk = json.loads(open(f"{cfg.out_dir}/summary.json").read())
    events = [json.loads(x) for x in open(f"{cfg.out_dir}/metrics.jsonl")]
    evals = [e for e in events if e.get("event") == "eval"]
    assert len(evals) == 2 and all(e["k"] == 3 and "yes_reward" in e["pass_at_k"] for e in evals)
    labels = [x[0] for x in eval_lines(evals)]
    assert labels == ["greedy accuracy", "mean@3 yes_reward", "pass@3 yes_reward"]
    ax = Figure().add_subplot()
    draw_panel(ax, "eval", View.from_events(events))
    assert [ln.get_label() for ln in ax.get_lines()] == labels
    assert {"eval/mean@k/<reward>", "eval/pass@k/<reward>"} <= set(METRICS)
    assert on_disk["eval_after"] == summary["eval_after"] and on_disk["eval_before"] == summary["eval_before"]
    for when in ("before", "after"):  # the held-out accuracy's own line carries its standard error
        assert on_disk[f"eval_accuracy_{when}_se"] == summary[f"eval_{when}"]["accuracy_se"] is not None
    # each figure's standard error, from the prompts' scores the run saved (eval_problems events)
    from minirl import compare
    from minirl.core.stats import mean_se
    problems = {e["step"]: e["problems"] for e in events if e.get("event") == "eval_problems"}
    assert sorted(problems) == [0, 1] and all(len(p) == 4 for p in problems.values())
    for key, step in (("eval_before", 0), ("eval_after", 1)):
        ev, ps = on_disk[key], problems[step]
        assert ev["n"] == 4
        assert ev["accuracy_se"] == pytest.approx(mean_se([p["scores"]["accuracy"] for p in ps])[1])
        assert ev["pass_at_k_se"]["yes_reward"] == pytest.approx(mean_se([p["scores"]["pass@k/yes_reward"]
                                                                          for p in ps])[1])
        assert ev["mean_at_k_se"]["yes_reward"] is not None and "accuracy" in ev["ci95"]
    ax = Figure().add_subplot()
    draw_panel(ax, "eval", View.from_events(events))
    assert len(ax.collections) == len(labels)  # a 95 % band around each line
    same = compare(cfg.out_dir, cfg.out_dir)
    assert (same.n, same.diff, same.se) == (4, 0.0, 0.0)
    before = compare(cfg.out_dir, cfg.out_dir, step=0)
    assert before.mean_a == pytest.approx(on_disk["eval_before"]["accuracy"])


# ---- issue 54 item 6: each figure with its standard error across the prompts ------------------------------------

def test_pass_at_k_hand_values():
    """1 - C(n-c, k) / C(n, k) by hand: n=5, c=2, k=2: 1 - 3/10; n=4, c=1, k=2: 1 - 3/6; n=6, c=1, k=3: 1 - 10/20;
    n=10, c=3, k=1: c/n."""
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(6, 1, 3) == pytest.approx(0.5)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_mean_se_and_interval_by_hand():
    """se = sample std (n - 1) / sqrt(n): [1, 0, 1, 1] -> mean 0.75, std 0.5, se 0.25; interval 0.75 +- 1.96 * 0.25."""
    from minirl.core.stats import ci95, mean_se
    assert mean_se([1, 0, 1, 1]) == (0.75, pytest.approx(0.25))
    assert ci95(0.75, 0.25) == (pytest.approx(0.26), pytest.approx(1.24))
    assert mean_se([0.5]) == (0.5, None) and ci95(0.5, None) is None


def test_an_accuracys_interval_is_wilsons_inside_0_1_and_not_empty_at_the_ends():
    """Wilson's score interval by hand for 3 of 4: centre (0.75 + z^2/8) / (1 + z^2/4), half-width
    z sqrt(0.75 * 0.25 / 4 + z^2 / 64) / (1 + z^2/4) -> [0.3006, 0.9544] (the normal one, [0.26, 1.24], leaves [0, 1]);
    0 of 32 -> [0, z^2/32 / (1 + z^2/32)] = [0, 0.1072], not [0, 0]. Non-0/1 scores keep mean +- 1.96 se."""
    from minirl.core.stats import interval95
    assert interval95([1, 0, 1, 1]) == (pytest.approx(0.3006, abs=1e-4), pytest.approx(0.9544, abs=1e-4))
    assert interval95([0] * 32) == (0.0, pytest.approx(0.1072, abs=1e-4))
    assert interval95([1] * 32) == (pytest.approx(1 - 0.1072, abs=1e-4), 1.0)
    se = 0.5 / 3 ** 0.5
    assert interval95([0.0, 0.5, 1.0]) == (pytest.approx(0.5 - 1.96 * se), pytest.approx(0.5 + 1.96 * se))
    assert interval95([1.0]) is None


class YesNoSource(FakeSource):
    """Greedy: 'yes' on prompts 0, 2 and 3, 'no' on prompt 1; sampled as FakeSource (prompt i: i of k say yes)."""

    def generate(self, prompts, n, params):
        if params.temperature:
            return super().generate(prompts, n, params)
        return [Group(p, (Completion((1,), (0.0,), (0,), "no" if p.index == 1 else "yes", "stop"),), 0.0)
                for p in prompts]


def test_each_eval_figure_carries_its_standard_error():
    """Greedy accuracies [1, 0, 1, 1]: 0.75, se 0.25. Sampled (k = 4): prompt i says yes i times, so mean@4 per
    prompt is [0, .25, .5, .75] (mean .375, sample variance .3125 / 3, se sqrt(.3125 / 3) / 2) and pass@4 per
    prompt [0, 1, 1, 1] (.75, se .25)."""
    prompts = [Prompt(i, (1, 2), f"q{i}") for i in range(4)]
    res = evaluate(YesNoSource(), prompts, Scorer.from_config([_yes], None, 10.0), 8, samples=4)
    assert (res.accuracy, res.mean_at_k["_yes"], res.pass_at_k["_yes"]) == (0.75, 0.375, 0.75)
    se_mean = (0.3125 / 3) ** 0.5 / 2
    assert res.se == {"accuracy": pytest.approx(0.25), "greedy/_yes": pytest.approx(0.25),
                      "mean@k/_yes": pytest.approx(se_mean), "pass@k/_yes": pytest.approx(0.25)}
    f = res.fields()
    assert f["n"] == 4 and f["accuracy_se"] == pytest.approx(0.25) and f["greedy_se"]["_yes"] == pytest.approx(0.25)
    assert f["mean_at_k_se"]["_yes"] == pytest.approx(se_mean) and f["pass_at_k_se"]["_yes"] == pytest.approx(0.25)
    assert f["ci95"]["accuracy"] == [pytest.approx(0.3006, abs=1e-4), pytest.approx(0.9544, abs=1e-4)]  # Wilson's
    assert f["ci95"]["mean@k/_yes"] == [pytest.approx(0.375 - 1.96 * se_mean), pytest.approx(0.375 + 1.96 * se_mean)]
    s = res.scalars()
    assert s["eval/accuracy_se"] == pytest.approx(0.25) and s["eval/pass@k/_yes_se"] == pytest.approx(0.25)
    assert s["eval/mean@k/_yes_se"] == pytest.approx(se_mean) and s["eval/greedy/_yes_se"] == pytest.approx(0.25)
    assert [p["scores"]["accuracy"] for p in res.problems] == [1.0, 0.0, 1.0, 1.0]
    assert [p["scores"]["pass@k/_yes"] for p in res.problems] == [0.0, 1.0, 1.0, 1.0]
    assert len({p["id"] for p in res.problems}) == 4


def _fake_run(path, step, scores, ids=None):
    """A run folder whose log holds one evaluation with these per-problem accuracies."""
    from minirl.core.metrics import MetricsLog
    log = MetricsLog(path / "metrics.jsonl")
    ids = ids or [f"p{i}" for i in range(len(scores))]
    log.log("eval_problems", step=step, problems=[{"index": i, "id": pid, "scores": {"accuracy": s}}
                                                   for i, (pid, s) in enumerate(zip(ids, scores))])
    log.close()
    return path


def test_compare_pairs_two_runs_problem_by_problem(tmp_path):
    """a = [1, 0, 1, 1, 0], b = [1, 1, 1, 0, 1] on p0..p4 (b's log in another order): differences [0, 1, 0, -1, 1],
    mean 0.2, sample variance 2.8 / 4 = 0.7, se sqrt(0.7 / 5)."""
    import minirl
    a = _fake_run(tmp_path / "a", 10, [1, 0, 1, 1, 0])
    b = _fake_run(tmp_path / "b", 12, [1, 0, 1, 1, 1], ids=["p4", "p3", "p2", "p1", "p0"])  # b: p0..p4 = 1 1 1 0 1
    c = minirl.compare(a, b)
    se = (0.7 / 5) ** 0.5
    assert (c.n, c.step_a, c.step_b, c.metric) == (5, 10, 12, "accuracy")
    assert (c.mean_a, c.mean_b, c.diff) == (pytest.approx(0.6), pytest.approx(0.8), pytest.approx(0.2))
    assert c.se == pytest.approx(se) and c.ci95 == (pytest.approx(0.2 - 1.96 * se), pytest.approx(0.2 + 1.96 * se))
    d = c.to_dict()
    assert d["diff"] == pytest.approx(0.2) and d["ci95"] == [pytest.approx(x) for x in c.ci95] and d["n"] == 5
    assert "5 problems paired" in repr(c) and "+0.2000" in repr(c)
    json.dumps(d)


def test_compare_refuses_different_problem_sets_in_one_line(tmp_path):
    import minirl
    a = _fake_run(tmp_path / "a", 10, [1, 0, 1])
    b = _fake_run(tmp_path / "b", 10, [1, 0, 1], ids=["p0", "p1", "q9"])
    with pytest.raises(ValueError, match=r"^the runs evaluated different problems \(3 and 3, 2 in common\): "
                                         r"compare runs evaluated on the same eval_data") as e:
        minirl.compare(a, b)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^run_a: no evaluation after 5 steps \(it has: \[10\]\)"):
        minirl.compare(a, b, step=5)
    with pytest.raises(ValueError, match=r"^run_a: no 'pass@k/x' per problem \(it has: accuracy\)"):
        minirl.compare(a, a, metric="pass@k/x")
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text(json.dumps({"event": "eval", "step": 0, "accuracy": 0.5}) + "\n")
    with pytest.raises(ValueError, match=r"^run_a: no per-problem eval scores in its log"):
        minirl.compare(old, a)


def test_a_resume_drops_the_per_problem_scores_of_the_steps_it_redoes(tmp_path):
    """A run resumed after 2 steps redoes step 2 on: the first attempt's evaluation after 3 steps (its eval and
    eval_problems events) is gone from the log as read, so compare pairs the resumed run's own evaluation."""
    from minirl.core.metrics import read_log
    lines = [{"event": "eval_problems", "step": 2, "problems": [{"index": 0, "id": "p0", "scores": {"accuracy": 0}}]},
             {"event": "eval_problems", "step": 3, "problems": [{"index": 0, "id": "p0", "scores": {"accuracy": 1}}]},
             {"event": "resume", "step": 2},
             {"event": "eval_problems", "step": 3, "problems": [{"index": 0, "id": "p0", "scores": {"accuracy": 0.5}}]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    kept = [(e["event"], e.get("step")) for e in read_log(tmp_path)]
    assert kept == [("eval_problems", 2), ("resume", 2), ("eval_problems", 3)]
    from minirl import compare
    assert compare(tmp_path, tmp_path).mean_a == 0.5


def test_the_eval_panels_band_is_the_evals_own_wilson_interval_not_a_zero_width_one():
    """All 4 prompts right (or all wrong): se = 0, so mean +- 1.96 se is [1, 1] ([0, 0]); Wilson's interval at p = 1
    is [n / (n + z^2), 1] = [4 / 7.8416, 1] = [0.5101, 1], at p = 0 [0, z^2 / (n + z^2)] = [0, 0.4899]. The panel
    draws the eval event's own `ci95`; a log without `ci95` (older runs) still gets mean +- 1.96 se."""
    from matplotlib.figure import Figure

    from minirl.run.evaluation import EvalResult
    from minirl.ui.panels import View, draw_panel, eval_lines
    z2 = 1.96 ** 2
    events = [{"event": "eval", "step": s, **EvalResult.from_problems(
        ["_yes"], 0, [{"index": i, "id": str(i), "scores": {"accuracy": acc, "greedy/_yes": acc}}
                      for i in range(4)]).fields()} for s, acc in ((0, 0.0), (1, 1.0))]
    assert [e["accuracy_se"] for e in events] == [0.0, 0.0]
    [(label, xs, ys, _, bands)] = eval_lines(events)
    assert (label, xs, ys) == ("greedy accuracy", [0, 1], [0.0, 1.0])
    assert bands == [(0.0, pytest.approx(z2 / (4 + z2))), (pytest.approx(4 / (4 + z2)), 1.0)]
    assert bands[1][0] == pytest.approx(0.5101, abs=1e-4)
    ax = Figure().add_subplot()
    draw_panel(ax, "eval", View.from_events(events))
    [band] = ax.collections  # the filled polygon's extent at each step is the interval
    by_x = {x: sorted({round(float(y), 6) for xx, y in band.get_paths()[0].vertices if xx == x}) for x in (0, 1)}
    assert by_x == {0: [0.0, round(z2 / (4 + z2), 6)], 1: [round(4 / (4 + z2), 6), 1.0]}
    old = [{"event": "eval", "step": 0, "accuracy": 0.75, "accuracy_se": 0.25}]  # a log from before ci95
    assert eval_lines(old)[0][4] == [(pytest.approx(0.75 - 1.96 * 0.25), pytest.approx(0.75 + 1.96 * 0.25))]

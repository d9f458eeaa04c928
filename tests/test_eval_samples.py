"""Sampled evaluation (`eval_samples: k`, `eval_temperature`): mean@k and pass@k per reward besides greedy
accuracy, in the eval events, summary.json and the dashboard's eval panel."""
import itertools
import json
from math import comb

import pytest

from minirl.run.evaluation import evaluate, pass_at_k
from minirl.rewards import Scorer
from minirl.types import Completion, Group, Prompt, SamplingParams

from conftest import TOY_ROWS


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

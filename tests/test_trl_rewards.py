"""TRL-style rewards as they are (issue 54 item 1): a batched reward `f(prompts, completions, **kwargs) ->
list[float | None]` (Unsloth's GRPO notebook rewards and TRL's quickstart reward, copied unchanged) is scored by
`check`, `preview`, `rescore`, the Scorer in-process and in its reward workers, a YAML `rewards: [module:fn]` and a
2-step run (Python and `minirl train`); None entries are left out of that reward's sum (TRL's nansum); a wrong
length, a non-number or a raise is a recorded failure; a signature of neither form is one line."""
import json
import subprocess
import sys

import pytest

import minirl
from minirl import Config, Run
from minirl.core.metrics import read_log
from minirl.rewards import Scorer, check_columns, reward
from minirl.rewards.scorer import failure_kinds
from minirl.types import Completion, Group, Prompt

# Unsloth's Qwen2.5 (3B) GRPO notebook: its system prompt, answer extraction and reward functions, unchanged.
UNSLOTH = '''import re

SYSTEM_PROMPT = """
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""


def extract_xml_answer(text: str) -> str:
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


# Reward functions
def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    responses = [completion[0]['content'] for completion in completions]
    q = prompts[0][-1]['content']
    extracted_responses = [extract_xml_answer(r) for r in responses]
    print('-'*20, f"Question:\\n{q}", f"\\nAnswer:\\n{answer[0]}", f"\\nResponse:\\n{responses[0]}", f"\\nExtracted:\\n{extracted_responses[0]}")
    return [2.0 if r == a else 0.0 for r, a in zip(extracted_responses, answer)]

def int_reward_func(completions, **kwargs) -> list[float]:
    responses = [completion[0]['content'] for completion in completions]
    extracted_responses = [extract_xml_answer(r) for r in responses]
    return [0.5 if r.isdigit() else 0.0 for r in extracted_responses]

def strict_format_reward_func(completions, **kwargs) -> list[float]:
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<reasoning>\\n.*?\\n</reasoning>\\n<answer>\\n.*?\\n</answer>\\n$"
    responses = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, r) for r in responses]
    return [0.5 if match else 0.0 for match in matches]

def soft_format_reward_func(completions, **kwargs) -> list[float]:
    """Reward function that checks if the completion has a specific format."""
    pattern = r"<reasoning>.*?</reasoning>\\s*<answer>.*?</answer>"
    responses = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, r) for r in responses]
    return [0.5 if match else 0.0 for match in matches]

def count_xml(text) -> float:
    count = 0.0
    if text.count("<reasoning>\\n") == 1:
        count += 0.125
    if text.count("\\n</reasoning>\\n") == 1:
        count += 0.125
    if text.count("\\n<answer>\\n") == 1:
        count += 0.125
        count -= len(text.split("\\n</answer>\\n")[-1])*0.001
    if text.count("\\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\\n</answer>")[-1]) - 1)*0.001
    return count

def xmlcount_reward_func(completions, **kwargs) -> list[float]:
    contents = [completion[0]["content"] for completion in completions]
    return [count_xml(c) for c in contents]
'''

# TRL's quickstart reward (a plain-text dataset: completions are strings), unchanged.
TRL_QUICKSTART = '''def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]
'''

UNSLOTH_NAMES = ["correctness_reward_func", "int_reward_func", "strict_format_reward_func", "soft_format_reward_func",
                 "xmlcount_reward_func"]
GOOD = "<reasoning>\n2+2\n</reasoning>\n<answer>\n4\n</answer>\n"
SHORT = "<answer>5</answer>"
TRAILING = "<reasoning>\nhm\n</reasoning>\n<answer>\nfour\n</answer>\nbye"
# by hand, per reward in UNSLOTH_NAMES' order. GOOD: right answer, digits, strict format; the soft pattern has no
# re.DOTALL, so `.*?` cannot cross the newlines: 0 (the notebook's own behaviour). xmlcount: 4 x 0.125. SHORT: a
# wrong digit answer. TRAILING: xmlcount 0.5 - 3 x 0.001 (after "\n</answer>\n") - (4 - 1) x 0.001.
EXPECTED = {GOOD: [2.0, 0.5, 0.5, 0.0, 0.5], SHORT: [0.0, 0.5, 0.0, 0.0, 0.0], TRAILING: [0.0, 0.0, 0.0, 0.0, 0.494]}


@pytest.fixture
def trl_module(tmp_path, monkeypatch):
    """The rewards above as modules `unsloth_rewards` and `trl_quickstart` on sys.path (workers import them)."""
    (tmp_path / "unsloth_rewards.py").write_text(UNSLOTH)
    (tmp_path / "trl_quickstart.py").write_text(TRL_QUICKSTART)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    importlib.invalidate_caches()
    return importlib.import_module("unsloth_rewards")


def _chat(question: str, system: str) -> tuple[dict, ...]:
    return ({"role": "system", "content": system}, {"role": "user", "content": question})


def _completion(text: str, n: int = 3, version: int = 0) -> Completion:
    return Completion(tuple(range(n)), (0.0,) * n, (version,) * n, text, "stop")


def test_unsloth_rewards_pass_check_on_conversational_cases(trl_module):
    """`check` calls each on a batch of one, prompt and completion as messages (the case's prompt is a list)."""
    prompt = list(_chat("What is 2 + 2?", trl_module.SYSTEM_PROMPT))
    for k, name in enumerate(UNSLOTH_NAMES):
        cases = [dict(prompt=prompt, completion=text, answer="4", expect=want[k]) for text, want in EXPECTED.items()]
        minirl.check(getattr(trl_module, name), cases).assert_ok()
    # conversational=True: a text prompt becomes a user message, the completion an assistant message
    minirl.check(trl_module.xmlcount_reward_func, [(GOOD, 0.5), (SHORT, 0.0)], conversational=True).assert_ok()
    minirl.check("trl_quickstart:reward_len", [("x" * 20, 0.0), ("x" * 5, -15.0)]).assert_ok()


@pytest.mark.parametrize("workers", [0, 1])
def test_unsloth_rewards_score_a_conversational_group_in_and_out_of_process(trl_module, workers):
    """One call per reward per group, in the reward workers as every reward; per-sample totals are the sums."""
    prompt = Prompt(0, (1, 2), "What is 2 + 2?", {"answer": "4"}, _chat("What is 2 + 2?", trl_module.SYSTEM_PROMPT))
    group = Group(prompt, tuple(_completion(t) for t in EXPECTED))
    scorer = Scorer.from_config([f"unsloth_rewards:{n}" for n in UNSLOTH_NAMES], None, 10.0, workers=workers)
    try:
        sg = scorer.score_group(group)
    finally:
        scorer.close()
    assert sg.failures == ()
    for k, name in enumerate(UNSLOTH_NAMES):
        assert sg.per_reward[name] == pytest.approx([w[k] for w in EXPECTED.values()])
    assert sg.rewards == pytest.approx([3.5, 0.5, 0.494])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_plain_dataset_gets_strings_and_every_keyword_as_trl_gives_them(trl_module, workers):
    """Text prompt: strings. Columns repeated per completion, completion_ids, finish_reason, trainer_state with the
    group's newest policy version as global_step; a reward without **kwargs gets only what it names."""
    def seen(prompts, completions, answer, completion_ids, trainer_state, finish_reason, **kwargs):
        assert prompts == ["q?"] * 3 and completions == ["a", "bb", "ccc"], (prompts, completions)
        assert answer == [7, 7, 7] and finish_reason == ["stop"] * 3 and "messages" not in kwargs, kwargs
        return [trainer_state.global_step * 100 + len(ids) for ids in completion_ids]

    def narrow(prompts, completions, answer):
        return [float(a) for a in answer]

    group = Group(Prompt(0, (1,), "q?", {"answer": 7}),
                  (_completion("a", 1, 2), _completion("bb", 2, 5), _completion("ccc", 4, 1)))
    scorer = Scorer.from_config([seen, narrow, "trl_quickstart:reward_len"], [1.0, 0.0, 1.0], 10.0, workers=workers)
    try:
        sg = scorer.score_group(group)
    finally:
        scorer.close()
    assert sg.failures == ()
    assert sg.per_reward["seen"] == (501.0, 502.0, 504.0)  # global_step 5 = max version; len(completion_ids)
    assert sg.per_reward["narrow"] == (7.0, 7.0, 7.0)
    assert sg.per_reward["reward_len"] == (-19.0, -18.0, -17.0)
    assert sg.rewards == (482.0, 484.0, 487.0)  # narrow has weight 0


def test_none_is_left_out_of_that_rewards_sum_and_all_none_skips_the_sample():
    """TRL's nansum: a batched None means "does not apply"; a sample where every weighted reward says None is
    skipped (excluded, not 0), and neither is a failure. A per-sample reward's None still skips the sample."""
    def maybe(prompts, completions, **kwargs):
        return [None if c.startswith("n") else 1.0 for c in completions]

    def half(prompt, completion, **_):
        return None if completion == "skip" else 0.5

    group = Group(Prompt(0, (1,), "q", {}), tuple(_completion(t) for t in ("yes", "no", "nope", "skip")))
    sg = Scorer([("maybe", maybe), ("half", half)], [1.0, 2.0], 5.0).score_group(group)
    assert sg.per_reward["maybe"] == (1.0, None, None, 1.0)
    assert sg.rewards == (2.0, 1.0, 1.0, None) and sg.failures == ()  # 1 + 2 x 0.5; 2 x 0.5; half skipped
    alone = Scorer([("maybe", maybe)], [1.0], 5.0).score_group(group)
    assert alone.rewards == (1.0, None, None, 1.0) and alone.failures == ()


@pytest.mark.parametrize("workers", [0, 1])
def test_wrong_length_non_numbers_and_raises_are_recorded_failures(workers):
    def short(prompts, completions, **kwargs):
        return [1.0]

    def odd(prompts, completions, **kwargs):
        return [1.0, "0.5", float("nan")]

    def scalar(prompts, completions, **kwargs):
        return 1.0

    def raises(prompts, completions, **kwargs):
        return [1 / 0 for _ in completions]

    group = Group(Prompt(0, (1,), "q", {}), tuple(_completion(t) for t in ("a", "b", "c")))
    scorer = Scorer([("short", short), ("odd", odd), ("scalar", scalar), ("raises", raises)], [1.0] * 4, 5.0,
                    workers=workers)
    try:
        sg = scorer.score_group(group)
        again = scorer.score_group(group)  # the pool goes on
    finally:
        scorer.close()
    why = {(f.reward, f.sample): f.reason for f in sg.failures}
    assert why[("short", 2)] == ("wrong length: returned 1 values for 3 completions; a batched reward gives one "
                                 "value (or None) per completion, in order")
    assert ("odd", 0) not in why and why[("odd", 1)] == "returned str '0.5', expected a float or None (entry 1)"
    assert why[("odd", 2)] == "returned non-finite nan"
    assert why[("scalar", 0)].startswith("returned float 1.0, expected a list of 3 floats or None")
    assert why[("raises", 1)] == "raised ZeroDivisionError: division by zero"
    assert len(sg.failures) == 3 + 2 + 3 + 3 and sg.rewards == (None, None, None)
    assert failure_kinds([sg]) == {"wrong length": 3, "expected a float": 1, "non-finite": 1, "expected a list": 3,
                                   "ZeroDivisionError": 3}
    assert sg.per_reward["odd"] == (1.0, None, None) and again.failures == sg.failures


def test_check_reports_a_batched_rewards_wrong_length_and_raise_as_the_case_failing():
    def two(prompts, completions, **kwargs):
        return [1.0, 1.0]

    def raises(prompts, completions, **kwargs):
        raise KeyError("answer")

    assert "returned 2 values for 1 completions" in minirl.check(two, [("a", 1.0)]).failures[0]["why"]
    assert minirl.check(raises, [("a", 1.0)]).failures[0]["why"] == "raised KeyError: 'answer'"


def test_a_signature_of_neither_form_is_one_line_showing_both():
    def lone(text):
        return 1.0

    line = ("reward 'lone' takes (text), neither form of a reward: per sample f(prompt, completion, **columns) -> "
            "float | None, or batched as in TRL f(prompts, completions, **kwargs) -> list[float | None]; give it "
            "one of these signatures")
    for call in (lambda: Scorer.from_config([lone], None, 5.0), lambda: minirl.check(lone, [("a", 1.0)]),
                 lambda: check_columns(lone, "lone", ["answer"])):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == line


def test_marked_batched_rewards_and_batched_column_checks():
    """`@minirl.reward(batched=True)` on other parameter names: called positionally with the lists. A batched
    reward needing a column the data lacks fails before training; completion_ids and trainer_state always exist."""
    @reward(name="test_trl_marked", batched=True)
    def marked(ps, cs, answer, **kwargs):
        return [float(len(c) == a) for c, a in zip(cs, answer)]

    group = Group(Prompt(0, (1,), "q", {"answer": 2}), (_completion("ab"), _completion("abc")))
    assert Scorer.from_config(["test_trl_marked"], None, 5.0).score_group(group).rewards == (1.0, 0.0)

    def needs(prompts, completions, solution, completion_ids, trainer_state):
        return [0.0] * len(completions)

    check_columns(needs, "needs", ["solution", "completion_tokens", "finish_reason"])
    with pytest.raises(ValueError, match=r"reward 'needs' needs column\(s\) \['solution'\]"):
        check_columns(needs, "needs", ["answer", "completion_tokens", "finish_reason"])


def test_yaml_rewards_name_batched_module_functions(trl_module, tmp_path):
    (tmp_path / "c.yaml").write_text("rewards: [unsloth_rewards:xmlcount_reward_func, trl_quickstart:reward_len]\n"
                                     "reward_weights: [1.0, 0.0]\n")
    cfg = Config.from_yaml(tmp_path / "c.yaml")
    scorer = Scorer.from_config(cfg.rewards, cfg.reward_weights, 5.0, workers=1)
    prompt = Prompt(0, (1,), "q", {}, ({"role": "user", "content": "q"},))
    try:
        sg = scorer.score_group(Group(prompt, (_completion(GOOD), _completion(TRAILING))))
    finally:
        scorer.close()
    assert sg.rewards == pytest.approx([0.5, 0.494])
    # reward_len on a conversational completion takes len() of its message list: 1, as in TRL
    assert sg.per_reward["reward_len"] == (-19.0, -19.0)


def test_preview_and_its_rescore_take_batched_rewards(trl_module, tiny_model):
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 1 ?"}], "answer": str(a + 1)} for a in range(3)]
    p = minirl.preview([trl_module.xmlcount_reward_func, trl_module.int_reward_func], rows, model=tiny_model,
                       prompts=2, n=3, max_tokens=4)
    assert len(p.rows) == 6 and all(r["failures"] == [] for r in p.rows)
    assert all(r["xmlcount_reward_func"] == 0.0 for r in p.rows)  # a tiny model's words have no tags
    q = p.rescore([trl_module.correctness_reward_func])
    assert all(r["failures"] == [] and r["reward"] in (0.0, 2.0) for r in q.rows)


def test_unsloth_rewards_train_two_steps_through_run_then_rescore(trl_module, toy_cfg):
    """A conversational dataset (system + user messages, string answers, as the notebook's GSM8K map makes them)
    with the notebook's rewards from 'module:function' in the reward workers: 2 steps, no failure, each reward
    logged; then `rescore` re-scores the logged samples with a batched reward, in message form."""
    rows = [{"prompt": list(_chat(f"What is {a} + {b} ?", trl_module.SYSTEM_PROMPT)), "answer": str(a + b)}
            for a in range(6) for b in range(6)]
    names = [f"unsloth_rewards:{n}" for n in UNSLOTH_NAMES]
    cfg = toy_cfg.replace(rewards=names, reward_workers=1, eval_size=4)
    Run(cfg, data=rows).run()
    steps = [e for e in read_log(cfg.out_dir) if e["event"] == "step"]
    assert len(steps) == 2 and all(e["reward/failures"] == 0 for e in steps)
    assert all(f"reward/{n}" in e for e in steps for n in UNSLOTH_NAMES)
    t = minirl.rescore(cfg.out_dir, trl_module.xmlcount_reward_func)
    assert len(t) > 0 and all(r["failures"] == [] and r["new_reward"] is not None for r in t.rows)


def test_minirl_train_with_trls_quickstart_reward_from_yaml(tiny_model, tmp_path):
    """`minirl train my.yaml` with `rewards: [trl_quickstart:reward_len]` (TRL's reward, unchanged) from the current
    directory, on a plain-text JSONL: 2 steps, no reward failure."""
    with open(tmp_path / "my.jsonl", "w") as f:
        for a in range(6):
            for b in range(6):
                f.write(json.dumps({"prompt": f"What is {a} + {b} ?", "answer": a + b}) + "\n")
    (tmp_path / "trl_quickstart.py").write_text(TRL_QUICKSTART)
    (tmp_path / "my.yaml").write_text(
        f"model: {tiny_model}\nbackend: hf\ndata: my.jsonl\nrewards: [trl_quickstart:reward_len]\nsteps: 2\n"
        "prompts_per_step: 4\ngroup_size: 4\nmax_tokens: 6\nlr: 1e-2\nlora_rank: 8\nlora_alpha: 16\neval_size: 4\n"
        "out_dir: runs/trl\n")
    p = subprocess.run([sys.executable, "-P", "-m", "minirl.cli", "train", "my.yaml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = [e for e in read_log(tmp_path / "runs/trl") if e["event"] == "step"]
    assert len(steps) == 2 and all(e["reward/failures"] == 0 for e in steps)
    assert all(-20.0 <= e["reward/reward_len"] < 0 for e in steps)


def test_check_takes_a_value_as_the_scorer_does():
    """`check` says what a run would record: a numpy number, a 0-d tensor, an async reward's awaited value are
    numbers (they failed every case); a value the scorer fails (1e30 beyond reward_clip, NaN) fails the case even
    where `expect` would take it; SystemExit and a predicate raising on a skip are the case's failure, not a
    traceback out of check."""
    import numpy as np
    import torch

    async def judged(prompt, completion, **_):
        return 1.0

    async def judged_batched(prompts, completions, **kwargs):
        return [0.5 for _ in completions]

    def tensor_batched(prompts, completions, **kwargs):
        return torch.tensor([0.25 for _ in completions])

    def nan_batched(prompts, completions, **kwargs):
        return [float("nan")]

    def quits(prompt, completion, **_):
        raise SystemExit(1)

    for fn, want in ((lambda p, c, **_: np.int64(1), 1.0), (lambda p, c, **_: np.float32(0.5), 0.5),
                     (lambda p, c, **_: torch.tensor(0.5), 0.5), (judged, 1.0), (judged_batched, 0.5),
                     (tensor_batched, 0.25)):
        minirl.check(fn, [("a", want)]).assert_ok()
    why = lambda fn, expect: minirl.check(fn, [dict(completion="a", expect=expect)]).failures[0]["why"]  # noqa: E731
    assert why(lambda p, c, **_: 1e30, 1e30) == "returned 1e+30, beyond reward_clip=1e+06"
    assert why(lambda p, c, **_: float("nan"), lambda v: True) == "returned non-finite nan"
    assert why(nan_batched, lambda v: True) == "returned non-finite nan"
    assert why(quits, 1.0) == "raised SystemExit(1)"
    assert why(lambda p, c, **_: None, lambda v: v > 0.5) == ("predicate raised TypeError: '>' not supported between "
                                                              "instances of 'NoneType' and 'float' (the reward "
                                                              "returned None: a skip)")
    assert why(lambda p, c, **_: None, 1.0) == "returned None (a skip), expected a number"
    assert why(lambda p, c, **_: "1.0", 1.0) == "returned str '1.0', expected a float or None"


def test_check_gives_up_on_a_hanging_reward_as_the_scorer_does():
    """A reward that never returns failed nothing and hung the notebook cell: it is the case's timeout now, and the
    next case runs."""
    import threading
    release = threading.Event()

    def hangs(prompt, completion, **_):
        if completion == "stuck":
            release.wait()  # until the test lets it go
        return 1.0
    try:
        report = minirl.check(hangs, [("stuck", 1.0), ("fine", 1.0)], timeout_s=0.5)
    finally:
        release.set()
    assert [(r["ok"], r["why"]) for r in report.results] == [(False, "timeout after 0.5s"), (True, "")]

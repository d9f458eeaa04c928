"""Rewards see what the completion was (issue 37 item 2, rewards part): `completion_tokens` and `finish_reason` reach
every reward that takes them (rewards without **kwargs keep working), a data column of the same name is an error at
start, and the built-ins `overlong_penalty` (DAPO) and `format_match` take their parameters from YAML
(`name(key=value)`) as from Python (`bind_reward`)."""
import pytest
from conftest import TOY_ROWS

from minirl import Config, Run
from minirl.core.metrics import read_log
from minirl.rewards import Scorer, bind_reward, check_columns, format_match, overlong_penalty
from minirl.rewards.registry import resolve_reward
from minirl.types import Completion, Group, Prompt


def _completion(n: int, finish: str, text: str = "yes") -> Completion:
    return Completion(tuple(range(n)), (0.0,) * n, (0,) * n, text, finish)


GROUP = Group(Prompt(0, (1, 2), "q", {"answer": 3}), (_completion(4, "stop"), _completion(9, "length", "no")))


def test_every_reward_gets_the_keywords_it_takes():
    seen = []

    def strict(prompt, completion, answer):  # no **kwargs, no new keywords: still called, with its column only
        seen.append(("strict", answer))
        return 1.0

    def lengths(prompt, completion, completion_tokens, finish_reason):
        seen.append(("lengths", completion_tokens, finish_reason))
        return float(completion_tokens)

    def anything(prompt, completion, **kw):
        seen.append(("anything", sorted(kw)))
        return 0.0
    s = Scorer.from_config([strict, lengths, anything], None, 5.0, workers=0)
    sg = s.score_group(GROUP)
    assert sg.failures == () and sg.per_reward["lengths"] == (4.0, 9.0)
    assert ("lengths", 4, "stop") in seen and ("lengths", 9, "length") in seen
    assert ("strict", 3) in seen and ("anything", ["answer", "completion_tokens", "finish_reason"]) in seen


def test_an_episode_counts_its_sampled_tokens_only():
    from minirl.rewards.scorer import _columns
    c = Completion((1, 2, 3, 4, 5), (0.0,) * 5, (0,) * 5, "x", "length", mask=(True, True, False, False, True))
    assert _columns({}, c)["completion_tokens"] == 3


def test_a_column_named_like_a_completion_keyword_is_an_error_at_start(toy_cfg):
    rows = [{**r, "finish_reason": "stop"} for r in TOY_ROWS]
    with pytest.raises(ValueError, match=r"the data has column\(s\) \['finish_reason'\].*rename the column"):
        Run(toy_cfg, data=rows).run()


def test_overlong_penalty_is_daps_soft_punishment():
    f = bind_reward("overlong_penalty", max_length=48, cache_length=16)
    got = [f("p", "c", completion_tokens=n) for n in (10, 32, 40, 48, 60)]
    assert got == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="cache_length=0 must be in"):
        overlong_penalty("p", "c", 3, max_length=4, cache_length=0)


def test_format_match():
    assert format_match("p", "<think>a\nb</think> 42", pattern=r"^<think>.*</think>\s*\d+$") == 1.0
    assert format_match("p", "42", pattern=r"^<think>") == 0.0


def test_parameters_from_yaml_and_python(tmp_path):
    cfg = Config(rewards=["arithmetic_correct", "overlong_penalty(max_length=48, cache_length=16)",
                          "format_match(pattern='^yes')"])
    cfg.to_yaml(tmp_path / "c.yaml")
    assert Config.from_yaml(tmp_path / "c.yaml").rewards == cfg.rewards
    s = Scorer.from_config(cfg.rewards, None, 5.0, workers=0)
    sg = s.score_group(GROUP)
    assert sg.per_reward["format_match(pattern='^yes')"] == (1.0, 0.0)
    assert sg.per_reward["overlong_penalty(max_length=48, cache_length=16)"] == (0.0, 0.0)
    fixed = resolve_reward("format_match(pattern='^no')")[1]
    assert fixed("p", "no", pattern="^yes") == 1.0  # a fixed keyword wins over a column of its name
    check_columns(fixed, "format_match(pattern='^no')", ["answer"])  # its pattern is no longer needed from data
    with pytest.raises(ValueError, match=r"needs column\(s\) \['pattern'\].*format_match\(pattern=\.\.\.\)"):
        check_columns(format_match, "format_match", ["answer"])
    with pytest.raises(ValueError, match=r"reward 'format_match\(patern=1\)': no parameter\(s\) \['patern'\]"):
        resolve_reward("format_match(patern=1)")
    with pytest.raises(ValueError, match="cannot read its parameters"):
        resolve_reward("format_match('^x')")
    with pytest.raises(ValueError, match="cannot read its parameters"):
        resolve_reward("format_match(pattern=re.compile('x'))")


def test_a_bound_builtin_in_a_run_with_reward_workers(toy_cfg):
    """`overlong_penalty(...)` from the config in a real run: sent to the worker processes, scored on every step."""
    cfg = toy_cfg.replace(rewards=["yes_reward", "overlong_penalty(max_length=6, cache_length=2)"],
                          reward_weights=[1.0, 0.0], reward_workers=1)
    Run(cfg, data=TOY_ROWS).run()
    steps = [e for e in read_log(cfg.out_dir) if e["event"] == "step"]
    key = "reward/overlong_penalty(max_length=6, cache_length=2)"
    assert len(steps) == 2 and all(e["reward/failures"] == 0 for e in steps)
    for e in steps:  # max_tokens = 6: a cut completion (6 tokens) gets -1, a 5-token one -0.5
        assert -1.0 <= e[key] <= 0.0
    assert any(e[key] < 0 for e in steps)


def test_mask_truncated_gives_a_cut_completion_no_loss(tiny_model):
    """Two groups whose only non-zero advantages are on cut completions (finish_reason 'length'): with
    mask_truncated the step trains on no sample and leaves the adapter as it was; without it, it trains on them."""
    import torch

    from minirl.training.batch import SampleFilter, samples_from_groups
    from minirl.training.trainer import Trainer
    from minirl.types import ScoredGroup
    cut, done = _completion(4, "length"), _completion(3, "stop")
    g = Group(Prompt(0, (1, 2, 3), "q"), (cut, cut, done))
    scored = [ScoredGroup(g, (1.0, 0.0, 0.5), {}, (1.0, -1.0, 0.0))]
    assert len(samples_from_groups(scored)) == 2
    assert samples_from_groups(scored, SampleFilter(drop_truncated=True)) == []
    cfg = Config(model=tiny_model, lora_rank=4, lr=1e-2, dtype="float32", max_tokens=6)
    for mask, trained in ((True, 0), (False, 2)):
        t = Trainer(cfg.replace(mask_truncated=mask), device="cpu")
        before = [p.detach().clone() for p in t.model.parameters() if p.requires_grad]
        m = t.step(scored)
        after = [p for p in t.model.parameters() if p.requires_grad]
        assert m["train/samples"] == trained
        assert all(torch.equal(a, b) for a, b in zip(after, before)) == (trained == 0)

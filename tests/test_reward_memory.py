"""A CPU reward model or local LLM judge in a reward worker, under its RLIMIT_DATA of `reward_memory_mb`
(`training.plan_reward.worker_limit_problem`): a copy the limit cannot hold stops the run before the workers start,
one line naming the value it needs; at that value a real worker loads and scores it. A local judge
(`judge(..., local=...)`) is counted in the memory plan as a reward model is (`training.plan_judge`)."""
import json
import re

import pytest
from conftest import TOY_ROWS

import minirl
from minirl.config import ConfigError
from minirl.rewards import Scorer
from minirl.run.placement import Devices, place
from minirl.run.plan import plan_run
from minirl.training.plan import GiB
from minirl.training.plan_reward import check_reward_models, reward_model_loads
from minirl.types import Completion, Group, Prompt

# The tiny model (vocab 64, hidden 64, 2 layers, intermediate 128, 4 heads of 16, 2 KV heads, untied) as a
# one-label classifier in float32: 2 x (q 4096 + k 2048 + v 2048 + o 4096 + gate, up, down 3 x 8192 + two norms 128)
# + the embedding 4096 + the final norm 64 + the score head 64 = 78,208 parameters, 312,832 bytes. toy_cfg's batch:
# 8 rows of min(512, 256) prompt + 6 completion tokens = 2096 tokens, each the KV cache's 2 x 2 x 2 x 16 x 4 = 512
# bytes and one layer's intermediates 4 x (4 x 64 + 3 x 64 + 3 x 128) = 3328: 8,048,640 bytes. One copy:
# 8,361,472 bytes = 7.97 MiB; a worker needs 384 + ceil(1.3 x 7.97 = 10.37) = 384 + 11 = 395 MiB.
TINY_RM_COPY, TINY_RM_NEED = 312_832 + 8_048_640, 395


def _classifier(tiny_model, folder):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    return f"reward_model(path={str(folder)!r})"


def test_a_reward_model_a_worker_cannot_hold_stops_the_run_before_the_workers_start(tiny_model, toy_cfg, tmp_path,
                                                                                   monkeypatch):
    """reward_memory_mb one MiB short of the need: the run stops at setup with one line naming the value and the
    other way out, before any reward worker starts (the scorer's start would fail the test); the same line is a
    problem of the plan (`minirl plan`). `reward_workers: 0` has no limit."""
    ref = _classifier(tiny_model, tmp_path / "rm")
    cfg = toy_cfg.replace(rewards=[ref], reward_workers=1, reward_memory_mb=TINY_RM_NEED - 1)
    loads, problems = reward_model_loads(cfg, "cpu", 256)
    assert loads["cpu"].gb == pytest.approx(TINY_RM_COPY / GiB)
    line = (f"{ref}: one copy of the reward model needs about {TINY_RM_NEED} MiB in each reward worker (8 MiB "
            f"planned, with the worker's own torch and the loader's slack), over reward_memory_mb={TINY_RM_NEED - 1}: "
            f"it cannot load there; raise reward_memory_mb to {TINY_RM_NEED}, or set reward_workers: 0 to load it in "
            "the run's process")
    assert problems == [line]
    monkeypatch.setattr(Scorer, "start", lambda self: pytest.fail("the reward workers started"))
    with pytest.raises(ConfigError) as e:
        minirl.Run(cfg, data=TOY_ROWS[:16]).setup()
    assert str(e.value) == line
    assert plan_run(cfg, Devices(0), place(cfg, 0)).problems() == [line]
    check_reward_models(cfg.replace(reward_workers=0))  # in the run's process: no limit, no problem
    check_reward_models(cfg.replace(reward_memory_mb=TINY_RM_NEED))


def test_at_the_value_the_plan_names_a_worker_loads_and_scores_the_reward_model(tiny_model, toy_cfg, tmp_path):
    """The needed value is enough: a worker capped at it loads the tiny classifier and scores a group, the same
    scores as without a cap. A cap far below it (torch alone does not fit) fails the worker's start with one line
    naming reward_memory_mb (before this check a run said "make its module importable" or std::bad_alloc)."""
    ref = _classifier(tiny_model, tmp_path / "rm")
    check_reward_models(toy_cfg.replace(rewards=[ref], reward_workers=1, reward_memory_mb=TINY_RM_NEED))
    group = Group(Prompt(0, (1, 2), "What is 1 + 2 ?", {"answer": 3}),
                  tuple(Completion((5,), (-1.0,), (0,), t, "stop") for t in ("3", "4 yes")))
    scores = {}
    for mb in (TINY_RM_NEED, None):
        scorer = Scorer.from_config([ref], None, 120.0, workers=1, memory_mb=mb)
        try:
            scored = scorer.score_group(group)
        finally:
            scorer.close()
        assert scored.failures == (), scored.failures
        scores[mb] = scored.rewards
    assert scores[TINY_RM_NEED] == scores[None]
    low = Scorer.from_config([ref], None, 120.0, workers=1, memory_mb=256)  # torch itself does not fit: at start
    with pytest.raises(RuntimeError, match=r"reward_memory_mb=256 MiB: raise it, or set reward_workers: 0 to score "
                                           r"in the run's process\)$"):
        low.score_group(group)


# A local judge's config.json: vocab 1000, hidden 128, 2 layers, intermediate 256, 4 heads of 32, 2 KV heads, untied.
# float32 (b = 4): 2 x (q 16384 + k 8192 + v 8192 + o 16384 + gate, up, down 3 x 32768 + two norms 256) + the
# embedding and lm_head 2 x 128000 + the final norm 128 = 551,552 parameters, 2,206,208 bytes. 4 questions
# (concurrency) of the prompt 256 + the run's max_tokens 64 + 'Rate {completion}' 17 characters = 5 tokens + the
# reply's 16: 4 x 341 = 1364 tokens, each the KV cache's 2 x 2 x 2 x 32 x 4 = 1024 bytes and one layer's
# intermediates 4 x (4 x 128 + 3 x 128 + 3 x 256) = 6656 (10,475,520 bytes), and the last position's logits
# 4 x 1000 x 4 = 16,000: one copy 12,697,728 bytes = 12.11 MiB; a worker needs 384 + ceil(1.3 x 12.11 = 15.74) = 400.
JUDGE_COPY, JUDGE_NEED = 2_206_208 + 10_475_520 + 16_000, 400


def _judge_cfg(toy_cfg, tmp_path, **fields):
    folder = tmp_path / "judge"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=1000, hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)))
    ref = f"judge(template='Rate {{completion}}', local={str(folder)!r}, max_tokens=16, concurrency=4)"
    return toy_cfg.replace(rewards=["yes_reward", ref], max_tokens=64, **fields), ref, str(folder)


def test_the_plan_counts_a_local_judges_copy_in_each_reward_worker(toy_cfg, tmp_path):
    """Three reward workers: three copies on the CPU, each as the comment above counts it, with a note line; a
    judge at a URL is no part of the plan."""
    cfg, ref, folder = _judge_cfg(toy_cfg, tmp_path, reward_workers=3)
    cpu = plan_run(cfg, Devices(0), place(cfg, 0)).devices[0]
    assert cpu.train["reward model"] == cpu.generate["reward model"] == pytest.approx(3 * JUDGE_COPY / GiB)
    assert (f"local judge {folder} (0.00B, float32) on cpu: 3 copies (one per reward worker, reward_workers: 3) x "
            f"0.01 GiB (weights 0.00, 4 questions generated together 0.01)") in cpu.table()
    one = plan_run(cfg.replace(reward_workers=0), Devices(0), place(cfg, 0)).devices[0]
    assert one.train["reward model"] == pytest.approx(JUDGE_COPY / GiB)
    url = cfg.replace(rewards=["judge(template='Rate {completion}', url='http://127.0.0.1:1/v1')"])
    assert "reward model" not in plan_run(url, Devices(0), place(url, 0)).devices[0].train


def test_a_local_judge_a_worker_cannot_hold_is_the_same_one_line(toy_cfg, tmp_path):
    cfg, ref, _ = _judge_cfg(toy_cfg, tmp_path, reward_workers=2, reward_memory_mb=JUDGE_NEED - 1)
    head = f"{ref}: one copy of the local judge needs about {JUDGE_NEED} MiB in each reward worker ("
    tail = f"raise reward_memory_mb to {JUDGE_NEED}, or set reward_workers: 0 to load it in the run's process"
    with pytest.raises(ConfigError, match=f"^{re.escape(head)}.*{re.escape(tail)}$"):
        check_reward_models(cfg)
    check_reward_models(cfg.replace(reward_memory_mb=JUDGE_NEED))
    gone = cfg.replace(rewards=["judge(template='{completion}', local='./no-such-judge')"])
    with pytest.raises(ConfigError, match=r"the local judge's folder './no-such-judge' does not exist"):
        check_reward_models(gone)


def test_the_models_a_worker_loads_are_held_together(tiny_model, toy_cfg, tmp_path):
    """Each reward worker loads every reward: the tiny classifier (toy_cfg's batch at max_tokens 64: 8 x 320 tokens
    x 3840 bytes + its weights = 10,143,232 bytes; alone it needs 384 + ceil(1.3 x 9.67 = 12.58) = 397 MiB) beside
    the judge (400 alone): together 22,840,960 bytes = 21.78 MiB, 384 + ceil(1.3 x 21.78 = 28.32) = 413. At 405
    each alone fits, both do not: one line naming both."""
    cfg, judge_ref, _ = _judge_cfg(toy_cfg, tmp_path, reward_workers=1, reward_memory_mb=405)
    rm = _classifier(tiny_model, tmp_path / "rm")
    check_reward_models(cfg)
    check_reward_models(cfg.replace(rewards=[rm]))
    with pytest.raises(ConfigError) as e:
        check_reward_models(cfg.replace(rewards=[rm, judge_ref]))
    assert str(e.value) == (f"{rm}, {judge_ref}: one copy of each of these 2 models needs about 413 MiB in each "
                            "reward worker (22 MiB planned, with the worker's own torch and the loader's slack), over "
                            "reward_memory_mb=405: they cannot load there; raise reward_memory_mb to 413, or set "
                            "reward_workers: 0 to load them in the run's process")


def test_a_local_judge_given_as_a_python_object_is_checked_too(toy_cfg, tmp_path, monkeypatch):
    """`Run(rewards=[judge(..., local=...)])`: the config holds only its name ('grader'); the run checks the object
    before the reward workers start, the same line as the config's string form, named by its name."""
    from minirl.rewards import judge
    cfg, _, folder = _judge_cfg(toy_cfg, tmp_path, reward_workers=1, reward_memory_mb=JUDGE_NEED - 1)
    grader = judge("Rate {completion}", local=folder, max_tokens=16, concurrency=4, name="grader")
    monkeypatch.setattr(Scorer, "start", lambda self: pytest.fail("the reward workers started"))
    with pytest.raises(ConfigError, match=rf"^grader: one copy of the local judge needs about {JUDGE_NEED} MiB in "
                                          rf"each reward worker .*raise reward_memory_mb to {JUDGE_NEED}, or set "):
        minirl.Run(cfg, rewards=[grader], data=TOY_ROWS[:16]).setup()

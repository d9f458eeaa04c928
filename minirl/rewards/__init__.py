"""Rewards: the registry (`registry.py`), the built-in tasks' rewards (`builtin.py`), the scorer that runs them on
each group and turns rewards into group-relative advantages (`scorer.py`), the worker processes the calls run in
(`workers.py`, `worker_main.py`); a reward model's score (`reward_model.py`); a model-graded reward, `judge(...)`
(`llm_judge.py`). Code rewards run model-written code in `minirl.rewards.sandbox`."""
from minirl.rewards import builtin, llm_judge, reward_model  # noqa: F401 - registers the built-in rewards
from minirl.rewards.builtin import arithmetic_correct, code_tests_pass, format_match, last_integer, overlong_penalty
from minirl.rewards.llm_judge import judge
from minirl.rewards.registry import (
    COMPLETION_KEYWORDS,
    REGISTRY,
    RewardFn,
    bind_reward,
    check_columns,
    check_data_columns,
    resolve_reward,
    reward,
    source_hash,
)
from minirl.rewards.scorer import Scorer

__all__ = ["COMPLETION_KEYWORDS", "REGISTRY", "RewardFn", "Scorer", "arithmetic_correct", "bind_reward",
           "check_columns", "check_data_columns", "code_tests_pass", "format_match", "judge", "last_integer",
           "overlong_penalty", "resolve_reward", "reward", "source_hash"]

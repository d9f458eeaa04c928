"""The memory plan's part 'local judge' (`training.plan`): each `judge(..., local=...)` in `rewards` (an LLM judge
run by transformers in the process that scores, `rewards.llm_judge.local_replies`) sized from its config.json alone,
on the CPU, once per process that loads it: each reward worker its own copy (`reward_workers: N`: N copies),
`reward_workers: 0` one, in the run's process. Counted with the reward models (`plan_reward`), as their part.

A copy: the causal LM's weights in float32 (as `local_replies` loads it; the lm_head too unless tied); one batch of
`concurrency` questions generated greedily for `max_tokens`: each row the filled template (the prompt, the
completion at `max_tokens` of the run, and the template's own text at 4 characters a token, a guess: its tokens
are the tokenizer's) plus the judge's reply; the KV cache of all those tokens, one decoder layer's intermediates of
the prefill as `plan_reward` counts a reward model's (taken over every token, the reply's too: an upper bound), and
the float32 logits of each row's last position (generate keeps only that one).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Sequence

from minirl.config import Config
from minirl.rewards.llm_judge import judge_reward
from minirl.rewards.registry import REGISTRY, BoundReward, parse_call
from minirl.training.models import EMBEDDED, embedded_model_dir
from minirl.training.plan import Shape

CHARS_PER_TOKEN = 4  # the template's text as tokens, before the tokenizer has seen it


@dataclass(frozen=True)
class LocalJudgeUse:
    """A `judge(..., local=...)` named in `rewards`, as the memory plan counts it (the judge's defaults filled in)."""
    ref: str
    path: str  # a folder or Hub id; the embedded model's name is its folder
    concurrency: int  # the questions generated together
    max_tokens: int  # the judge's reply
    template: str


def local_judge_uses(refs: Sequence[Any]) -> list[LocalJudgeUse]:
    """The local judges among a config's `rewards` ('judge(template=..., local=...)' strings) or a run's reward
    objects (`judge(..., local=...)` in Python: its `name` is its ref). Other rewards, judges with `url=` or
    `serve=`, and a reference that cannot be read (the scorer names that one) are left out."""
    defaults = {k: p.default for k, p in inspect.signature(judge_reward).parameters.items()}
    out = []
    for ref in refs:
        if isinstance(ref, BoundReward) and ref.fn is judge_reward:
            ref, params = ref.__name__, ref.params
        elif not (isinstance(ref, str) and "(" in ref and ref.rstrip().endswith(")")):
            continue
        else:
            try:
                head, params = parse_call(ref)
            except ValueError:
                continue
            if REGISTRY.get(head) is not judge_reward and head != "minirl.rewards.llm_judge:judge_reward":
                continue
        if not params.get("local"):
            continue
        kw = {**defaults, **params}
        path = str(embedded_model_dir()) if kw["local"] == EMBEDDED else str(kw["local"])
        out.append(LocalJudgeUse(ref, path, int(kw["concurrency"]), int(kw["max_tokens"]), str(kw["template"] or "")))
    return out


def judge_copy_bytes(c: dict, use: LocalJudgeUse, cfg: Config, prompt: int) -> tuple[int, int, int]:
    """(weights, activations, parameters) of one copy of the local judge of config.json `c` (module docstring); a
    config Shape cannot read raises its ConfigError."""
    shape, b = Shape.from_config(c), 4  # float32: local_replies loads it so
    h, q, i = shape.hidden, shape.heads * shape.head_dim, shape.intermediate
    row = prompt + cfg.max_tokens + math.ceil(len(use.template) / CHARS_PER_TOKEN) + use.max_tokens
    tokens = use.concurrency * row
    acts = tokens * (shape.kv_bytes_per_token(b) + b * (4 * h + 3 * q + 3 * i)) + use.concurrency * shape.vocab * b
    return shape.params() * b, acts, shape.params()

"""A reward from a sequence-classification reward model, the commonest RLHF reward: `reward_model(path=...)` in
`rewards` (a Hub id or a folder that `AutoModelForSequenceClassification` loads). It is a batched reward: each group
is scored in batches of `batch_size` on `device`. The text scored is the prompt and the completion through the
reward model's chat template (a user message, the assistant's answer; message lists as they are), or the two
strings joined when it has none. The score is the head's single logit, or with several labels the logit of `label`
(a name from its `id2label`, or an index). The model is loaded once per process (the run's, or each reward worker's:
`reward_workers: 0` keeps one copy), in its config's dtype (transformers' 'auto'). The memory plan counts every copy
on its device (`reward_model_uses`, `training.plan_reward`): one that cannot fit, or a CPU copy that a reward
worker's `reward_memory_mb` cannot hold, stops the run before anything loads."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from minirl.rewards.registry import REGISTRY, parse_call, reward

_LOADED: dict[tuple[str, str], tuple[Any, Any]] = {}


def _load(path: str, device: str) -> tuple[Any, Any]:
    if (path, device) not in _LOADED:
        tok = AutoTokenizer.from_pretrained(path)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype="auto").to(device).eval()
        model.config.pad_token_id = tok.pad_token_id  # the head reads each row's last token before the padding
        _LOADED[(path, device)] = tok, model
    return _LOADED[(path, device)]


def _column(model, label: str | int | None, path: str) -> int:
    n = model.config.num_labels
    if label is None:
        if n == 1:
            return 0
        raise ValueError(f"reward_model: {path} has {n} labels {sorted(model.config.label2id)}: give label= one of "
                         "them (its logit is the score)")
    if isinstance(label, str):
        if label not in model.config.label2id:
            raise ValueError(f"reward_model: label {label!r} is not one of {path}'s {sorted(model.config.label2id)}")
        return int(model.config.label2id[label])
    if not 0 <= int(label) < n:
        raise ValueError(f"reward_model: label {label} is not an index below {path}'s {n} labels")
    return int(label)


def _text(tok, prompt: str | Sequence[dict], completion: str | Sequence[dict]) -> str:
    if not tok.chat_template:
        flat = [m["content"] for x in (prompt, completion) for m in ([{"content": x}] if isinstance(x, str) else x)]
        return "".join(flat)
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    msgs += [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
    return tok.apply_chat_template(msgs, tokenize=False)


@reward
def reward_model(prompts: Sequence, completions: Sequence, *, path: str, label: str | int | None = None,
                 device: str = "cpu", batch_size: int = 8, max_length: int = 2048, **_: Any) -> list[float]:
    """The reward model's score of each (prompt, completion) (module docstring), e.g.
    `reward_model(path='my-org/my-rm')` or `reward_model(path='./rm', label='good', device='cuda:1')`."""
    tok, model = _load(path, device)
    col = _column(model, label, path)
    texts = [_text(tok, p, c) for p, c in zip(prompts, completions)]
    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i:i + batch_size], return_tensors="pt", padding=True, truncation=True,
                      max_length=max_length, add_special_tokens=not tok.chat_template).to(device)
            out += model(**enc).logits[:, col].float().tolist()
    return out


@dataclass(frozen=True)
class RewardModelUse:
    """A `reward_model(...)` named in `rewards`, as the memory plan counts it (the function's defaults filled in)."""
    ref: str
    path: str
    device: str  # 'cpu' or 'cuda:N' ('cuda' is 'cuda:0'); other devices as given (not planned)
    batch_size: int
    max_length: int


def reward_model_uses(refs: Sequence[Any]) -> list[RewardModelUse]:
    """The reward models among a config's `rewards` ('reward_model(path=..., ...)' strings; `bind_reward`'s name is
    the same string), with `reward_model`'s defaults where a keyword is not given. Other rewards, and a reference
    that cannot be read (the scorer names that one), are left out."""
    defaults = {k: p.default for k, p in inspect.signature(reward_model).parameters.items()}
    out = []
    for ref in refs:
        if not (isinstance(ref, str) and "(" in ref and ref.rstrip().endswith(")")):
            continue
        try:
            head, params = parse_call(ref)
        except ValueError:
            continue
        if "path" not in params or (REGISTRY.get(head) is not reward_model
                                    and head != "minirl.rewards.reward_model:reward_model"):
            continue
        kw = {**defaults, **params}
        device = f"cuda:{kw['device']}" if isinstance(kw["device"], int) else str(kw["device"])
        out.append(RewardModelUse(ref, str(kw["path"]), "cuda:0" if device == "cuda" else device,
                                  int(kw["batch_size"]), int(kw["max_length"])))
    return out

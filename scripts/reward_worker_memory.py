"""Where a CPU reward model and a local judge stop loading in a reward worker, against the memory plan's need
(`training.plan_reward.worker_limit_problem`, whose WORKER_TORCH_MIB and WORKER_SLACK come from these runs): each
model is scored in one worker capped at each `reward_memory_mb` given, a batch about the plan's size (8 rows of a
~260-token prompt and a ~40-token completion; the plan assumes 256 + max_tokens 48), printing 'scored' or the
failure. The classifier: a random Llama of 47M parameters in float32 (built in a temporary folder, the tiny
model's tokenizer); the judge: the embedded model (`local='smollm2-135m-instruct'`).

    python scripts/reward_worker_memory.py rm 765 790 810 857
    python scripts/reward_worker_memory.py judge 1200 1240 1314
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from minirl import Config
from minirl.rewards import Scorer
from minirl.training.models import build_tiny_model
from minirl.training.plan_reward import reward_model_loads
from minirl.types import Completion, Group, Prompt

JUDGE = ("judge(template='Is {completion} the answer to {prompt}? Say yes or no.', parse='yes_no', "
         "local='smollm2-135m-instruct', max_tokens=8, concurrency=8)")


def classifier(root: Path) -> str:
    tiny, rm = build_tiny_model(root / "tiny"), root / "rm"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_labels=1,
                      max_position_embeddings=512, pad_token_id=0, tie_word_embeddings=False)
    LlamaForSequenceClassification(cfg).save_pretrained(rm)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(rm)
    return f"reward_model(path={str(rm)!r})"


def main(which: str, limits: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ref = classifier(Path(tmp)) if which == "rm" else JUDGE
        cfg = Config(model=str(build_tiny_model(Path(tmp) / "tiny")), rewards=[ref], reward_workers=1,
                     reward_memory_mb=1, max_tokens=48)
        loads, problems = reward_model_loads(cfg, "cpu", 256)
        print(loads["cpu"].notes[0])
        print("the plan:", problems[0].split(": ", 1)[1].split(";")[0])
        prompt = "What is 1 + 2 ? " + " ".join(["yes"] * 250)
        group = Group(Prompt(0, (1, 2), prompt, {"answer": 3}),
                      tuple(Completion((5,), (-1.0,), (0,), f"{n} " + " ".join(["no"] * 40), "stop")
                            for n in range(8)))
        for mb in limits:
            scorer = Scorer.from_config([ref], None, 600.0, workers=1, memory_mb=mb)
            try:
                scored = scorer.score_group(group)
                print(mb, "MiB:", "scored" if not scored.failures else scored.failures[0].reason[:160])
            except RuntimeError as e:
                print(mb, "MiB: the worker did not start:", str(e)[:160])
            finally:
                scorer.close()


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2:]])

"""What autograd keeps for one training micro-batch, by tensor, against the memory plan's per-token count.

One forward of the trainer's model (LoRA on every linear layer) on a shared-prefix packed micro-batch of random
tokens, every tensor autograd saves recorded once (by storage; parameters left out), grouped by shape. Prints one
JSON: tokens, the saved bytes per token, the packed row's mask, and the plan's figure
(`plan.Shape.layer_activation_bytes` x layers + the final norm); tests/test_plan.py runs `census` on the tiny model.

    python scripts/activation_census.py [--model smollm2-135m-instruct] [--tokens 2048] [--dtype bfloat16 --device cuda]
"""
import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def census(model, tokens: int, group: int = 8, prompt: int = 40, seed: int = 0) -> dict:
    """Saved bytes of one forward of `model` (a peft model in training mode) on one packed row of about `tokens`
    tokens: groups of one prompt and `group` completions."""
    import torch

    from minirl.training.batch import Sample, make_batch
    from minirl.training.packing import pack, packed_completion_logprobs
    vocab = model.get_base_model().config.vocab_size
    rng = random.Random(seed)
    comp = max(1, (tokens // 2 - prompt) // group)
    samples = []
    for p in range(2):
        ids = tuple(rng.randrange(3, vocab) for _ in range(prompt))
        for g in range(group):
            c = tuple(rng.randrange(3, vocab) for _ in range(comp))
            samples.append(Sample(ids, c, (0.0,) * comp, (0,) * comp, 1.0 if g % 2 else -1.0))
    batch = make_batch(samples, 0, "token-mean", comp)
    (mb,) = pack(samples, batch, 10**9)
    mb = mb.to(next(model.parameters()).device)
    seen: dict[int, tuple[int, tuple, str]] = {}

    def keep(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = (st.nbytes(), tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return t
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        packed_completion_logprobs(model, mb)
    acts = {k: v for k, v in seen.items() if k not in params}
    by_shape = Counter()
    for n, shape, dtype in acts.values():
        by_shape[f"{shape} {dtype}"] += n
    T = mb.n_real_tokens
    mask = next((n for n, shape, _ in acts.values() if shape[-2:] == (T, T)), 0)
    return {"tokens": T, "saved_bytes": sum(n for n, _, _ in acts.values()), "mask_bytes": mask,
            "by_shape": dict(by_shape.most_common(20))}


def plan_bytes_per_token(config: dict, rank: int, b: int = 4) -> int:
    """The plan's kept bytes per token without checkpointing (layers x per-layer + the final norm)."""
    from minirl.training.plan import Shape
    s = Shape.from_config(config)
    return s.layers * s.layer_activation_bytes(b, rank) + 2 * s.hidden * b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from minirl.config import Config
    from minirl.training.models import build_model
    cfg = Config(model=args.model, dtype=args.dtype)
    model = build_model(cfg, args.device)
    res = census(model, args.tokens)
    per = (res["saved_bytes"] - res["mask_bytes"]) / res["tokens"]
    plan = plan_bytes_per_token(model.get_base_model().config.to_dict(), cfg.lora_rank,
                                4 if args.dtype == "float32" else 2)
    print(json.dumps({**res, "saved_per_token": round(per), "plan_per_token": plan, "plan_over_saved":
                      round(plan / per, 3)}))


if __name__ == "__main__":
    main()

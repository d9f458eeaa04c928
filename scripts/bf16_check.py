"""Trainer speed of bf16 vs fp32 on this CPU: a LoRA forward + backward of the embedded model on the demo's batch
shape (32 sequences x 70 tokens), the two dtypes interleaved over rounds (ABAB...), all cores. Mixed precision as
`dtype: bfloat16` runs it: the base in bf16, the LoRA weights (peft upcasts them) in fp32.

    python scripts/bf16_check.py [--rounds 3]
Prints one JSON line: the CPU's bf16 flags, tokens/s per dtype (median over rounds), the ratio.
"""
import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=70)
    args = ap.parse_args()
    from minirl.config import Config
    from minirl.training.models import build_model, cpu_bf16_flags
    models = {d: build_model(Config(dtype=d), "cpu") for d in ("float32", "bfloat16")}
    ids = torch.randint(100, 10000, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    times = {d: [] for d in models}
    for r in range(args.rounds + 1):  # round 0 warms up
        for d, m in models.items():
            t = time.perf_counter()
            out = m(input_ids=ids).logits.float().log_softmax(-1)[..., :-1, :].gather(-1, ids[:, 1:, None]).mean()
            out.backward()
            m.zero_grad(set_to_none=True)
            if r:
                times[d].append(time.perf_counter() - t)
    tps = {d: round(args.batch * args.tokens / statistics.median(ts), 1) for d, ts in times.items()}
    print(json.dumps({"cpu_bf16": cpu_bf16_flags(), "threads": torch.get_num_threads(), "rounds": args.rounds,
                      "order": "fp32,bf16 per round", "batch": [args.batch, args.tokens], "tokens_per_s": tps,
                      "bf16_over_fp32": round(tps["bfloat16"] / tps["float32"], 2),
                      "step_s": {d: [round(x, 2) for x in ts] for d, ts in times.items()}}))


if __name__ == "__main__":
    main()

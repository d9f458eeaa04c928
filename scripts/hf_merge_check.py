"""transformers generation with the LoRA merged (the CPU default) vs unmerged, side by side on the demo's prompts
(8 prompts x 8 samples, 24 tokens, rank-16 all-linear LoRA), one torch thread as in the pipeline's generator
process. Pin it to one core for a steady figure:

    taskset -c 0 python scripts/hf_merge_check.py [--rounds 4]
"""
import argparse
import json

import torch
from transformers import AutoTokenizer

from minirl import data as D
from minirl.benchmarks.generation import bench_hf_merge
from minirl.models import resolve_model

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = resolve_model("smollm2-135m-instruct")
    prompts = D.to_prompts(D.arithmetic_splits(64, 0)[0][:8], AutoTokenizer.from_pretrained(path))
    print(json.dumps(bench_hf_merge(path, prompts, n=8, max_tokens=24, rounds=args.rounds)))

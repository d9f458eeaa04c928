"""transformers generation with the LoRA merged (the CPU default) vs unmerged, side by side on the demo's prompts
(8 prompts x 8 samples, 24 tokens, the demo's trainer: rank-16 all-linear LoRA), one torch thread as in the
pipeline's generator process; a fake optimizer step before each round, so the merge is timed as in a run. Pin it to one core for a steady figure:

    taskset -c 0 python scripts/hf_merge_check.py [--rounds 4]
"""
import argparse
import json

import torch

from minirl.benchmarks.generation import bench_hf_merge, demo_prompts
from minirl.config import DEMO, Config
from minirl.training.trainer import Trainer
from minirl.types import SamplingParams

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    trainer = Trainer(Config(**DEMO), device="cpu")
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=0)
    print(json.dumps(bench_hf_merge(trainer, demo_prompts(trainer.tokenizer), 8, params, rounds=args.rounds)))

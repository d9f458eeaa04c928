"""The pipeline's own bookkeeping per step at K = 0 (issue 39 item 4): a run's steps through `rollout.Pipeline`
against the same steps called directly (generate, then score), with a generator and a scorer that do no work, so
what remains is the pipeline's threads, buffer and version signal. Interleaved rounds; JSON on stdout.

    python scripts/bench_pipeline_overhead.py [--steps 200] [--rounds 5] [--prompts 8] [--group 8]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

from minirl.pipeline.rollout import Pipeline
from minirl.types import Completion, Group, Prompt, SamplingParams, ScoredGroup


class NoWorkGenerator:
    """Returns G fixed completions per prompt at once; its version is what the "trainer" set."""
    name = "no-work"

    def __init__(self, n_tokens: int = 32):
        self.version = 0
        self.comp = Completion(tuple(range(n_tokens)), (-1.0,) * n_tokens, (0,) * n_tokens, "x", "stop")

    def generate(self, prompts, n, params):
        return [Group(p, (self.comp,) * n) for p in prompts]


class NoWorkScorer:
    def score_group(self, g):
        return self.score_groups([g])[0]

    def score_groups(self, groups):
        return [ScoredGroup(g, (0.0,) * len(g.completions), {}, (0.0,) * len(g.completions)) for g in groups]


def direct(steps: int, prompts: list[Prompt], G: int) -> float:
    gen, scorer, params = NoWorkGenerator(), NoWorkScorer(), SamplingParams()
    t0 = time.perf_counter()
    for s in range(steps):
        scorer.score_groups(gen.generate(prompts, G, params))
        gen.version = s + 1
    return (time.perf_counter() - t0) / steps


def piped(steps: int, prompts: list[Prompt], G: int) -> float:
    gen, scorer = NoWorkGenerator(), NoWorkScorer()
    p = Pipeline(gen, scorer, lambda s: prompts, lambda s: SamplingParams(), G, len(prompts), steps, 0)
    t0 = time.perf_counter()
    try:
        for s in range(steps):
            groups = p.take(s)
            p.filter_stale(groups, s, None)
            gen.version = s + 1  # the "trainer" pushed
            p.signal_version()
        return (time.perf_counter() - t0) / steps
    finally:
        p.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    a = ap.parse_args()
    prompts = [Prompt(i, tuple(range(45)), f"p{i}") for i in range(a.prompts)]
    d, p = [], []
    for _ in range(a.rounds):  # interleaved
        d.append(direct(a.steps, prompts, a.group))
        p.append(piped(a.steps, prompts, a.group))
    over = [y - x for x, y in zip(d, p)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"settings": vars(a), "commit": commit, "cpu": platform.processor() or platform.machine(),
                      "direct_ms_per_step": [x * 1e3 for x in d], "pipeline_ms_per_step": [x * 1e3 for x in p],
                      "overhead_ms_per_step_median": statistics.median(over) * 1e3,
                      "overhead_ms_per_step_max": max(over) * 1e3}, indent=2))


if __name__ == "__main__":
    main()

"""Measure what the sync check has to tell apart: how far one real training step moves the probe's logprobs,
and how far a correct engine's logprobs sit from the trainer's (its numerics), per engine / trainer dtype.

Real GRPO steps on the embedded SmolLM2-135M (arithmetic task, default lr / rank), rollouts from transformers on
the trainer's model; after each step the adapter is pushed to a real vLLM engine (`ipc`) and the run's probe
(`minirl.sync.check.make_probe`, 64 tokens; statistics for its first 32, as runs use, and all 64) is scored on both sides.
One JSON line per dtype pair, per step:
  sep          rms |trainer(v_k) - trainer(v_k-1)|           how far a step moves the probe
  noise        rms |engine(v_k) - trainer(v_k)|              a correct engine's disagreement (max_noise: over all)
  dnoise       rms |engine move - trainer move| over a step  (the engine's offset does not cancel in 16-bit)
  t, t_diff    where the engine sits on the line from the previous adapter (0) to the new one (1)
  t_stale      the same for an engine that kept the previous adapter (its reading at the previous push)
  t_base       the same for an engine serving the base model (its reading before the first push)

    python scripts/verify_calibration.py --trainer-dtype float32 --engine-dtype float32
    python scripts/verify_calibration.py --trainer-dtype float32 --engine-dtype bfloat16
    python scripts/verify_calibration.py --trainer-dtype bfloat16 --engine-dtype bfloat16
"""
import argparse
import json
import math
import os


def rms(a, b):
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)) / len(a))


def where(e, new, prev):
    d = [x - y for x, y in zip(new, prev)]
    den = sum(x * x for x in d)
    return sum((x - p) * y for x, p, y in zip(e, prev, d)) / den if den else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer-dtype", default="float32")
    ap.add_argument("--engine-dtype", default="float32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    from minirl.config import Config
    from minirl.data import rows as D
    from minirl.generation.hf import HFGenerator
    from minirl.generation.vllm import VLLMGenerator
    from minirl.rewards import Scorer
    from minirl.rewards.advantages import AdvantageSettings, step_advantages
    from minirl.sync.tensor import TensorSync
    from minirl.sync.wire import engine_kwargs
    from minirl.training.trainer import Trainer
    from minirl.types import SamplingParams

    kw = {} if args.lr is None else {"lr": args.lr}
    cfg = Config(dtype=args.trainer_dtype, prompts_per_step=4, group_size=4, max_tokens=32, **kw)
    torch.set_num_threads(1)
    trainer = Trainer(cfg)
    tok = trainer.tokenizer
    rows, _ = D.arithmetic_splits(8, cfg.seed)
    prompts = D.to_prompts(rows, tok)
    scorer = Scorer.from_config(cfg.rewards, None, 10.0)
    local = HFGenerator(trainer.model, tok, lambda: trainer.version)
    from minirl.sync.check import make_probe
    probe = make_probe(trainer.model, prompts[0].token_ids, 64, cfg.seed, tok.all_special_ids, len(tok))
    probes = {"probe64": probe}
    gen = VLLMGenerator(trainer.model_path, max_lora_rank=cfg.lora_rank, max_model_len=512, dtype=args.engine_dtype,
                        kv_cache_gb=1, engine_kwargs=engine_kwargs(), cpu_cores="0")
    sync = TensorSync("ipc")
    stream = D.prompt_stream(prompts, cfg.seed)
    n_hist = {k: [trainer.logprobs(*p, 1.0)] for k, p in probes.items()}
    e_hist = {k: [gen.score(*p)] for k, p in probes.items()}
    try:
        for step in range(args.steps):
            groups = local.generate(D.take(stream, cfg.prompts_per_step), cfg.group_size,
                                    SamplingParams(temperature=1.0, max_tokens=cfg.max_tokens, seed=step))
            trainer.step(step_advantages([scorer.score_group(g) for g in groups], AdvantageSettings.from_config(cfg)))
            sync.push(trainer, gen)
            for k, p in probes.items():
                n_hist[k].append(trainer.logprobs(*p, 1.0))
                e_hist[k].append(gen.score(*p))
    finally:
        gen.close()
        sync.close()
    out = {"trainer_dtype": args.trainer_dtype, "engine_dtype": args.engine_dtype, "lr": cfg.lr, "stats": {}}
    for L in (32, 64):
        n = [x[:L] for x in n_hist["probe64"]]
        e = [x[:L] for x in e_hist["probe64"]]
        rows = []
        for s in range(1, len(n)):
            d_e = [a - b for a, b in zip(e[s], e[s - 1])]   # the engine's move
            d_n = [a - b for a, b in zip(n[s], n[s - 1])]   # the trainer's move
            rows.append({"sep": rms(n[s], n[s - 1]), "noise": rms(e[s], n[s]), "dnoise": rms(d_e, d_n),
                         "engine_move": rms(e[s], e[s - 1]), "t": where(e[s], n[s], n[s - 1]),
                         "t_diff": where([a - b for a, b in zip(e[s], e[s - 1])], d_n, [0.0] * L),
                         "t_stale": where(e[s - 1], n[s], n[s - 1]), "t_base": where(e[0], n[s], n[s - 1]),
                         "t_base_diff": where([a - b for a, b in zip(e[0], e[s - 1])], d_n, [0.0] * L)})
        out["stats"][L] = {"mean_logprob": sum(n[0]) / L, "noise_v0": rms(e[0], n[0]),
                           "max_noise": max([rms(e[0], n[0])] + [r["noise"] for r in rows]),
                           "steps": [{a: round(b, 5) for a, b in r.items()} for r in rows]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

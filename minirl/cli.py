"""Command line: `minirl demo`, `minirl train CONFIG.yaml`, `minirl eval`, `minirl bench ...`."""
from __future__ import annotations

import argparse
import json
import sys

from .config import DEMO, Config, ConfigError, add_cli_args, overrides_from_args


def _print_step(rec: dict) -> None:
    print(f"step {rec['step'] + 1:3d}  reward {rec['reward/mean']:.3f}  len {rec['length/mean']:5.1f}  "
          f"gen {rec['time/gen_s']:5.1f}s  train {rec['time/train_s']:5.1f}s  step {rec['time/step_s']:5.1f}s"
          + (f"  turns {rec['episode/turns']:.2f}" if "episode/turns" in rec else ""), flush=True)  # env runs


def _run(cfg: Config) -> dict:
    from .run import Run
    run = Run(cfg)
    run.on_step.append(_print_step)
    run.setup()
    print(f"minirl: model={cfg.model} backend={run.backend} ({run.backend_why}) transport={run.sync.transport} "
          f"steps={cfg.steps} out={cfg.out_dir}", flush=True)
    try:
        summary = run.run()
    finally:
        if run.history:  # the run's pictures, drawn from its log; a drawing error never hides the run's own
            try:
                from .ui import render
                render(run.out / "metrics.jsonl", run.out / "reward.png", panels=("reward",), dpi=100)
                render(run.out / "metrics.jsonl", run.out / "dashboard.png")
            except Exception as e:  # noqa: BLE001 - the run's outcome matters more than its pictures
                print(f"minirl: warning: could not draw the run's plots ({type(e).__name__}: {e})", file=sys.stderr)
    print(json.dumps(summary, indent=2))
    return summary


def _seeds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 0,1,2)") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minirl", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="GRPO + LoRA on the arithmetic task with the embedded model")
    demo.add_argument("--out", default=None, help="output folder (default runs/demo)")
    demo.add_argument("--task", default="arithmetic", help="the built-in task: single-turn 'arithmetic' (default), "
                      "or a multi-turn env task of minirl/tasks.py ('sums')")
    add_cli_args(demo, Config(**DEMO))
    train = sub.add_parser("train", help="run a YAML config (flags override its fields)")
    train.add_argument("config", help="YAML file with Config fields")
    add_cli_args(train)
    ev = sub.add_parser("eval", help="greedy held-out accuracy of a model (+ optional adapter)")
    ev.add_argument("--adapter", default=None, help="peft adapter folder to evaluate")
    add_cli_args(ev)
    bench = sub.add_parser("bench", help="benchmarks; results written as JSON")
    bench.add_argument("what", choices=["generation", "pipeline", "sync", "learning"])
    bench.add_argument("--out", default="bench", help="folder for the JSON results")
    bench.add_argument("--seed", type=int, default=0, help="seed of the pipeline benchmark's runs")
    bench.add_argument("--seeds", type=_seeds, default=(0, 1, 2), help="comma-separated seeds of the learning benchmark")
    bench.add_argument("--ks", type=_seeds, default=(0, 1, 2), help="comma-separated K (max_async_steps) of the "
                       "learning benchmark")
    args = p.parse_args(argv)
    try:
        if args.cmd == "demo":
            from .tasks import TASKS
            if args.task != "arithmetic" and args.task not in TASKS:
                raise ValueError(f"unknown task {args.task!r}: choose 'arithmetic' or one of {sorted(TASKS)}")
            task = {} if args.task == "arithmetic" else {"env": args.task, **TASKS[args.task].demo}  # env tasks
            cfg = Config(**{**DEMO, **task, **overrides_from_args(args), **({"out_dir": args.out} if args.out else {})})
            _run(cfg)
        elif args.cmd == "train":
            cfg = Config.from_yaml(args.config)
            cfg = Config.from_dict({**cfg.to_dict(), **overrides_from_args(args)})
            _run(cfg)
        elif args.cmd == "eval":
            from .run import eval_cli
            print(json.dumps(eval_cli(Config(**overrides_from_args(args)), args.adapter), indent=2))
        elif args.cmd == "bench":
            from .benchmarks import run as bench
            print(json.dumps(bench(args.what, args.out, seed=args.seed, seeds=args.seeds, ks=args.ks), indent=2))
    except (ConfigError, ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"minirl: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

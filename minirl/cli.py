"""Command line: `minirl demo`, `minirl train CONFIG.yaml`, `minirl eval`, `minirl export`, `minirl bench ...`,
`minirl plan CONFIG`, `minirl xray RUN`.

A bad input is one line on stderr (`minirl: error: ...`, exit code 2), never a traceback. `module:function`
rewards are imported from the current directory, as a script's imports would be.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import shlex
import sys
from pathlib import Path

from peft import set_peft_model_state_dict
from safetensors.torch import load_file
from tqdm import tqdm

from minirl.benchmarks.dispatch import run as bench
from minirl.config import DEMO, Config, ConfigError, add_cli_args, dashed, overrides_from_args
from minirl.config.cli import _parse_value
from minirl.config.io import TRL_NAMES
from minirl.core.lifecycle import Terminated, sigterm_interrupts
from minirl.generation.tasks import TASKS
from minirl.run.checkpoint import atomic_write, latest_checkpoint
from minirl.run.evaluation import eval_options, evaluate
from minirl.run.export import export_merged
from minirl.run.gguf_export import export_gguf
from minirl.run.loop import Run
from minirl.run.plan import plan
from minirl.ui import render, xray


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (not the usage block) that suggest the flag that was meant."""
    commands: tuple[str, ...] = ()  # the top-level parser's subcommands, named when none is given

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            known = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(Config)] + RUN_FLAGS
            hints = [_trl_flag(a) or (f"{a} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(
                a.split("=")[0], known, 1)) else a) for a in message.split(":", 1)[1].split() if a.startswith("-")]
            message = f"unrecognized arguments: {' '.join(hints) or message.split(':', 1)[1].strip()}"
        if message == "the following arguments are required: cmd" and self.commands:  # `minirl` alone
            message = "give a command: " + ", ".join(self.commands)
        print(f"minirl: error: {message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)


RUN_FLAGS = ["--resume", "--overwrite", "--out", "--adapter", "--seeds", "--ks"]


def _trl_flag(arg: str) -> str | None:
    """`--learning-rate` (a TRL GRPOConfig field as a flag) named with minirl's flag (`--lr`); None for others."""
    name = arg.split("=")[0].lstrip("-").replace("-", "_")
    if name not in TRL_NAMES:
        return None
    ours, _, note = TRL_NAMES[name].partition(" ")
    return f"{arg.split('=')[0]} (TRL's name; minirl's is --{ours.replace('_', '-')}{' ' + note if note else ''})"


class _Progress:
    """Progress of a run: on a terminal, tqdm bars for training (step k/N, reward, seconds per step, ETA) and for
    each evaluation pass; in a log file (no terminal), one line per step with the same figures."""

    def __init__(self, total: int, initial: int, tty: bool | None = None):
        self.total, self.done = total, initial
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.bar = self.eval_bar = None
        self.times: list[float] = []

    def step(self, rec: dict) -> None:
        reward = rec.get("reward/mean")
        reward = f"reward {reward:.3f}" if isinstance(reward, float) and reward == reward else "reward -"
        if "episode/turns" in rec:  # env runs
            reward += f"  turns {rec['episode/turns']:.2f}  tool calls {rec['episode/tool_calls']:.2f}"
        self.done += 1
        self.times.append(rec["time/step_s"])
        if not self.tty:
            eta = sum(self.times[-5:]) / len(self.times[-5:]) * (self.total - self.done)
            print(f"step {self.done}/{self.total}  {reward}  {rec['time/step_s']:.1f} s/step  "
                  f"ETA {_clock(eta)}", file=sys.stderr, flush=True)
            return
        if self.bar is None:
            self.bar = tqdm(total=self.total, initial=self.done - 1, unit="step", dynamic_ncols=True,
                            bar_format="step {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}, {rate_fmt}{postfix}]")
        self.bar.set_postfix_str(reward, refresh=False)
        self.bar.update(1)

    def eval(self, rec: dict) -> None:
        if "accuracy" in rec:
            if self.eval_bar is not None:
                self.eval_bar.close()
                self.eval_bar = None
            se = rec.get("accuracy_se")
            line = f"held-out accuracy after {rec['step']} steps: {rec['accuracy']:.3f}" + \
                (f" +/- {se:.3f} (standard error, {rec.get('n')} problems)" if se is not None else "")
            tqdm.write(line, file=sys.stderr) if self.tty else print(line, file=sys.stderr, flush=True)
        elif self.tty:
            if self.eval_bar is None:
                self.eval_bar = tqdm(total=rec["total"], desc=f"eval after {rec['step']} steps", unit="prompt",
                                     leave=False, dynamic_ncols=True)
            self.eval_bar.update(rec["done"] - self.eval_bar.n)

    def close(self) -> None:
        for bar in (self.eval_bar, self.bar):
            if bar is not None:
                bar.close()
        self.bar = self.eval_bar = None


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


def _render(out) -> None:
    """The run's pictures, drawn from its log, each written atomically."""
    log = out / "metrics.jsonl"
    atomic_write(out / "reward.png", lambda p: render(log, p, panels=("reward",), dpi=100))
    atomic_write(out / "dashboard.png", lambda p: render(log, p))


def _why(stop: KeyboardInterrupt) -> str:
    return "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C"


def _flags(overrides: dict) -> str:
    """The config flags a command was given, as they are typed again (the hint after a stop names them: without
    `--steps 40` or `--out-dir B`, `--resume` would refuse, or continue the run in the YAML's out_dir)."""
    out = []
    for name, v in overrides.items():
        text = v if isinstance(v, str) and _parse_value(v) == v else json.dumps(v)
        out.append(f" --{name.replace('_', '-')} {shlex.quote(text)}")
    return "".join(out)


def _run(cfg: Config, resume: bool, overwrite: bool, again: str) -> dict:
    run = Run(cfg, resume=resume, overwrite=overwrite)
    try:
        run.setup()  # a failed set-up closes what it opened and writes nothing
    except KeyboardInterrupt as e:
        print(f"minirl: stopped during set-up ({_why(e)}); nothing was written: run "
              f"`{again}{' --resume' if resume else ''}` again", file=sys.stderr)
        raise
    print(f"minirl: model={run.cfg.model} backend={run.backend} ({run.backend_why}) transport={run.sync.transport} "
          f"steps={run.cfg.steps} out={run.cfg.out_dir}", flush=True)
    print(f"minirl: {len(run.train_prompts)} training prompts; eval: {run.splits.note}"
          + (f"; resuming after step {run.start_step}" if resume else ""), flush=True)
    progress = _Progress(run.cfg.steps, run.start_step)
    run.on_step.append(progress.step)
    run.on_eval.append(progress.eval)
    try:
        summary = run.run()
    except KeyboardInterrupt as e:
        progress.close()
        ckpt = latest_checkpoint(run.out)
        print(f"minirl: interrupted after {run.next_step} steps ({_why(e)}); `{again} --resume` continues after "
              f"step {ckpt.step if ckpt else 0} (the latest checkpoint)", file=sys.stderr)
        raise
    finally:
        progress.close()
        if run.history:  # the run's pictures, drawn from its log; a drawing error never hides the run's own
            try:
                _render(run.out)
            except Exception as e:  # noqa: BLE001 - the run's outcome matters more than its pictures
                print(f"minirl: warning: could not draw the run's plots ({type(e).__name__}: {e})", file=sys.stderr)
    print(json.dumps(summary, indent=2))
    return summary


def _eval(cfg: Config, adapter: str | None = None) -> dict:
    """`minirl eval`: greedy held-out accuracy of the base model, or of a saved adapter on top of it."""
    weights = Path(adapter or ".") / "adapter_model.safetensors"
    if adapter and not weights.is_file():  # before the model loads
        where = "its adapter/ folder" if (Path(adapter) / "adapter").is_dir() else "a folder holding it"
        raise ValueError(f"--adapter {adapter}: no adapter_model.safetensors there; give {where} (a run's "
                         "out_dir/adapter, or a checkpoint's adapter)")
    conf = _adapter_config(adapter) if adapter else {}
    if conf:  # the adapter's own shape, not the flags' (a run with lora_rank 8 would not load into the default 16)
        shape = dict(lora_rank=conf.get("r"), lora_alpha=conf.get("lora_alpha"),
                     target_modules=conf.get("target_modules"))
        cfg = cfg.replace(**{k: sorted(v) if isinstance(v, list) else v for k, v in shape.items() if v is not None})
    run = Run(cfg.replace(steps=0))
    run.load()  # no out_dir of its own: nothing is written
    try:
        if adapter:
            base = f"; it was trained on {conf['base_model_name_or_path']!r} (its adapter_config.json): give that " \
                "as --model" if conf.get("base_model_name_or_path") else "; give its base model as --model"
            try:
                loaded = set_peft_model_state_dict(run.trainer.model, load_file(str(weights)))
            except RuntimeError as e:  # another base: the shapes differ
                raise ValueError(f"--adapter {adapter} does not fit the model {cfg.model!r} "
                                 f"({str(e).strip().splitlines()[-1].strip()}){base}") from None
            if extra := getattr(loaded, "unexpected_keys", None):  # weights for modules this model does not have
                raise ValueError(f"--adapter {adapter} does not fit the model {cfg.model!r} ({len(extra)} of its "
                                 f"weights have no place in it, e.g. {extra[0]}){base}")
            run.trainer.version = 1
            run.sync.push(run.trainer, run.generator)
        res = evaluate(run.rollouts, run.eval_prompts, run.scorer, cfg.max_tokens, **eval_options(cfg, 0))
        return {"model": cfg.model, "adapter": adapter, "eval_size": len(run.eval_prompts), **res.fields(),
                "backend": run.backend}
    finally:
        run.close()


def _adapter_config(adapter: str) -> dict:
    """The adapter's adapter_config.json (peft's), checked before the model loads: a LoRA minirl can rebuild."""
    path = Path(adapter) / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"--adapter {adapter}: no adapter_config.json beside adapter_model.safetensors; give a peft "
                         "adapter folder (a run's out_dir/adapter, or a checkpoint's adapter)")
    try:
        conf = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); give the folder peft's save_pretrained wrote") from None
    if not isinstance(conf, dict) or conf.get("peft_type", "LORA") != "LORA" or conf.get("use_dora") or \
            conf.get("use_rslora"):
        what = conf.get("peft_type") if isinstance(conf, dict) else type(conf).__name__
        what = "DoRA" if isinstance(conf, dict) and conf.get("use_dora") else \
            "rsLoRA" if isinstance(conf, dict) and conf.get("use_rslora") else what
        raise ValueError(f"--adapter {adapter}: a {what} adapter; minirl evaluates the plain LoRA adapters it trains "
                         "(evaluate this one with peft)")
    return conf


def _seeds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 0,1,2)") from None


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing: give comma-separated names (e.g. demo,judge)")
    return names


def _settings(text: str) -> dict:
    """`key=value,key=value` -> {key: value}, each value read as a Config flag's is (true, 0.5, 1e-3)."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"{item!r} is not key=value (e.g. train_zero_adv=true,shuffle=false)")
        out[key.strip()] = _parse_value(value)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} sets nothing: give key=value pairs (e.g. train_zero_adv=true)")
    return out


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="continue the run in out_dir from its latest checkpoint")
    g.add_argument("--overwrite", action="store_true", help="replace the run in out_dir")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="minirl", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="GRPO + LoRA on the arithmetic task with the embedded model")
    demo.add_argument("--out", default=None, help="output folder (default runs/demo)")
    demo.add_argument("--task", default="arithmetic", help="the built-in task: single-turn 'arithmetic' (default), "
                      "or a multi-turn env task of minirl/generation/tasks.py ('sums', 'retry')")
    _add_run_flags(demo)
    add_cli_args(demo, Config(**DEMO))
    train = sub.add_parser("train", help="run a YAML config (flags override its fields)")
    train.add_argument("config", help="YAML file with Config fields")
    _add_run_flags(train)
    add_cli_args(train)
    ev = sub.add_parser("eval", help="greedy held-out accuracy of a model (+ optional adapter)")
    ev.add_argument("--adapter", default=None, help="peft adapter folder to evaluate")
    add_cli_args(ev)
    export = sub.add_parser("export", help="a run's adapter merged into its base model, for serving")
    export.add_argument("run_dir", help="the run's out_dir (its config.yaml and adapter/)")
    to = export.add_mutually_exclusive_group(required=True)
    to.add_argument("--merged", metavar="OUT", help="new folder for the merged model + tokenizer (safetensors)")
    to.add_argument("--gguf", metavar="OUT", help="new GGUF file of the merged model + tokenizer (llama, qwen2)")
    export.add_argument("--type", choices=["f16", "q8_0"], default=None, help="GGUF weight type (default f16)")
    bench = sub.add_parser("bench", help="benchmarks; results written as JSON")
    bench.add_argument("what", choices=["generation", "pipeline", "sync", "learning", "memory", "trl"])
    bench.add_argument("--out", default="bench", help="folder for the JSON results")
    bench.add_argument("--seed", type=int, default=0, help="seed of the pipeline benchmark's runs")
    bench.add_argument("--seeds", type=_seeds, default=(0, 1, 2), help="comma-separated seeds of the learning and trl "
                       "benchmarks")
    bench.add_argument("--ks", type=_seeds, default=(0, 1, 2), help="comma-separated K (max_async_steps) of the "
                       "learning benchmark")
    bench.add_argument("--workloads", type=_names, default=None, help="comma-separated workloads of the pipeline "
                       "benchmark (default: demo,long-tail,judge)")
    bench.add_argument("--variants", type=_names, default=None, help="comma-separated variants of the pipeline "
                       "benchmark (default: each workload's own; sync, k1, k1_shared, k2, sync_vllm, k1_vllm)")
    bench.add_argument("--steps", type=int, default=None, help="steps per run (pipeline, memory)")
    bench.add_argument("--rounds", type=int, default=None, help="interleaved rounds (pipeline, memory)")
    bench.add_argument("--lr", type=float, default=None, help="learning rate of both toolkits (trl; default 2e-4, "
                       "the demo task's 5e-4)")
    bench.add_argument("--task", default=None, help="trl: 'addition' (default: a, b in 0..49) or 'demo' (the demo's)")
    bench.add_argument("--eval-size", type=int, default=None, help="held-out problems per evaluation (trl: default "
                       "64; learning: 128, with --presets 256)")
    bench.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations (learning; "
                       "default 5)")
    bench.add_argument("--presets", type=_names, default=None, help="learning: compare these settings, paired "
                       "against the first: loss_type presets at K = 0 (e.g. dapo,grpo,gspo,cispo), <preset>-k1 and "
                       "<preset>-epochs2 (grpo, dapo, cispo, gspo), rloo, reinforce++, dapo-entropy, dapo-top-entropy "
                       "(benchmarks/learning.py)")
    bench.add_argument("--save-every", type=int, default=None, help="steps between saved, scored adapters (trl; "
                       "default 2)")
    bench.add_argument("--minirl-overrides", type=_settings, default=None, metavar="KEY=VALUE,...", help="trl: "
                       "minirl's Config fields changed from its defaults, for an ablation (e.g. train_zero_adv=true); "
                       "learning: Config fields of every run over the demo's, e.g. your task (data=rows.jsonl,"
                       "eval_data=held.jsonl,rewards=mymod:fn)")
    bench.add_argument("--trl-from", default=None, metavar="TRL_JSON", help="trl: take TRL's runs from this trl.json "
                       "(same settings) and run minirl alone")
    pl = sub.add_parser("plan", help="the memory plan of a YAML config (or of flags alone: minirl plan --model ID "
                        "--gpu-gb 24), from the model's config.json alone")
    pl.add_argument("config", nargs="?", default=None, help="YAML file with Config fields (default: the defaults; "
                    "flags override either)")
    pl.add_argument("--gpu-gb", type=float, default=None, help="plan for GPUs of this many GB each (default: this "
                    "machine's, or its RAM on CPU)")
    pl.add_argument("--gpus", type=int, default=None, help="plan for this many GPUs, vLLM installed (default: "
                    "this machine's; one with --gpu-gb where it has none; 0: the CPU); the run's placement follows them")
    add_cli_args(pl)
    xr = sub.add_parser("xray", help="a logged sample token by token as the loss saw it (docs/runs.md)")
    xr.add_argument("run_dir", help="the run's out_dir (or its metrics.jsonl)")
    xr.add_argument("--step", type=int, default=None, help="the step (default: the last logged)")
    xr.add_argument("--sample", type=int, default=0, help="the sample of that step (default 0)")
    xr.add_argument("--out", default=None, help="write a .png or .html there (default: print a table)")
    parsers = {"demo": demo, "train": train, "eval": ev, "bench": bench, "plan": pl, "export": export, "xray": xr}
    p.commands = tuple(parsers)
    args, extra = p.parse_known_args(dashed(sys.argv[1:] if argv is None else argv))
    if extra:  # named by the subcommand's parser, so the hint points at its --help
        parsers[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        with sigterm_interrupts():  # SIGTERM stops as Ctrl-C does: checkpoint, children closed, exit 143
            return _command(args)
    except BrokenPipeError:  # `minirl xray RUN | head`: the reader left; end quietly, as shell tools do
        _quiet_stdout()
        return 141  # 128 + SIGPIPE
    except (ConfigError, ValueError, RuntimeError, OSError) as e:
        for line in str(e).splitlines() or [""]:  # a ConfigError holds one line per bad setting
            print(f"minirl: error: {line}", file=sys.stderr)
        return 2
    except Terminated:
        return 143  # 128 + SIGTERM, as a shell reports it
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit does not fail on the closed pipe again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a file descriptor (a notebook's or pytest's stdout)
        sys.stdout = open(os.devnull, "w")


def _command(args: argparse.Namespace) -> int:
    """Run the parsed subcommand; 0 when it went through."""
    if args.cmd == "demo":
        if args.task != "arithmetic" and args.task not in TASKS:
            raise ValueError(f"unknown task {args.task!r}: choose 'arithmetic' or one of {sorted(TASKS)}")
        task = {} if args.task == "arithmetic" else {"env": args.task, **TASKS[args.task].demo}  # env tasks
        cfg = Config(**{**DEMO, **task, **overrides_from_args(args), **({"out_dir": args.out} if args.out else {})})
        again = "minirl demo" + (f" --task {args.task}" if args.task != "arithmetic" else "") \
            + (f" --out {args.out}" if args.out else "") + _flags(overrides_from_args(args))
        _run(cfg, args.resume, args.overwrite, again)
    elif args.cmd == "train":
        cfg = Config.from_yaml(args.config)
        cfg = cfg.replace(**overrides_from_args(args))  # the file's fields and the flags win over loss_type
        _run(cfg, args.resume, args.overwrite, f"minirl train {args.config}{_flags(overrides_from_args(args))}")
    elif args.cmd == "eval":
        print(json.dumps(_eval(Config(**overrides_from_args(args)), args.adapter), indent=2))
    elif args.cmd == "plan":
        cfg = (Config.from_yaml(args.config) if args.config else Config()).replace(**overrides_from_args(args))
        print(plan(cfg, gpu_gb=args.gpu_gb, gpus=args.gpus).table())
    elif args.cmd == "export":
        if args.merged and args.type:
            raise ValueError("--type applies to --gguf only (the --merged folder keeps the run's dtype)")
        info = export_merged(args.run_dir, args.merged) if args.merged else \
            export_gguf(args.run_dir, args.gguf, args.type or "f16")
        print(json.dumps(info, indent=2))
    elif args.cmd == "xray":
        x = xray(args.run_dir, args.step, args.sample)
        print(f"wrote {x.save(args.out)}" if args.out else x.text())
    elif args.cmd == "bench":
        sizes = {k: v for k in ("workloads", "variants", "steps", "rounds", "lr", "task", "eval_size", "save_every",
                                "eval_every", "presets", "minirl_overrides", "trl_from")
                 if (v := getattr(args, k)) is not None}
        print(json.dumps(bench(args.what, args.out, seed=args.seed, seeds=args.seeds, ks=args.ks, **sizes), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

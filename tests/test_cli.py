"""The command line as a new user meets it: their own JSONL and reward module, and every bad input one line."""
import json
import subprocess
import sys

import pytest
from conftest import TOY_ROWS

from minirl.cli import main

REWARD = '''def says_yes(prompt, completion, **_):
    return 1.0 if "yes" in completion.split() else 0.0
'''


def _write_run(tmp_path, model, **extra):
    with open(tmp_path / "my.jsonl", "w") as f:
        for r in TOY_ROWS:
            f.write(json.dumps(r) + "\n")
    (tmp_path / "myrew.py").write_text(REWARD)
    cfg = dict(model=model, backend="hf", data="my.jsonl", rewards=["myrew:says_yes"], steps=2, prompts_per_step=4,
               group_size=4, max_tokens=6, lr="1e-2", lora_rank=8, lora_alpha=16, out_dir="runs/my", **extra)
    (tmp_path / "my.yaml").write_text("".join(f"{k}: {json.dumps(v) if isinstance(v, list) else v}\n"
                                              for k, v in cfg.items()).replace('lr: "1e-2"', "lr: 1e-2"))


def test_train_on_own_jsonl_with_a_reward_module_in_the_current_directory(tiny_model, tmp_path):
    """`minirl train my.yaml` on a JSONL, with `myrew:says_yes` from the current directory: `-P` keeps the current
    directory off sys.path, as for the installed `minirl` script. Held-out accuracy before and after."""
    _write_run(tmp_path, tiny_model)
    p = subprocess.run([sys.executable, "-P", "-m", "minirl.cli", "train", "my.yaml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout[p.stdout.index("{"):])
    assert summary["eval_size"] == 6 and "carved from data" in summary["eval"]
    assert isinstance(summary["eval_accuracy_before"], float) and isinstance(summary["eval_accuracy_after"], float)
    assert "held-out accuracy after 0 steps" in p.stderr and "held-out accuracy after 2 steps" in p.stderr
    assert "step 2/2  reward" in p.stderr and "Traceback" not in p.stderr
    assert (tmp_path / "runs/my/adapter/adapter_model.safetensors").exists()
    assert (tmp_path / "runs/my/dashboard.png").exists()


BAD = [  # (what, files, argv, the line's content)
    ("yaml syntax", {"c.yaml": "steps: 3\nlr: [1e-4\n"}, ["train", "c.yaml"], "c.yaml:3:1: not valid YAML"),
    ("yaml list", {"c.yaml": "- steps: 3\n"}, ["train", "c.yaml"], "c.yaml: expected `field: value` lines (a mapping), got a list"),
    ("yaml value", {"c.yaml": "reward_timeout_s: soon\n"}, ["train", "c.yaml"], "c.yaml: reward_timeout_s: expected a number, got 'soon'"),
    ("yaml typo", {"c.yaml": "stepz: 3\n"}, ["train", "c.yaml"], "'stepz' (did you mean 'steps'?)"),
    ("no config", {}, ["train", "nope.yaml"], "config file 'nope.yaml' not found"),
    ("row without prompt", {"c.yaml": "data: d.jsonl\n", "d.jsonl": '{"prompt": "a", "answer": 1}\n{"answer": 2}\n'},
     ["train", "c.yaml"], "d.jsonl:2: no 'prompt' column (columns: ['answer']); every row needs one"),
    ("not utf-8", {"c.yaml": "data: d.jsonl\n", "d.jsonl": b'{"prompt": "a"}\n{"prompt": "\xff"}\n'},
     ["train", "c.yaml"], "d.jsonl:2: not UTF-8 text (byte 0xff"),
    ("no data file", {"c.yaml": "data: nope.jsonl\n"}, ["train", "c.yaml"], "data 'nope.jsonl': no such file"),
    ("no eval_data file", {"c.yaml": "eval_data: nope.jsonl\n"}, ["train", "c.yaml"],
     "error: eval_data 'nope.jsonl': no such file"),
    ("csv not utf-8", {"c.yaml": "data: d.csv\n", "d.csv": b'prompt\n"a"\n"\xff"\n'}, ["train", "c.yaml"],
     "d.csv:3: not UTF-8 text (byte 0xff); save the file as UTF-8"),
    ("reward module", {"c.yaml": "rewards: [nomod:f]\n"}, ["train", "c.yaml"], "reward 'nomod:f' cannot be imported"),
    ("unknown flag", {}, ["demo", "--stepz", "3"], "unrecognized arguments: --stepz (did you mean --steps?); see `minirl demo --help`"),
    ("bad flag value", {}, ["demo", "--eval-fraction", "2"], "eval_fraction=2.0: accepted range [0, 1) (a fraction, e.g. 0.1)"),
    # the field's own spelling (YAML, docs/config.md) is a flag too: it parses, and reaches the same check
    ("field-named flag", {}, ["demo", "--eval_fraction=2"], "eval_fraction=2.0: accepted range [0, 1)"),
    ("eval adapter", {"runs/x/adapter/adapter_model.safetensors": ""}, ["eval", "--adapter", "runs/x"],
     "--adapter runs/x: no adapter_model.safetensors there; give its adapter/ folder"),
    ("no command", {}, [], "give a command: demo, train, eval, bench, plan, export, xray; see `minirl --help`"),
    ("xray no run", {}, ["xray", "runs/none"], "runs/none: no metrics log here; give a run's out_dir or its metrics.jsonl"),
    ("xray of a run's file", {"runs/r/metrics.jsonl": "", "runs/r/config.yaml": "steps: 3\n"},
     ["xray", "runs/r/config.yaml"], "runs/r/config.yaml: not a metrics log; give the run's folder (runs/r) or its"),
    ("xray old run", {"runs/old/metrics.jsonl": '{"event": "samples", "step": 0, "samples": [{"prompt": "p"}]}\n'},
     ["xray", "runs/old"], "runs/old: no logged sample with a token X-ray; runs log one per sample"),
    ("reward typo", {}, ["demo", "--rewards", "arithmetic_corect"],
     "unknown reward 'arithmetic_corect' (did you mean 'arithmetic_correct'?)"),
    ("rewards in one string", {}, ["demo", "--rewards", "arithmetic_correct,format_match"],
     "names 2 rewards in one string: give a list, rewards: ['arithmetic_correct', 'format_match'] (a flag: "
     "--rewards \"[arithmetic_correct, format_match]\")"),
    ("run exists", {"runs/demo/metrics.jsonl": "{}\n"}, ["demo"], "'runs/demo' already holds a run; continue it with --resume"),
    ("nothing to resume", {}, ["demo", "--resume"], "nothing to resume in 'runs/demo'"),
    ("tracker", {}, ["demo", "--report-to", "mlflow"], "report_to='mlflow': use 'trackio', 'tensorboard', 'wandb' or none"),
    ("unknown task", {}, ["demo", "--task", "chess"], "unknown task 'chess': choose 'arithmetic' or one of ['retry', 'sums']"),
    ("env module", {"c.yaml": "env: nomod:Game\n"}, ["train", "c.yaml"], "env 'nomod:Game' cannot be imported"),
    ("bench workload", {}, ["bench", "pipeline", "--workloads", "demo,chess"],
     "unknown workload 'chess': choose from demo, long-tail, judge"),
    ("bench size", {}, ["bench", "sync", "--steps", "2"], "bench sync does not take --steps (it takes none of them)"),
    ("bench variant", {}, ["bench", "pipeline", "--variants", "sync,k3"],
     "unknown variant 'k3': choose from sync, k1, k1_shared, k2, sync_vllm, k1_vllm"),
    ("bench trl task", {}, ["bench", "trl", "--task", "chess"], "unknown task 'chess': choose from addition, demo"),
    ("bench trl flag elsewhere", {}, ["bench", "learning", "--save-every", "8"],
     "bench learning does not take --save-every (it takes --eval-size, --eval-every, --presets, --minirl-overrides)"),
    ("bench learning own field", {}, ["bench", "learning", "--minirl-overrides", "seed=3"],
     "--minirl-overrides sets seed, which bench learning sets itself: use --seeds"),
    ("bench learning override", {}, ["bench", "learning", "--presets", "dapo,rloo", "--minirl-overrides", "dat=r.jsonl"],
     "'dat' (did you mean 'data'?)"),
    ("bench learning override a setting", {}, ["bench", "learning", "--presets", "dapo,rloo", "--minirl-overrides",
                                               "advantage_estimator=group"],
     "advantage_estimator='group' would replace what setting 'rloo' sets, so the settings would not differ by it: "
     "leave advantage_estimator out"),
    ("bench learning your data", {"r.jsonl": '{"prompt": "a", "solution": "1"}\n'},
     ["bench", "learning", "--presets", "dapo,rloo", "--minirl-overrides", "data=r.jsonl"],
     "needs column(s) ['answer'] that the data lacks"),
    ("bench preset", {}, ["bench", "learning", "--presets", "grpo,ppo"],
     "unknown preset 'ppo': choose from grpo, dr_grpo, dapo, bnpo, gspo"),
    ("bench eval every", {}, ["bench", "learning", "--eval-every", "0"], "--eval-every must be at least 1, got 0"),
    ("bench trl eval size", {}, ["bench", "trl", "--eval-size", "0"], "--eval-size must be at least 1, got 0"),
    ("bench trl override", {}, ["bench", "trl", "--minirl-overrides", "train_zero_advs=true"],
     "'train_zero_advs' (did you mean 'train_zero_adv'?)"),
    ("bench trl override value", {}, ["bench", "trl", "--minirl-overrides", "temperature=hot"],
     "temperature: expected a number, got 'hot'"),
    ("bench trl override syntax", {}, ["bench", "trl", "--minirl-overrides", "zero"], "'zero' is not key=value"),
    ("bench trl from", {"t.json": '{"config": {"steps": 3}, "runs": {}}'}, ["bench", "trl", "--trl-from", "t.json"],
     "t.json: its TRL runs were made with other settings than these"),
    ("bench trl from nothing", {}, ["bench", "trl", "--trl-from", "no.json"], "--trl-from no.json: no such file"),
    # a new user's mistakes (TRL / Unsloth habits, hand-edited files)
    ("yaml field twice", {"c.yaml": "lr: 1e-4\nsteps: 3\nlr: 2e-4\n"}, ["train", "c.yaml"],
     "c.yaml:3: 'lr' is given twice (lines 1 and 3); keep one"),
    ("TRL flag", {}, ["demo", "--learning-rate", "1e-4", "--num-generations=4"],
     "unrecognized arguments: --learning-rate (TRL's name; minirl's is --lr) --num-generations (TRL's name; "
     "minirl's is --group-size)"),
    ("reward not a function", {"c.yaml": "rewards: [rconst:SCALE]\n", "rconst.py": "SCALE = 3\n"}, ["train", "c.yaml"],
     "reward 'rconst:SCALE' is an int, not a function; point it at a function f(prompt, completion, **columns)"),
    ("reward as a file path", {"c.yaml": "rewards: [rpath.py:f]\n",
                               "rpath.py": "def f(prompt, completion, **_):\n    return 1.0\n"}, ["train", "c.yaml"],
     "reward 'rpath.py:f' cannot be imported: 'rpath.py' is a file path, not a module name; write 'rpath:f'"),
    ("answers in another column", {"c.yaml": "data: d.jsonl\n", "d.jsonl": '{"prompt": "a", "solution": "1"}\n'},
     ["train", "c.yaml"], "needs column(s) ['answer'] that the data lacks (columns: ['completion_tokens', "
     "'finish_reason', 'solution']); add them to the dataset, give them defaults, or fix them in `rewards` as "
     "arithmetic_correct(answer=...); the answers in 'solution'? set answer_column: solution"),
    ("jsonl line cut short", {"c.yaml": "data: d.jsonl\n", "d.jsonl": '{"prompt": "a", "answer": 1}\n{"prompt": "b\n'},
     ["train", "c.yaml"], "d.jsonl:2: not valid JSON (Unterminated string starting at column 12); each line must be"),
    ("json array named jsonl", {"c.yaml": "data: d.jsonl\n", "d.jsonl": '[\n  {"prompt": "a", "answer": 1}\n]\n'},
     ["train", "c.yaml"], "d.jsonl:1: starts a JSON array, not one JSON object a line; name the file d.json"),
    ("no model folder", {"c.yaml": "model: ./no/model\n"}, ["train", "c.yaml"],
     "model path './no/model' does not exist; point `model` at a folder with config.json and a tokenizer"),
    ("eval adapter without its config", {"a/adapter_model.safetensors": ""}, ["eval", "--adapter", "a"],
     "--adapter a: no adapter_config.json beside adapter_model.safetensors; give a peft adapter folder"),
]


@pytest.mark.parametrize("what,files,argv,expect", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_before_the_model_loads(what, files, argv, expect, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the current directory on it
    monkeypatch.setattr("minirl.run.build.Trainer", lambda *a, **k: pytest.fail("the model loaded"))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    code = _exit_code(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("minirl: error: ") and expect in lines[0], lines[0]


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's errors exit
        return e.code


def _connects(monkeypatch) -> list:
    """Every TCP connect this process makes from here on (host, port), each refused as the closed port refuses it."""
    import socket
    tries: list = []

    def connect(self, address):
        tries.append(tuple(address[:2]))
        raise ConnectionRefusedError(111, "Connection refused")
    monkeypatch.setattr(socket.socket, "connect", connect)
    return tries


def test_a_model_that_cannot_be_found_fails_after_one_probe(monkeypatch, tmp_path, capsys):
    """A Hugging Face id not in the local cache, with the Hub unreachable (here: a closed loopback port): one probe, no
    retries."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("minirl.run.build.Trainer", lambda *a, **k: pytest.fail("the model loaded"))
    tries = _connects(monkeypatch)
    assert main(["demo", "--model", "someone/no-such-model-here"]) == 2
    assert tries == [("127.0.0.1", 9)]  # the one probe: no client's retries after it (they took ~30 s)
    (line,) = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert "'someone/no-such-model-here' is not in the local Hugging Face cache" in line
    assert "model: smollm2-135m-instruct" in line


def test_a_dataset_that_cannot_be_found_fails_after_one_probe(monkeypatch, tmp_path, capsys):
    """`data: hf:NAME` not in the local cache, the Hub unreachable: one line at once (datasets alone retried for
    ~30 s, printing a line each time)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("minirl.run.build.Trainer", lambda *a, **k: pytest.fail("the model loaded"))
    tries = _connects(monkeypatch)
    assert main(["demo", "--data", "hf:someone/no-such-data@train"]) == 2
    assert tries == [("127.0.0.1", 9)]  # the one probe: datasets alone retried for ~30 s
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert lines == ["minirl: error: data 'hf:someone/no-such-data@train': the dataset 'someone/no-such-data' is not "
                     "in the local Hugging Face cache and the Hub cannot be reached (offline); download it where there "
                     "is a network, or save it with Dataset.save_to_disk and give that folder"], lines


@pytest.mark.parametrize("tty", [True, False])
def test_progress_shows_step_reward_rate_and_eta(tty, capsys):
    from minirl.cli import _Progress
    p = _Progress(total=4, initial=1, tty=tty)
    p.eval({"step": 1, "done": 8, "total": 16})
    p.eval({"event": "eval", "step": 1, "accuracy": 0.25, "accuracy_se": 0.125, "n": 16})
    for k in (1, 2):
        p.step({"step": k, "reward/mean": 0.5 * k, "time/step_s": 2.0})
    p.close()
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "held-out accuracy after 1 steps: 0.250 +/- 0.125 (standard error, 16 problems)" in err
    if tty:
        assert "step 3/4" in err and "reward 1.000" in err and "step/s" in err and "<00:0" in err  # rate, ETA
    else:
        assert err.splitlines()[-1] == "step 3/4  reward 1.000  2.0 s/step  ETA 0:00:02"


def test_eval_measures_the_held_out_split_and_writes_nothing(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the current directory on it
    _write_run(tmp_path, tiny_model)
    assert main(["eval", "--model", tiny_model, "--backend", "hf", "--data", "my.jsonl", "--rewards", "[myrew:says_yes]",
                 "--max-tokens", "6", "--out-dir", "runs/my"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval_size"] == 6 and 0 <= out["accuracy"] <= 1
    assert not (tmp_path / "runs").exists()


def _adapter(model: str, out, rank: int) -> None:
    """A peft LoRA adapter of `model` (not minirl's default shape: rank `rank`, q/v only), saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model)
    get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"])).save_pretrained(
        out)


def test_eval_reads_the_adapters_shape_and_names_a_base_it_does_not_fit(tiny_model, tmp_path, monkeypatch, capsys):
    """`minirl eval --adapter` of a run trained with lora_rank 4 (not the default 16): evaluated with the adapter's
    own shape (it was 60 lines of size mismatches); an adapter of another base: one line naming that base."""
    from minirl.training.models import build_tiny_model
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    _write_run(tmp_path, tiny_model)
    _adapter(tiny_model, tmp_path / "r4", rank=4)
    argv = ["eval", "--adapter", "r4", "--backend", "hf", "--data", "my.jsonl", "--rewards", "[myrew:says_yes]",
            "--max-tokens", "4"]
    assert main(argv + ["--model", tiny_model]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["adapter"] == "r4"
    wider = str(build_tiny_model(tmp_path / "wider", hidden=96))
    assert main(argv + ["--model", wider]) == 2
    (line,) = [l for l in capsys.readouterr().err.splitlines() if l.startswith("minirl:")]
    assert line.startswith(f"minirl: error: --adapter r4 does not fit the model {wider!r} (size mismatch")
    assert line.endswith(f"it was trained on {tiny_model!r} (its adapter_config.json): give that as --model")


def test_bench_trl_overrides_reach_the_benchmark_typed_as_config_flags(monkeypatch):
    """`--minirl-overrides lr=1e-3` is the number 0.001 (YAML 1.1 alone reads "1e-3" as a string), true a bool."""
    seen = {}
    monkeypatch.setattr("minirl.cli.bench", lambda what, out, **kw: seen.update(kw) or {})
    assert main(["bench", "trl", "--minirl-overrides", "lr=1e-3,train_zero_adv=true"]) == 0
    assert seen["minirl_overrides"] == {"lr": 1e-3, "train_zero_adv": True}


def test_the_hint_after_a_stop_repeats_the_flags_the_run_was_given(tmp_path, monkeypatch, capsys):
    """`minirl train my.yaml --resume --steps 40 --out-dir B`, stopped: the hint is that command with --resume. It
    said `minirl train my.yaml --resume`, which refuses a finished run extended to 40 steps ('already trained its
    30 steps') and continues the YAML's out_dir, not B."""
    class Stopped:
        def __init__(self, cfg, **_):
            self.cfg = cfg

        def setup(self):
            raise KeyboardInterrupt
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the current directory on it
    monkeypatch.setattr("minirl.cli.Run", Stopped)
    (tmp_path / "my.yaml").write_text("steps: 30\nout_dir: runs/a\n")
    assert main(["train", "my.yaml", "--resume", "--steps", "40", "--out-dir", "runs/b", "--stop", "[a b]"]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    again = "minirl train my.yaml --stop '[\"a b\"]' --steps 40 --out-dir runs/b --resume"  # in the Config's order
    assert line == f"minirl: stopped during set-up (Ctrl-C); nothing was written: run `{again}` again"
    assert main(["demo", "--out", "runs/d", "--lr", "1e-05"]) == 130
    assert "run `minirl demo --out runs/d --lr 1e-05` again" in capsys.readouterr().err


def test_output_cut_short_by_a_closed_pipe_is_not_an_error(tmp_path, monkeypatch, capsys):
    """`minirl xray RUN | head`: the reader leaves early; the command ends quietly with 141 (128 + SIGPIPE), as
    shell tools do, not with "minirl: error: [Errno 32] Broken pipe"."""
    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr("minirl.cli.xray", lambda *a: type("X", (), {"text": lambda self: "t\n" * 100_000})())
    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["xray", "runs/r"]) == 141
    assert capsys.readouterr().err == ""

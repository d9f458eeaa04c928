import dataclasses

from minirl import Config
from minirl.config import add_cli_args, field_docs, overrides_from_args


def test_every_field_has_a_docstring():
    docs = field_docs()
    missing = [f.name for f in dataclasses.fields(Config) if not docs.get(f.name)]
    assert not missing


def test_yaml_round_trip(tmp_path):
    c = Config(steps=7, target_modules=["q_proj", "v_proj"], tis_cap=None, reward_weights=[0.5])
    c.to_yaml(tmp_path / "c.yaml")
    assert Config.from_yaml(tmp_path / "c.yaml") == c


def test_cli_flags_parse_as_yaml_values():
    import argparse
    p = argparse.ArgumentParser()
    add_cli_args(p)
    ns = p.parse_args(["--steps", "5", "--target-modules", "[q_proj,v_proj]", "--tis-cap", "null", "--lr", "1e-3"])
    ov = overrides_from_args(ns)
    assert ov == {"steps": 5, "target_modules": ["q_proj", "v_proj"], "tis_cap": None, "lr": 1e-3}
    assert Config(**ov).steps == 5


def test_every_cli_help_prints(capsys):
    """`minirl <command> --help` lists the Config flags (a '%' in a field's docstring once crashed argparse)."""
    import pytest

    from minirl.cli import main
    for cmd in ("demo", "train", "eval", "bench"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "usage: minirl" in capsys.readouterr().out


def test_config_is_frozen_and_coerces_yaml_values(tmp_path):
    import pytest

    from minirl import ConfigError
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().lr = 1.0
    (tmp_path / "c.yaml").write_text("lr: 1e-4\nreward_timeout_s: 1e1\nmax_staleness: null\nsteps: '3'\n")
    c = Config.from_yaml(tmp_path / "c.yaml")  # PyYAML reads 1e-4 as the string '1e-4'
    assert (c.lr, c.reward_timeout_s, c.max_staleness, c.steps) == (1e-4, 10.0, None, 3)
    for bad, msg in ((dict(lr="fast"), "lr: expected a number, got 'fast'"),
                     (dict(steps=2.5), "steps: expected a whole number"),
                     (dict(behav_clip="maybe"), "behav_clip: expected true or false")):
        with pytest.raises(ConfigError, match=msg):
            Config(**bad)


def test_run_set_validates_first_and_keeps_the_config_on_a_rejected_change():
    import pytest

    from minirl import ConfigError, Run
    run = Run(Config(steps=1))
    with pytest.raises(ConfigError, match="temperature"):
        run.set(temperature=0)
    assert run.cfg.temperature == 1.0
    run.set(temperature=0.7, lr=1e-3)  # a later valid change still works
    assert (run.cfg.temperature, run.cfg.lr) == (0.7, 1e-3)


def test_a_16_bit_dtype_on_a_cpu_that_emulates_bf16_is_warned_about(tmp_path):
    """The CPU's bf16 support read from cpuinfo (faked here: an AVX2-only machine and an AMX one)."""
    import torch

    from minirl.training.models import cpu_bf16_flags, cpu_dtype_warning, train_dtype
    avx2, amx = tmp_path / "avx2", tmp_path / "amx"
    avx2.write_text("processor : 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    amx.write_text("processor : 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_bf16_flags(str(avx2)) == [] and cpu_bf16_flags(str(amx)) == ["avx512_bf16", "amx_bf16"]
    assert cpu_bf16_flags(str(tmp_path / "missing")) == []
    msg = cpu_dtype_warning("bfloat16", str(avx2))
    assert msg.count("\n") == 0 and "emulated" in msg and "dtype: auto" in msg
    assert cpu_dtype_warning("bfloat16", str(amx)) is None
    assert cpu_dtype_warning("float32", str(avx2)) is None and cpu_dtype_warning("auto", str(avx2)) is None
    if not torch.cuda.is_available():
        assert train_dtype(Config(dtype="auto")) == torch.float32  # on either kind of CPU (measured: no gain)


def test_max_async_steps_auto_follows_the_measured_rule():
    """'auto' (the default): K = 1 where generation can run beside training without taking its device (vLLM on
    2+ GPUs, the transformers generator process on 2+ CPU cores: BENCHMARKS.md "K = 1 against K = 0, in training
    seconds"); else the synchronous loop (one GPU shared by both phases, one core, vLLM on a CPU)."""
    import pytest

    from minirl.config import ConfigError
    from minirl.run.placement import Devices, pick_async_steps, place
    auto = Config()
    assert auto.max_async_steps == "auto"
    for tokens in (24, 160):  # on CPU, short or long completions alike
        assert pick_async_steps(auto.replace(max_tokens=tokens), "hf", 0, cores=2)[0] == 1
        assert pick_async_steps(auto.replace(max_tokens=tokens), "hf", 0, cores=16)[0] == 1
        assert pick_async_steps(auto.replace(max_tokens=tokens), "hf", 0, cores=1)[0] == 0
        assert pick_async_steps(auto.replace(max_tokens=tokens), "vllm", 0, cores=2)[0] == 0
    one, two = place(Config(backend="hf"), Devices(0, cores=1)), place(Config(backend="hf"), Devices(0, cores=2))
    assert (one.max_async_steps, two.max_async_steps) == (0, 1) and "2 CPU cores" in two.async_why
    assert pick_async_steps(auto, "hf", 1, cores=16)[0] == 0  # one GPU: the phases take turns on it
    assert pick_async_steps(auto.replace(env="retry"), "hf", 0, cores=2)[0] == 0  # episodes: generation-bound
    assert pick_async_steps(auto, "vllm", 1)[0] == 0 and pick_async_steps(auto, "vllm", 2)[0] == 1
    assert pick_async_steps(auto, "vllm-server", 2)[0] == 1 and pick_async_steps(auto, "hf", 2)[0] == 0
    assert pick_async_steps(auto.replace(max_async_steps=2), "hf", 0) == (2, "max_async_steps=2")
    assert pick_async_steps(auto.replace(max_async_steps=0), "vllm", 4)[0] == 0
    assert Config.from_dict({"max_async_steps": "1"}).max_async_steps == 1
    for bad in ("two", -1, 1.5):
        with pytest.raises(ConfigError, match="max_async_steps"):
            Config(max_async_steps=bad)


def test_a_run_resolves_auto_k_before_loading_and_records_why(toy_cfg):
    import os

    from minirl.run.loop import Run
    run = Run(toy_cfg.replace(max_async_steps="auto", backend="hf"))
    assert run.cfg.max_async_steps == int((os.cpu_count() or 1) >= 2) and run.async_why.startswith("auto:")
    run = Run(toy_cfg.replace(max_async_steps=1, backend="hf"))
    assert run.cfg.max_async_steps == 1 and run.async_why == "max_async_steps=1"


def _numeric(hint) -> bool:
    import types
    import typing
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType, list) else (hint,)
    return any(a in (int, float) or (typing.get_origin(a) is list and _numeric(a)) for a in args)


def test_every_numeric_field_has_a_range_and_each_range_rejects_its_outside():
    """The range table covers every numeric field of Config; a value just outside each range (and NaN, inf) is
    one line naming the field and the accepted range; several bad values are one line each."""
    import math
    import typing

    import pytest

    from minirl.config import ConfigError
    from minirl.config.validate import RANGES
    hints = typing.get_type_hints(Config)
    numeric = {f.name for f in dataclasses.fields(Config) if _numeric(hints[f.name])}
    assert numeric - set(RANGES) == set() and set(RANGES) - numeric == set()
    Config()  # the defaults are inside every range
    for name, rng in RANGES.items():
        is_int = int in typing.get_args(hints[name]) or hints[name] is int
        outside = [v for v in ((rng.lo - (0 if rng.lo_open else 1)) if rng.lo is not None else None,
                               (rng.hi + (0 if rng.hi_open else 1)) if rng.hi is not None else None) if v is not None]
        if not is_int:
            outside += [math.nan, math.inf]
        assert outside, name
        for v in outside:
            value = [v] if name == "reward_weights" else v
            with pytest.raises(ConfigError) as e:
                Config(**{name: value})
            line = str(e.value).splitlines()[0]  # (a cross-field line may follow: token_budget < max_tokens)
            assert line.startswith(f"{name}") and f"accepted range {rng.text()}" in line, line
    issue = dict(lora_rank=0, ppo_epochs=0, top_k=-5, clip_low=2, kl_coef=-1, max_grad_norm=math.nan,
                 gpu_memory_utilization=1.5, max_prompt_tokens=-1, reward_memory_mb=-1)
    with pytest.raises(ConfigError) as e:
        Config(**issue)
    lines = str(e.value).splitlines()
    assert [ln.split("=")[0] for ln in lines] == [n for n in RANGES if n in issue]


def test_a_device_spec_that_is_not_one_names_the_field_and_the_forms():
    import subprocess
    import sys

    import pytest

    from minirl.config import ConfigError
    for bad in ("abc", "cuda:x", "3-1", "0,,1", "-1"):
        with pytest.raises(ConfigError, match=f"train_devices={bad!r}: use 'auto', 'cuda', GPU ids"):
            Config(train_devices=bad)
    assert Config(train_devices=1, gen_devices="0-3").train_devices == "1"  # `--train-devices 1`
    assert Config(gen_devices="cuda:1,2").gen_devices == "cuda:1,2"
    p = subprocess.run([sys.executable, "-m", "minirl.cli", "demo", "--train-devices", "abc"],
                       capture_output=True, text=True)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "train_devices='abc'" in lines[0] and "CPU cores" in lines[0]


def test_an_unknown_keyword_is_one_config_error_naming_the_field_meant():
    """Issue 51 item 6: `Config(stepz=3)` says what the YAML and the CLI already say."""
    import pytest

    from minirl import ConfigError
    for make in (lambda: Config(stepz=3), lambda: Config().replace(stepz=3)):
        with pytest.raises(ConfigError, match=r"'stepz' \(did you mean 'steps'\?\)"):
            make()
    with pytest.raises(ConfigError, match=r"unknown config field\(s\): 'zzz'; see"):
        Config(zzz=1)
    assert Config(scale_adv_by_std=False).recipe.scale_rewards == "none"  # an old name is still known


def test_a_trl_field_name_is_answered_with_minirls_name():
    """A TRL user's GRPOConfig names (`num_generations`, `learning_rate`) get minirl's names in the one error line,
    not a guess; every name offered is a real field."""
    import dataclasses

    import pytest

    from minirl import ConfigError
    from minirl.config.io import TRL_NAMES
    with pytest.raises(ConfigError, match=r"'learning_rate' \(TRL's name; minirl's is lr\), 'num_generations' "
                                          r"\(TRL's name; minirl's is group_size\); see .*docs/coming-from-trl.md"):
        Config(num_generations=8, learning_rate=1e-5)
    fields = {f.name for f in dataclasses.fields(Config)}
    assert not set(TRL_NAMES) & fields and {v.split()[0] for v in TRL_NAMES.values()} <= fields


def trl_table_names(page: str) -> set[str]:
    """The TRL / Unsloth names in the first column of docs/coming-from-trl.md's GRPOConfig table (plain
    identifiers; `LoraConfig(...)`, `_cap` and the dataset's own `prompt` column are not config keys)."""
    import re
    table = page.split("| TRL / Unsloth | minirl | note |", 1)[1].split("\n\n", 1)[0]
    firsts = [row.split("|")[1] for row in table.splitlines()[2:]]
    return {n for cell in firsts if not cell.strip().startswith("dataset")
            for n in re.findall(r"`([a-z][a-z0-9_]*)`", cell)}


def test_every_trl_name_the_docs_map_is_a_field_or_answered_with_one():
    """A name the coming-from-trl table maps, left in a config, is a field (the same name) or gets minirl's name in
    the error line (TRL_NAMES), as the page promises."""
    from pathlib import Path

    from minirl.config.io import TRL_NAMES
    page = (Path(__file__).resolve().parent.parent / "docs" / "coming-from-trl.md").read_text(encoding="utf-8")
    names = trl_table_names(page)
    fields = {f.name for f in dataclasses.fields(Config)}
    assert {"num_generations", "bf16", "max_seq_length", "learning_rate"} <= names
    assert sorted(names - fields - set(TRL_NAMES)) == []
    row = "| `vllm_importance_sampling_correction` / `_cap` |"
    assert row in page and "unmapped_trl_knob" in trl_table_names(page.replace(row, row[:-1] + " `unmapped_trl_knob` |"))

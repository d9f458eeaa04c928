"""The memory plan (issue 36 item 4): from config.json alone, its parts, its choices, the stop before loading, and
its calibration against recorded `minirl bench memory` rows."""
import json

import pytest

from minirl import Config
from minirl.config import ConfigError
from minirl.run.placement import Devices, place
from minirl.run.plan import check_run_plan, plan
from minirl.training.plan import Shape, resolve_token_budget
from minirl.training.shapes.synthetic import NAMES, shape_config


@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_from_config_json_alone_is_exact(name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape_config(name)))
    assert Shape.from_config(shape_config(name)).params() == sum(p.numel() for p in model.parameters())


def _folder(tmp_path, name):
    """A model folder with a config.json and no weights: a plan must not need them."""
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(shape_config(name)))
    return str(d)


def test_plan_picks_checkpointing_then_4bit_as_the_gpu_shrinks(tmp_path):
    cfg = Config(model=_folder(tmp_path, "qwen2.5-7b"), backend="hf", max_tokens=512)
    big, mid, small = (plan(cfg, gpu_gb=g, gpus=1).trainer for g in (80, 24, 16))
    assert big.fits and not big.load_in_4bit and big.gradient_checkpointing and big.token_budget >= 4096  # 'auto'
    assert mid.fits and not mid.load_in_4bit and mid.token_budget < big.token_budget  # 14 GiB of bf16 weights
    assert small.fits and small.load_in_4bit  # the bf16 weights alone leave no room on 16 GB
    assert not plan(cfg.replace(gradient_checkpointing=False), gpu_gb=80, gpus=1).trainer.gradient_checkpointing
    ck = plan(cfg.replace(token_budget=4096), gpu_gb=80, gpus=1, gradient_checkpointing=True).trainer
    no = plan(cfg.replace(token_budget=4096), gpu_gb=80, gpus=1, gradient_checkpointing=False).trainer
    assert ck.train["activations"] < no.train["activations"] / 5 and ck.train["base weights"] == no.train["base weights"]
    assert "activations" in big.table() and "peak" in big.table()


def test_engine_share_and_sleep_wake(tmp_path):
    cfg = Config(model=_folder(tmp_path, "qwen2.5-1.5b"), backend="vllm", max_tokens=256)
    p = plan(cfg, gpu_gb=48, gpus=1).trainer  # one GPU, K = 0: the engine sleeps while the trainer works
    awake = plan(cfg.replace(max_async_steps=1), gpu_gb=48, gpus=1).trainer  # K = 1 on one GPU: awake
    assert 0 < p.gpu_memory_utilization < 1 and p.sleep_wake_gb == pytest.approx(2 * p.generate["engine weights"])
    assert "engine weights" not in p.train and awake.train["engine weights"] == p.generate["engine weights"]


def test_a_gpu_run_that_cannot_fit_stops_in_one_line_and_cpu_warns(tmp_path, capsys):
    cfg = Config(model=_folder(tmp_path, "qwen2.5-7b"), backend="hf", load_in_4bit=True, token_budget=8192,
                 max_tokens=1024, prompts_per_step=64, group_size=16)
    with pytest.raises(ConfigError, match=r"^the memory plan does not fit: peak .* of 8.0 GB") as e:
        check_run_plan(cfg, Devices.fake(1, 8), place(cfg, 1))
    assert "\n" not in str(e.value)
    import minirl
    huge = Config(model=_folder(tmp_path, "qwen2.5-1.5b"), token_budget=4096, max_tokens=1024, prompts_per_step=512,
                  group_size=64, out_dir=str(tmp_path / "run"))
    with pytest.raises(Exception):  # the folder has no weights: loading fails, after the plan's warning
        minirl.Run(huge).setup()
    err = capsys.readouterr().err  # the warning, before loading (the plan's line is printed once a run starts)
    assert "minirl: warning: the memory plan does not fit" in err


def test_a_plan_that_fits_only_in_4bit_stops_a_run_that_does_not_load_4bit(tmp_path):
    """The trainer's plan picks 4-bit where 16 bits do not fit; a run loads 4-bit only when load_in_4bit says so, so
    a plan that needed it, with load_in_4bit off, is a problem (a GPU run stops before loading), not a fit."""
    cfg = Config(model=_folder(tmp_path, "qwen2.5-7b"), backend="hf")  # 7.6B: ~15 GiB of bf16 weights alone
    gpu = Devices.fake(1, 16)
    with pytest.raises(ConfigError, match=r"^the memory plan fits cuda:0 \(16.0 GB\) only with the base in 4-bit "
                                          r"\(peak .* GiB\), which the run does not load: set load_in_4bit: true") as e:
        check_run_plan(cfg, gpu, place(cfg, gpu))
    assert "\n" not in str(e.value)
    assert plan(cfg, gpu_gb=16, gpus=1).fits is False and plan(cfg, gpu_gb=80, gpus=1).fits
    qlora = cfg.replace(load_in_4bit=True)
    assert check_run_plan(qlora, gpu, place(qlora, gpu)).fits


def test_token_budget_auto_resolves_in_one_place(tmp_path):
    cfg = Config()
    assert cfg.token_budget == "auto" and resolve_token_budget(cfg, "cpu") == 512
    assert resolve_token_budget(cfg.replace(token_budget=1024), "cpu") == 1024
    assert Config.from_dict({"token_budget": "2048"}).token_budget == 2048
    with pytest.raises(ConfigError, match="token_budget=8 is below max_tokens=48"):
        Config(token_budget=8)


def test_cli_plan_prints_the_table(tmp_path, capsys):
    from minirl.cli import main
    (tmp_path / "c.yaml").write_text(f"model: {_folder(tmp_path, 'qwen2.5-0.5b')}\nbackend: hf\n")
    assert main(["plan", str(tmp_path / "c.yaml"), "--gpu-gb", "24"]) == 0
    out = capsys.readouterr().out
    assert "minirl: plan:" in out and "fits" in out and "base weights" in out


def test_gpu_memory_utilization_auto_is_sized_from_the_free_memory_at_engine_start():
    """`engine_share` on faked free / total memory (no GPU here): what is free with the trainer loaded, less the
    trainer's growth while the engine is awake, the engine's CUDA context (1 GiB) and 8 % headroom."""
    from minirl.training.plan import engine_share
    G = 10**9
    asleep = engine_share(64 * G, 80 * G, 0, 17 * G)  # an 80 GB GPU, the trainer holds 16 GB, the engine sleeps
    assert asleep == 0.70  # (64 - 1.07 - 6.4) / 80 = 0.707, rounded down
    awake = engine_share(64 * G, 80 * G, 20 * G, 17 * G)  # awake while training: 20 GB kept for the trainer
    assert awake == 0.45
    assert engine_share(40 * G, 80 * G, 0, 17 * G) < asleep  # less free, a smaller share
    with pytest.raises(ConfigError, match=r"^gpu_memory_utilization 'auto': 20.0 GB of the GPU's 24.0 GB are free"
                       ) as e:
        engine_share(20 * G, 24 * G, 10 * G, 16 * G)  # a 7B engine beside a trainer on 24 GB
    assert "\n" not in str(e.value) and "load_in_4bit" in str(e.value)


def test_gpu_memory_utilization_field_and_own_gpu():
    from minirl.training.plan import OWN_GPU_SHARE, resolve_engine_share
    assert Config().gpu_memory_utilization == "auto"
    assert Config.from_dict({"gpu_memory_utilization": "0.5"}).gpu_memory_utilization == 0.5
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization='most': use 'auto' or a share"):
        Config(gpu_memory_utilization="most")
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=1.5: accepted range"):
        Config(gpu_memory_utilization=1.5)
    assert resolve_engine_share(Config(gpu_memory_utilization=0.4), "cuda:0", "0", True) == 0.4  # as given
    assert resolve_engine_share(Config(), "cuda:0", "1", False) == OWN_GPU_SHARE  # a GPU the trainer does not use


def test_per_token_count_matches_a_census_of_what_autograd_saves(tiny_model):
    """The plan's per-token activations (`Shape.layer_activation_bytes`: a structural count, no fitted figure)
    against every tensor autograd saves in one packed forward of a LoRA model (the tiny Llama, float32): within
    10 %, and the packed row's mask is tokens^2 float32."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from activation_census import census, plan_bytes_per_token

    from minirl.training.models import build_model
    cfg = Config(model=str(tiny_model), dtype="float32")
    model = build_model(cfg, "cpu")
    res = census(model, 256)
    T = res["tokens"]
    assert res["mask_bytes"] == T * T * 4
    saved = (res["saved_bytes"] - res["mask_bytes"]) / T
    plan_ = plan_bytes_per_token(model.get_base_model().config.to_dict(), cfg.lora_rank)
    assert abs(plan_ - saved) <= 0.10 * saved, (plan_, saved, res["by_shape"])


def test_a_sleep_wake_cycle_costs_what_upstream_measured_not_only_the_copy():
    """Issue 52 item 8: vLLM 0.32's sleep level 1 costs more than moving the weights (its pools, the KV remap): the
    plan's cycle reproduces upstream's two figures (vllm#48337: 1.4 s at 0.6B, 12.8 s at 8B, bf16 weights)."""
    from minirl.training.plan import GiB, sleep_wake_seconds
    for params, seconds in ((0.6e9, 1.4), (8e9, 12.8)):
        assert abs(sleep_wake_seconds(params * 2 / GiB, int(params)) - seconds) < 0.05
    assert sleep_wake_seconds(0.6e9 * 2 / GiB, int(0.6e9)) > 10 * 2 * 0.6e9 * 2 / 20e9  # the copy alone is a tenth of it


def test_offline_plan_of_an_uncached_hub_id_uses_the_shipped_shape(tmp_path, monkeypatch, capsys):
    """No Hub, the id not cached: `minirl plan` plans a shipped shape's id (an -Instruct one: its base's sizes)
    (any org: mirrors keep the name) with the plan of that config.json, saying so; any other id stays the one-line
    error, naming the ids it knows."""
    from minirl.cli import main
    from minirl.training.models import ModelNotCached
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("minirl.training.models.try_to_load_from_cache", lambda *a, **k: None)  # nothing cached
    hub = plan(Config(model="Qwen/Qwen2.5-1.5B-Instruct", backend="hf"), gpu_gb=24, gpus=1).trainer
    assert "planned with the shape of qwen2.5-1.5b that minirl ships" in capsys.readouterr().err
    here = plan(Config(model=_folder(tmp_path, "qwen2.5-1.5b"), backend="hf"), gpu_gb=24, gpus=1).trainer
    assert (hub.train, hub.generate, hub.token_budget) == (here.train, here.generate, here.token_budget)
    with pytest.raises(ModelNotCached, match="knows the Hub ids of the shapes it ships: Qwen/Qwen2.5-0.5B"):
        plan(Config(model="Qwen/Qwen2.5-3B-Instruct"), gpu_gb=24, gpus=1)
    assert main(["plan", "--model", "Qwen/Qwen2.5-Math-1.5B", "--gpu-gb", "24"]) == 2  # not a shipped shape's name
    assert main(["plan", "--model", "unsloth/Qwen2.5-7B-Instruct", "--gpu-gb", "24"]) == 0  # a mirror: its name
    assert main(["plan", "--model", "meta-llama/Llama-3.2-1B-Instruct", "--gpu-gb", "24"]) == 0
    assert "Llama-3.2-1B-Instruct (1.24B)" in capsys.readouterr().out


def test_auto_k_on_a_cpu_keeps_one_copy_of_the_model_where_two_do_not_fit(tmp_path):
    """`auto` gives a CPU of 2+ cores K = 1, whose generator process holds a second copy of the model; where the
    machine's memory holds one copy but not two, the run is placed synchronously (K = 0), saying why. A K set by
    hand is kept (the plan warns), and so is K = 1 where neither fits."""
    from minirl.run.plan import place_run, plan_run
    from minirl.training.plan import HEADROOM, GiB
    cfg = Config(model=_folder(tmp_path, "qwen2.5-1.5b"), backend="hf", dtype="float32")
    roomy = Devices(0, cores=2, cpu_gb=1000.0)
    assert place_run(cfg, roomy).max_async_steps == 1
    one = plan_run(cfg, roomy, place(cfg.replace(max_async_steps=0), roomy)).devices[0].peak_gb
    two = plan_run(cfg, roomy, place(cfg, roomy)).devices[0].peak_gb
    assert two > one + 5  # the plan counts the generator process's copy: 1.5B parameters in float32
    between = Devices(0, cores=2, cpu_gb=(one + two) / 2 * GiB / HEADROOM / 1e9)
    p = place_run(cfg, between)
    assert (p.max_async_steps, p.gen_devices, p.train_threads) == (0, None, 2)
    assert p.async_why.startswith("auto: a generator process's second copy of the model would not fit (peak ")
    assert plan_run(cfg, between).placement == p and plan_run(cfg, between).fits  # `minirl plan` shows the same
    assert place_run(cfg.replace(max_async_steps=1), between).max_async_steps == 1
    assert place_run(cfg, Devices(0, cores=2, cpu_gb=one / 2)).max_async_steps == 1

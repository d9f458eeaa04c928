"""Issue 52 item 5: the plan follows the placement. Each GPU is planned for what the placement puts on it, and
`minirl plan` prints the plan a run checks; the GPUs are faked (torch.cuda's device facts, vLLM as installed)."""
import json
from types import SimpleNamespace

import pytest
import torch

import minirl
from minirl.config import Config, ConfigError
from minirl.run import placement as P
from minirl.training.shapes.synthetic import shape_config


def _box(monkeypatch, n: int, gb: float = 24, capability=(8, 0)):
    """This machine, as torch and the placement see it: `n` GPUs of `gb` GB each, vLLM installed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=int(gb * 1e9)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    monkeypatch.setattr(P, "vllm_available", lambda: True)


def _yaml(tmp_path, name: str, **fields) -> tuple[Config, str]:
    """A model folder holding only the shape's config.json (a plan needs no weights), and its YAML config."""
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(shape_config(name)))
    text = "".join(f"{k}: {v}\n" for k, v in {"model": str(d), "backend": "vllm", "max_tokens": 512,
                                                 "reward_workers": 0, "out_dir": str(tmp_path / "run"),
                                                 **fields}.items())
    (tmp_path / "c.yaml").write_text(text)
    return Config.from_yaml(tmp_path / "c.yaml"), str(tmp_path / "c.yaml")


def _cli(capsys, *argv) -> str:
    from minirl.cli import main
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out.rstrip("\n")


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_the_clis_table_is_the_runs_plan(tmp_path, monkeypatch, capsys, gpus):
    """`minirl plan --gpus N --gpu-gb 24` prints what a run on a machine of N 24 GB GPUs checks before loading:
    the placement line, then each GPU planned for what the placement puts on it."""
    cfg, path = _yaml(tmp_path, "qwen2.5-1.5b")
    printed = _cli(capsys, path, "--gpus", str(gpus), "--gpu-gb", "24")
    _box(monkeypatch, gpus)
    run = minirl.Run(cfg)
    assert printed == run.memory_plan().table()
    assert printed.splitlines()[0] == run.placement.line()
    devices = run.memory_plan().devices
    assert [d.device for d in devices] == [f"cuda:{i}" for i in range(gpus)]
    if gpus == 1:
        assert devices[0].role == "trainer + vLLM engine asleep while training"
    else:  # the trainer's GPU and the engine's apart; what is left idle says so
        assert [d.role for d in devices] == ["trainer", "vLLM engine"] + ["idle"] * (gpus - 2)
        assert "engine weights" not in devices[0].train and devices[1].gpu_memory_utilization == 0.9


def test_one_gpu_plans_the_engine_asleep_with_the_sleep_line(tmp_path, monkeypatch, capsys):
    """The issue's case: `minirl plan my.yaml --gpu-gb 24`, Qwen2.5-1.5B, vLLM, 512 tokens, on a machine without a
    GPU, is the run's one-GPU plan: the engine asleep while training (8.87 / 19.35 GiB, share 0.68), the
    sleep/wake line; not the engine awake (19.38 / 14.66, share 0.47)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, path = _yaml(tmp_path, "qwen2.5-1.5b")
    out = _cli(capsys, path, "--gpu-gb", "24")
    assert "sleep/wake: 5.75 GiB moved per step" in out and "gpu_memory_utilization=0.68" in out
    assert "peak                  8.87         19.35" in out


def test_7b_fits_on_two_24gb_gpus(tmp_path, monkeypatch):
    """Each copy of the base on its own GPU: the trainer's 14.19 GiB of bf16 weights on GPU 0, the engine's on GPU
    1 in its 0.9 share (21.6 GB = 20.12 GiB: 14.19 weights + 1.5 overhead + 4.43 KV cache). Colocated on one 24 GB
    GPU it does not fit."""
    cfg, _ = _yaml(tmp_path, "qwen2.5-7b")
    _box(monkeypatch, 2)
    p = minirl.Run(cfg).memory_plan()
    assert p.fits is True and p.problems() == []
    trainer, engine = p.devices
    assert trainer.fits and engine.fits and "engine weights" not in trainer.train and not trainer.sleep_wake_gb
    assert engine.peak_gb == pytest.approx(0.9 * 24e9 / 2**30)
    assert engine.generate["engine KV cache"] == pytest.approx(0.9 * 24e9 / 2**30 - 14.19 - 1.5, abs=0.01)
    _box(monkeypatch, 1)
    assert minirl.Run(cfg).memory_plan().fits is False


def test_an_explicit_share_is_judged_on_the_engines_own_gpu(tmp_path, monkeypatch):
    """gpu_memory_utilization: 0.9 on two GPUs: the engine's GPU holds 0.9 of 24 GB, under the 92 % headroom, and
    the run goes on to load. On one GPU the trainer shares that GPU: the run stops before loading, in one line
    naming the field."""
    cfg, _ = _yaml(tmp_path, "qwen2.5-1.5b", gpu_memory_utilization=0.9)
    _box(monkeypatch, 2)
    p = minirl.Run(cfg).memory_plan()
    assert p.fits is True and p.devices[1].gpu_memory_utilization == 0.9
    assert p.devices[0].gpu_memory_utilization is None  # nothing of the engine on the trainer's GPU
    _box(monkeypatch, 1)
    run = minirl.Run(cfg)
    with pytest.raises(ConfigError) as e:
        run.setup()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the memory plan does not fit") and "cuda:0" in msg
    assert "gpu_memory_utilization=0.9" in msg and "'auto'" in msg and "GPU of its own" in msg


def test_an_engine_share_too_small_for_its_weights_does_not_fit(tmp_path, monkeypatch):
    """0.3 of a 24 GB GPU (7.2 GB) cannot hold 7B's 15.2 GB of weights: refused on the engine's GPU, in one line,
    although the GPU's peak is under the headroom."""
    cfg, _ = _yaml(tmp_path, "qwen2.5-7b", gpu_memory_utilization=0.3)
    _box(monkeypatch, 2)
    p = minirl.Run(cfg).memory_plan()
    assert p.devices[1].peak_gb * 2**30 < 0.92 * 24e9 and p.devices[1].fits is False
    (line,) = p.problems()
    assert line.startswith("the memory plan does not fit on cuda:1 (vLLM engine): gpu_memory_utilization=0.3")


def test_servers_on_three_or_more_gpus_take_every_gpu_but_the_trainers(tmp_path):
    """`backend: vllm-server, num_servers: 3` on 4 GPUs (docs/gpu.md's recipe): one server a GPU, 1, 2 and 3,
    not all three on GPU 1; the plan gives each its GPU."""
    cfg, _ = _yaml(tmp_path, "qwen2.5-1.5b", backend="vllm-server", num_servers=3)
    p = P.place(cfg, P.Devices.fake(4, 24, vllm=True))
    assert (p.train_device, p.gen_devices, p.max_async_steps) == ("cuda:0", "1,2,3", 1)
    from minirl.run.plan import plan_run
    plan = plan_run(cfg, P.Devices.fake(4, 24, vllm=True), p)
    assert [d.role for d in plan.devices] == ["trainer", "vLLM server", "vLLM server", "vLLM server"]
    assert plan.fits


def test_backend_auto_on_four_gpus_starts_a_server_on_each_gpu_the_trainer_leaves(tmp_path, monkeypatch, capsys):
    """`backend: auto` on 4 GPUs: the trainer on cuda:0, three vLLM servers on GPUs 1, 2 and 3 (one in-process
    engine would leave two idle); the placement line and `minirl plan` say so, and the run starts three."""
    cfg, path = _yaml(tmp_path, "qwen2.5-1.5b", backend="auto")
    printed = _cli(capsys, path, "--gpus", "4", "--gpu-gb", "24")
    _box(monkeypatch, 4)
    run = minirl.Run(cfg)
    p = run.placement
    assert (p.backend, p.gen_devices, p.num_servers, p.max_async_steps) == ("vllm-server", "1,2,3", 3, 1)
    assert "vllm-server generation on 1,2,3 (3 servers, one per GPU), training on cuda:0" in p.line()
    assert run.cfg.num_servers == 3 and printed == run.memory_plan().table()
    assert [d.role for d in run.memory_plan().devices] == ["trainer"] + ["vLLM server"] * 3
    two = P.place(cfg, P.Devices.fake(2, 24, vllm=True))
    assert (two.backend, two.gen_devices, two.num_servers) == ("vllm", "1", None)  # two GPUs: one engine


@pytest.mark.parametrize("why", [dict(inflight="abort"), dict(env="sums"), dict(sync_transport="files"),
                                 dict(max_async_steps=0), dict(backend="vllm"), dict(gen_devices="1")])
def test_servers_only_where_they_do_what_the_run_asks(tmp_path, why):
    """In-flight swaps, env episodes, an explicit transport, K = 0, an explicit backend or GPUs: one engine."""
    cfg = Config(**{"max_tokens": 512, **why})
    p = P.place(cfg, P.Devices.fake(4, 24, vllm=True))
    assert p.backend == "vllm" and p.num_servers is None


def test_the_trainer_keeps_the_runs_token_budget(tiny_model):
    """The run's plan picks 'auto' (`build` passes it); the trainer keeps it when its config changes mid-run, and a
    number in the config wins."""
    from minirl.training.trainer import Trainer
    cfg = Config(model=str(tiny_model), dtype="float32")
    t = Trainer(cfg, device="cpu", token_budget=1536)
    assert t.token_budget == 1536
    t.reconfigure(cfg.replace(lr=1e-3))
    assert t.token_budget == 1536
    t.reconfigure(cfg.replace(token_budget=1024))
    assert t.token_budget == 1024


@pytest.mark.parametrize("argv", [["--gpus", "-1"], ["--gpu-gb", "0"]])
def test_a_bad_device_figure_is_one_line(tmp_path, capsys, argv):
    from minirl.cli import main
    _, path = _yaml(tmp_path, "qwen2.5-0.5b")
    assert main(["plan", path, *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("minirl: error: plan for gpus=") and "--gpus 2 --gpu-gb 24" in line


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_your_servers_are_on_no_device_of_the_plan(tmp_path, gpus):
    """`server_urls` (servers started by hand): the placement line names them, not a GPU or the cores they are not
    on; on CPU the trainer takes every core and the plan counts no engine (it said "generation on 0" / "every core"
    and counted a vLLM server's weights and KV cache on this machine)."""
    from minirl.run.plan import plan_run
    cfg, _ = _yaml(tmp_path, "qwen2.5-1.5b", backend="vllm-server", server_urls="['http://127.0.0.1:8000']")
    devices = P.Devices.fake(gpus, 80, vllm=True)
    p = P.place(cfg, devices)
    assert "vllm-server generation on your 1 server (server_urls), training on" in p.line(), p.line()
    assert p.gen_devices is None and p.your_servers == 1 and p.max_async_steps == 1  # nothing here to share
    plan = plan_run(cfg, devices, p)
    assert [d.role for d in plan.devices] == ["trainer"] + ["idle"] * (gpus - 1) if gpus else ["trainer"]
    assert "engine" not in plan.table()
    if not gpus:
        assert p.train_threads == (__import__("os").cpu_count() or 1)


def test_plan_takes_config_flags_with_or_without_a_yaml(tmp_path, capsys):
    """`minirl plan --model ID --gpu-gb 24` (no YAML: a TRL user's "does it fit my GPU?"), and flags over a YAML's
    fields, as `minirl train` takes them: the same plan as the YAML holding those fields."""
    cfg, path = _yaml(tmp_path, "qwen2.5-1.5b", max_tokens=1024)
    yaml_plan = _cli(capsys, path, "--gpu-gb", "24", "--gpus", "1")
    flags = ["--model", cfg.model, "--backend", "vllm", "--max-tokens", "1024", "--reward-workers", "0",
             "--out-dir", cfg.out_dir]
    assert _cli(capsys, *flags, "--gpu-gb", "24", "--gpus", "1") == yaml_plan
    smaller = _cli(capsys, path, "--max-tokens", "256", "--gpu-gb", "24", "--gpus", "1")
    assert smaller != yaml_plan and "qwen2.5-1.5b" in smaller

"""Placement from the config and a device count (faked: no GPU here), decided before anything loads."""
import os

import pytest

from minirl.config import Config, ConfigError
from minirl.run.placement import Devices, place


@pytest.mark.parametrize("gpus,train,gen,k", [
    (1, "cuda:0", "0", 0),   # one GPU: colocated, synchronous
    (2, "cuda:0", "1", 1),   # trainer on cuda:0, the engine on GPU 1 alone, one step ahead
    (4, "cuda:0", "1", 1),   # the rest: vllm-server with num_servers N-1 (docs)
])
def test_auto_on_gpus(gpus, train, gen, k):
    p = place(Config(backend="vllm"), gpus)
    assert (p.train_device, p.gen_devices, p.max_async_steps) == (train, gen, k)
    assert p.train_threads is None and f"K = {k}" in p.line()


def test_auto_on_cpu_splits_cores_only_when_asynchronous():
    """`auto` on CPU: one core, the synchronous loop on it; 2+ cores, K = 1 with the cores split (the first half
    to the generator process); K = 0 set by hand, both phases on every core in turn."""
    p = place(Config(backend="hf"), Devices(0, cores=1))
    assert (p.train_device, p.gen_devices, p.train_threads, p.max_async_steps) == ("cpu", None, 1, 0)
    for n, gen in ((2, "0"), (4, "0-1"), (16, "0-7")):
        p = place(Config(backend="hf"), Devices(0, cores=n))
        assert (p.gen_devices, p.train_threads, p.max_async_steps) == (gen, n // 2, 1)
        p = place(Config(backend="hf", max_async_steps=0), Devices(0, cores=n))
        assert (p.gen_devices, p.train_threads, p.max_async_steps) == (None, n, 0)
    n = os.cpu_count() or 1  # this machine's, where Devices does not say
    assert place(Config(backend="hf"), 0).max_async_steps == int(n >= 2)
    assert place(Config(backend="hf", steps=0), Devices(0, cores=n)).max_async_steps == 0  # evaluation only


def test_explicit_gpu_ids_in_either_form():
    p = place(Config(backend="vllm", gen_devices="cuda:2,3", train_devices="1"), 4)
    assert (p.train_device, p.gen_devices) == ("cuda:1", "2,3")
    p = place(Config(backend="vllm", train_devices="cuda:1"), 2)
    assert (p.train_device, p.gen_devices) == ("cuda:1", "0")  # the engine takes the GPU the trainer leaves


@pytest.mark.parametrize("field,value,gpus,match", [
    ("train_devices", "abc", 0, r"^train_devices='abc': use 'auto', 'cuda', GPU ids"),  # the form: Config itself
    ("train_devices", "99", 0, r"^train_devices='99': on CPU give cores below"),
    ("gen_devices", "0-", 0, r"^gen_devices='0-'"),
    ("train_devices", "0,1", 2, r"^train_devices='0,1': .* give one GPU below 2"),
    ("gen_devices", "2", 2, r"^gen_devices='2': on this machine's 2 GPU\(s\) give GPU ids below 2"),
    ("train_devices", "gpu0", 1, r"^train_devices='gpu0'"),
])
def test_a_bad_device_string_is_one_line_naming_the_field(field, value, gpus, match):
    with pytest.raises(ConfigError, match=match):
        place(Config(backend="vllm" if gpus else "hf", **{field: value}), gpus)


def test_a_run_is_placed_before_it_loads(toy_cfg):
    from minirl import Run
    with pytest.raises(ConfigError, match="train_devices='zz'"):
        Run(toy_cfg.replace(train_devices="zz"))  # nothing loaded: no model, no out_dir
    assert not os.path.exists(toy_cfg.out_dir)
    run = Run(toy_cfg)
    assert run.placement.train_device == "cpu" and run.placement.to_dict()["max_async_steps"] == 0

"""Issue 52, items 3 and 10, with the GPU and vLLM's abilities faked (monkeypatch): QLoRA where vLLM cannot load
NF4, a CUDA IPC handle opened by an engine that numbers GPUs differently, NCCL asked for two ranks on one GPU,
and a float32 engine."""
import pytest
import torch

from minirl.config import Config, ConfigError
from minirl.generation import factory
from minirl.run import placement
from minirl.run.placement import place


def fake_vllm(monkeypatch):
    """vLLM installed, as `place` sees it (an int of GPUs) and as `Run` does (`placement.device_facts`, which
    holds its own name for `vllm_available`): without both, a machine with no vllm (the GPU image) fails here."""
    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    monkeypatch.setattr(placement, "vllm_available", lambda: True)


@pytest.fixture
def vllm_without_nf4(monkeypatch):
    fake_vllm(monkeypatch)
    monkeypatch.setattr(factory, "loads_bitsandbytes", lambda: False)  # 0.32 / 0.34: no bitsandbytes method


# --- item 3: QLoRA without an NF4-capable engine ------------------------------------------------------------
def test_qlora_on_a_gpu_generates_with_transformers_where_vllm_has_no_nf4(vllm_without_nf4, monkeypatch):
    """backend auto + load_in_4bit on one GPU: the transformers generator (the trainer's own 4-bit model), said
    in the placement's reason; where vLLM loads NF4, vLLM; without 4-bit, vLLM as before."""
    p = place(Config(load_in_4bit=True), 1)
    assert p.backend == "hf" and "NF4" in p.backend_why and "4-bit model" in p.backend_why
    assert place(Config(), 1).backend == "vllm"
    monkeypatch.setattr(factory, "loads_bitsandbytes", lambda: True)
    assert place(Config(load_in_4bit=True), 1).backend == "vllm"


def test_explicit_vllm_with_4bit_says_the_gap_before_loading_and_turns_the_check_off(vllm_without_nf4, tmp_path,
                                                                                       capsys):
    """backend: vllm + load_in_4bit where the engine holds the 16-bit base: one line before anything loads
    (the measured gap, what the sync check does, the fix), and the run's sync check is off -- it would compare
    logprobs 0.48 nats apart by design against its 0.25 bound and stop the run at its first check."""
    from minirl import Run
    run = Run(Config(backend="vllm", load_in_4bit=True, out_dir=str(tmp_path / "r")))
    line = capsys.readouterr().out.strip()
    assert line.count("\n") == 0 and "0.48" in line and "verify_sync" in line and "backend: hf" in line
    assert run.cfg.verify_sync is False and run.placement.backend == "vllm"
    assert factory.engine_gap(Config(backend="vllm-server", load_in_4bit=True), "vllm-server")  # servers too
    assert factory.engine_gap(Config(backend="vllm"), "vllm") is None  # 16-bit: no gap
    assert factory.engine_gap(Config(load_in_4bit=True), "hf") is None  # the trainer's own model


def test_an_engine_that_loads_nf4_keeps_the_sync_check(monkeypatch, tmp_path, capsys):
    fake_vllm(monkeypatch)
    monkeypatch.setattr(factory, "loads_bitsandbytes", lambda: True)
    from minirl import Run
    run = Run(Config(backend="vllm", load_in_4bit=True, out_dir=str(tmp_path / "r")))
    assert run.cfg.verify_sync is True and "qlora" not in capsys.readouterr().out


# --- item 10: edge cases ------------------------------------------------------------------------------------
def test_a_cuda_ipc_handle_is_opened_on_the_engines_own_device(monkeypatch):
    """The trainer on cuda:1 shares its buffer (handle device 1, its numbering); the colocated engine sees only
    that GPU, as its cuda:0. The channel opens the handle on cuda:0, not on a device 1 it does not have."""
    from minirl.sync import channel
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))

    def open_cuda(h):
        calls["handle"] = list(h)
        return torch.UntypedStorage(64)
    monkeypatch.setattr(channel.compat, "open_cuda", open_cuda)
    empty = torch.empty

    def cpu_empty(*a, device=None, **kw):  # no GPU here: the "cuda" tensor the storage is set into lives on CPU
        calls["device"] = device
        return empty(*a, **kw)
    monkeypatch.setattr(torch, "empty", cpu_empty)
    layout = {"dtype": "float32", "nbytes": 64}
    ch = channel.Channel(layout, {"kind": "cuda_ipc", "handle": [1, b"h", 64, 0]}, torch.device("cuda:0"))
    assert calls == {"set_device": 0, "handle": [0, b"h", 64, 0], "device": "cuda:0"}
    assert ch.flat.numel() == 16


def test_collective_on_the_trainers_gpu_is_refused_in_one_line(monkeypatch):
    """NCCL cannot hold two ranks on one GPU: sync_transport 'collective' with a colocated engine fails before
    anything loads; with the engine on a GPU of its own it is allowed."""
    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    with pytest.raises(ConfigError) as e:
        place(Config(backend="vllm", sync_transport="collective"), 1)
    assert str(e.value).count("\n") == 0 and "sync_transport='auto'" in str(e.value) and "cuda:0" in str(e.value)
    with pytest.raises(ConfigError):
        place(Config(backend="vllm", sync_transport="collective", gen_devices="0,1"), 2)
    assert place(Config(backend="vllm", sync_transport="collective"), 2).gen_devices == "1"
    assert place(Config(backend="vllm", sync_transport="auto"), 1).gen_devices == "0"


def test_float32_on_a_gpu_says_the_engine_runs_in_float32(monkeypatch):
    from minirl.training.models import cuda_dtype_note
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    note = cuda_dtype_note(Config(dtype="float32"), "cuda:0", engine=True)
    assert note.count("\n") == 0 and "float32" in note and "dtype: auto" in note
    assert cuda_dtype_note(Config(dtype="float32"), "cuda:0", engine=False) is None  # transformers: nothing to say
    assert cuda_dtype_note(Config(dtype="auto"), "cuda:0", engine=True) is None

"""Issue 52, items 4, 6 and 9, with the GPU faked (monkeypatch): float16 below compute capability 8.0, GPU ids
mapped through the parent's CUDA_VISIBLE_DEVICES, and a run started while a spawned child re-imports the script."""
import os

import pytest
import torch

from minirl.config import Config, ConfigError


def _gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


# --- item 4: T4 / V100 ----------------------------------------------------------------------------------------
def test_auto_dtype_is_float16_below_compute_capability_8(monkeypatch):
    """A T4 (7.5): 'auto' trains (and the engine serves) float16, said in one line; an explicit bfloat16 is one
    error line naming the fix. float16 and float32 stay as asked."""
    from minirl.training.models import cuda_dtype_note, train_dtype
    _gpu(monkeypatch, (7, 5))
    assert train_dtype(Config(dtype="auto"), "cuda:0") == torch.float16
    note = cuda_dtype_note(Config(dtype="auto"), "cuda:0")
    assert note.count("\n") == 0 and "float16" in note and "7.5" in note and note.startswith("minirl: ")
    with pytest.raises(ConfigError) as e:
        train_dtype(Config(dtype="bfloat16"), "cuda:0")
    assert str(e.value).count("\n") == 0 and "dtype: float16" in str(e.value) and "7.5" in str(e.value)
    with pytest.raises(ConfigError):
        cuda_dtype_note(Config(dtype="bfloat16"), "cuda:0")  # what the run's set-up calls before loading
    assert train_dtype(Config(dtype="float16"), "cuda:0") == torch.float16
    assert train_dtype(Config(dtype="float32"), "cuda:0") == torch.float32
    assert cuda_dtype_note(Config(dtype="float16"), "cuda:0") is None


def test_auto_dtype_stays_bfloat16_from_compute_capability_8(monkeypatch):
    """An A100 (8.0): bfloat16 as before, nothing printed; on the CPU device bfloat16 is never refused."""
    from minirl.training.models import cuda_dtype_note, train_dtype
    _gpu(monkeypatch, (8, 0))
    assert train_dtype(Config(dtype="auto"), "cuda:0") == torch.bfloat16
    assert train_dtype(Config(dtype="bfloat16"), "cuda:0") == torch.bfloat16
    assert cuda_dtype_note(Config(dtype="auto"), "cuda:0") is None
    _gpu(monkeypatch, (7, 0))
    assert train_dtype(Config(dtype="bfloat16"), "cpu") == torch.bfloat16


def test_float16_base_keeps_the_lora_weights_in_float32(tiny_model):
    """Why a float16 trainer needs no GradScaler: peft keeps the adapter (what AdamW updates) in float32."""
    from minirl.training.models import build_model
    model = build_model(Config(model=str(tiny_model), dtype="float16"), "cpu")
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert next(model.parameters()).dtype == torch.float16  # the base, which the engine's dtype follows


# --- item 6: CUDA_VISIBLE_DEVICES ---------------------------------------------------------------------------
def test_gpu_ids_are_indexes_into_the_parents_visible_devices(monkeypatch):
    """CUDA_VISIBLE_DEVICES=2,3 here: minirl's GPU 1 is physical GPU 3 for a server, and this process's variable
    is left as it was."""
    from minirl.generation.factory import split_devices
    from minirl.generation.server_proc import ServerOptions, server_env, visible_devices
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert visible_devices("1") == "3" and visible_devices("0,1") == "2,3" and visible_devices("cuda:0") == "2"
    places = split_devices(None, 2, on_gpu=True)
    assert places == ["0", "1"]
    envs = [server_env(ServerOptions("m", on_cpu=False, gpus=p), "key")["CUDA_VISIBLE_DEVICES"] for p in places]
    assert envs == ["2", "3"] and os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(ValueError, match="indexes into CUDA_VISIBLE_DEVICES"):
        visible_devices("2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_devices("cuda:1") == "1"  # unset: the ids themselves
    assert "CUDA_VISIBLE_DEVICES" not in server_env(ServerOptions("m", on_cpu=False), "key")


def test_the_engine_environment_is_restored_after_its_start(monkeypatch):
    """The vLLM engine's processes get the mapped variable while they start; the trainer's own is restored."""
    from minirl.generation.vllm import child_environ
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv("MINIRL_TEST_UNSET", raising=False)
    with child_environ({"CUDA_VISIBLE_DEVICES": "3", "MINIRL_TEST_UNSET": "x"}):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and os.environ["MINIRL_TEST_UNSET"] == "x"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and "MINIRL_TEST_UNSET" not in os.environ
    with pytest.raises(RuntimeError), child_environ({"CUDA_VISIBLE_DEVICES": "3"}):
        raise RuntimeError("the engine failed to start")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


# --- item 9: spawn re-imports the main script ---------------------------------------------------------------
def test_a_run_started_while_a_spawned_child_imports_the_script_is_one_line(tmp_path):
    """A spawned child re-imports the main script as `__mp_main__`: a Run started at that script's top level stops
    with one line before anything else; called from a function (a child's target), or from the real main script,
    nothing happens."""
    from minirl.run.loop import MAIN_GUARD, Run, check_main_guard
    check_main_guard()  # this process: nothing
    script = compile("Run(Config(out_dir=out))", "<unguarded script>", "exec")
    names = {"Run": Run, "Config": Config, "out": str(tmp_path / "run")}
    with pytest.raises(SystemExit) as e:
        exec(script, {**names, "__name__": "__mp_main__"})
    assert str(e.value) == MAIN_GUARD and MAIN_GUARD.count("\n") == 0
    assert 'if __name__ == "__main__":' in MAIN_GUARD and not (tmp_path / "run").exists()
    child = {"check_main_guard": check_main_guard, "__name__": "__mp_main__"}
    exec(compile("def target():\n    check_main_guard()", "<guarded script>", "exec"), child)
    child["target"]()  # a child's target function, called by multiprocessing after the import: allowed
    exec(compile("check_main_guard()", "<main script>", "exec"), {"check_main_guard": check_main_guard,
                                                                  "__name__": "__main__"})


def test_the_vllm_engine_starts_on_the_mapped_gpu_and_the_trainer_keeps_its_variable(monkeypatch):
    """VLLMGenerator on a faked GPU platform with a fake AsyncLLM: the engine start sees CUDA_VISIBLE_DEVICES=3
    for device_ids='1' under CUDA_VISIBLE_DEVICES=2,3; afterwards this process has 2,3 again."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.v1.engine import async_llm

    from minirl.generation.vllm import VLLMGenerator
    seen = []

    def fake_start(engine_args):
        seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
        return SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float16), shutdown=lambda: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(async_llm.AsyncLLM, "from_engine_args", staticmethod(fake_start))
    gen = VLLMGenerator("model", dtype="float16", device_ids="1")
    try:
        assert seen == ["3"] and os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and gen.dtype == "float16"
    finally:
        gen.close()

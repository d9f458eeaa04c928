"""In-memory adapter sync (minirl.sync senders + the engine-side receiver minirl.sync.receiver) with real vLLM on CPU.

One float32 engine (worker extension installed) for the module. Each transport: after a push the engine's probe
logprobs equal the trainer's and differ from the previous version's; 50 rapid in-place syncs during continuous
generation fail no request and every token's version tag (from the worker's swap reports) is the adapter that
produced it; an absent or killed peer gives a clear error within the timeout.
"""
import asyncio
import importlib.util
import multiprocessing as mp
import os
import shutil
import time
import types

import pytest
import torch

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")]
ATOL = 2e-3   # float32 engine vs float32 transformers, per token
RANK = 8


# ---- pure helpers (no engine) ----------------------------------------------------------------------------------

def test_layout_pack_unpack_roundtrip():
    from minirl.core.adapter import Packer, make_layout, unpack
    ts = {"a.lora_A.weight": torch.randn(4, 6), "a.lora_B.weight": torch.randn(5, 4), "b": torch.randn(3)}
    lay = make_layout(ts, {"r": 4}, torch.bfloat16)
    assert lay["nbytes"] == 2 * (24 + 20 + 3)
    flat = torch.empty(lay["numel"], dtype=torch.bfloat16)
    Packer(ts, flat, lay).pack()
    out = unpack(flat, lay)
    for k, v in ts.items():
        assert torch.equal(out[k], v.to(torch.bfloat16))


def test_contiguous_adapter_packs_with_one_copy_and_prescaled_b():
    """`make_contiguous` + `Packer` (one flat copy, lora_B scaled in the buffer) gives the same bytes as the
    per-tensor path; a parameter rebound elsewhere afterwards sends the packer back to the per-tensor path."""
    from peft import LoraConfig, get_peft_model

    from minirl.core.adapter import Packer, _span, adapter_params, b_scalings, make_contiguous, make_layout, unpack
    base = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4))
    pm = get_peft_model(base, LoraConfig(r=2, lora_alpha=6, target_modules=["0", "2"]))
    with torch.no_grad():
        for p in pm.parameters():
            p.normal_()
    ts, sc = adapter_params(pm), b_scalings(pm)
    assert list(ts)[:2] == [n for n in ts if ".lora_A." in n] and set(sc) == {n for n in ts if ".lora_B." in n}
    assert set(sc.values()) == {3.0}
    lay = make_layout(ts, {"r": 2}, torch.bfloat16)
    ref = torch.empty(lay["numel"], dtype=torch.bfloat16)
    Packer(ts, ref, lay, sc).pack()
    assert _span(list(ts.values())) is None
    buf = make_contiguous(pm)
    assert buf is not None and _span(list(adapter_params(pm).values())) is not None
    flat = torch.empty_like(ref)
    packer = Packer(adapter_params(pm), flat, lay, sc)
    packer.pack()
    assert torch.equal(flat, ref)
    for n, v in unpack(flat, lay).items():
        assert torch.equal(v, ts[n].detach().to(torch.bfloat16) * sc.get(n, 1.0))  # scaled in bf16, as vLLM does
    with torch.no_grad():  # an optimizer-style in-place update is seen by the next pack
        buf.add_(1.0)
    packer.pack()
    assert torch.equal(unpack(flat, lay)[list(ts)[0]], ts[list(ts)[0]].detach().to(torch.bfloat16))
    p0 = list(ts.values())[0]
    p0.data = p0.data.clone() + 5  # rebound: no longer a view of the buffer
    packer.pack()
    assert torch.equal(unpack(flat, lay)[list(ts)[0]], p0.detach().to(torch.bfloat16))


def test_chunked_pack_gives_the_same_bytes_and_reports_progress_in_order():
    """The ipc sender packs in chunks and publishes after each how much of the buffer is final: chunk bounds that
    cut tensors and scaled runs give the bytes of a whole pack, progress only grows and ends at the total."""
    from peft import LoraConfig, get_peft_model

    from minirl.core.adapter import Packer, adapter_params, b_scalings, make_contiguous, make_layout
    base = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    pm = get_peft_model(base, LoraConfig(r=3, lora_alpha=5, target_modules=["0", "2"]))
    make_contiguous(pm)
    with torch.no_grad():
        for p in pm.parameters():
            p.normal_()
    ts, sc = adapter_params(pm), b_scalings(pm)
    lay = make_layout(ts, {"r": 3}, torch.bfloat16)
    ref = torch.empty(lay["numel"], dtype=torch.bfloat16)
    Packer(ts, ref, lay, sc).pack()
    for chunk in (1, 5, 13, lay["numel"], 10 * lay["numel"]):
        flat = torch.full_like(ref, float("nan"))
        packer = Packer(ts, flat, lay, sc)
        seen = []
        for done in packer.pack_chunks(chunk):
            assert not flat[:done].isnan().any() and (done == flat.numel() or flat[done:].isnan().all())
            seen.append(done)
        assert seen == sorted(seen) and seen[-1] == lay["numel"] and torch.equal(flat, ref), chunk


def test_swap_log_token_versions():
    from minirl.generation.swaps import SwapLog, split_worker_request_id
    assert split_worker_request_id("3_minirl-17-ab12cd34") == ("minirl-17", 3)
    assert split_worker_request_id("minirl-17-ab12cd34") == ("minirl-17", 0)
    log = SwapLog()
    # r1 runs across two swaps (3 tokens on v1, 2 on v2, rest v3); r2 ran and finished between the swaps on v1;
    # r3 started after the first swap; r4 started after the last one
    w = {r: f"{r}-0123abcd" for r in ("r1", "r2", "r3", "r4")}
    log.add({"version": 2, "prev_version": 1, "swap": {"0_" + w["r1"]: 3, "1_" + w["r1"]: 1},
             "started": [("0_" + w["r1"], 1), ("1_" + w["r1"], 1), (w["r2"], 1)]})
    log.add({"version": 3, "prev_version": 2, "swap": {"0_" + w["r1"]: 5, w["r3"]: 1}, "started": [(w["r3"], 2)]})
    assert log.token_versions("r1", 7) == [1, 1, 1, 2, 2, 3, 3]
    assert log.token_versions("r1", 3, index=1) == [1, 2, 2]
    assert log.token_versions("r2", 4) == [1] * 4
    assert log.token_versions("r3", 3) == [2, 3, 3]
    assert log.token_versions("r4", 2) == [3, 3]


def test_gate_lets_a_waiting_install_in_before_the_next_step():
    """The worker's gate: an install never overlaps a step; one that waits goes before the next step; a step
    that does not end makes the install time out."""
    import threading

    from minirl.sync.channel import Gate
    gate, order = Gate(), []
    gate.enter()  # a step in progress

    def run(name, install):
        gate.enter(install=install, timeout_s=60)
        order.append(name)
        time.sleep(0.05)  # the thing under test: a second thread let in meanwhile would show between the two
        order.append(name + " done")
        gate.leave()

    def blocked(n):  # a condition wait: the deadline only bounds a hang
        deadline = time.monotonic() + 60
        while gate.waiting < n:
            assert time.monotonic() < deadline, "the thread never reached the gate"
            time.sleep(0.001)
    inst = threading.Thread(target=run, args=("install", True))
    inst.start()
    blocked(1)
    step = threading.Thread(target=run, args=("next step", False))
    step.start()
    blocked(2)  # both are inside `enter`, waiting for the step in progress
    assert order == [] and gate.installs_waiting == 1
    gate.leave()
    inst.join(60)
    step.join(60)
    assert order == ["install", "install done", "next step", "next step done"]
    assert gate.waiting == gate.installs_waiting == 0
    gate.enter()
    with pytest.raises(TimeoutError, match="engine step did not end"):
        gate.enter(install=True, timeout_s=0.2)
    assert gate.installs_waiting == gate.waiting == 0
    gate.leave()
    gate.enter(install=True, timeout_s=0.2)  # the control: a free gate lets the install in at once
    gate.leave()


def test_absent_peer_times_out_quickly(tmp_path):
    from minirl.sync.wire import open_group
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="could not meet its peer"):
        open_group(str(tmp_path), 0, "gloo", timeout_s=2)
    assert time.perf_counter() - t0 < 60  # a hang bound: torch's own default wait is 30 minutes


def _listeners(pids) -> list:
    """The TCP addresses these processes listen on."""
    import psutil
    out = []
    for pid in pids:
        try:
            out += [c.laddr for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return out


def _peer(rdv, q):
    from minirl.sync.wire import broadcast, open_group
    _, pg = open_group(rdv, 1, "gloo", timeout_s=20)
    buf = torch.empty(1000, dtype=torch.uint8)
    broadcast(pg, buf, 20, "test receive")
    q.put(int(buf.sum()))
    time.sleep(600)  # killed by the test


def test_killed_peer_gives_a_clear_error_within_the_timeout():
    """Also: the group listens on 127.0.0.1 only, in both processes (no TCP store on any port)."""
    from minirl.sync.base import SyncTimeout
    from minirl.sync.wire import broadcast, open_group, rendezvous_dir
    rdv = rendezvous_dir()
    assert os.stat(rdv).st_mode & 0o777 == 0o700
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peer, args=(rdv, q), daemon=True)
    p.start()
    try:
        _, pg = open_group(rdv, 0, "gloo", timeout_s=60)
        broadcast(pg, torch.ones(1000, dtype=torch.uint8), 20, "test send")
        assert q.get(timeout=30) == 1000
        listening = _listeners({os.getpid(), p.pid})
        assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
        p.kill()
        p.join(10)
        t0 = time.perf_counter()
        with pytest.raises(SyncTimeout, match="peer gone or no answer"):  # what the sender raises, as a run sees it
            for _ in range(3):  # a send may still land in the socket buffer; the next one must fail
                broadcast(pg, torch.ones(1 << 20, dtype=torch.uint8), 5, "test send")
        assert time.perf_counter() - t0 < 60  # a hang bound: gloo's own default wait is 30 minutes
    finally:
        if p.is_alive():
            p.kill()
        shutil.rmtree(rdv, ignore_errors=True)


# ---- with the engine -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def probe(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Name one primary color."}], add_generation_prompt=True,
                                  tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    return list(ids), tok("Blue is a primary color, like red.")["input_ids"]


@pytest.fixture(scope="module")
def trainer(embedded_model):
    """A stand-in for minirl.training.trainer.Trainer: the peft model, a version, logprobs and save_adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from minirl.core.adapter import make_contiguous
    from minirl.training.batch import sequence_logprobs
    base = AutoModelForCausalLM.from_pretrained(embedded_model, dtype=torch.float32)
    pm = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=16, target_modules="all-linear",
                                         task_type="CAUSAL_LM")).eval()
    make_contiguous(pm)  # as minirl.training.trainer.build_model does
    t = types.SimpleNamespace(model=pm, version=0)
    t.logprobs = lambda p, c, temp=1.0: sequence_logprobs(pm, p, c, temp)

    def save_adapter(path):
        pm.save_pretrained(path)
        return path
    t.save_adapter = save_adapter
    return t


def set_version(trainer, v: int) -> None:
    """Deterministic adapter weights for version v (B random, A as initialised)."""
    g = torch.Generator().manual_seed(1000 + v)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    trainer.version = v


@pytest.fixture(scope="module")
def gen(embedded_model):
    if not HAS_VLLM:
        pytest.skip("vllm is not installed")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from minirl.generation.vllm import VLLMGenerator
    from minirl.sync.wire import engine_kwargs
    g = VLLMGenerator(embedded_model, max_lora_rank=RANK, max_model_len=512, dtype="float32", kv_cache_gb=1,
                      engine_kwargs=engine_kwargs())
    yield g
    g.close()


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
@pytest.mark.parametrize("transport,inflight", [("ipc", False), ("ipc", True), ("ipc-zero-copy", True),
                                                ("collective", True), ("files", False)])
def test_sync_serves_the_trainers_adapter(gen, trainer, probe, transport, inflight, monkeypatch):
    import functools

    from minirl.sync import senders as transports
    from minirl.sync.files import FileSync
    from minirl.sync.tensor import TensorSync
    zero_copy = transport == "ipc-zero-copy"
    if zero_copy:  # the trainer's parameters in the shared buffer; the worker converts and scales
        monkeypatch.setitem(transports.SENDERS, "ipc", functools.partial(transports.IpcSender, zero_copy=True))
        transport = "ipc"
    sync = FileSync() if transport == "files" else TensorSync(transport, inflight=inflight, timeout_s=30)
    prev = gen.score(*probe)
    try:
        for step in range(3):
            set_version(trainer, trainer.version + 1)
            stats = sync.push(trainer, gen)
            assert stats.version == trainer.version == gen.version and stats.bytes > 0
            got = gen.score(*probe)
            assert _max_diff(got, trainer.logprobs(*probe)) < ATOL, f"{transport} v{trainer.version}"
            assert _max_diff(got, prev) > 0.01, "the engine still serves the previous version"
            prev = got
            if transport == "collective":  # nothing of the run (trainer, engine core) listens beyond loopback
                import psutil
                tree = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
                listening = _listeners(tree)
                assert all(a.ip in ("127.0.0.1", "::1") for a in listening), listening
            if transport != "files":
                assert getattr(sync.sender, "zero_copy", False) == zero_copy
                assert sync.last["inplace"] == (inflight and step > 0)
                # the first push installs the id by engine call; in-place swaps ring the worker's doorbell (collective:
                # the broadcast in chunks, each copied into the slot as it arrives)
                assert sync.last["via"] == ("doorbell" if inflight and step > 0 else "rpc")
                if inflight and step > 0:
                    assert sync.last["path"] == "fast"  # the direct slot copy (vLLM's reload path otherwise)
        if transport != "files":
            # in-memory adapters of earlier versions are removed once idle (memory stays bounded)
            assert len(gen.loaded_adapters()) <= 2
    finally:
        sync.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_the_engine_reports_its_hooks_and_the_sync_runs_on_them(gen):
    """At engine start `make_sync` asks the worker for its hooks (`minirl_hooks`, checked on the runner in use):
    vLLM-CPU's V1 runner has every one, so `inflight` gets the in-memory transport, and the reason names the
    release, the runner and the hooks checked (tests/test_vllm_hooks.py: the faults, and the GPU releases' V2)."""
    from minirl.sync import vllm_compat
    from minirl.sync.factory import make_sync
    sync, why = make_sync("auto", gen, "cpu", inflight=True)
    try:
        assert sync.transport == "ipc" and sync.inflight
        assert f"vLLM {vllm_compat.vllm_version()}, model runner V1 (CPUModelRunner): hooks checked" in why
    finally:
        sync.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_inplace_adapter_evicted_from_its_slot_comes_back_with_its_latest_weights(gen, trainer, probe, tmp_path):
    """Fast in-place installs write only the engine's slot; when other adapters take every slot and ours comes
    back, vLLM re-activates it from its LoRAModel tensors: they must hold the latest version, not the first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from minirl.sync.senders import call_on_loop, rpc
    from minirl.sync.tensor import TensorSync
    sync = TensorSync("ipc", inflight=True, timeout_s=30)
    try:
        for _ in range(3):
            set_version(trainer, trainer.version + 1)
            sync.push(trainer, gen)
        assert sync.last["path"] == "fast"
        ours, want, served = sync.lora_id, trainer.logprobs(*probe), trainer.version
        dirs = []
        for k in range(gen.engine_args.max_loras):
            set_version(trainer, 500 + k)
            dirs.append(trainer.save_adapter(str(tmp_path / f"other{k}")))
        set_version(trainer, served)  # the trainer holds what the engine serves again (for the tests after this)

        async def others():
            for k, d in enumerate(dirs):
                async for _ in gen.engine.generate(TokensPrompt(prompt_token_ids=probe[0]),
                                                        SamplingParams(max_tokens=1), f"evict-{k}",
                                                        lora_request=LoRARequest(f"other{k}", 900_000 + k, d)):
                    pass
        asyncio.run_coroutine_threadsafe(others(), gen.loop).result(timeout=300)
        assert ours not in call_on_loop(gen, rpc(gen, "minirl_info"), 30)["slots"], "ours was not evicted"
        assert _max_diff(gen.score(*probe), want) < ATOL
    finally:
        sync.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
@pytest.mark.full("~4 min of an engine swapping adapters under load; by default test_swaps checks the versions' "
                  "bookkeeping and test_sync_serves_the_trainers_adapter[*-True] an in-flight swap on the engine")
def test_rapid_inflight_syncs_during_generation_keep_exact_versions(gen, trainer, tok, monkeypatch):
    """50 in-place syncs while requests stream through the generator: no request fails; every token's version
    tag (`Completion.versions`, from the worker's swap reports) is the adapter that produced it (its sampled
    logprob equals the one recomputed under that version). The first push installs the id by engine call, the
    other 50 ring the worker's doorbell (the swap lands between two engine steps; the report comes back outside
    the engine's output stream, so finishing requests must wait for it)."""
    from minirl.sync.tensor import TensorSync
    from minirl.types import Prompt, SamplingParams
    sync = TensorSync("ipc", inflight=True, timeout_s=30)
    set_version(trainer, trainer.version + 1)
    sync.push(trainer, gen)
    assert sync.last["via"] == "rpc"
    # widen the window between a swap landing in the worker and its report reaching the generator (every 4th
    # report 0.6 s late: longer than an engine step here): requests that finish in it must wait for the report, or
    # their tokens after the swap would be tagged with the older version
    update_adapter, calls = gen.update_adapter, []

    def late_report(deliver, in_place=False):
        def delivered():
            update = deliver()  # the swap landed in the worker; its report reaches the generator late
            calls.append(1)
            if len(calls) % 4 == 0:
                time.sleep(0.6)
            return update
        return update_adapter(delivered, in_place)
    monkeypatch.setattr(gen, "update_adapter", late_report)
    first = trainer.version
    prompts = [Prompt(i, tuple(tok(f"Write a short story about the number {i}.")["input_ids"]), "") for i in range(6)]
    sp = SamplingParams(temperature=1.0, max_tokens=32)
    stop = False
    groups, errors = [], []

    async def worker(w):
        i = 0
        while not stop:
            i += 1
            try:
                groups.append(await gen.generate_group(prompts[(w + i) % 6], 2, sp))
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    async def run_workers():
        await asyncio.gather(*(worker(w) for w in range(2)))

    fut = asyncio.run_coroutine_threadsafe(run_workers(), gen.loop)
    t0 = time.perf_counter()
    peak = 0  # records in the generator's swap log for our id
    try:
        _wait_for_tokens(gen, sync.lora_id, 1)  # requests are streaming on the id the pushes swap
        for _ in range(50):
            set_version(trainer, trainer.version + 1)
            sync.push(trainer, gen)
            assert sync.last["path"] == "fast" and sync.last["via"] == "doorbell", sync.last
            peak = max(peak, len(gen.swaps.logs[sync.lora_id].records))
    finally:
        stop = True
        fut.result(timeout=120)
        sync.close()
    sync_s = time.perf_counter() - t0
    assert not errors, errors[:3]
    # the swap log keeps only what running requests can need: once none runs, the last install's record
    assert len(gen.swaps.logs[sync.lora_id].records) == 1
    assert gen.version == trainer.version
    comps = [(g.prompt.token_ids, c) for g in groups for c in g.completions]
    assert len(groups) >= 3 and all(c.token_ids for _, c in comps)
    for _, c in comps:
        assert len(c.versions) == len(c.token_ids) and list(c.versions) == sorted(c.versions)
        assert first <= c.versions[0] and c.versions[-1] <= trainer.version
    spanning = sorted((t for t in comps if len(set(t[1].versions)) >= 2), key=lambda t: -len(set(t[1].versions)))
    assert spanning, "no sequence saw an in-flight swap"
    # exactness: replay every sequence token by token in transformers, switching to each token's tagged version
    # at the step that sampled it (the engine computed the KV of token i-1 in that same step)
    last = trainer.version
    for prompt_ids, comp in comps:
        exact = _replay_logprobs(trainer, prompt_ids, list(comp.token_ids), list(comp.versions))
        assert _max_diff(exact, list(comp.logprobs)) < ATOL, list(zip(comp.versions, exact, comp.logprobs))
    # and the check discriminates: one version for the whole sequence does not explain the tokens
    prompt_ids, comp = spanning[0]
    wrong = _replay_logprobs(trainer, prompt_ids, list(comp.token_ids), [comp.versions[0]] * len(comp.versions))
    assert _max_diff(wrong, list(comp.logprobs)) > 10 * ATOL
    set_version(trainer, last)
    print(f"50 in-place syncs in {sync_s:.1f} s during generation; {len(groups)} groups, "
          f"{len(spanning)} sequences spanned >= 2 versions (max {len(set(spanning[0][1].versions))}); swap log "
          f"peak {peak} records")


@torch.no_grad()
def _replay_logprobs(trainer, prompt_ids, token_ids, versions):
    """Logprob of token i computed with version versions[i]'s weights over a KV cache built step by step."""
    model, out, past = trainer.model, [], None
    feed = list(prompt_ids)
    for i, (t, v) in enumerate(zip(token_ids, versions)):
        if trainer.version != v:
            set_version(trainer, v)
        res = model(input_ids=torch.tensor([feed]), past_key_values=past, use_cache=True)
        past = res.past_key_values
        out.append(float(torch.log_softmax(res.logits[0, -1].float(), -1)[t]))
        feed = [t]
    return out


def _sampled_logprobs(comp):
    """The logprob of each sampled token (vLLM's per-position dict or flat logprobs)."""
    lp = comp.logprobs
    if hasattr(lp, "start_indices"):
        return [float(lp.logprobs[next(k for k in range(lp.start_indices[i], lp.end_indices[i])
                                       if lp.token_ids[k] == t)]) for i, t in enumerate(comp.token_ids)]
    return [d[t].logprob for d, t in zip(lp, comp.token_ids)]


def _wait_for_tokens(gen, lora_id: int, tokens: int, running=lambda: True) -> None:
    """Until the engine's worker holds a request on LoRA `lora_id` with at least `tokens` output tokens (asked from
    the worker between two engine steps: `minirl_info`), while `running()`; the deadline only bounds a hang."""
    from minirl.sync.senders import call_on_loop, rpc
    deadline = time.monotonic() + 120
    while True:
        held = [n for lid, n in call_on_loop(gen, rpc(gen, "minirl_info"), 30)["requests"].values() if lid == lora_id]
        if held and max(held) >= tokens:
            return
        assert running(), f"the requests on LoRA {lora_id} ended before the worker was seen holding {tokens} tokens"
        assert time.monotonic() < deadline, f"the worker holds {held} on LoRA {lora_id}"
        time.sleep(0.01)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_abort_policy_resubmits_unfinished_sequences_under_the_new_adapter(gen, trainer, tok):
    """inflight='abort': a push aborts the running request; each unfinished sequence is resubmitted as prompt +
    its tokens so far under the new adapter. Tokens keep the version and logprob they were sampled with: those
    before the swap are the old adapter's, those after are the new adapter's over the whole prefix."""
    from minirl.sync.tensor import TensorSync
    from minirl.types import Prompt, SamplingParams
    sync = TensorSync("ipc", inflight=False, timeout_s=30)
    set_version(trainer, trainer.version + 1)
    sync.push(trainer, gen)
    old = trainer.version
    ids = tok("Write a long story about a dragon who learns to count.")["input_ids"]
    gen.policy, before = "abort", gen.resubmitted
    try:
        fut = gen.submit([Prompt(0, tuple(ids), "story")], 3, SamplingParams(temperature=1.0, max_tokens=200, seed=3))
        # a sequence has sampled tokens on the old adapter (200 tokens: it runs on long after the worker says so)
        _wait_for_tokens(gen, sync.lora_id, 2, running=lambda: not fut.done())
        set_version(trainer, old + 1)
        sync.push(trainer, gen)
        group = fut.result(timeout=120)[0]
    finally:
        gen.policy = "continue"
        sync.close()
    assert gen.resubmitted > before
    lp = {}
    for v in (old, old + 1):
        set_version(trainer, v)
        lp[v] = [trainer.logprobs(ids, list(c.token_ids)) for c in group.completions]
    spanning = 0
    for j, c in enumerate(group.completions):
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) <= 200 and c.finish_reason != "abort"
        assert list(c.versions) == sorted(c.versions) and set(c.versions) <= {old, old + 1}
        spanning += len(set(c.versions)) == 2
        want = [lp[v][j][i] for i, v in enumerate(c.versions)]
        assert _max_diff(list(c.logprobs), want) < ATOL, (j, c.versions)
        if len(set(c.versions)) == 2:  # discriminates: the old adapter does not explain the later tokens
            assert _max_diff(list(c.logprobs), lp[old][j]) > 10 * ATOL
    assert spanning, "no sequence was aborted and resubmitted mid-way"


def _push_failing_midpack(sync, trainer, gen, monkeypatch) -> float:
    """Push the next version with a pack that raises MemoryError after its first chunk (the error must come
    through as is); returns the seconds until the push raised. The pack stays failing: restore it."""
    from minirl.core.adapter import Packer
    real = Packer.pack_chunks

    def failing(self, chunk):
        it = real(self, chunk)
        yield next(it)
        raise MemoryError("the trainer ran out of memory mid-pack")
    monkeypatch.setattr(Packer, "pack_chunks", failing)
    set_version(trainer, trainer.version + 1)
    t0 = time.perf_counter()
    with pytest.raises(MemoryError):
        sync.push(trainer, gen)
    return time.perf_counter() - t0


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_ipc_worker_copies_only_what_the_trainer_has_packed(gen, trainer, probe, monkeypatch):
    """On CPU the worker copies into the slot while the trainer still packs: a slow pack in small chunks still
    serves exactly the trainer's adapter (a worker that read ahead of the progress header would copy stale
    bytes); a pack that fails midway, or a trainer that never packs, gives a clear error within the timeout,
    and the next push serves the right adapter again."""
    from minirl.core.adapter import Packer
    from minirl.sync import senders as transports
    from minirl.sync.base import SyncError
    from minirl.sync.senders import call_on_loop, install
    from minirl.sync.tensor import TensorSync
    slow = Packer.pack_chunks

    def crawling(self, chunk):
        for done in slow(self, chunk):
            time.sleep(0.002)  # a slow trainer core (the slowness is the thing under test)
            yield done
    monkeypatch.setattr(Packer, "pack_chunks", crawling)
    monkeypatch.setitem(transports.SENDERS, "ipc", lambda *a, **k: transports.IpcSender(*a, chunk_bytes=64 << 10, **k))
    sync = TensorSync("ipc", inflight=True, timeout_s=120)
    try:
        for _ in range(3):
            set_version(trainer, trainer.version + 1)
            sync.push(trainer, gen)
            assert sync.sender.header is not None and sync.last["path"] in ("fast", "vllm")
            assert _max_diff(gen.score(*probe), trainer.logprobs(*probe)) < ATOL
        assert sync.last["path"] == "fast"

        assert _push_failing_midpack(sync, trainer, gen, monkeypatch) < 60  # told at once, not at the 120 s wait
        assert sync.lora_id is None and sync.sender is None  # the next push: a fresh id on a fresh channel
        monkeypatch.setattr(Packer, "pack_chunks", slow)
        sync.push(trainer, gen)
        assert sync.last["via"] == "rpc" and _max_diff(gen.score(*probe), trainer.logprobs(*probe)) < ATOL

        s = sync.sender  # a push number the trainer announces but never packs: the worker gives up in time
        s.seq += 1
        s.publish_progress(0)
        t0 = time.perf_counter()
        with pytest.raises(SyncError, match="not packed in time"):
            call_on_loop(gen, install(gen, s.channel, 3_000_000, trainer.version, 2.0, seq=s.seq), 2.0)
        assert time.perf_counter() - t0 < 60  # a hang bound; the message is the worker's own (its 2 s wait)

        set_version(trainer, trainer.version + 1)
        sync.push(trainer, gen)
        assert sync.last["via"] == "doorbell" and _max_diff(gen.score(*probe), trainer.logprobs(*probe)) < ATOL
    finally:
        sync.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_engine_side_absent_peer_errors_and_engine_survives(gen, trainer, probe, tmp_path):
    """The worker cannot meet the trainer (nobody listens): a clear error within the timeout, engine unharmed."""
    from minirl.core.adapter import adapter_params, make_layout, peft_config_dict
    from minirl.sync.base import SyncError
    from minirl.sync.senders import call_on_loop, rpc
    lay = make_layout(adapter_params(trainer.model), peft_config_dict(trainer.model))
    src = {"kind": "collective", "rdv_dir": str(tmp_path), "backend": "gloo", "timeout_s": 2}
    t0 = time.perf_counter()
    with pytest.raises(SyncError, match="could not meet its peer"):
        call_on_loop(gen, rpc(gen, "minirl_open_channel", "nobody", lay, src, timeout_s=20), 20)
    assert time.perf_counter() - t0 < 15
    assert _max_diff(gen.score(*probe), trainer.logprobs(*probe)) < ATOL  # still serving, same adapter


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
@pytest.mark.parametrize("ring", [False, True])
def test_trainer_side_collective_times_out_when_the_worker_does_not_receive(gen, trainer, ring):
    """The trainer broadcasts (whole, or in chunks after ringing the doorbell) but the worker never takes part:
    bounded, clear error."""
    from minirl.core.adapter import adapter_params, peft_config_dict
    from minirl.sync.base import SyncError
    from minirl.sync.senders import CollectiveSender
    s = CollectiveSender(gen, adapter_params(trainer.model), peft_config_dict(trainer.model), timeout_s=3,
                         chunk_bytes=1 << 20)
    try:
        assert s.bell is not None
        s.channel = "not-the-channel"  # the worker answers "no channel" and never joins the broadcast
        t0 = time.perf_counter()
        with pytest.raises(SyncError):
            s.send(2_000_000, 1, ring=ring)
        assert time.perf_counter() - t0 < 60  # a hang bound: gloo's own default wait is 30 minutes
    finally:
        s.close()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_collective_push_abandoned_midway_frees_the_engine_at_once(gen, trainer, probe, monkeypatch):
    """A chunked collective swap whose pack fails after the first chunk: the trainer's error comes through as is,
    and the worker, which waits for the other chunks inside the engine's gate, is released at once (the trainer
    drops its end of the group) instead of at its 120 s timeout: the engine generates and the next push serves the
    trainer's adapter within seconds."""
    from minirl.core.adapter import Packer
    from minirl.sync.tensor import TensorSync
    from minirl.types import Prompt, SamplingParams
    slow = Packer.pack_chunks
    sync = TensorSync("collective", inflight=True, timeout_s=120)
    try:
        for _ in range(2):
            set_version(trainer, trainer.version + 1)
            sync.push(trainer, gen)
        assert sync.last["via"] == "doorbell"

        t0 = time.perf_counter()
        assert _push_failing_midpack(sync, trainer, gen, monkeypatch) < 60
        monkeypatch.setattr(Packer, "pack_chunks", slow)
        done = gen.generate([Prompt(0, tuple(probe[0]), "probe")], 1, SamplingParams(max_tokens=4))
        assert done[0].completions[0].token_ids
        sync.push(trainer, gen)
        assert _max_diff(gen.score(*probe), trainer.logprobs(*probe)) < ATOL
        assert time.perf_counter() - t0 < 90  # the worker's own wait would have held the engine for 120 s
    finally:
        sync.close()


def _wait_gone(pid: int) -> None:
    """Until process `pid` has ended (gone, or a zombie); the deadline only bounds a hang."""
    import psutil
    deadline = time.monotonic() + 60
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.01)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_killed_engine_worker_gives_a_clear_error(gen, trainer):
    """Last test of the module (it kills the engine's worker): a push then fails fast with SyncError."""
    import signal

    from minirl.sync.base import SyncError
    from minirl.sync.senders import call_on_loop, rpc
    from minirl.sync.tensor import TensorSync
    sync = TensorSync("ipc", inflight=True, timeout_s=10)
    set_version(trainer, trainer.version + 1)
    sync.push(trainer, gen)
    pid = call_on_loop(gen, rpc(gen, "minirl_info", timeout_s=10), 10)["pid"]
    assert pid != os.getpid()
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)
    set_version(trainer, trainer.version + 1)
    t0 = time.perf_counter()
    with pytest.raises(SyncError, match="worker is gone"):  # an in-place swap: rung on the dead worker's doorbell
        sync.push(trainer, gen)
    assert time.perf_counter() - t0 < 20
    assert gen.swaps.pending == 0  # finishing requests do not wait for a report that will never come
    sync.close()  # the engine is gone: closing only unlinks the shared-memory file

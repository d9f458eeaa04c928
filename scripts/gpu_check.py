"""The GPU-only paths of minirl in one short run, or their CPU twins (`--cpu-twin`, same code, gloo/shared memory).

Sections (each one JSON object in `OUT/gpu_check.json`, and one line on stdout; a section that cannot run on this
machine says why instead of failing the others):

- `env`: torch / CUDA / GPU, bf16 support, which optional packages are importable (vllm, bitsandbytes, peft).
- `ipc`: the `ipc` transport between two processes (`scripts/ipc_check.py`): CUDA IPC handles on GPU, a
  shared-memory file on CPU; the receiver's copy must equal the trainer's tensors after every update.
- `collective`: a two-rank broadcast of the adapter's bytes, NCCL on GPU (needs two GPUs: NCCL refuses two ranks on
  one device), gloo on CPU; the received bytes must equal the sent ones.
- `train`: a short asynchronous run (K = 1) on a tiny model with the transformers generator, the trainer on the GPU
  in bfloat16 (CPU twin: float32), verification on; every logged loss must be finite and the adapter saved.
- `vllm`: when vLLM is importable, the real-engine tests (`pytest -m vllm tests/test_vllm.py`).

    bash scripts/gpu_check.sh            # on a GPU machine; writes $OUT (or ./gpu_check_out)
    bash scripts/gpu_check.sh --cpu-twin # here
"""
import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def env(dev: str) -> dict:
    import torch
    out = {"torch": torch.__version__, "device": dev, "cuda": torch.cuda.is_available(),
           "packages": {m: importlib.util.find_spec(m) is not None
                        for m in ("vllm", "bitsandbytes", "peft", "transformers", "gguf")}}
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


def _rank(rank: int, backend: str, port: int, numel: int, q) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dev = f"cuda:{rank}" if backend == "nccl" else "cpu"
    g = torch.Generator().manual_seed(0)
    want = torch.randn(numel, generator=g).to(torch.bfloat16).to(dev)
    buf = want.clone() if rank == 0 else torch.zeros_like(want)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dist.broadcast(buf, src=0)
        if backend == "nccl":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    if rank == 1:
        q.put({"equal": bool(torch.equal(buf, want)), "p50_ms": round(1000 * sorted(times)[5], 2)})
    dist.destroy_process_group()


def collective(dev: str) -> dict:
    import socket
    import torch
    import torch.multiprocessing as mp
    backend = "nccl" if dev == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        return {"skipped": "NCCL needs two GPUs (it refuses two ranks on one device); this machine has "
                           f"{torch.cuda.device_count()}"}
    with socket.socket() as s:  # loopback only; the port is bound again at once by rank 0
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    numel = 4_884_480  # the embedded model's rank-16 adapter
    procs = [ctx.Process(target=_rank, args=(r, backend, port, numel, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=180)
    for p in procs:
        p.join(60)
    if not res["equal"]:
        raise AssertionError(f"{backend} broadcast: received bytes differ from the sent ones")
    return {"backend": backend, "mbytes": round(numel * 2 / 1e6, 1), **res}


def train(dev: str) -> dict:
    import minirl
    from minirl.metrics import read_log
    from minirl.models import build_tiny_model
    tmp = Path(tempfile.mkdtemp(prefix="minirl-gpucheck-"))
    model = build_tiny_model(tmp / "tiny")
    rows = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(10) for b in range(10)]
    kw = dict(train_devices="cuda:0", dtype="bfloat16") if dev == "cuda" else dict(dtype="float32")
    cfg = minirl.Config(model=str(model), backend="hf", steps=4, prompts_per_step=4, group_size=4, max_tokens=8,
                        max_async_steps=1, eval_size=0, eval_fraction=0.0, checkpoint_every=0, reward_workers=0,
                        out_dir=str(tmp / "run"), rewards=["arithmetic_correct"], **kw)
    t = time.perf_counter()
    summary = minirl.Run(cfg, data=rows).start().wait()
    wall = time.perf_counter() - t
    steps = [e for e in read_log(tmp / "run" / "metrics.jsonl") if e.get("event") == "step"]
    losses = [e["loss"] for e in steps if "loss" in e]  # a step whose groups all had zero advantage trains nothing
    if len(steps) != 4 or not losses or not all(isinstance(x, float) and math.isfinite(x) for x in losses):
        raise AssertionError(f"want 4 steps with finite losses, got {len(steps)} steps, losses {losses}")
    if not (tmp / "run" / "adapter" / "adapter_config.json").exists():
        raise AssertionError("no adapter saved")
    shutil.rmtree(tmp, ignore_errors=True)
    return {"steps": len(steps), "wall_s": round(wall, 1), "losses": [round(x, 4) for x in losses],
            "dtype": kw["dtype"], "summary_keys": sorted(summary)[:8]}


def vllm(dev: str) -> dict:
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed here"}
    some = [] if dev == "cuda" else ["-k", "engine_errors"]  # the twin: one test shows the wiring (CI runs them all)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "vllm", "tests/test_vllm.py", *some],
                       capture_output=True, text=True, timeout=420)
    tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-300:]
    if p.returncode != 0:
        raise AssertionError(tail)
    return {"pytest": tail}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-twin", action="store_true", help="run the CPU twins (shared memory, gloo, float32)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--only", default="env,ipc,collective,train,vllm")
    args = ap.parse_args()
    import torch
    dev = "cpu" if args.cpu_twin or not torch.cuda.is_available() else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, failed = {}, []
    for name in args.only.split(","):
        t = time.perf_counter()
        try:
            res = {"ok": True, **globals()[name](dev)}
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

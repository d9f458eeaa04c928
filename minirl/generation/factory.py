"""The choice a run makes: which generator serves it, and which `WeightSync` carries the adapter to it
(`make_generator`); the backend `auto` picks (`pick_backend`) and how generation devices are split."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from minirl.config import Config, parse_cores
from minirl.core.adapter import adapter_params
from minirl.generation.hf import HFGenerator
from minirl.generation.hf_process import ProcGenerator
from minirl.generation.server_proc import ServerOptions
from minirl.generation.vllm import VLLMGenerator, loads_bitsandbytes
from minirl.generation.vllm_server import ServerGenerator
from minirl.sync.base import WeightSync
from minirl.sync.factory import make_sync, refuse_unchecked_inflight
from minirl.sync.local import SharedSync, ShmSync
from minirl.sync.servers import ServerSync
from minirl.training.plan import resolve_engine_share
from minirl.training.plan_reward import reward_gb_on
from minirl.types import Generator, PolicyTrainer

QLORA_UNQUANTIZED = (
    "minirl: qlora: {engine} cannot load the base in bitsandbytes 4-bit: the engine samples from the 16-bit base "
    "while the trainer trains LoRA on its NF4 base (measured on the embedded model: 0.48 nats per token apart, "
    "BENCHMARKS.md 'QLoRA behaviour policy'); truncated importance sampling corrects for it, and the sync check "
    "(verify_sync), which compares the engine's logprobs with the trainer's, is off for this run: the gap is over "
    "its bound by design. backend: hf samples from the trainer's own 4-bit model (no gap)")


def vllm_available() -> bool:
    """True when vllm can be imported (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def pick_backend(backend: str, cuda: bool, four_bit: bool = False, vllm: bool | None = None) -> tuple[str, str]:
    """(backend, why). 'auto' is vLLM on GPUs. On CPU it is transformers, on the ground that vLLM-CPU serving a
    LoRA adapter is slower than transformers `generate` (its CPU LoRA kernels copy the adapter weights for every
    token). The measurement behind it, side by side on the demo's step (8 prompts x 8 samples x 24 tokens, the
    embedded model, float32; vLLM with the adapter pushed as a run pushes it, transformers on the trainer's own
    model as the synchronous loop runs it): `minirl bench generation --out DIR`, `vllm_vs_hf` in
    DIR/generation.json (`vllm_vs_hf.vllm_vs_hf`: vLLM's tokens/s over transformers'). backend='vllm' forces it.
    QLoRA (`four_bit`) on a GPU is vLLM only where it loads the base in NF4 as the trainer does (`engine_gap`);
    else transformers, whose generator samples from the trainer's own 4-bit model. `vllm`: whether vLLM is
    installed (None: looked up here; a plan for another machine says)."""
    vllm = vllm_available() if vllm is None else vllm
    if backend != "auto":
        if backend == "vllm" and not vllm:
            raise RuntimeError("backend='vllm' but vllm is not installed: `bash install.sh cpu` (CPU) or "
                               "`bash install.sh gpu` (GPU), or use backend='hf'")
        return backend, f"backend={backend!r}"
    if not vllm:
        return "hf", "vllm is not installed"
    if not cuda:
        return "hf", "on CPU, vLLM's LoRA path is slower than transformers (set backend='vllm' to use it)"
    if four_bit and not (vllm_available() and loads_bitsandbytes()):  # a faked machine: the pinned vLLM has none
        return "hf", ("load_in_4bit: this vLLM cannot load the base in NF4, so it would sample from the 16-bit base; "
                      "the transformers generator samples from the trainer's own 4-bit model (backend='vllm' "
                      "forces vLLM)")
    return "vllm", "vllm is installed and a GPU is present"


def engine_gap(cfg: Config, backend: str) -> str | None:
    """The line a QLoRA run prints before loading when its vLLM engine (or servers) will sample from the 16-bit base
    (`QLORA_UNQUANTIZED`; such a run's sync check is off), None when the engine holds what the trainer trains."""
    if not cfg.load_in_4bit or backend not in ("vllm", "vllm-server"):
        return None
    if backend == "vllm" and loads_bitsandbytes():
        return None
    engine = "a vLLM server" if backend == "vllm-server" else "this vLLM (vLLM-CPU, or a release without bitsandbytes)"
    return QLORA_UNQUANTIZED.format(engine=engine)


def make_generator(cfg: Config, trainer: PolicyTrainer, backend: str, asynchronous: bool,
                   gen_devices: str | None, sleep_mode: bool = False,
                   hf_slots: int | None = None) -> tuple[Generator, WeightSync, str]:
    """(generator, sync, why) for a run: vLLM with the configured transport; the transformers generator in a
    process of its own when generation runs ahead of training (`asynchronous`); else the trainer's own model.
    `gen_devices`: on CPU the cores generation is pinned to ('0', '0-3', '0,2'), on GPU the GPU ids it may use
    ('1', '0,1'); None: no constraint. `sleep_mode`: the vLLM engine can sleep while the trainer shares its GPU.
    `hf_slots`: the transformers generator's static-path cache slots (the memory plan's `RunPlan.hf_slots`)."""
    on_gpu = trainer.device.startswith("cuda")
    if backend == "vllm-server":
        return _server_generator(cfg, trainer, gen_devices, on_gpu)
    if backend == "vllm":
        refuse_unchecked_inflight(cfg.inflight == "inflight")  # before the engine loads the model
        dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
        share = resolve_engine_share(cfg, trainer.device, gen_devices, sleep_mode, reward_gb_on(cfg, trainer.device)) \
            if on_gpu else 0.0
        # QLoRA: the engine samples from the same 4-bit base where this vLLM can load one (else `engine_gap`)
        quant = "bitsandbytes" if cfg.load_in_4bit and loads_bitsandbytes() else None
        gen = VLLMGenerator(trainer.model_path, max_lora_rank=cfg.lora_rank, seed=cfg.seed, dtype=dtype,
                            cpu_cores=None if on_gpu else gen_devices, device_ids=gen_devices if on_gpu else None,
                            kv_cache_gb=cfg.kv_cache_gb, gpu_memory_utilization=share,
                            max_model_len=cfg.max_model_len, inflight=cfg.inflight, sleep_mode=sleep_mode,
                            quantization=quant)
        try:
            sync, why = make_sync(cfg.sync_transport, gen, trainer.device, inflight=cfg.inflight == "inflight")
        except BaseException:  # a failed transport (or a Ctrl-C / SIGTERM here) must not leave the engine running
            gen.close()
            raise
        print(f"minirl: adapter sync {sync.transport}: {why}", flush=True)  # the transport, why, the engine's hooks
        return gen, sync, why
    if asynchronous:  # its own model in its own process: no GIL shared with the trainer
        cores = parse_cores(gen_devices) if gen_devices and not on_gpu else None
        device = f"cuda:{gen_devices.split(',')[0]}" if gen_devices and on_gpu else trainer.device
        gen = ProcGenerator(cfg, adapter_params(trainer.model), cores=cores, device=device, slots=hf_slots)
        return gen, ShmSync(), "transformers generator process: the adapter goes through one shared-memory buffer"
    gen = HFGenerator(trainer.model, trainer.tokenizer, lambda: trainer.version, decode_mode=cfg.hf_decode,
                      slots=hf_slots)
    return gen, SharedSync(), "synchronous transformers loop: the generator uses the trainer's own model"


def split_devices(spec: str | None, n: int, on_gpu: bool) -> list[str]:
    """Where each of `n` servers runs: on GPU one id each from `spec` ('0,1'; None: every GPU), round robin; on
    CPU an equal share of the cores in `spec` ('0-3'; None: every core this process may use), or, with fewer
    cores than servers, one core each, round robin."""
    if on_gpu:
        ids = spec.split(",") if spec else [str(i) for i in range(torch.cuda.device_count())]
        return [ids[i % len(ids)] for i in range(n)]
    cores = parse_cores(spec) if spec else sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        return [str(cores[i % len(cores)]) for i in range(n)]
    per = len(cores) // n
    return [",".join(map(str, cores[i * per:(i + 1) * per])) for i in range(n)]


def _server_generator(cfg: Config, trainer: PolicyTrainer, gen_devices: str | None,
                      on_gpu: bool) -> tuple[Generator, WeightSync, str]:
    """(ServerGenerator, ServerSync, why): the servers minirl starts (`num_servers`, pinned by `split_devices`),
    or yours (`server_urls`, key from VLLM_API_KEY)."""
    dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    common = dict(restart=cfg.restart_servers, timeout_s=cfg.server_timeout_s, dtype=dtype,
                  log_dir=str(Path(cfg.out_dir) / "servers"))
    if cfg.server_urls:
        root = cfg.adapter_dir or str(Path(cfg.out_dir).resolve() / "server_adapters")
        gen = ServerGenerator(cfg.server_urls, api_key=os.environ.get("VLLM_API_KEY"), **common)
        why = f"{len(cfg.server_urls)} vLLM server(s) at server_urls; adapters written to {root}"
        return gen, ServerSync(root), why
    if not vllm_available():
        raise RuntimeError("backend='vllm-server' starts vLLM servers, but vllm is not installed here: `bash "
                           "install.sh cpu` (CPU) or `bash install.sh gpu` (GPU), or give server_urls")
    places = split_devices(gen_devices, cfg.num_servers, on_gpu)
    launch = [ServerOptions(trainer.model_path, dtype=dtype, max_model_len=cfg.max_model_len,
                            max_lora_rank=cfg.lora_rank, max_loras=cfg.max_async_steps + 2, seed=cfg.seed,
                            on_cpu=not on_gpu, cores=None if on_gpu else p, gpus=p if on_gpu else None,
                            kv_cache_gb=cfg.kv_cache_gb, extra_args=tuple(cfg.server_args),
                            gpu_memory_utilization=resolve_engine_share(cfg, trainer.device, p, False, reward_gb_on(
                                cfg, trainer.device)) if on_gpu else 0.3) for p in places]
    gen = ServerGenerator(launch=launch, **common)
    where = "GPUs" if on_gpu else "cores"
    why = f"{cfg.num_servers} vLLM server(s) started by minirl on {where} {places}; adapters through files"
    return gen, ServerSync(cfg.adapter_dir), why

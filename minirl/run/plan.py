"""The run's memory plan: each device planned for what the placement puts on it, before anything loads.

    minirl plan CONFIG [--gpus N] [--gpu-gb G]      minirl.plan(cfg, gpu_gb=None, gpus=None)

`plan_run(cfg, devices, placement)` is the one function: `Run` checks its result before loading (`check_run_plan`)
and gives the trainer its token budget; `minirl plan` prints it for this machine or for faked device facts. The
placement (`placement.place`, from the config and the `Devices`) says what each device holds (`holdings`):

  CPU         the trainer and the generator (a vLLM-CPU engine, or transformers), held against the machine's RAM.
  1 GPU       the trainer and a vLLM engine that sleeps while the trainer works (K = 0): the trainer's phase without
              the engine, the engine's share when it generates, and the sleep/wake traffic.
  2+ GPUs     the trainer's GPU and each engine's GPU apart: an engine on a GPU of its own takes its share (0.9 for
              'auto', or `gpu_memory_utilization` as given), judged on that GPU; on 3+ GPUs with `backend: auto`, a
              vLLM server on each GPU the trainer leaves; a GPU nothing is placed on is idle.

The trainer's GPU picks the token budget, gradient checkpointing and 4-bit (`training.plan.plan_shape`); the other
devices are planned with those choices. A reward model (`reward_model(path=..., device=...)` in `rewards`) is a part
of the device it names, each copy counted (`training.plan_reward`): a device nothing else uses is planned for it
alone, one this machine lacks is a problem; so is a CPU copy a reward worker's `reward_memory_mb` cannot hold. A
local LLM judge (`judge(..., local=...)`) is counted as a reward model on the CPU (`training.plan_judge`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
from huggingface_hub import try_to_load_from_cache

from minirl.config import Config, ConfigError
from minirl.generation.factory import split_devices
from minirl.run.placement import Devices, Placement, device_facts, place
from minirl.training.models import EMBEDDED, ModelNotCached, config_json
from minirl.training.plan import HEADROOM, OWN_GPU_SHARE, GiB, Holds, MemoryPlan, Shape, model_config, plan_shape
from minirl.training.plan_reward import reward_model_loads
from minirl.training.shapes.synthetic import SHIPPED, published_shape, shape_config


@dataclass(frozen=True)
class RunPlan:
    """The plan of each device a run uses, in order (the CPU, or GPU 0, 1, ...), and the placement it follows."""
    placement: Placement
    devices: tuple[MemoryPlan, ...]
    beside: "RunPlan | None" = None  # on GPUs: the other generator's plan (the hf path beside vLLM's, or vLLM's)
    missing: tuple[str, ...] = ()  # what cannot be planned, one line each: a reward model on a device not here
    asked_4bit: bool = False  # the config's own load_in_4bit (the trainer's plan may pick 4-bit where it is off)

    @property
    def trainer(self) -> MemoryPlan:
        """The plan of the trainer's device (its token budget, checkpointing and 4-bit are the run's)."""
        return next(p for p in self.devices if p.device == self.placement.train_device)

    @property
    def hf_slots(self) -> int | None:
        """The cache slots the plan sized for the transformers generator's static path (None: not that path)."""
        return next((p.hf_slots for p in self.devices if p.hf_slots), None)

    @property
    def token_budget(self) -> int:
        return self.trainer.token_budget

    @property
    def fits(self) -> bool | None:
        verdicts = [p.fits for p in self.devices] + [False] * bool(self.missing or self.needs_4bit)
        return False if False in verdicts else None if None in verdicts else True

    def line(self) -> str:
        """One line a device, for the devices in use (an idle GPU only in the table)."""
        return "\n".join(p.line() for p in self.devices if p.role != "idle")

    def table(self) -> str:
        """The placement line, then each device's parts; then the other generator's plan, where both are options."""
        out = [self.placement.line(), *(p.table() for p in self.devices),
               *(f"problem: {m}" for m in [*self.missing, *self._four_bit()])]
        if self.beside is not None:
            b = self.beside.placement
            what = f"backend: hf, hf_decode: {self.beside.hf_slots and 'static' or 'loop'}" \
                if b.backend == "hf" else f"backend: {b.backend}"
            out += ["", f"beside it, the same run with {what}, max_async_steps: auto:", self.beside.table()]
        return "\n".join(out)

    @property
    def needs_4bit(self) -> bool:
        """The trainer's device fits only with the base in 4-bit, which the config does not ask for."""
        return self.trainer.load_in_4bit and not self.asked_4bit

    def problems(self) -> list[str]:
        """One line for each device whose plan does not fit, naming the figures and the ways out."""
        return [*self.missing, *self._four_bit(), *(_problem(p) for p in self.devices if p.fits is False)]

    def _four_bit(self) -> list[str]:
        t = self.trainer
        return [f"the memory plan fits {t.device} ({t.memory_gb:.1f} GB) only with the base in 4-bit (peak "
                f"{t.peak_gb:.1f} GiB), which the run does not load: set load_in_4bit: true (QLoRA), or use a smaller "
                "model (`minirl plan CONFIG` shows the parts)"] if self.needs_4bit and t.fits else []


RM_WAYS = ("set reward_workers: 0 (one copy, in the run's process), give reward_model(...) a smaller batch_size, "
           "or another device (device='cpu' or a GPU with room)")


def _problem(p: MemoryPlan) -> str:
    where = f"{p.device} ({p.role})"
    rm = p.train.get("reward model", 0.0)
    if p.short and rm:
        return (f"the memory plan does not fit on {where}: {p.short}; the reward model takes {rm:.1f} GiB of the GPU "
                f"(a copy per reward worker): {RM_WAYS}")
    if p.short and p.role.startswith("trainer"):  # the engine gets what the trainer leaves of the GPU
        return (f"the memory plan does not fit on {where}: {p.short}; use backend: hf (the trainer's own model "
                "generates), a smaller model, or give the engine a GPU of its own (`minirl plan CONFIG` shows the "
                "parts)")
    if p.short:
        return (f"the memory plan does not fit on {where}: {p.short}; raise gpu_memory_utilization (at most "
                f"{HEADROOM}; 'auto' is {OWN_GPU_SHARE}) or use a smaller model (`minirl plan CONFIG` shows the parts)")
    head = (f"the memory plan does not fit: peak {p.peak_gb:.1f} GiB > {HEADROOM:.0%} of {p.memory_gb:.1f} GB on "
            f"{where} (training {p.train_gb:.1f}, generation {p.generate_gb:.1f}); ")
    if rm and (p.peak_gb - rm) * GiB <= HEADROOM * p.memory_gb * 1e9:  # it fits without the reward model
        return head + (f"the reward model takes {rm:.1f} GiB of it (a copy per reward worker): {RM_WAYS}" +
                       (f", or lower gpu_memory_utilization={p.gpu_memory_utilization}"
                        if p.gpu_memory_utilization else ""))
    if p.gpu_memory_utilization and p.role.startswith("trainer"):
        return head + (f"gpu_memory_utilization={p.gpu_memory_utilization} is the engine's share of the GPU the "
                       "trainer holds too: leave it 'auto' (the memory free once the trainer loaded), lower it, or "
                       "give the engine a GPU of its own")
    if p.gpu_memory_utilization:
        return head + f"lower gpu_memory_utilization={p.gpu_memory_utilization} (at most {HEADROOM})"
    return head + ("lower prompts_per_step/group_size/max_tokens, set load_in_4bit: true, or use a smaller model "
                   "(`minirl plan CONFIG` shows the parts)")


def holdings(cfg: Config, p: Placement) -> list[tuple[str, Holds]]:
    """(device, what it holds) for each device of placement `p`: the trainer's, each vLLM engine's or server's
    (one engine runs on the first of its GPU ids; servers are spread as `factory.split_devices` spreads them), the
    transformers generator's (on the trainer's model when synchronous, else in a process of its own)."""
    if p.backend == "vllm-server":  # your servers (server_urls) are on no device of this machine's plan
        n = p.num_servers or cfg.num_servers
        gen, ids = "vllm-server", [] if cfg.server_urls else split_devices(p.gen_devices, n, p.cuda_devices > 0)
    elif p.backend == "vllm":
        gen, ids = "vllm", [(p.gen_devices or "0").split(",")[0]]
    elif p.max_async_steps:
        gen, ids = "hf-process", [(p.gen_devices or "0").split(",")[0]]
    else:
        gen, ids = "hf", [p.train_device.removeprefix("cuda:")]
    if not p.cuda_devices:
        return [("cpu", Holds(True, None if p.your_servers else gen, max(len(ids), 1)))]
    out = []
    for i in range(p.cuda_devices):
        here, n = f"cuda:{i}" == p.train_device, ids.count(str(i))
        out.append((f"cuda:{i}", Holds(here, gen if n else None, max(n, 1), p.engine_sleeps and here and n > 0)))
    return out


def plan_run(cfg: Config, devices: Devices, placement: Placement | None = None,
             gradient_checkpointing: bool | None = None, prompt_tokens: int | None = None,
             beside: bool = True, shape: Shape | None = None) -> RunPlan:
    """The run's plan on `devices`, placed as `placement` (default: `place(cfg, devices)`): the trainer's device
    first (it picks the token budget, checkpointing and 4-bit), then every other device with those choices.
    `beside`, on GPUs: with the plan of the other generator (`other_generator`) where both are options. `shape`:
    the model's (default: from its config.json)."""
    placement = placement or place_run(cfg, devices)
    shape = shape or Shape.from_config(model_config(cfg))
    held = holdings(cfg, placement)
    train = next(d for d, h in held if h.trainer)
    loads, missing = reward_model_loads(cfg, train, prompt_tokens or min(cfg.max_prompt_tokens, 256))
    for device in loads:
        if device in dict(held):
            continue
        if device == "cpu" or (device.startswith("cuda:") and device[5:].isdigit() and int(device[5:]) < devices.count):
            held.append((device, Holds(False, None)))
        else:
            missing.append(f"a reward model is placed on {device!r}, which this machine does not have ("
                           f"{devices.count} GPUs): give reward_model(...) device='cpu'" +
                           (f" or one of cuda:0..cuda:{devices.count - 1}" if devices.count else ""))
    held = [(d, replace(h, reward_gb=loads[d].gb) if d in loads else h) for d, h in held]

    def memory(device: str) -> float | None:
        if device == "cpu":
            return devices.cpu_gb or psutil.virtual_memory().total / 1e9
        return devices.gb(int(device.split(":")[1]))

    plans = {train: plan_shape(cfg, shape, train, memory(train), gradient_checkpointing, dict(held)[train],
                               prompt_tokens)}
    t = plans[train]
    chosen = cfg.replace(token_budget=t.token_budget, load_in_4bit=t.load_in_4bit)
    for device, holds in held:
        if device != train:
            plans[device] = plan_shape(chosen, shape, device, memory(device), t.gradient_checkpointing, holds,
                                       prompt_tokens)
    other = other_generator(cfg, placement, devices) if beside and placement.cuda_devices else None
    alt = other and plan_run(other, devices, None, gradient_checkpointing, prompt_tokens, beside=False, shape=shape)
    plans = {d: replace(p, notes=p.notes + loads[d].notes) if d in loads else p for d, p in plans.items()}
    return RunPlan(placement, tuple(plans[d] for d, _ in held), alt, tuple(missing), bool(cfg.load_in_4bit))


def place_run(cfg: Config, devices: Devices) -> Placement:
    """`place`, then on a CPU: where `auto` gave K = 1 (a second copy of the model, the generator process's) and the
    plan says the machine's memory holds the synchronous loop's one copy but not two, K = 0, saying why. Only with
    the model's config.json at hand (no network here): otherwise K = 1 stays, and the run's own plan warns."""
    p = place(cfg, devices)
    if devices.count or not p.max_async_steps or cfg.max_async_steps != "auto" or (shape := _local_shape(cfg)) is None:
        return p
    two = plan_run(cfg, devices, p, beside=False, shape=shape)
    if two.fits is not False:
        return p
    sync = place(cfg.replace(max_async_steps=0), devices)
    if plan_run(cfg, devices, sync, beside=False, shape=shape).fits is False:
        return p
    cpu = two.devices[0]
    why = (f"auto: a generator process's second copy of the model would not fit (peak {cpu.peak_gb:.1f} GiB on "
           f"{cpu.memory_gb:.1f} GB): the synchronous loop, one copy")
    return replace(sync, async_why=why)


def other_generator(cfg: Config, placement: Placement, devices: Devices) -> Config | None:
    """The config with the other generator, where both run on these GPUs: the transformers generator on the static
    path (`hf_decode: static` unless 'loop' is set) for a vLLM run, vLLM (where installed) for a transformers run,
    K as `max_async_steps: auto` picks it for that generator; None where the other is no option (a config only one
    allows)."""
    if placement.backend in ("vllm", "vllm-server"):
        other = dict(backend="hf", hf_decode="loop" if cfg.hf_decode == "loop" else "static", server_urls=[])
    elif devices.vllm:
        other = dict(backend="vllm")
    else:
        return None
    try:
        return cfg.replace(**other, max_async_steps="auto")
    except (ConfigError, ValueError):
        return None


def check_run_plan(cfg: Config, devices: Devices, placement: Placement) -> RunPlan:
    """Before loading: on GPUs a plan with a device that cannot fit stops the run here (one line a device); on
    CPU it warns (on stderr), unless a reward model's device is a GPU or not here. The plan's lines are the run's
    to print (`Run` prints them at start)."""
    p = plan_run(cfg, devices, placement, beside=False)
    if problems := p.problems():
        if placement.cuda_devices or p.missing or any(d.fits is False and d.device != "cpu" for d in p.devices):
            raise ConfigError("\n".join(problems))
        print("\n".join("minirl: warning: " + x for x in problems), file=sys.stderr, flush=True)
    return p


def plan(cfg: Config, gpu_gb: float | None = None, gpus: int | None = None,
         gradient_checkpointing: bool | None = None, prompt_tokens: int | None = None) -> RunPlan:
    """The run's plan of `cfg` (`minirl.plan`, `minirl plan`): on this machine, or on `gpus` GPUs of `gpu_gb` GB
    each (either alone: the other from this machine, one GPU where it has none; a GPU box is assumed to have vLLM,
    as `bash install.sh gpu` installs it). `gpus=0`: the CPU. A Hub id that is not cached, with the Hub out of
    reach, is planned with the shape minirl ships for it, where it ships one (`published_shape`), saying so."""
    if (gpus is not None and gpus < 0) or (gpu_gb is not None and gpu_gb <= 0):
        raise ConfigError(f"plan for gpus={gpus}, gpu_gb={gpu_gb}: give 0 GPUs or more (0: the CPU), of more than "
                          "0 GB each (`minirl plan CONFIG --gpus 2 --gpu-gb 24`)")
    devices = device_facts()
    if gpus is not None or gpu_gb is not None:
        n = (devices.count or 1) if gpus is None else gpus
        gb = gpu_gb if gpu_gb is not None else devices.gb(0)
        devices = Devices.fake(n, gb, devices.capability, vllm=True if n else devices.vllm)
    return plan_run(cfg, devices, gradient_checkpointing=gradient_checkpointing, prompt_tokens=prompt_tokens,
                    shape=_shape(cfg))


def _local_shape(cfg: Config) -> Shape | None:
    """The model's shape where its config.json is here (the embedded model, a folder, a cached Hub id), else None."""
    name = cfg.model
    try:
        if name == EMBEDDED or Path(name).expanduser().is_dir():
            return Shape.from_config(model_config(cfg))
        cached = try_to_load_from_cache(name, "config.json") if name.count("/") == 1 else None
        return Shape.from_config(config_json(str(Path(cached).parent))) if isinstance(cached, str) else None
    except (ValueError, OSError):  # no config.json, a malformed id: the run says so where it loads the model
        return None


def _shape(cfg: Config) -> Shape:
    """The model's shape from its config.json, as a run reads it, or the shipped shape of an uncached Hub id."""
    model = cfg.model
    try:
        return Shape.from_config(model_config(cfg))
    except ModelNotCached as e:
        if (name := published_shape(model)) is None:
            raise ModelNotCached(f"{e}; offline, `minirl plan` knows the Hub ids of the shapes it ships: "
                                 f"{', '.join(SHIPPED)} (and their -Instruct)") from None
    print(f"minirl: plan: {model!r} is not in the local Hugging Face cache and the Hub cannot be reached; planned "
          f"with the shape of {name} that minirl ships (its config.json's sizes)", file=sys.stderr, flush=True)
    return Shape.from_config(shape_config(name))

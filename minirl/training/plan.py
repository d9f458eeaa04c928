"""A memory plan before loading: from the model's `config.json` alone (no weights), the parts of peak memory of one
device for what it holds (`Holds`; the run maps its placement to each device's holdings: `minirl.run.plan`).

Parts (GiB): base weights (dtype, or NF4 for the linear layers with double-quantized scales), LoRA + AdamW (fp32
parameters, gradients and two moments: 16 bytes a LoRA parameter), activations of the largest micro-batch with or
without gradient checkpointing, the lm_head logits of one chunk (`batch.LOGIT_CHUNK` completion tokens; float32),
and the generator: vLLM's share of its GPU (its weights, overhead and the KV cache the rest leaves), or the
transformers generator's KV cache (`plan_hf`: one step's sequences, or the static path's slots and CUDA graphs). The
training phase and the generation phase peak apart; the device's peak is the larger. Where the engine sleeps, the
sleep/wake cost is its weights moved to the host and back per step. A reward model: `plan_reward`, in both.

The micro-batch is what one step holds, cut at `token_budget` (`micro_batch`): with 'shared-prefix' packing one row
of whole groups, each prompt once, plus its tokens x tokens attention mask; with 'padded' whole rows. Per decoder
layer and token, autograd keeps what `Shape.layer_activation_bytes` lists (a census of the saved tensors,
`scripts/activation_census.py`); with checkpointing a layer keeps only its input, and one layer's full set lives
during its recompute. On CPU resident memory follows these live bytes with `cpu_compact_memory: true` (the trainer
fixes glibc's mmap threshold, `trainer.fix_malloc_threshold`); by default, for speed, glibc's heap may keep up to
~2x them. The calibration test (tests/test_plan_calibration.py) checks the predicted increase of the training peak
between token budgets and completion lengths against recorded `minirl bench memory` rows.

Assumptions stated plainly: prompts of min(max_prompt_tokens, 256) tokens; every completion max_tokens long; a vLLM
engine takes its whole share (`gpu_memory_utilization`) and fails to start when that share cannot hold its weights,
overhead and one sequence's KV cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from minirl.config import Config, ConfigError
from minirl.training.batch import LOGIT_CHUNK
from minirl.training.models import config_json, resolve_model
from minirl.training.plan_hf import hf_generator_parts

GiB = 2**30
BUDGETS = (512, 1024, 2048, 4096, 8192)  # past 8192 tokens a micro-batch gains little on a GPU
CPU_BUDGET = 512  # on CPU smaller micro-batches cost no time and much less memory (BENCHMARKS.md, "Memory")
CUDA_CONTEXT_GB = 1.0  # the CUDA context, cuBLAS workspaces and the allocator's slack (not measured on a GPU yet)
ENGINE_OVERHEAD_GB = 1.5  # vLLM's activations, CUDA graphs and sampler beside weights + KV cache (vLLM's profile)
HOST_LINK_GBPS = 20.0  # host <-> GPU copy rate assumed for sleep/wake (PCIe 4 x16, pinned memory)
# vLLM 0.32's sleep level 1 also offloads its runtime and CUDA-graph pools and remaps the KV cache on wake: a cycle
# cost beyond the weights' copy, fitted (line through two points) to upstream's 1.4 s at 0.6B, 12.8 s at 8B
# (vllm#48337) less their copy at HOST_LINK_GBPS; not measured here (each step logs time/sleep_s, time/wake_s)
SLEEP_CYCLE_S, SLEEP_CYCLE_S_PER_B = 0.48, 1.34
HEADROOM = 0.92  # a plan fits when its peak is under this share of the memory


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer as its config.json describes it."""
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, c: dict) -> "Shape":
        c = c.get("text_config", c)
        try:
            heads = c["num_attention_heads"]
            return cls(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], heads,
                       c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads,
                       bool(c.get("tie_word_embeddings", False)),
                       c.get("model_type") in ("qwen2", "qwen2_moe") or bool(c.get("attention_bias", False)))
        except KeyError as e:
            raise ConfigError(f"config.json has no {e.args[0]!r}: the memory plan reads decoder-only transformer "
                              "configs (Llama, Qwen2, Mistral and alike)") from None

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer: q, k, v, o, gate, up, down."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.linears())

    def params(self) -> int:
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        per_layer = bias + 2 * self.hidden  # + the two norms
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.linear_params() + self.layers * per_layer + embed + self.hidden

    def lora_params(self, rank: int) -> int:
        """LoRA on every linear layer of the decoder ('all-linear' leaves out the lm_head)."""
        return self.layers * sum(rank * (a + b) for a, b in self.linears())

    def layer_activation_bytes(self, b: int, rank: int) -> int:
        """Bytes autograd keeps for one token of one decoder layer, weights of `b` bytes, LoRA of rank `rank` on its
        seven linear layers (no LoRA dropout), attention through SDPA with a mask (each layer's count, from a census
        of the saved tensors of the embedded model, `scripts/activation_census.py`): the layer's input and the
        residual after attention; each RMSNorm's output, and in 16 bits the float32 copy of its input (float32
        weights: the input itself); q after RoPE, k and v repeated to every head (a mask makes transformers repeat
        them), the attention output (the o_proj input); gate, up, silu(gate) and their product; each LoRA's
        rank-wide intermediate; the norms' float32 rsqrt and the attention's float32 logsumexp."""
        h, q, i = self.hidden, self.heads * self.head_dim, self.intermediate
        kept = b * (4 * h + 4 * q + 4 * i + 7 * rank)
        upcast = 2 * 4 * h if b < 4 else 0
        return kept + upcast + 4 * (2 + self.heads)

    def kv_bytes_per_token(self, b: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * b


def model_config(cfg: Config) -> dict:
    """The model's config.json, without loading weights (a Hub id: only that file is fetched)."""
    return config_json(resolve_model(cfg.model))


@dataclass(frozen=True)
class Holds:
    """What one device holds, as the run's placement puts it there (`minirl.run.plan` maps a placement to it): the
    trainer or not, and the generator on it: 'vllm' (`engines` vLLM engines or servers, each taking its share of
    the GPU), 'hf' (the transformers generator on the trainer's own model), 'hf-process' (the transformers
    generator in a process of its own, with its own copy of the model) or None; 'vllm-server' counts as 'vllm'.
    `sleeps`: the vLLM engine sleeps while the trainer works (it shares the trainer's GPU with K = 0). `reward_gb`:
    GiB of the reward models' copies on it (`plan_reward`), there in both phases."""
    trainer: bool = True
    generator: str | None = None
    engines: int = 1
    sleeps: bool = False
    reward_gb: float = 0.0

    def role(self) -> str:
        gen = {"vllm": "vLLM engine" if self.engines == 1 else f"{self.engines} vLLM engines",
               "vllm-server": "vLLM server" if self.engines == 1 else f"{self.engines} vLLM servers",
               "hf": "transformers generator", "hf-process": "transformers generator process"}.get(self.generator)
        gen = gen and gen + (" asleep while training" if self.sleeps else "")
        rm = ["reward model"] if self.reward_gb else []
        return " + ".join([*(["trainer"] if self.trainer else []), *([gen] if gen else []), *rm]) or "idle"


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of one device (a GPU or the CPU) for what it holds."""
    model: str
    device: str  # 'cuda:N' or 'cpu'
    memory_gb: float | None  # the GPU's (or, on CPU, the machine's) memory the plan is held against, in GB (1e9)
    params_b: float  # billions
    role: str  # what the device holds (`Holds.role`)
    token_budget: int
    gradient_checkpointing: bool
    gpu_memory_utilization: float | None  # vLLM's share picked (None: no vLLM engine on this GPU)
    load_in_4bit: bool
    train: dict[str, float] = field(default_factory=dict)  # GiB of each part during training
    generate: dict[str, float] = field(default_factory=dict)  # GiB of each part during generation
    sleep_wake_gb: float = 0.0
    sleep_wake_s: float = 0.0
    notes: tuple[str, ...] = ()
    short: str = ""  # why it cannot run although its peak fits (an engine's share too small), one line
    hf_slots: int = 0  # the transformers generator's static-path cache slots (0: not that path; `plan_hf`)

    @property
    def train_gb(self) -> float:
        return sum(self.train.values())

    @property
    def generate_gb(self) -> float:
        return sum(self.generate.values())

    @property
    def peak_gb(self) -> float:
        return max(self.train_gb, self.generate_gb)

    @property
    def fits(self) -> bool | None:
        if self.memory_gb is None:
            return None
        return self.peak_gb * GiB <= HEADROOM * self.memory_gb * 1e9 and not self.short

    def line(self) -> str:
        where = f"{self.memory_gb:.1f} GB" if self.memory_gb else "unknown memory"
        verdict = {True: "fits", False: "does NOT fit", None: "not checked"}[self.fits]
        share = f"gpu_memory_utilization={self.gpu_memory_utilization}" if self.gpu_memory_utilization else ""
        head = f"minirl: plan: {self.device} {where} ({self.role}): peak {self.peak_gb:.1f} GiB, {verdict}"
        if self.role == "idle":
            return f"minirl: plan: {self.device} {where}: idle, nothing is placed on it"
        if not self.role.startswith("trainer"):
            return head + (f"; {share}" if share else "")
        return (f"{head}; {self.model} ({self.params_b:.2f}B), token_budget={self.token_budget}, gradient_"
                f"checkpointing={str(self.gradient_checkpointing).lower()}, load_in_4bit="
                f"{str(self.load_in_4bit).lower()}" + (f", {share}" if share else ""))

    def table(self) -> str:
        if not self.train and not self.generate:
            return self.line()
        rows = [("part", "train GiB", "generate GiB")]
        for k in dict.fromkeys([*self.train, *self.generate]):
            rows.append((k, *("" if x is None else f"{x:.2f}" for x in (self.train.get(k), self.generate.get(k)))))
        rows.append(("peak", f"{self.train_gb:.2f}", f"{self.generate_gb:.2f}"))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        out = [f"{a:<{w[0]}}  {b:>{w[1]}}  {c:>{w[2]}}".rstrip() for a, b, c in rows]
        if self.sleep_wake_gb:
            out.append(f"sleep/wake: {self.sleep_wake_gb:.2f} GiB moved per step, ~{self.sleep_wake_s:.1f} s (copies "
                       f"at {HOST_LINK_GBPS:g} GB/s + vLLM's pools and KV remap, vllm#48337)")
        return "\n".join([self.line(), *out, *(f"note: {n}" for n in (*self.notes, *[self.short][:bool(self.short)]))])


def micro_batch(cfg: Config, budget: int, prompt: int) -> tuple[int, int, int]:
    """(tokens, completion tokens, attention length) of the largest micro-batch the trainer cuts from one step of
    `cfg` at `budget` tokens, every completion `max_tokens` long and every prompt `prompt` tokens: no more than the
    step holds. 'shared-prefix': one row of whole groups (each prompt once, then its completions) up to the budget,
    its attention over the whole row (a tokens x tokens mask); 'padded': whole rows of prompt + completion."""
    p, g, m = cfg.prompts_per_step, cfg.group_size, cfg.max_tokens
    if cfg.packing == "shared-prefix":
        seg = prompt + g * m
        tokens = max(min(budget, p * seg), prompt + m)
        return tokens, math.ceil(tokens * g * m / seg), tokens
    row = prompt + m
    tokens = max(min(budget // row, p * g), 1) * row
    return tokens, math.ceil(tokens * m / row), row


def _trainer_parts(cfg: Config, shape: Shape, b: int, budget: int, ckpt: bool, four_bit: bool,
                   prompt: int) -> tuple[float, float, float]:
    """(base weights, activations, logits) in bytes: what the trainer holds, and its growth while it trains."""
    lin = shape.linear_params()
    # NF4: 4 bits a weight, an 8-bit scale per 64 weights and a float32 scale per 256 of those (double quantization)
    weights = (lin * (0.5 + 1 / 64 + 4 / (64 * 256)) if four_bit else lin * b) + (shape.params() - lin) * b
    tokens, completion, attn_len = micro_batch(cfg, budget, prompt)
    h, i = shape.hidden, shape.intermediate
    per_layer = shape.layer_activation_bytes(b, cfg.lora_rank)
    kept = shape.layers * (h * b if ckpt else per_layer) + (per_layer if ckpt else 0)  # ckpt: one layer recomputed
    kept += 2 * h * b + b * (2 * h + 3 * i)  # the final norm's input and output; one layer's gradients in flight
    acts = tokens * kept
    if cfg.packing == "shared-prefix":
        acts += attn_len * attn_len * b  # the packed row's additive mask (tokens x tokens), kept for backward
    chunk = min(LOGIT_CHUNK, completion)
    # one chunk's lm_head output recomputed in backward: float32 logits / temperature, the exp of logsumexp's backward,
    # the gradient and the gather's scattered gradient (four float32 copies; in 16 bits also the head's own output)
    return weights, acts, chunk * shape.vocab * (4 * 4 + (b if b < 4 else 0))


def _estimate(cfg: Config, shape: Shape, device: str, memory_gb: float | None, budget: int, ckpt: bool,
              four_bit: bool, holds: Holds, prompt: int) -> MemoryPlan:
    gpu = device.startswith("cuda")
    b = 2 if gpu and cfg.dtype in ("auto", "bfloat16", "float16") else 4
    weights, acts, logits = _trainer_parts(cfg, shape, b, budget, ckpt, four_bit, prompt)
    lora = shape.lora_params(cfg.lora_rank)
    seqs, seq_len = cfg.prompts_per_step * cfg.group_size, prompt + cfg.max_tokens
    kv = seqs * seq_len * shape.kv_bytes_per_token(b) / GiB
    context = {"CUDA context": CUDA_CONTEXT_GB} if gpu else {}
    train, resident, notes, util, short = {}, {}, [], None, ""
    if holds.trainer:
        resident = {"base weights": weights / GiB, "LoRA + AdamW": lora * 16 / GiB}
        train = {**resident, "activations": acts / GiB, "logits": logits / GiB, **context}
        resident.update(context)
    if holds.reward_gb:  # resident in both phases; an engine's 'auto' share leaves it room
        train["reward model"] = resident["reward model"] = holds.reward_gb
    gen, slots = dict(resident), 0
    if holds.generator in ("hf", "hf-process"):  # the trainer's own model; its own, in its own process (K >= 1)
        if holds.generator == "hf-process":  # there while the trainer works
            own = {"generator weights": weights / GiB, "generator LoRA": lora * 4 / GiB,
                   **{f"generator {k}": v for k, v in context.items()}}
            gen.update(own)
            train.update(own)
        room = HEADROOM * memory_gb * 1e9 - sum(gen.values()) * GiB if memory_gb else None
        static = cfg.hf_decode == "static"  # 'auto' is the loop until measured (fast_decode.resolve_decode)
        hf, slots = hf_generator_parts(shape, b, cfg.prompts_per_step, seqs, prompt, cfg.max_tokens, static, gpu, room)
        gen.update(hf)
        if slots:
            notes.append(f"hf_decode static: {slots} cache slots of {seq_len} tokens for {seqs} samples, refilled")
    elif holds.generator in ("vllm", "vllm-server"):
        n, ew, over = holds.engines, shape.params() * b / GiB, ENGINE_OVERHEAD_GB if gpu else 0.0
        cache = kv
        if four_bit:
            notes.append("the vLLM engine loads the base in 4-bit where it can (vLLM with bitsandbytes on a GPU), "
                         "else unquantized in the trainer's dtype: counted here unquantized")
        if gpu and memory_gb:
            total = memory_gb * 1e9
            if cfg.gpu_memory_utilization != "auto":
                util = float(cfg.gpu_memory_utilization)
            elif not holds.trainer:
                util = OWN_GPU_SHARE
            else:  # 'auto': what is free once the trainer loaded (resolve_engine_share's rule at engine start)
                reserve = 0 if holds.sleeps else acts + logits
                util = max(0.0, _share(total - sum(resident.values()) * GiB, total, reserve))
            cache = util * total / GiB - ew - over  # vLLM gives its KV cache what its share leaves
            one = cfg.max_model_len * shape.kv_bytes_per_token(b) / GiB
            if cache < one:
                short = (f"gpu_memory_utilization={util} on {device} gives {'each' if n > 1 else 'the'} vLLM engine "
                         f"{util * memory_gb:.1f} GB, "
                         f"below the {(ew + over + one) * GiB / 1e9:.1f} GB its weights, overhead and the KV cache of "
                         "one sequence (max_model_len) take")
            elif cache < kv:
                notes.append(f"the engine's KV cache holds {cache / kv:.0%} of one step's {seqs} sequences at once: "
                             "vLLM queues the rest")
            cache = max(cache, 0.0)
        engine = {"engine weights": n * ew, "engine KV cache": n * cache, "engine overhead": n * over}
        gen.update(engine)
        if not holds.sleeps:
            train.update(engine)
    moved = shape.params() * b / GiB if holds.generator in ("vllm", "vllm-server") and holds.sleeps and gpu else 0.0
    return MemoryPlan(cfg.model, device, memory_gb, shape.params() / 1e9, holds.role(), budget, ckpt, util, four_bit,
                      train, gen, 2 * moved, sleep_wake_seconds(moved, shape.params()) if moved else 0.0, tuple(notes),
                      short, slots)


def sleep_wake_seconds(weights_gb: float, params: int) -> float:
    """One sleep + wake cycle's seconds: the weights to the host and back, plus vLLM's own cycle cost (SLEEP_CYCLE_S)."""
    return 2 * weights_gb * GiB / (HOST_LINK_GBPS * 1e9) + SLEEP_CYCLE_S + SLEEP_CYCLE_S_PER_B * params / 1e9


def plan_shape(cfg: Config, shape: Shape, device: str, memory_gb: float | None,
               gradient_checkpointing: bool | None = None, holds: Holds = Holds(),
               prompt_tokens: int | None = None) -> MemoryPlan:
    """The plan of `device` ('cpu', 'cuda:N') holding `holds` (default: the trainer alone) for `shape`: the fixed
    choices of `cfg` kept, the others picked where the device holds the trainer. `token_budget` 'auto': the largest
    budget (up to one step's tokens) that fits; gradient checkpointing as the trainer sets it ('auto': on a GPU);
    4-bit is picked only where nothing fits in the trainer's dtype (a plan that needs it says so). On CPU (or with
    no memory figure) 'auto' is 512. `prompt_tokens`: a prompt's length (default min(max_prompt_tokens, 256))."""
    prompt = prompt_tokens or min(cfg.max_prompt_tokens, 256)
    step_tokens = micro_batch(cfg, 2**62, prompt)[0]  # the whole step in one micro-batch
    if cfg.token_budget != "auto":
        budgets = [int(cfg.token_budget)]
    elif device == "cpu" or memory_gb is None:
        budgets = [CPU_BUDGET]
    else:
        budgets = sorted({min(x, max(512, 2 ** math.ceil(math.log2(step_tokens)))) for x in BUDGETS}, reverse=True)
    if gradient_checkpointing is None:  # the trainer's rule (models.checkpointing_on): 'auto' is on a GPU only
        gradient_checkpointing = device != "cpu" if cfg.gradient_checkpointing == "auto" else bool(
            cfg.gradient_checkpointing)
    bits = [True] if cfg.load_in_4bit else [False, True]
    first = None
    for four in bits if holds.trainer else bits[:1]:
        for bud in budgets if holds.trainer else budgets[:1]:
            p = _estimate(cfg, shape, device, memory_gb, bud, gradient_checkpointing, four, holds, prompt)
            first = first or p
            if p.fits is not False:
                return p
    return first  # nothing fits: the plan of the config as given, which says so


def resolve_token_budget(cfg: Config, device: str) -> int:
    """`cfg.token_budget` as a number for a trainer built alone (a run passes its plan's, `minirl.run.plan`):
    'auto' is 512 on CPU; on a GPU the plan's choice for the trainer alone on `device`."""
    if cfg.token_budget != "auto":
        return int(cfg.token_budget)
    if not str(device).startswith("cuda"):
        return CPU_BUDGET
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    gb = torch.cuda.get_device_properties(index).total_memory / 1e9
    return plan_shape(cfg, Shape.from_config(model_config(cfg)), f"cuda:{index}", gb).token_budget


OWN_GPU_SHARE = 0.9  # 'auto' for an engine on a GPU of its own: vLLM's own default


def engine_share(free_bytes: int, total_bytes: int, reserve_bytes: int = 0, need_bytes: int = 0) -> float:
    """`gpu_memory_utilization: auto` for an engine sharing the trainer's GPU: vLLM's share of the GPU (0-1, rounded
    down to 0.01) from the memory free when it starts (the trainer loaded), less `reserve_bytes` (what the trainer
    still allocates while the engine holds its memory: its training-phase growth when the engine stays awake, 0 when
    it sleeps), the engine's own CUDA context (vLLM counts it in its share and checks the share against the free
    memory at start) and the plan's headroom (1 - HEADROOM of the GPU). A share that cannot hold `need_bytes` (the
    engine's weights and overhead) is one ConfigError line naming the figures and the ways out."""
    gb = 1e9
    share = _share(free_bytes, total_bytes, reserve_bytes)
    if share * total_bytes < need_bytes or share <= 0:
        raise ConfigError(
            f"gpu_memory_utilization 'auto': {free_bytes / gb:.1f} GB of the GPU's {total_bytes / gb:.1f} GB are "
            f"free with the trainer loaded; after its {reserve_bytes / gb:.1f} GB for training, the engine's CUDA "
            f"context and {1 - HEADROOM:.0%} headroom the engine would get {max(share, 0) * total_bytes / gb:.1f} GB, "
            f"below the {need_bytes / gb:.1f} GB its weights and overhead take; set load_in_4bit: true, use "
            "backend: hf or a smaller model, or give the engine a GPU of its own (`minirl plan CONFIG` shows the parts)")
    return share


def _share(free: float, total: float, reserve: float) -> float:
    return math.floor(100 * (free - reserve - CUDA_CONTEXT_GB * GiB - (1 - HEADROOM) * total) / total) / 100


def resolve_engine_share(cfg: Config, trainer_device: str, engine_gpus: str | None, engine_sleeps: bool,
                         reward_gb: float = 0.0) -> float:
    """`cfg.gpu_memory_utilization` as the number vLLM takes, for an engine on GPUs `engine_gpus` ('0', '1,2'; None:
    every GPU) beside a trainer on `trainer_device`: a number as given; 'auto' is `OWN_GPU_SHARE` on GPUs the trainer
    does not use, else `engine_share` of the memory free on the trainer's GPU now (called after the trainer loaded,
    just before the engine starts), less `reward_gb` (the reward models there, loaded at their first call)."""
    if cfg.gpu_memory_utilization != "auto":
        return float(cfg.gpu_memory_utilization)
    dev = torch.device(trainer_device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if engine_gpus is not None and str(index) not in engine_gpus.split(","):
        return OWN_GPU_SHARE
    torch.cuda.empty_cache()  # what the trainer's allocator holds but does not use is free for the engine
    free, total = torch.cuda.mem_get_info(dev)
    p = plan_shape(cfg, Shape.from_config(model_config(cfg)), f"cuda:{index}", total / 1e9,
                   holds=Holds(True, "vllm", sleeps=engine_sleeps, reward_gb=reward_gb))
    reserve = reward_gb + (0.0 if engine_sleeps else p.train["activations"] + p.train["logits"])
    need = p.generate.get("engine weights", 0.0) + ENGINE_OVERHEAD_GB
    return engine_share(free, total, int(reserve * GiB), int(need * GiB))

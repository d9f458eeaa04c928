"""Config checks, all made before anything loads: every numeric field's accepted range in one table (`RANGES`),
then the choices and the checks across fields. Every violation is one line naming the field and what it accepts;
`validate` raises one `ConfigError` holding all of them."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from minirl.config.errors import ConfigError
from minirl.config.presets import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    OBJECTIVES,
    PRESETS,
    REWARD_NORMALIZATIONS,
    SCALE_REWARDS,
)


@dataclass(frozen=True)
class Range:
    """An accepted interval for a number (each item of a list of numbers): `lo`/`hi` are bounds (None: none),
    closed unless `lo_open`/`hi_open`. Every value must also be finite. `why` says what the bound is for."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def accepts(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def text(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return "any finite number"


# One line per numeric field of Config (tests/test_config.py checks that every numeric field is here). None,
# where a field allows it, and the string 'auto' of max_async_steps, token_budget and gpu_memory_utilization are
# checked elsewhere.
RANGES: dict[str, Range] = {
    "lora_rank": Range(1, why="the LoRA rank r"),
    "lora_alpha": Range(0, lo_open=True, why="the update is scaled by alpha / r"),
    "lora_dropout": Range(0, 1, hi_open=True, why="a dropout probability"),
    "reward_weights": Range(why="one finite weight per reward"),
    "reward_timeout_s": Range(0, lo_open=True, why="seconds"),
    "reward_workers": Range(0, why="0 = rewards run in the trainer's process"),
    "reward_clip": Range(0, lo_open=True, why="the largest reward magnitude accepted"),
    "reward_memory_mb": Range(1, why="MiB per reward worker; there is no 'unlimited'"),
    "eval_fraction": Range(0, 1, hi_open=True, why="a fraction, e.g. 0.1"),
    "eval_size": Range(0, why="0 = no held-out evaluation"),
    "prompts_per_step": Range(1),
    "group_size": Range(2, why="group-relative advantages need at least 2 completions per prompt"),
    "max_tokens": Range(1),
    "temperature": Range(0, lo_open=True, why="use eval for greedy decoding"),
    "top_p": Range(0, 1, lo_open=True),
    "top_k": Range(0, why="0 = off"),
    "min_p": Range(0, 1, hi_open=True, why="0 = off"),
    "repetition_penalty": Range(0, lo_open=True, why="1 = off"),
    "max_prompt_tokens": Range(1),
    "max_turns": Range(1, why="model replies per episode"),
    "max_episode_tokens": Range(1),
    "steps": Range(0),
    "lr": Range(0, lo_open=True),
    "warmup_steps": Range(0),
    "weight_decay": Range(0),
    "max_grad_norm": Range(0, lo_open=True, why="the gradient norm is clipped to it"),
    "token_budget": Range(1, why="or 'auto'"),
    "ppo_epochs": Range(1, why="passes over each batch"),
    "clip_low": Range(0, 1, hi_open=True, why="the ratio's lower bound 1 - clip_low must stay above 0"),
    "clip_high": Range(0),
    "tis_cap": Range(1, why="a cap on pi_trainer / pi_behaviour; None = no correction"),
    "opsm_delta": Range(0, why="a mean |log ratio|; None = off"),
    "kl_coef": Range(0, why="0 = off"),
    "cispo_min": Range(0, why="a lower bound on the IS weight; 0 = none"),
    "cispo_max": Range(0, lo_open=True, why="an upper bound on the IS weight, e.g. 5.0"),
    "entropy_coef": Range(0, why="0 = off; the loss subtracts entropy_coef * entropy"),
    "top_entropy_quantile": Range(0, 1, why="the share of tokens kept by entropy; 1.0 = all"),
    "is_mask_low": Range(0, why="a lower bound on pi_trainer / pi_behaviour; None = none"),
    "is_mask_high": Range(0, lo_open=True, why="an upper bound on pi_trainer / pi_behaviour; None = none"),
    "max_resample_rounds": Range(1, why="refill rounds per step (dynamic_sampling)"),
    "max_async_steps": Range(0, why="or 'auto'"),
    "max_staleness": Range(0, why="or None = keep all"),
    "gpu_memory_utilization": Range(0, 1, lo_open=True, why="vLLM's share of GPU memory"),
    "kv_cache_gb": Range(0, lo_open=True),
    "num_servers": Range(1, why="start at least 1 server, or give server_urls"),
    "server_timeout_s": Range(0, lo_open=True, why="seconds"),
    "seed": Range(0, 2**32 - 1),
    "eval_every": Range(0, why="0 = only before and after"),
    "eval_samples": Range(0, why="0 = greedy only; k samples per held-out prompt"),
    "eval_temperature": Range(0, lo_open=True, why="use eval_samples: 0 for greedy only"),
    "checkpoint_every": Range(0, why="0 = only at the end"),
    "keep_checkpoints": Range(1),
    "log_samples": Range(0),
}

LOSS_FN = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")  # 'package.module:function'

# gen_devices / train_devices: 'auto', 'cuda', or a comma list of GPU ids ('1', 'cuda:1') or cores ('0', '0-3').
DEVICES = re.compile(r"auto|cuda|(?:(?:cuda:)?\d+(?:-\d+)?)(?:,(?:cuda:)?\d+(?:-\d+)?)*")
DEVICE_FORMS = "'auto', 'cuda', GPU ids ('1', 'cuda:1', '1,2') or CPU cores ('0', '0-3', '0,2-3')"


def range_problems(cfg) -> list[str]:
    """One line per numeric field outside its accepted range."""
    out = []
    for name, rng in RANGES.items():
        v = getattr(cfg, name)
        values = v if isinstance(v, list) else [v]
        for i, x in enumerate(values):
            if x is None or isinstance(x, str):
                continue
            if not rng.accepts(x):
                label = f"{name}[{i}]" if isinstance(v, list) else name
                note = f" ({rng.why})" if rng.why else ""
                out.append(f"{label}={x!r}: accepted range {rng.text()}{note}")
    return out


def validate(cfg) -> None:
    """Raise one ConfigError holding a line per bad setting, each naming the field and what it accepts."""
    problems = range_problems(cfg)

    def need(ok: bool, msg: str) -> None:
        if not ok:
            problems.append(msg)
    need(cfg.lr_schedule in ("constant", "cosine"), f"lr_schedule={cfg.lr_schedule!r}: use 'constant' or 'cosine'")
    need(cfg.loss_type is None or cfg.loss_type in PRESETS,
         f"loss_type={cfg.loss_type!r}: use one of {', '.join(PRESETS)}, or none")
    need(cfg.loss_agg in (None, *AGGREGATIONS),
         f"loss_agg={cfg.loss_agg!r}: use 'token-mean', 'seq-mean' or 'constant'")
    need(cfg.scale_rewards in (None, *SCALE_REWARDS),
         f"scale_rewards={cfg.scale_rewards!r}: use 'group', 'batch' or 'none'")
    need(cfg.advantage_estimator in ADVANTAGE_ESTIMATORS,
         f"advantage_estimator={cfg.advantage_estimator!r}: use 'group', 'rloo' or 'reinforce++'")
    need(cfg.reward_normalization in REWARD_NORMALIZATIONS,
         f"reward_normalization={cfg.reward_normalization!r}: use 'sum' or 'per-reward'")
    need(cfg.advantage_estimator != "reinforce++" or cfg.scale_rewards in (None, "batch"),
         f"advantage_estimator='reinforce++' divides by the step's std of its centred values itself: leave "
         f"scale_rewards unset (or 'batch'), not {cfg.scale_rewards!r}")
    need(cfg.importance_level in (None, *IMPORTANCE_LEVELS),
         f"importance_level={cfg.importance_level!r}: use 'token' or 'sequence' (GSPO)")
    need(cfg.objective in (None, *OBJECTIVES), f"objective={cfg.objective!r}: use 'ppo-clip' or 'cispo'")
    need(cfg.cispo_min < cfg.cispo_max, f"cispo_min={cfg.cispo_min} is not below cispo_max={cfg.cispo_max}: "
         "give a lower bound below the upper one (0 = no lower bound)")
    need(cfg.is_mask_low is None or cfg.is_mask_high is None or cfg.is_mask_low < cfg.is_mask_high,
         f"is_mask_low={cfg.is_mask_low} is not below is_mask_high={cfg.is_mask_high}: the band of IS weights "
         "kept is [is_mask_low, is_mask_high]")
    need(cfg.loss_fn is None or LOSS_FN.fullmatch(cfg.loss_fn) is not None,
         f"loss_fn={cfg.loss_fn!r}: give 'module:function' (e.g. 'my_losses:clipped'), or none for the built-in loss")
    need(cfg.backend in ("auto", "vllm", "vllm-server", "hf"),
         f"backend={cfg.backend!r}: use 'auto', 'vllm', 'vllm-server' or 'hf'")
    need(cfg.hf_decode in ("auto", "loop", "static"), f"hf_decode={cfg.hf_decode!r}: use 'auto', 'loop' or 'static'")
    for i, url in enumerate(cfg.server_urls):
        need(re.fullmatch(r"https?://[^/\s:]+(:\d+)?/?", url) is not None,
             f"server_urls[{i}]={url!r}: give the server's address as http://HOST:PORT")
    need(not cfg.server_urls or cfg.backend == "vllm-server",
         f"server_urls needs backend='vllm-server' (got backend={cfg.backend!r})")
    need(not (cfg.restart_servers and cfg.server_urls), "restart_servers restarts servers minirl started; it "
         "cannot restart yours (server_urls): drop one of the two")
    need(cfg.inflight in ("continue", "abort", "inflight"),
         f"inflight={cfg.inflight!r}: use 'continue', 'abort' or 'inflight'")
    need(cfg.sync_transport in ("auto", "ipc", "collective", "files"),
         f"sync_transport={cfg.sync_transport!r}: use 'auto', 'ipc', 'collective' or 'files'")
    need(not isinstance(cfg.max_async_steps, str) or cfg.max_async_steps == "auto",
         f"max_async_steps={cfg.max_async_steps!r}: use 'auto' or an integer >= 0")
    for name in ("gen_devices", "train_devices"):
        spec = getattr(cfg, name)
        ok = DEVICES.fullmatch(spec) is not None and all(
            int(a) <= int(b or a) for a, _, b in (p.removeprefix("cuda:").partition("-") for p in spec.split(","))
            if a.isdigit())
        need(ok, f"{name}={spec!r}: use {DEVICE_FORMS}")
    need(cfg.gpu_memory_utilization == "auto" or not isinstance(cfg.gpu_memory_utilization, str),
         f"gpu_memory_utilization={cfg.gpu_memory_utilization!r}: use 'auto' or a share of GPU memory in (0, 1]")
    need(cfg.token_budget == "auto" or not isinstance(cfg.token_budget, str),
         f"token_budget={cfg.token_budget!r}: use 'auto' or an integer >= max_tokens")
    need(isinstance(cfg.token_budget, str) or cfg.token_budget >= cfg.max_tokens,
         f"token_budget={cfg.token_budget} is below max_tokens={cfg.max_tokens}: a micro-batch must hold one "
         "completion; raise token_budget (or 'auto')")
    need(cfg.packing in ("shared-prefix", "padded"), f"packing={cfg.packing!r}: use 'shared-prefix' or 'padded'")
    need(cfg.gradient_checkpointing == "auto" or isinstance(cfg.gradient_checkpointing, bool),
         f"gradient_checkpointing={cfg.gradient_checkpointing!r}: use 'auto', true or false")
    need(cfg.dtype in ("auto", "float32", "bfloat16", "float16"),
         f"dtype={cfg.dtype!r}: use auto/float32/bfloat16/float16")
    need(cfg.reward_weights is None or len(cfg.reward_weights) == len(cfg.rewards),
         f"reward_weights has {len(cfg.reward_weights or [])} entries for {len(cfg.rewards)} rewards; give one per reward")
    need(not cfg.reward_weights or any(cfg.reward_weights),
         "reward_weights are all 0: every reward is a check (logged, never trained on), so nothing is trained; give "
         "the reward to train on a weight, e.g. reward_weights: [1, 0]")
    need(cfg.report_to in (None, "trackio", "tensorboard", "wandb"),
         f"report_to={cfg.report_to!r}: use 'trackio', 'tensorboard', 'wandb' or none")
    if problems:
        raise ConfigError("\n".join(problems))


def parse_cores(spec: str) -> list[int]:
    """CPU cores from a device string: '1', '0-3', '0,2-3'."""
    out: list[int] = []
    for part in str(spec).split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out

"""Config checks: each bad setting is one `ConfigError` naming the field and the fix, raised before anything loads."""
from __future__ import annotations

import re

from .errors import ConfigError


def validate(cfg) -> None:
    """Raise one ConfigError, naming the field and the fix, for the first bad setting."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)
    need(cfg.group_size >= 2, f"group_size={cfg.group_size}: group-relative advantages need at least "
         "2 completions per prompt; set group_size >= 2")
    need(cfg.prompts_per_step >= 1, "prompts_per_step must be >= 1")
    need(cfg.max_tokens >= 1, "max_tokens must be >= 1")
    need(cfg.temperature > 0, "temperature must be > 0 (use eval for greedy decoding)")
    need(0 < cfg.top_p <= 1, "top_p must be in (0, 1]")
    need(cfg.steps >= 0, "steps must be >= 0")
    need(cfg.lr > 0, "lr must be > 0")
    need(cfg.lr_schedule in ("constant", "cosine"), f"lr_schedule={cfg.lr_schedule!r}: use 'constant' or 'cosine'")
    need(cfg.loss_agg in ("token-mean", "seq-mean", "constant"),
         f"loss_agg={cfg.loss_agg!r}: use 'token-mean', 'seq-mean' or 'constant'")
    need(cfg.backend in ("auto", "vllm", "vllm-server", "hf"),
         f"backend={cfg.backend!r}: use 'auto', 'vllm', 'vllm-server' or 'hf'")
    need(cfg.num_servers >= 1, f"num_servers={cfg.num_servers}: start at least 1 server, or give server_urls")
    for i, url in enumerate(cfg.server_urls):
        need(re.fullmatch(r"https?://[^/\s:]+(:\d+)?/?", url) is not None,
             f"server_urls[{i}]={url!r}: give the server's address as http://HOST:PORT")
    need(not cfg.server_urls or cfg.backend == "vllm-server",
         f"server_urls needs backend='vllm-server' (got backend={cfg.backend!r})")
    need(not (cfg.restart_servers and cfg.server_urls), "restart_servers restarts servers minirl started; it "
         "cannot restart yours (server_urls): drop one of the two")
    need(cfg.server_timeout_s > 0, "server_timeout_s must be > 0 seconds")
    need(cfg.inflight in ("continue", "abort", "inflight"),
         f"inflight={cfg.inflight!r}: use 'continue', 'abort' or 'inflight'")
    need(cfg.sync_transport in ("auto", "ipc", "collective", "files"),
         f"sync_transport={cfg.sync_transport!r}: use 'auto', 'ipc', 'collective' or 'files'")
    need(cfg.max_async_steps == "auto" or (isinstance(cfg.max_async_steps, int) and cfg.max_async_steps >= 0),
         f"max_async_steps={cfg.max_async_steps!r}: use 'auto' or an integer >= 0")
    need(cfg.max_staleness is None or cfg.max_staleness >= 0, "max_staleness must be >= 0 or None")
    need(cfg.token_budget >= cfg.max_tokens, "token_budget must be at least max_tokens")
    need(cfg.dtype in ("auto", "float32", "bfloat16", "float16"), f"dtype={cfg.dtype!r}: use auto/float32/bfloat16")
    need(cfg.reward_weights is None or len(cfg.reward_weights) == len(cfg.rewards),
         f"reward_weights has {len(cfg.reward_weights or [])} entries for {len(cfg.rewards)} rewards; give one per reward")
    need(cfg.tis_cap is None or cfg.tis_cap >= 1, "tis_cap must be >= 1 or None")
    need(cfg.reward_workers >= 0, "reward_workers must be >= 0 (0 = rewards run in the trainer's process)")
    need(cfg.reward_timeout_s > 0, "reward_timeout_s must be > 0 seconds")
    need(cfg.reward_clip > 0, "reward_clip must be > 0")
    need(cfg.max_turns >= 1, "max_turns must be >= 1 (model replies per episode)")
    need(cfg.max_episode_tokens >= 1, "max_episode_tokens must be >= 1")
    need(cfg.eval_size >= 0, "eval_size must be >= 0 (0 = no held-out evaluation)")
    need(0 <= cfg.eval_fraction < 1, f"eval_fraction={cfg.eval_fraction}: use a fraction in [0, 1), e.g. 0.1")
    need(cfg.eval_every >= 0, "eval_every must be >= 0")
    need(cfg.checkpoint_every >= 0, "checkpoint_every must be >= 0 (0 = only at the end)")
    need(cfg.keep_checkpoints >= 1, "keep_checkpoints must be >= 1")
    need(cfg.report_to in (None, "trackio", "tensorboard", "wandb"),
         f"report_to={cfg.report_to!r}: use 'trackio', 'tensorboard', 'wandb' or none")


def parse_cores(spec: str) -> list[int]:
    """CPU cores from a device string: '1', '0-3', '0,2-3'."""
    out: list[int] = []
    for part in str(spec).split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out

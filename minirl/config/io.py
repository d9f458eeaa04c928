"""Config conversions: field values coerced to their types, YAML in and out (the CLI flags: `cli.py`)."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from minirl.config.errors import ConfigError
from minirl.config.presets import LOSS_FIELDS

NONE_IS_A_VALUE = {"scale_rewards"}  # 'none' is one of its values (no scaling), not None (the preset's)


def coerce(cls, kw: dict[str, Any]) -> dict[str, Any]:
    """The given field values `kw` each coerced to its field's type (a new dict), or one ConfigError."""
    hints = _hints(cls)
    out = {name: v if name in NONE_IS_A_VALUE and isinstance(v, str) else
           _coerce(name, v, hints[name]) if name in hints else v for name, v in kw.items()}
    for name in ("max_async_steps", "token_budget"):  # int | 'auto': a number written as a string ('1') is a number
        k = out.get(name)
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            out[name] = int(k)
    u = out.get("gpu_memory_utilization")  # float | 'auto': a number written as a string ('0.5') is a number
    if isinstance(u, str) and u.strip() != "auto":
        try:
            out["gpu_memory_utilization"] = float(u)
        except ValueError:
            pass  # validate names it
    gc = out.get("gradient_checkpointing")  # bool | 'auto': 'true' / 'false' (a flag, a quoted YAML value) are bools
    if isinstance(gc, str) and gc.strip().lower() in ("true", "false", "yes", "no"):
        out["gradient_checkpointing"] = gc.strip().lower() in ("true", "yes")
    return out


def _scale_rewards(v: Any) -> str:
    b = _bool(v)
    if not isinstance(b, bool):
        raise ConfigError(f"scale_adv_by_std: expected true or false, got {v!r}; or use scale_rewards: group, batch "
                          "or none")
    return "group" if b else "none"


def _bool(v: Any) -> Any:
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "yes", "no"):
        return v.strip().lower() in ("true", "yes")
    return v


# old field name -> (new name, old value -> new value, what the old values meant): old YAML and keywords still load
ALIASES: dict[str, tuple[str, Any, str]] = {
    "scale_adv_by_std": ("scale_rewards", _scale_rewards, "true = 'group', false = 'none'"),
}


def translate_aliases(kw: dict[str, Any]) -> dict[str, Any]:
    """`kw` with old field names replaced by the new ones (one ConfigError when both are given and disagree)."""
    for old, (new, convert, meaning) in ALIASES.items():
        if old in kw:
            kw = dict(kw)
            value = convert(kw.pop(old))
            if new in kw and kw[new] != value:
                raise ConfigError(f"{old} and {new}={kw[new]!r} disagree ({old} is the old name of {new}: {meaning}); "
                                  f"give only {new}")
            kw[new] = value
    return kw


def to_yaml(cfg, path: str | Path | None = None) -> str:
    """`field: value` lines; a loss field left to the `loss_type` preset is written `null` with a comment giving the
    value it resolves to, so the file says what the user set and what the preset did, and loads back the same."""
    recipe = cfg.recipe
    lines = []
    for name, value in cfg.to_dict().items():
        line = yaml.safe_dump({name: value}, sort_keys=False, width=10**6).rstrip("\n")
        if name == "scale_rewards" and value is None and recipe.scale_rewards_by:
            line += f"  # {recipe.scale_rewards} from {recipe.scale_rewards_by}"
        elif name in LOSS_FIELDS and value is None:
            line += f"  # {getattr(recipe, name)} from loss_type {recipe.preset}" + (
                " (the default)" if cfg.loss_type is None else "")
        lines.append(line)
    text = "\n".join(lines) + "\n"
    if path is not None:
        Path(path).write_text(text)
    return text


# TRL's GRPOConfig / PEFT / Unsloth name -> minirl's (docs/coming-from-trl.md): named in the error, never taken
# silently (TRL's batch counts completions, minirl's prompts; a copied config should be read, not guessed)
TRL_NAMES = {
    "learning_rate": "lr", "lr_scheduler_type": "lr_schedule", "max_steps": "steps", "num_generations": "group_size",
    "per_device_train_batch_size": "prompts_per_step (x group_size completions)",
    "gradient_accumulation_steps": "token_budget (micro-batches in tokens)", "num_iterations": "ppo_epochs",
    "max_completion_length": "max_tokens", "max_prompt_length": "max_prompt_tokens", "beta": "kl_coef",
    "epsilon": "clip_low", "epsilon_high": "clip_high", "importance_sampling_level": "importance_level",
    "mask_truncated_completions": "mask_truncated", "reward_funcs": "rewards",
    "vllm_importance_sampling_cap": "tis_cap", "use_vllm": "backend", "vllm_mode": "backend",
    "vllm_gpu_memory_utilization": "gpu_memory_utilization", "shuffle_dataset": "shuffle", "output_dir": "out_dir",
    "save_steps": "checkpoint_every", "r": "lora_rank", "model_name": "model", "model_name_or_path": "model",
    "dataset": "data", "dataset_name": "data", "bf16": "dtype (bfloat16)", "fp16": "dtype (float16)",
    "num_train_epochs": "steps (no epochs)", "warmup_ratio": "warmup_steps (a number of steps)",
    "vllm_importance_sampling_correction": "tis_cap (None: no correction)", "eval_steps": "eval_every",
    "save_total_limit": "keep_checkpoints", "model_init_kwargs": "model_kwargs", "log_completions": "log_samples",
    "num_completions_to_print": "log_samples", "max_seq_length": "max_prompt_tokens (+ max_tokens)",
    "vllm_importance_sampling_mode": "tis_cap (token_truncate) / is_mask_high (token_mask)",
    "off_policy_mask_threshold": "opsm_delta", "multi_objective_aggregation": "reward_normalization",
}


def check_names(cls, given: Any) -> None:
    """One ConfigError naming each unknown field in `given` with minirl's name for a TRL one (`TRL_NAMES`) or the
    closest known name (a keyword, a YAML key)."""
    known = {f.name for f in dataclasses.fields(cls)} | set(ALIASES)
    unknown = sorted(map(str, set(given) - known))
    if unknown:
        def hint(u: str) -> str:
            if u in TRL_NAMES:
                return f"{u!r} (TRL's name; minirl's is {TRL_NAMES[u]})"
            close = difflib.get_close_matches(u, known, 1)
            return f"{u!r} (did you mean {close[0]!r}?)" if close else repr(u)
        trl = " (TRL's names: docs/coming-from-trl.md)" if any(u in TRL_NAMES for u in unknown) else ""
        raise ConfigError(f"unknown config field(s): {', '.join(map(hint, unknown))}; see `minirl train --help`"
                          + trl)


def from_dict(cls, d: dict[str, Any]) -> Any:
    check_names(cls, d)
    return cls(**d)


def from_yaml(cls, path: str | Path) -> Any:
    """Read a YAML file of `field: value` lines; every problem is one ConfigError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found" if not p.exists() else
                          f"config {str(p)!r} is a folder; give a YAML file")
    try:
        text = p.read_text(encoding="utf-8")
        d = yaml.safe_load(text)
        _check_repeats(p, text)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                          "save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({what}); write one `field: value` per line") from None
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"{p}: expected `field: value` lines (a mapping), got {_kind(d)}; "
                          "e.g. `steps: 20` on its own line")
    try:
        return from_dict(cls, d)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def _check_repeats(p: Path, text: str) -> None:
    """One ConfigError for a field given twice (YAML would keep the last silently: `lr: 1e-4` above, `lr: 1e-3`
    further down)."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(node, yaml.MappingNode):
        return
    first: dict[str, int] = {}
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode):
            line = key.start_mark.line + 1
            if key.value in first:
                raise ConfigError(f"{p}:{line}: {key.value!r} is given twice (lines {first[key.value]} and {line}); "
                                  "keep one: YAML would silently take the last")
            first[key.value] = line


@lru_cache(maxsize=None)
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _kind(v: Any) -> str:
    name = "string" if isinstance(v, str) else type(v).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _coerce(name: str, v: Any, hint: Any) -> Any:
    """`v` as the field's type, or one clear ConfigError. Numbers may be written as strings ('1e-4': YAML 1.1 reads
    it as a string); 'none'/'null' is None where the field allows it; a single string is a one-item list."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else (hint,)
    optional = type(None) in args
    kinds = [a for a in args if a is not type(None)]
    if v is None or (optional and isinstance(v, str) and v.strip().lower() in ("none", "null", "~")):
        if optional:
            return None
        raise ConfigError(f"{name}: a value is required (got None)")
    for k in kinds:
        origin = typing.get_origin(k) or k
        if origin is list and isinstance(v, (list, tuple)):
            (elem,) = typing.get_args(k) or (Any,)
            return [_coerce(f"{name}[{i}]", x, elem) for i, x in enumerate(v)]
        if origin is str and isinstance(v, str):
            return v
    k = kinds[0]
    origin = typing.get_origin(k) or k
    if origin is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "yes", "no"):
            return v.strip().lower() in ("true", "yes")
        raise ConfigError(f"{name}: expected true or false, got {v!r} ({_kind(v)})")
    if origin in (int, float):
        if isinstance(v, bool):
            raise ConfigError(f"{name}: expected a number, got {v!r}")
        x = v
        if isinstance(v, str):
            try:
                x = float(v.strip().replace("_", ""))
            except ValueError:
                raise ConfigError(f"{name}: expected a number, got {v!r} ({_kind(v)})") from None
        if not isinstance(x, (int, float)):
            raise ConfigError(f"{name}: expected a number, got {v!r} ({_kind(v)})")
        if origin is int:
            if isinstance(x, float) and not x.is_integer():
                raise ConfigError(f"{name}: expected a whole number, got {v!r}")
            return int(x)
        return float(x)
    if origin is list:
        if isinstance(v, str):
            return [v]
        raise ConfigError(f"{name}: expected a list, got {v!r} ({_kind(v)})")
    if origin is str and isinstance(v, int) and not isinstance(v, bool):
        return str(v)  # `--train-devices 1`, YAML `gen_devices: 0`
    if origin is str:
        raise ConfigError(f"{name}: expected a string, got {v!r} ({_kind(v)})")
    if origin is dict:
        d = yaml.safe_load(v) if isinstance(v, str) else v  # a mapping written as text: the command line
        if not isinstance(d, dict) or not all(isinstance(key, str) for key in d):
            raise ConfigError(f"{name}: expected a mapping such as {{attn_implementation: sdpa}}, got {v!r}")
        return dict(d)
    return v


class Coercing(type):
    """`Config(...)` takes the old names of renamed fields (`io.ALIASES`) and coerces each given value to its
    field's type (`io.coerce`: '1e-4' is a number, a single string a one-item list) before the dataclass's own
    __init__; the instance is never written after it."""

    def __call__(cls, *args: Any, **kw: Any) -> Any:
        names = [f.name for f in dataclasses.fields(cls)]
        if len(args) > len(names) or set(names[:len(args)]) & set(kw):
            raise TypeError(f"{cls.__name__}() takes at most {len(names)} values, each given once")
        check_names(cls, kw)  # Config(stepz=3): one ConfigError with "did you mean 'steps'?"
        return super().__call__(**coerce(cls, translate_aliases({**dict(zip(names, args)), **kw})))

"""The token X-ray record: what the loss did with each token of one logged completion (a "samples" row's "xray").

The trainer fills it during its step from the tensors it already has (`training/xray.py`); the views read it back
from metrics.jsonl (`ui/xray.py`). Floats are kept to 4 significant digits, flags as 0/1 and short codes.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# masked_T's codes (several join with '+'): why a token's policy-gradient term was cut or capped
MASK_CODES = {
    "trunc": "IS weight pi_prox / pi_behav capped at tis_cap",
    "band": "IS weight outside [is_mask_low, is_mask_high]: set to 0 (masked IS)",
    "behav": "behav_clip: pi / pi_behav already past the clip range in the advantage's direction: dropped",
    "opsm": "OPSM: a negative-advantage sequence too far off-policy (opsm_delta): dropped",
    "entropy": "below top_entropy_quantile's entropy threshold: no policy gradient",
}


def sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits (a compact JSON float)."""
    return float(f"{float(x):.{digits}g}")


@dataclass(frozen=True)
class TokenXray:
    """One completion, token by token (every `*_T` has one entry per completion token, environment tokens of an
    episode included; the trainer-side ones are empty when the completion was not trained on: `note` says why).

    loss_mask_T: 1 for a sampled token (a loss target), 0 for an environment token (context). version_T: the policy
    version that sampled it. behav_logp_T: its logprob under that policy (the engine's). trainer_logp_T: the
    trainer's at the start of the step (the proximal policy). mismatch_T: trainer - behaviour. ratio_T: pi / pi_prox
    in the step's last epoch (1 with ppo_epochs 1: the clip acts from the second epoch). is_weight_T: pi_prox /
    pi_behav after tis_cap and the is_mask band (what multiplies the token's term). clipped_T: 1 where the clip
    bound, given the advantage's sign. masked_T: `MASK_CODES` joined by '+' ('' none). weight_T: advantage x the
    token's aggregation weight (loss_agg's; 0 off the loss targets): its sign is the direction the token is pushed.
    trainer_version: the policy version the step started from (staleness = trainer_version - version_T)."""
    token_ids_T: tuple[int, ...]
    pieces_T: tuple[str, ...]
    loss_mask_T: tuple[int, ...]
    version_T: tuple[int, ...]
    behav_logp_T: tuple[float, ...]
    trainer_logp_T: tuple[float, ...] = ()
    mismatch_T: tuple[float, ...] = ()
    ratio_T: tuple[float, ...] = ()
    is_weight_T: tuple[float, ...] = ()
    clipped_T: tuple[int, ...] = ()
    masked_T: tuple[str, ...] = ()
    weight_T: tuple[float, ...] = ()
    advantage: float = 0.0
    trainer_version: int = 0
    note: str = ""

    @property
    def trained(self) -> bool:
        return bool(self.trainer_logp_T)

    def __len__(self) -> int:
        return len(self.token_ids_T)

    def to_row(self) -> dict[str, Any]:
        """A JSON-ready dict (keys without the `_T` suffix)."""
        return {f.name.removesuffix("_T"): list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in fields(self)}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "TokenXray":
        """Back from `to_row`'s dict (as read from metrics.jsonl)."""
        kw = {}
        for f in fields(cls):
            key = f.name.removesuffix("_T")
            if key in row:
                kw[f.name] = tuple(row[key]) if f.name.endswith("_T") else row[key]
        return cls(**kw)

    def table(self) -> list[dict[str, Any]]:
        """One dict per token: position, id, piece, and each per-token value (None where not trained)."""
        out = []
        for t in range(len(self)):
            row = {"t": t, "token_id": self.token_ids_T[t], "piece": self.pieces_T[t]}
            for f in fields(self):
                if f.name.endswith("_T") and f.name not in ("token_ids_T", "pieces_T"):
                    v = getattr(self, f.name)
                    row[f.name.removesuffix("_T")] = v[t] if t < len(v) else None
            out.append(row)
        return out

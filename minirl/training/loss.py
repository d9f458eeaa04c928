"""The token-level GRPO-family policy loss, as pure functions on tensors (advantages: `rewards/advantages.py`).

Where this departs from the GRPO paper (Shao et al., 2024):
- The objective is token-level and *decoupled* (as in AReaL / "decoupled PPO"): the clipped ratio is taken
  against the proximal policy (the trainer's own weights at the start of the update, so with one update per
  batch it is 1 and only the gradient flows), and the gap between that policy and the *behaviour* policy that
  actually sampled the tokens (a stale adapter, or an engine whose numerics differ) is corrected by a truncated
  importance weight min(pi_prox / pi_behav, C) (TIS). The paper assumes the two are the same.
- With one update per batch that clip is inert, so nothing bounds how far the trainer has already moved from the
  stale policy that sampled a batch. `behav_clip` restores PPO's trust region against the *behaviour* policy: a
  token whose probability already moved beyond the clip range since it was sampled, in the direction its
  advantage pushes, gets no gradient (the gradient of PPO's clipped objective with old = behaviour). On-policy the
  ratio is 1 and it does nothing, up to engine numerics (a bf16 engine's token far from the trainer's probability
  is masked, as PPO with the engine's logprobs as "old" would).
- Clipping may be asymmetric (DAPO's clip-higher): ratio in [1 - clip_low, 1 + clip_high].
- The KL term to the reference is optional and off by default (Dr. GRPO / DAPO drop it); when on it uses the
  k3 estimator, like the paper.
- `importance_level="sequence"` is GSPO (Zheng et al., 2025) inside the decoupled objective: every ratio above (the
  clipped one against the proximal policy, the capped IS weight against the behaviour policy, `behav_clip`'s) is
  the length-normalised sequence ratio exp(mean_t log ratio) of the token's sequence. The gradient is GSPO-token's:
  sg[s_i] * pi(y_t) / sg[pi(y_t)], i.e. s_i * grad log pi(y_t) per token; with per-sequence advantages and per-row
  uniform weights (all of `AGGREGATIONS`) it equals the gradient of GSPO's sequence objective. GSPO's `old` is the
  sampling policy; here the clip is against the proximal policy and the gap to the sampling policy is the IS weight
  and `behav_clip`, both at sequence level too.
- Aggregation is a choice of per-token weights computed over the *whole* batch, so micro-batches with gradient
  accumulation give exactly the full-batch gradient: "token-mean" (DAPO: every token counts the same),
  "seq-mean" (the paper: mean over each sequence, then over sequences), "constant" (Dr. GRPO: sum / (B * L_max)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minirl.config.presets import AGGREGATIONS, IMPORTANCE_LEVELS


def token_weights(mask_B_T: torch.Tensor, agg: str, max_tokens: int | None = None) -> torch.Tensor:
    """Per-token weights whose weighted sum of per-token losses is the aggregated loss of the whole batch."""
    mask = mask_B_T.to(torch.float64)
    if agg == "token-mean":
        w = mask / mask.sum().clamp(min=1)
    elif agg == "seq-mean":
        lens = mask.sum(1, keepdim=True)
        n_seq = (lens > 0).sum().clamp(min=1)
        w = mask / lens.clamp(min=1) / n_seq
    elif agg == "constant":
        if not max_tokens:
            raise ValueError("loss_agg='constant' needs max_tokens (the Dr. GRPO constant is B * max_tokens)")
        w = mask / (mask.shape[0] * max_tokens)
    else:
        raise ValueError(f"unknown loss_agg {agg!r}: choose one of {AGGREGATIONS}")
    return w.to(torch.float32)


@dataclass
class LossOut:
    loss: torch.Tensor          # scalar, already aggregated with the given weights (sum over this micro-batch)
    n_tokens: int
    clipped: float              # number of tokens where the clipped branch was active
    behav_clipped: float        # number of tokens outside the trust region around the behaviour policy
    is_truncated: float         # number of tokens whose IS weight hit the cap
    is_weight_sum: float
    kl_behav_sum: float         # sum of k3 KL(behaviour || trainer) estimates
    kl_ref_sum: float
    mismatch_sum: float         # sum of |logp_trainer - logp_behaviour|


@dataclass(frozen=True)
class LossSettings:
    """The policy loss's knobs (each documented on the `Config` field of the same name; the defaults are Config's)."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = 2.0
    kl_coef: float = 0.0
    opsm_delta: float | None = None
    behav_clip: bool = True
    importance_level: str = "token"

    @classmethod
    def from_config(cls, cfg: Any) -> "LossSettings":
        """A `Config`'s settings: the clip range and importance level as its `recipe` resolves them."""
        r = cfg.recipe
        return cls(clip_low=r.clip_low, clip_high=r.clip_high, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef,
                   opsm_delta=cfg.opsm_delta, behav_clip=cfg.behav_clip, importance_level=r.importance_level)


def policy_loss(
    logp_B_T: torch.Tensor,
    old_logp_B_T: torch.Tensor,
    behav_logp_B_T: torch.Tensor,
    adv_B: torch.Tensor,
    weight_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    settings: LossSettings = LossSettings(),
    ref_logp_B_T: torch.Tensor | None = None,
) -> LossOut:
    """Decoupled clipped surrogate with truncated IS, optional k3 KL to a reference and optional OPSM.

    logp: trainer logprobs (with grad); old_logp: proximal policy (no grad); behav_logp: sampling policy;
    weight_B_T: per-token aggregation weights from `token_weights` (zero on prompt and padding tokens).
    OPSM (off-policy sequence masking): a sequence with negative advantage whose mean |log ratio| to the
    behaviour policy exceeds `opsm_delta` is masked out.
    `behav_clip`: tokens whose pi_trainer / pi_behaviour is already above 1 + clip_high with a positive advantage,
    or below 1 - clip_low with a negative one, are masked out (PPO's clip against the sampling policy).
    `importance_level="sequence"` (GSPO): each of those three ratios is its sequence's geometric mean (module
    docstring), so a sequence is clipped, capped or masked whole; OPSM is per sequence at either level.
    """
    clip_low, clip_high, tis_cap = settings.clip_low, settings.clip_high, settings.tis_cap
    mask = mask_B_T.bool()
    adv = adv_B[:, None].to(logp_B_T.dtype)
    if settings.importance_level == "sequence":
        n_B1 = mask.sum(1, keepdim=True).clamp(min=1)

        def seq_mean(x_B_T: torch.Tensor) -> torch.Tensor:  # each row's mean over its tokens, on every token
            return ((x_B_T * mask).sum(1, keepdim=True) / n_B1).expand_as(x_B_T)
        log_s = seq_mean(logp_B_T.detach() - old_logp_B_T)
        ratio = torch.exp(log_s + logp_B_T - logp_B_T.detach())  # value s_i, gradient s_i * grad log pi(y_t)
        log_is = seq_mean(old_logp_B_T - behav_logp_B_T).detach()
        log_rb = seq_mean(logp_B_T.detach() - behav_logp_B_T)
    elif settings.importance_level == "token":
        ratio = torch.exp(logp_B_T - old_logp_B_T)
        log_is = (old_logp_B_T - behav_logp_B_T).detach()
        log_rb = logp_B_T.detach() - behav_logp_B_T
    else:
        raise ValueError(f"unknown importance_level {settings.importance_level!r}: choose one of {IMPORTANCE_LEVELS}")
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    surr = torch.minimum(ratio * adv, clipped_ratio * adv)
    is_w = torch.exp(log_is)
    if tis_cap is not None:
        is_w = is_w.clamp(max=tis_cap)
    per_tok = -is_w * surr
    w = weight_B_T.to(logp_B_T.dtype)
    out_B_T = torch.zeros_like(mask)
    if settings.behav_clip:
        r_b = torch.exp(log_rb)
        out_B_T = ((adv > 0) & (r_b > 1 + clip_high)) | ((adv < 0) & (r_b < 1 - clip_low))
        w = w * ~out_B_T
    if settings.opsm_delta is not None:
        n = mask.sum(1).clamp(min=1)
        seq_gap = ((old_logp_B_T - behav_logp_B_T).detach().abs() * mask).sum(1) / n  # token gaps, either level
        keep = ~((adv_B < 0) & (seq_gap > settings.opsm_delta))
        w = w * keep[:, None]
    kl_ref = torch.zeros((), dtype=logp_B_T.dtype)
    if ref_logp_B_T is not None:
        d = ref_logp_B_T - logp_B_T
        k3 = torch.exp(d) - d - 1
        per_tok = per_tok + settings.kl_coef * k3
        kl_ref = (k3.detach() * mask).sum()
    loss = (per_tok * w * mask).sum()
    with torch.no_grad():
        d_b = behav_logp_B_T - logp_B_T
        return LossOut(
            loss=loss,
            n_tokens=int(mask.sum()),
            clipped=float(((surr != ratio * adv) & mask).sum()),
            behav_clipped=float((out_B_T & mask).sum()),
            is_truncated=float(((torch.exp(log_is) > tis_cap) & mask).sum()) if tis_cap is not None else 0.0,
            is_weight_sum=float((is_w * mask).sum()),
            kl_behav_sum=float(((torch.exp(d_b) - d_b - 1) * mask).sum()),
            kl_ref_sum=float(kl_ref),
            mismatch_sum=float(((logp_B_T - behav_logp_B_T).abs() * mask).sum()),
        )

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
- `objective="cispo"` (MiniMax-M1, Chen et al. 2025, as in TRL / tinker / ScaleRL) replaces PPO's clipped
  surrogate by sg(clip(r, cispo_min, cispo_max)) * A * log pi per token, r the ratio to the proximal policy: a token
  past the clip keeps its gradient, only its weight is bounded. TRL bounds the ratio above only (its epsilon_high is
  the absolute cap, 5.0 recommended); cispo_min = 0 is that. It stays inside the decoupled objective: the capped IS
  weight to the behaviour policy multiplies it, behav_clip and OPSM mask as above, and at sequence level r is the
  sequence ratio (the weight of every token of the sequence). The loss value is -w * A * log pi, not a ratio (as in
  TRL), so the logged `loss` is on another scale than PPO's.
- Masked IS (`is_mask_low` / `is_mask_high`, TRL's token_mask / sequence_mask): a token whose IS weight to the
  behaviour policy leaves the band gets IS weight 0; TRL's sequence modes test the product of the token ratios,
  here the sequence level tests the length-normalised ratio the loss uses. Like TRL, the band and
  `top_entropy_B_T` (top_entropy_quantile) zero the policy-gradient term only (the KL term stays); behav_clip and
  OPSM, minirl's own, drop the whole token.
- The entropy bonus (`entropy_coef`) subtracts coef * sum(w * H) with the aggregation weights w (restricted to the
  tokens top_entropy_quantile keeps), so it is the mean token entropy under loss_agg, summed exactly over
  micro-batches. TRL uses a token mean for every loss type.
- Aggregation is a choice of per-token weights computed over the *whole* batch, so micro-batches with gradient
  accumulation give exactly the full-batch gradient: "token-mean" (DAPO: every token counts the same),
  "seq-mean" (the paper: mean over each sequence, then over sequences), "constant" (Dr. GRPO: sum / (B * L_max)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minirl.config.presets import AGGREGATIONS, IMPORTANCE_LEVELS, OBJECTIVES


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
    """A loss_fn's result for one micro-batch. Only `loss` is needed; the counts feed the step's metrics."""
    loss: torch.Tensor          # scalar, already aggregated with the given weights (sum over this micro-batch)
    n_tokens: int = 0
    clipped: float = 0.0        # number of tokens where the clip was active (ppo-clip's branch, cispo's bound)
    behav_clipped: float = 0.0  # number of tokens outside the trust region around the behaviour policy
    is_truncated: float = 0.0   # number of tokens whose IS weight hit the cap
    is_masked: float = 0.0      # number of tokens whose IS weight left [is_mask_low, is_mask_high]
    is_weight_sum: float = 0.0
    kl_behav_sum: float = 0.0   # sum of k3 KL(behaviour || trainer) estimates
    kl_ref_sum: float = 0.0
    mismatch_sum: float = 0.0   # sum of |logp_trainer - logp_behaviour|


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
    objective: str = "ppo-clip"
    cispo_min: float = 0.0
    cispo_max: float = 5.0
    entropy_coef: float = 0.0
    is_mask_low: float | None = None
    is_mask_high: float | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> "LossSettings":
        """A `Config`'s settings: the clip range, importance level and objective as its `recipe` resolves them."""
        r = cfg.recipe
        return cls(clip_low=r.clip_low, clip_high=r.clip_high, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef,
                   opsm_delta=cfg.opsm_delta, behav_clip=cfg.behav_clip, importance_level=r.importance_level,
                   objective=r.objective, cispo_min=cfg.cispo_min, cispo_max=cfg.cispo_max,
                   entropy_coef=cfg.entropy_coef, is_mask_low=cfg.is_mask_low, is_mask_high=cfg.is_mask_high)


@dataclass(frozen=True)
class LossInputs:
    """What a loss_fn gets for one micro-batch: (B, T) tensors aligned to the token they score, T the rows' length.

    logp_B_T: the trainer's logprobs, with gradient. old_logp_B_T: the proximal policy's (the trainer at the start
    of the step; no grad). behav_logp_B_T: the policy that sampled (the engine's logprobs). adv_B: one advantage per
    row. weight_B_T: the aggregation weights over the whole step (`token_weights`; 0 off the loss targets), so the
    sum over micro-batches of sum(per-token loss * weight) is the step's loss. mask_B_T: the loss targets (sampled
    completion tokens). ref_logp_B_T: the reference policy's (only when kl_coef > 0). entropy_B_T: the trainer's
    token entropy, with gradient when entropy_coef > 0 (None when neither entropy_coef nor top_entropy_quantile
    asks for it). top_entropy_B_T: the tokens top_entropy_quantile keeps (None: all)."""
    logp_B_T: torch.Tensor
    old_logp_B_T: torch.Tensor
    behav_logp_B_T: torch.Tensor
    adv_B: torch.Tensor
    weight_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    settings: LossSettings = LossSettings()
    ref_logp_B_T: torch.Tensor | None = None
    entropy_B_T: torch.Tensor | None = None
    top_entropy_B_T: torch.Tensor | None = None


def policy_loss(
    logp_B_T: torch.Tensor,
    old_logp_B_T: torch.Tensor,
    behav_logp_B_T: torch.Tensor,
    adv_B: torch.Tensor,
    weight_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    settings: LossSettings = LossSettings(),
    ref_logp_B_T: torch.Tensor | None = None,
    entropy_B_T: torch.Tensor | None = None,
    top_entropy_B_T: torch.Tensor | None = None,
) -> LossOut:
    """`decoupled_loss` on tensors (the arguments are `LossInputs`' fields)."""
    return decoupled_loss(LossInputs(logp_B_T, old_logp_B_T, behav_logp_B_T, adv_B, weight_B_T, mask_B_T, settings,
                                     ref_logp_B_T, entropy_B_T, top_entropy_B_T))


@dataclass(frozen=True)
class TokenTerms:
    """`decoupled_loss`'s per-token pieces before aggregation (B, T), also read by the token X-ray
    (`training/xray.py`). ratio: pi / pi_prox (at sequence level the sequence's, on each token); surr: the
    objective's surrogate; clipped: the clip bound (ppo-clip's clipped branch, cispo's bound); is_raw / is_w: the IS
    weight pi_prox / pi_behav before and after tis_cap and the is_mask band; band: outside that band (IS weight 0);
    out: behav_clip's tokens; drop: those and OPSM's sequences (no term at all)."""
    ratio: torch.Tensor
    surr: torch.Tensor
    clipped: torch.Tensor
    is_raw: torch.Tensor
    is_w: torch.Tensor
    band: torch.Tensor
    out: torch.Tensor
    drop: torch.Tensor


def token_terms(inp: LossInputs) -> TokenTerms:
    """The per-token terms of `decoupled_loss` (its docstring); no aggregation, no KL, no entropy."""
    s = inp.settings
    logp_B_T, old_logp_B_T, behav_logp_B_T = inp.logp_B_T, inp.old_logp_B_T, inp.behav_logp_B_T
    clip_low, clip_high, tis_cap = s.clip_low, s.clip_high, s.tis_cap
    mask = inp.mask_B_T.bool()
    adv_B = inp.adv_B
    adv = adv_B[:, None].to(logp_B_T.dtype)
    if s.importance_level == "sequence":
        n_B1 = mask.sum(1, keepdim=True).clamp(min=1)

        def seq_mean(x_B_T: torch.Tensor) -> torch.Tensor:  # each row's mean over its tokens, on every token
            return ((x_B_T * mask).sum(1, keepdim=True) / n_B1).expand_as(x_B_T)
        log_s = seq_mean(logp_B_T.detach() - old_logp_B_T)
        ratio = torch.exp(log_s + logp_B_T - logp_B_T.detach())  # value s_i, gradient s_i * grad log pi(y_t)
        log_is = seq_mean(old_logp_B_T - behav_logp_B_T).detach()
        log_rb = seq_mean(logp_B_T.detach() - behav_logp_B_T)
    elif s.importance_level == "token":
        ratio = torch.exp(logp_B_T - old_logp_B_T)
        log_is = (old_logp_B_T - behav_logp_B_T).detach()
        log_rb = logp_B_T.detach() - behav_logp_B_T
    else:
        raise ValueError(f"unknown importance_level {s.importance_level!r}: choose one of {IMPORTANCE_LEVELS}")
    if s.objective == "ppo-clip":
        surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
        clipped_B_T = surr != ratio * adv
    elif s.objective == "cispo":
        r = ratio.detach()
        coef = r.clamp(s.cispo_min, s.cispo_max)
        surr = coef * adv * logp_B_T  # the weight is a constant: every token's gradient is coef * A * grad log pi
        clipped_B_T = coef != r
    else:
        raise ValueError(f"unknown objective {s.objective!r}: choose one of {OBJECTIVES}")
    is_raw = torch.exp(log_is)
    is_w = is_raw if tis_cap is None else is_raw.clamp(max=tis_cap)
    band_B_T = torch.zeros_like(mask)
    if s.is_mask_low is not None:
        band_B_T = band_B_T | (is_raw < s.is_mask_low)
    if s.is_mask_high is not None:
        band_B_T = band_B_T | (is_raw > s.is_mask_high)
    is_w = is_w.masked_fill(band_B_T, 0.0)  # masked, not truncated
    out_B_T = torch.zeros_like(mask)
    if s.behav_clip:
        r_b = torch.exp(log_rb)
        out_B_T = ((adv > 0) & (r_b > 1 + clip_high)) | ((adv < 0) & (r_b < 1 - clip_low))
    drop_B_T = out_B_T
    if s.opsm_delta is not None:
        n = mask.sum(1).clamp(min=1)
        seq_gap = ((old_logp_B_T - behav_logp_B_T).detach().abs() * mask).sum(1) / n  # token gaps, either level
        drop_B_T = out_B_T | ((adv_B < 0) & (seq_gap > s.opsm_delta))[:, None]
    return TokenTerms(ratio, surr, clipped_B_T, is_raw, is_w, band_B_T, out_B_T, drop_B_T)


def decoupled_loss(inp: LossInputs) -> LossOut:
    """The built-in loss_fn: the decoupled objective ('ppo-clip' or 'cispo') with truncated or masked IS, optional
    k3 KL to a reference, OPSM, behav_clip, the top-entropy mask and the entropy bonus (module docstring).

    OPSM (off-policy sequence masking): a sequence with negative advantage whose mean |log ratio| to the
    behaviour policy exceeds `opsm_delta` is masked out.
    `behav_clip`: tokens whose pi_trainer / pi_behaviour is already above 1 + clip_high with a positive advantage,
    or below 1 - clip_low with a negative one, are masked out (PPO's clip against the sampling policy).
    `importance_level="sequence"` (GSPO): each of those ratios is its sequence's geometric mean (module
    docstring), so a sequence is clipped, capped or masked whole; OPSM is per sequence at either level.
    """
    s = inp.settings
    logp_B_T, behav_logp_B_T, tis_cap = inp.logp_B_T, inp.behav_logp_B_T, s.tis_cap
    mask = inp.mask_B_T.bool()
    t = token_terms(inp)
    per_tok = -t.is_w * t.surr
    if inp.top_entropy_B_T is not None:
        per_tok = per_tok * inp.top_entropy_B_T
    w = inp.weight_B_T.to(logp_B_T.dtype)
    kl_ref = torch.zeros((), dtype=logp_B_T.dtype)
    if inp.ref_logp_B_T is not None:
        d = inp.ref_logp_B_T - logp_B_T
        k3 = torch.exp(d) - d - 1
        per_tok = per_tok + s.kl_coef * k3
        kl_ref = (k3.detach() * mask).sum()
    loss = (per_tok * w * ~t.drop * mask).sum()
    if s.entropy_coef:
        if inp.entropy_B_T is None:
            raise ValueError("entropy_coef > 0 needs the token entropies (LossInputs.entropy_B_T)")
        w_ent = w if inp.top_entropy_B_T is None else w * inp.top_entropy_B_T
        loss = loss - s.entropy_coef * (inp.entropy_B_T * w_ent * mask).sum()
    with torch.no_grad():
        d_b = behav_logp_B_T - logp_B_T
        return LossOut(
            loss=loss,
            n_tokens=int(mask.sum()),
            clipped=float((t.clipped & mask).sum()),
            behav_clipped=float((t.out & mask).sum()),
            is_truncated=float(((t.is_raw > tis_cap) & ~t.band & mask).sum()) if tis_cap is not None else 0.0,
            is_masked=float((t.band & mask).sum()),
            is_weight_sum=float((t.is_w * mask).sum()),
            kl_behav_sum=float(((torch.exp(d_b) - d_b - 1) * mask).sum()),
            kl_ref_sum=float(kl_ref),
            mismatch_sum=float(((logp_B_T - behav_logp_B_T).abs() * mask).sum()),
        )

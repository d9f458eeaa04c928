"""From scored groups to padded tensors, and the policy's per-token logprobs on them.

`samples_from_groups` keeps the samples that carry a learning signal; `make_batch` pads them into a `Batch` whose
per-token tensors are aligned to the token they score; `completion_logprobs` runs the model and returns the
completion tokens' logprobs with temperature applied — the trainer's side of every comparison with the engine.
Logprobs are computed from the final hidden states of the completion tokens only, in chunks, so float32 logits
never exist for the whole batch (nor for prompt or padding positions).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from minirl.core.logits import Processing, histories, processed_logits, seen_tokens
from minirl.training.loss import token_weights
from minirl.types import Completion, ScoredGroup

LOGIT_CHUNK = 1024  # completion tokens per lm_head chunk


@dataclass(frozen=True)
class Sample:
    """One completion ready for the loss."""
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behav_logp: tuple[float, ...]
    versions: tuple[int, ...]
    advantage: float
    temperature: float = 1.0  # the temperature the completion was sampled at: its logprobs are taken at it
    mask: tuple[bool, ...] | None = None  # episodes: which completion tokens were sampled (None: all)
    origin: tuple[int, int] | None = None  # (group, completion) index in the step's groups (the token X-ray's key)


@dataclass
class Batch:
    """Right-padded prompt+completion rows. `tgt_mask_B_L[b, t]` marks the sampled completion tokens (the loss
    targets; an episode's environment tokens are context only); per-token tensors are aligned to the token they
    score."""
    input_ids_B_L: torch.Tensor
    attn_B_L: torch.Tensor
    tgt_mask_B_L: torch.Tensor
    behav_logp_B_L: torch.Tensor
    version_B_L: torch.Tensor
    adv_B: torch.Tensor
    weight_B_L: torch.Tensor  # aggregation weights over the whole batch
    temp_B: torch.Tensor      # sampling temperature of each row
    index_B: torch.Tensor | None = None  # each row's sample index in the step (micro-batches keep it)

    @property
    def n_tokens(self) -> int:
        return int(self.tgt_mask_B_L.sum())

    def _map(self, fn) -> "Batch":
        return Batch(**{f.name: None if (v := getattr(self, f.name)) is None else fn(v) for f in fields(self)})

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device))

    def rows(self, idx: list[int]) -> "Batch":
        width = int(self.attn_B_L[idx].sum(1).max())
        return self._map(lambda t: t[idx][:, :width] if t.dim() == 2 else t[idx])

    def micro_batches(self, token_budget: int) -> Iterator["Batch"]:
        """Rows sorted by length, packed greedily so that rows * longest row <= token_budget."""
        lens = self.attn_B_L.sum(1).tolist()
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        cur: list[int] = []
        for i in order:
            if cur and (len(cur) + 1) * lens[cur[0]] > token_budget:
                yield self.rows(cur)
                cur = []
            cur.append(i)
        if cur:
            yield self.rows(cur)


@dataclass(frozen=True)
class SampleFilter:
    """Which completions get a loss term. Zero-advantage samples carry no policy gradient and are dropped unless a
    KL term needs them (`keep_zero_adv`); with `drop_truncated` (`mask_truncated`), so are completions cut by a
    length cap (finish_reason 'length'): no loss at all, while their rewards still counted in their group's
    baseline (DAPO's overlong filtering). Failed rewards and empty completions are never trained on."""
    keep_zero_adv: bool = False
    drop_truncated: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> "SampleFilter":
        return cls(keep_zero_adv=cfg.kl_coef > 0 or cfg.train_zero_adv, drop_truncated=cfg.mask_truncated)

    def skip_reason(self, c: Completion, reward: float | None, advantage: float) -> str | None:
        """Why `c` gets no loss term, in words (the token X-ray's note), or None when it is trained: the one
        place that decides it."""
        if reward is None:
            return "its reward failed"
        if not c.token_ids:
            return "empty completion"
        if self.drop_truncated and c.truncated:
            return "truncated by a length cap (mask_truncated)"
        if advantage == 0.0 and not self.keep_zero_adv:
            return "zero advantage (no policy gradient; train_zero_adv or kl_coef > 0 keeps it)"
        return None


def samples_from_groups(groups: Sequence[ScoredGroup], keep: SampleFilter = SampleFilter()) -> list[Sample]:
    """Included samples with their advantages: those `keep` finds no reason to skip (the trainer passes
    `SampleFilter.from_config(cfg)`, the filter its token X-rays explain; the default drops zero-advantage samples
    and keeps truncated ones)."""
    if not isinstance(keep, SampleFilter):
        raise TypeError(f"samples_from_groups takes a SampleFilter, not {type(keep).__name__}: pass "
                        "SampleFilter(keep_zero_adv=..., drop_truncated=...) or SampleFilter.from_config(cfg)")
    out = []
    for gi, g in enumerate(groups):
        for ci, (c, r, a) in enumerate(zip(g.group.completions, g.rewards, g.advantages)):
            if keep.skip_reason(c, r, a) is None:
                out.append(Sample(g.group.prompt.token_ids, c.token_ids, c.logprobs, c.versions, a,
                                  g.group.temperature, c.mask, (gi, ci)))
    return out


def make_batch(samples: Sequence[Sample], pad_id: int, agg: str, max_tokens: int) -> Batch:
    L = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    tgt = torch.zeros((B, L), dtype=torch.bool)
    behav = torch.zeros((B, L))
    ver = torch.zeros((B, L), dtype=torch.long)
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[b, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attn[b, : p + c] = 1
        tgt[b, p: p + c] = True if s.mask is None else torch.tensor(s.mask, dtype=torch.bool)  # env tokens: context
        behav[b, p: p + c] = torch.tensor(s.behav_logp)
        ver[b, p: p + c] = torch.tensor(s.versions)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    temp = torch.tensor([s.temperature for s in samples], dtype=torch.float32)
    return Batch(ids, attn, tgt, behav, ver, adv, token_weights(tgt, agg, max_tokens), temp, torch.arange(B))


def completion_logprobs(model, batch: Batch, temperature: float | None = None, with_entropy: bool | str = False,
                        recompute: bool = True, proc: Processing = Processing()):
    """Per-token logprobs (B, L) of the completion tokens under `model` (a peft or plain causal LM), with
    temperature applied — each row's own (`batch.temp_B`), or `temperature` for all — plus the entropy of those
    positions as `with_entropy` asks (`ENTROPY`). With grad enabled each chunk's logits are recomputed in backward
    (`_chunk_logp` under activation checkpointing) rather than kept: autograd holds (N, vocab) float32 logits for
    every completion token of the micro-batch until backward otherwise (`recompute=False`: one lm_head matmul
    per chunk less). `proc`: the sampler's min_p / repetition penalty, applied as it applied them."""
    inner, head = _decoder_and_head(model)
    hidden = inner(input_ids=batch.input_ids_B_L, attention_mask=batch.attn_B_L).last_hidden_state
    pick = batch.tgt_mask_B_L[:, 1:]
    h_N_H = hidden[:, :-1][pick]
    targets_N = batch.input_ids_B_L[:, 1:][pick]
    if temperature is None:
        temp_N = batch.temp_B[:, None].expand(pick.shape)[pick].to(h_N_H.device)
    else:
        temp_N = torch.full(targets_N.shape, float(temperature), device=h_N_H.device)
    return hidden_logprobs(h_N_H, targets_N, temp_N, head, batch, with_entropy, recompute, proc)


ENTROPY = {False: "none: 0.0", True: "their summed entropy, a float (no grad)",
           "tokens": "each target's entropy, (B, L) like the logprobs (no grad)",
           "grad": "each target's entropy, (B, L), with gradient (the entropy bonus)"}


def hidden_logprobs(h_N_H, targets_N, temp_N, head, rows: Batch, with_entropy: bool | str = False,
                    recompute: bool = True, proc: Processing = Processing()):
    """Logprobs of `targets_N` from the final hidden states that predict them, by lm_head chunks, scattered into
    the (B, L) layout of `rows.tgt_mask_B_L` (row-major order), plus their entropy as `with_entropy` asks
    (`ENTROPY`; the shared tail of the padded and the packed path). With a repetition penalty each target's history
    is its row's ids before it."""
    if with_entropy not in ENTROPY:
        raise ValueError(f"with_entropy={with_entropy!r}: one of {list(ENTROPY)}")
    recompute = recompute and torch.is_grad_enabled() and h_N_H.requires_grad
    tgt_mask_B_L = rows.tgt_mask_B_L
    hist = histories(rows.input_ids_B_L, rows.attn_B_L, tgt_mask_B_L) if proc.penalised else None
    logps, ents, ent = [], [], 0.0
    for s in range(0, h_N_H.shape[0], LOGIT_CHUNK):
        sl = slice(s, s + LOGIT_CHUNK)
        hist_c = None if hist is None else (hist[0][sl].to(h_N_H.device), hist[1][sl].to(h_N_H.device))
        args = (h_N_H[sl], targets_N[sl], temp_N[sl], head)
        if recompute:
            lp, e = checkpoint(_chunk_logp, *args, with_entropy, proc, hist_c, use_reentrant=False)
        else:
            lp, e = _chunk_logp(*args, with_entropy, proc, hist_c)
        logps.append(lp)
        if isinstance(e, torch.Tensor):
            ents.append(e)
        else:
            ent += e
    logp_N = torch.cat(logps) if logps else h_N_H.new_zeros(0)
    out = _scatter(logp_N, tgt_mask_B_L)
    if with_entropy in ("tokens", "grad"):
        return out, _scatter(torch.cat(ents) if ents else h_N_H.new_zeros(0), tgt_mask_B_L)
    return out, ent


def _scatter(x_N: torch.Tensor, tgt_mask_B_L: torch.Tensor) -> torch.Tensor:
    """Per-target values into the (B, L) layout of `tgt_mask_B_L` (row-major), zero elsewhere."""
    out = torch.zeros(tgt_mask_B_L.shape, dtype=x_N.dtype, device=x_N.device)
    return out.masked_scatter(tgt_mask_B_L.to(out.device), x_N)


def _chunk_logp(h_N_H, targets_N, temp_N, head, with_entropy: bool | str, proc: Processing = Processing(),
                hist=None):
    """Logprobs of `targets_N` from hidden states `h_N_H` (float32 logits, processed as the sampler did: penalty
    from `hist`, temperature, min_p) and their entropy as `with_entropy` asks (`ENTROPY`)."""
    logits = head(h_N_H).float()
    seen = None if hist is None else seen_tokens(hist[0], hist[1], logits.shape[-1])
    logits = processed_logits(logits, temp_N, proc, seen)
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets_N[:, None]).squeeze(-1) - lse
    ent = 0.0
    if with_entropy == "grad":  # H = lse - sum_v p_v z_v; a min_p cut (z = -inf, p = 0) adds nothing, nor NaN grads
        z = logits if proc.min_p <= 0 else torch.where(torch.isfinite(logits), logits, 0.0)
        ent = lse - (torch.exp(logits - lse[:, None]) * z).sum(-1)
    elif with_entropy:  # after logp: a recompute in backward stops once logp's saved tensors are back
        with torch.no_grad():
            plogp = torch.softmax(logits, -1) * logits
            if proc.min_p > 0:  # the cut tokens: 0 * -inf
                plogp = torch.where(torch.isfinite(logits), plogp, 0.0)
            ent_N = lse - plogp.sum(-1)
            ent = ent_N if with_entropy == "tokens" else float(ent_N.sum())
    return logp, ent


def _decoder_and_head(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def sequence_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float,
                      proc: Processing = Processing()) -> list[float]:
    """Logprobs of one completion: the trainer-side reference for sync verification and tests."""
    s = Sample(tuple(prompt_ids), tuple(completion_ids), (0.0,) * len(completion_ids), (0,) * len(completion_ids), 0.0)
    b = make_batch([s], pad_id=0, agg="token-mean", max_tokens=len(completion_ids))
    b = b.to(next(model.parameters()).device)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, b, temperature, proc=proc)
    return lp[b.tgt_mask_B_L].tolist()

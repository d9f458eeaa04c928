"""The logit processing a sampler applies besides temperature that the trainer applies again when it scores, so
that a behaviour logprob and the trainer's logprob of the same token are taken from the same distribution.

Both generators and the trainer call these functions (vLLM applies its own, with the same definitions):

    repetition_penalty  on the raw logits, before temperature: a token already in the prompt or the completion so
                        far has its logit divided by the penalty when positive, multiplied when negative (the
                        CTRL paper's penalty as transformers and vLLM implement it)
    min_p               after temperature: tokens whose probability is below min_p times the largest are removed
                        and the rest renormalised

top_p / top_k are not here: the trainer does not re-apply them (Config.top_p says so), a cut that is not
re-applied biases the importance ratio. vLLM applies min_p before top-k / top-p, transformers after; with top_p
and top_k off (their defaults) the two orders are the same distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Processing:
    """The processing a run samples with and the trainer re-applies (Config.min_p, Config.repetition_penalty)."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0


def penalise(logits_N_V: torch.Tensor, seen_N_V: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty on raw logits: each row's `seen` tokens divided by `penalty` when positive, times it
    when not."""
    hit = torch.where(logits_N_V > 0, logits_N_V / penalty, logits_N_V * penalty)
    return torch.where(seen_N_V, hit, logits_N_V)


def min_p_cut(scores_N_V: torch.Tensor, min_p: float) -> torch.Tensor:
    """Temperature-scaled logits with every token below `min_p` times the row's top probability set to -inf (the
    top token always stays). The cut is a mask, not differentiated through."""
    if min_p <= 0:
        return scores_N_V
    with torch.no_grad():
        drop = scores_N_V < scores_N_V.max(-1, keepdim=True).values + torch.log(torch.tensor(min_p))
    return scores_N_V.masked_fill(drop, float("-inf"))


def seen_tokens(ids_N_L: torch.Tensor, valid_N_L: torch.Tensor, vocab: int) -> torch.Tensor:
    """(N, vocab) bool: which tokens each row's valid ids contain."""
    counts = torch.zeros(ids_N_L.shape[0], vocab, dtype=torch.int32, device=ids_N_L.device)
    counts.scatter_add_(1, ids_N_L, valid_N_L.to(torch.int32))
    return counts > 0


def histories(ids_B_L: torch.Tensor, attn_B_L: torch.Tensor, tgt_mask_B_L: torch.Tensor):
    """For each target token of `tgt_mask_B_L` (row-major order), the ids before it in its row and which of them
    are real tokens (not padding): (ids_N_L, valid_N_L), the history a repetition penalty looks at."""
    r_N, j_N = torch.nonzero(tgt_mask_B_L, as_tuple=True)
    cols = torch.arange(ids_B_L.shape[1], device=ids_B_L.device)
    valid = (cols[None, :] < j_N[:, None]) & attn_B_L[r_N].bool()
    return ids_B_L[r_N], valid


def processed_logits(logits_N_V: torch.Tensor, temp_N: torch.Tensor, proc: Processing,
                     seen_N_V: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits → the scores the sampler drew from: penalty (needs `seen_N_V`), temperature, min_p."""
    if proc.penalised:
        logits_N_V = penalise(logits_N_V, seen_N_V, proc.repetition_penalty)
    return min_p_cut(logits_N_V / temp_N[:, None], proc.min_p)

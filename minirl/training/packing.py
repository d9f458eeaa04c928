"""Shared-prefix packed micro-batches: each prompt computed once for its completions, and no padding.

The idea is Prefix Grouper's (Liu et al., 2025, arXiv 2506.05433): the G completions of a group share their prompt,
so a group becomes one *segment* -- the prompt's tokens once, then each completion's tokens -- where every completion
attends to the prompt and to itself only. Here that is done with an explicit attention mask and position ids (each
completion's positions continue from the prompt's end, as in its own padded row), not by reusing a KV cache: the
forward and backward are one ordinary pass over the packed tokens, so gradients flow through the shared prompt
(summed over the completions that attend to it, which is what the padded path's per-row copies of the prompt
accumulate too) and activation checkpointing recomputes the same thing.

Several segments share a micro-batch, kept apart by the same mask (block diagonal), up to `token_budget` *real*
tokens: a micro-batch is one row of exactly the tokens it computes (each prompt once per segment, plus its
completions), no padding. A group whose prompt and completions exceed the budget is split into several segments,
each repeating the prompt. Completions are grouped by their prompt's token ids (two visits of one prompt in a batch
share a segment: each completion still sees only the prompt and itself).

The loss side is unchanged: a `PackedMicroBatch` carries `rows`, the padded `Batch` rows of its samples (with the
batch-wide aggregation weights), and `packed_completion_logprobs` returns logprobs in that layout, so `policy_loss`
runs on identical tensors in both paths. The mask is additive (0 / the dtype's minimum), which the eager and SDPA
attention implementations take; implementations that cannot take a custom mask (flash-attention) use the padded
path (`Trainer` falls back to it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from minirl.core.logits import Processing
from minirl.training.batch import Batch, Sample, _decoder_and_head, hidden_logprobs

MASKABLE_ATTENTION = ("eager", "sdpa")  # attention implementations that take an arbitrary 4-D mask


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch of segments packed into a single row of `n_real_tokens` tokens.

    `input_ids_1_T`, `position_ids_1_T`: the packed row; `segment_T`, `completion_T` (-1 on prompt tokens) say which
    segment and which completion each token belongs to (the mask is built from them on the device); `pred_idx_N`:
    for each loss target of `rows` (row-major over `rows.tgt_mask_B_L`), the packed position whose hidden state
    predicts it; `target_N`: that target token; `sample_R`: the batch row (sample index) of each of `rows`' rows."""
    input_ids_1_T: torch.Tensor
    position_ids_1_T: torch.Tensor
    segment_T: torch.Tensor
    completion_T: torch.Tensor
    pred_idx_N: torch.Tensor
    target_N: torch.Tensor
    sample_R: torch.Tensor
    rows: Batch

    @property
    def n_real_tokens(self) -> int:
        return int(self.input_ids_1_T.shape[1])

    def to(self, device) -> "PackedMicroBatch":
        return PackedMicroBatch(*(getattr(self, f).to(device) for f in (
            "input_ids_1_T", "position_ids_1_T", "segment_T", "completion_T", "pred_idx_N", "target_N", "sample_R")),
            rows=self.rows.to(device))

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """(1, 1, T, T) additive mask: token i sees token j iff both are in one segment, j <= i, and j is a prompt
        token or in i's own completion."""
        seg, comp = self.segment_T, self.completion_T
        T = seg.shape[0]
        causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
        allowed = causal & (seg[:, None] == seg[None, :]) & ((comp[None, :] < 0) | (comp[:, None] == comp[None, :]))
        mask = torch.zeros(T, T, dtype=dtype, device=seg.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]


def segments(samples: Sequence[Sample], token_budget: int) -> list[tuple[tuple[int, ...], list[int]]]:
    """(prompt ids, sample indices) per segment: samples grouped by prompt (first-seen order), a group split where
    its prompt plus completions would exceed `token_budget` (a single completion too long for it goes alone)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        by_prompt.setdefault(s.prompt_ids, []).append(i)
    out = []
    for prompt, idx in by_prompt.items():
        cur: list[int] = []
        size = len(prompt)
        for i in idx:
            n = len(samples[i].completion_ids)
            if cur and size + n > token_budget:
                out.append((prompt, cur))
                cur, size = [], len(prompt)
            cur.append(i)
            size += n
        out.append((prompt, cur))
    return out


def pack(samples: Sequence[Sample], batch: Batch, token_budget: int) -> list[PackedMicroBatch]:
    """Micro-batches of whole segments, each at most `token_budget` real tokens (a segment alone may exceed it
    only where one prompt plus one completion does): first-fit over segments sorted longest first. `batch` is
    `make_batch(samples, ...)`: its rows, with their batch-wide weights, are the loss's view."""
    segs = segments(samples, token_budget)
    size = [len(p) + sum(len(samples[i].completion_ids) for i in idx) for p, idx in segs]
    bins: list[list[int]] = []
    room: list[int] = []
    for k in sorted(range(len(segs)), key=lambda k: -size[k]):
        b = next((j for j, r in enumerate(room) if r >= size[k]), None)
        if b is None:
            bins.append([])
            room.append(token_budget)
            b = len(bins) - 1
        bins[b].append(k)
        room[b] -= size[k]
    return [_build([segs[k] for k in ks], samples, batch) for ks in bins]


def _build(segs, samples: Sequence[Sample], batch: Batch) -> PackedMicroBatch:
    ids: list[int] = []
    pos: list[int] = []
    seg_of: list[int] = []
    comp_of: list[int] = []
    start: dict[int, int] = {}  # sample index -> packed offset of its first completion token
    prompt_end: dict[int, int] = {}  # sample index -> packed offset of its prompt's last token
    rows: list[int] = []
    for s_id, (prompt, idx) in enumerate(segs):
        p_last = len(ids) + len(prompt) - 1
        ids += prompt
        pos += range(len(prompt))
        seg_of += [s_id] * len(prompt)
        comp_of += [-1] * len(prompt)
        for i in idx:
            c = samples[i].completion_ids
            start[i], prompt_end[i] = len(ids), p_last
            ids += c
            pos += range(len(prompt), len(prompt) + len(c))
            seg_of += [s_id] * len(c)
            comp_of += [i] * len(c)
            rows.append(i)
    view = batch.rows(rows)
    pred: list[int] = []
    tgt: list[int] = []
    for r, i in enumerate(rows):
        p = len(samples[i].prompt_ids)
        for t in torch.nonzero(view.tgt_mask_B_L[r]).flatten().tolist():  # row positions p .. p + len(c) - 1
            j = start[i] + (t - p)
            pred.append(prompt_end[i] if t == p else j - 1)
            tgt.append(ids[j])
    long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return PackedMicroBatch(long(ids)[None], long(pos)[None], long(seg_of), long(comp_of), long(pred), long(tgt),
                            long(rows), view)


def packed_completion_logprobs(model, mb: PackedMicroBatch, temperature: float | None = None,
                               with_entropy: bool | str = False, proc: Processing = Processing()):
    """`completion_logprobs` for a packed micro-batch: the same (rows, L) logprobs of `mb.rows`' completion tokens
    (and their entropy, as `batch.ENTROPY` says), from one forward over the packed row."""
    inner, head = _decoder_and_head(model)
    dtype = inner.get_input_embeddings().weight.dtype  # the attention's compute dtype (4-bit bases included)
    hidden = inner(input_ids=mb.input_ids_1_T, position_ids=mb.position_ids_1_T,
                   attention_mask=mb.attention_mask(dtype)).last_hidden_state[0]
    h_N_H = hidden[mb.pred_idx_N]
    rows = mb.rows
    if temperature is None:
        temp_N = rows.temp_B[:, None].expand(rows.tgt_mask_B_L.shape)[rows.tgt_mask_B_L].to(h_N_H.device)
    else:
        temp_N = torch.full(mb.target_N.shape, float(temperature), device=h_N_H.device)
    return hidden_logprobs(h_N_H, mb.target_N, temp_N, head, rows, with_entropy, proc=proc)

"""The static path's slots (`fast_decode.static_decode`): S rows of a KV cache of fixed shape, each holding one
sample (a request: prompt i's j-th sample) at a time, and the device state of the rows, changed in place only (a
CUDA graph replays the step on these addresses). Continuous refill: a slot whose sample ended is given the next
waiting sample (`Slots.fill`: its prompt's prefilled keys and values copied into the slot, its mask, position,
penalty history and counters reset, its first token drawn from the prompt's prefill logits), so a call with more
samples than slots, or samples of very different lengths, keeps the batch full without a new capture.

Layout: every slot keeps the left-padded prompt (width W) in cache columns [0, W) and its k-th generated token's
keys and values in column W + k, written at the slot's own column (`SlotLayer`: a per-row scatter, not the shared
column of transformers' `StaticLayer`). The query offset the mask is built with is the last column, so causality
hides nothing and the slot's 2D mask alone says what it sees: its prompt's real tokens and its own tokens so far
(a column left by the slot's previous sample is masked until the new sample writes it). RoPE positions are each
slot's own (`pos_S`), so a row's attention is exactly the loop's (`hf.decode`) for the same prefix.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache, StaticLayer


class SlotLayer(StaticLayer):
    """A `StaticLayer` whose update writes each row's one new key and value at that row's column `col_S[row]`
    (shared by every layer of the cache, advanced by the step). Its sequence length (the query offset) is held at
    the last column: causality hides nothing, the attention mask does the rest."""

    def __init__(self, max_cache_len: int, col_S: torch.Tensor):
        super().__init__(max_cache_len=max_cache_len)
        self.col_S = col_S

    def update(self, key_states, value_states, *args, **kwargs):
        S, H, _, _ = key_states.shape
        col = self.col_S.view(S, 1, 1, 1)
        self.keys.scatter_(2, col.expand(S, H, 1, key_states.shape[-1]), key_states)
        self.values.scatter_(2, col.expand(S, H, 1, value_states.shape[-1]), value_states)
        return self.keys, self.values


def slot_cache(model, pre: DynamicCache, slots: int, max_len: int, col_S: torch.Tensor) -> Cache:
    """A cache of `slots` rows x `max_len` columns of `SlotLayer`s, shaped (heads, head dim, dtype, device) as the
    prefill `pre`; empty (zeros) until `Slots.fill` copies prompts in."""
    if any(StaticCache(config=model.config, max_cache_len=max_len).is_sliding):
        raise ValueError("hf_decode='static' does not support models with sliding-window attention layers: use "
                         "hf_decode='loop'")
    cache = Cache(layers=[SlotLayer(max_len, col_S) for _ in pre.layers])
    k0 = pre.layers[0].keys
    cache.early_initialization(slots, [x.keys.shape[1] for x in pre.layers], [x.keys.shape[-1] for x in pre.layers],
                               k0.dtype, k0.device)
    for layer in cache.layers:
        layer.cumulative_length.fill_(max_len - 1)
    return cache


class Slots:
    """The device state of S slots: the last token fed (`tok_S`) and its position (`pos_S`), the tokens generated
    so far (`t_S`; the last one's cache column is W - 1 + t), the mask over the cache, the penalty's history,
    which slots go on (`live_S`), and the outputs ((S, T + 1): column T takes the writes of ended rows).

    `prompts`: the prefill (`pre`, one row per prompt), each prompt's attention mask (P, W), last position (P,),
    penalty history (P, V) or None, last logits (P, V) and last token (P,)."""

    def __init__(self, S: int, T: int, cache: Cache, col_S: torch.Tensor, pre: DynamicCache, attn_P_W, last_pos_P,
                 seen_P_V, logits_P_V, last_tok_P, eos: int):
        dev = attn_P_W.device
        W = attn_P_W.shape[1]
        self.S, self.T, self.W, self.eos, self.cache, self.col_S = S, T, W, eos, cache, col_S
        self.pre, self.attn_P_W, self.last_pos_P, self.seen_P_V = pre, attn_P_W, last_pos_P, seen_P_V
        self.logits_P_V, self.last_tok_P = logits_P_V, last_tok_P
        self.mask_S_L = attn_P_W.new_zeros(S, W + T)
        self.seen_S_V = None if seen_P_V is None else seen_P_V.new_zeros(S, seen_P_V.shape[1])
        self.tok_S = torch.zeros(S, dtype=torch.long, device=dev)
        self.pos_S = torch.zeros(S, dtype=torch.long, device=dev)
        self.t_S = torch.zeros(S, dtype=torch.long, device=dev)
        self.live_S = torch.zeros(S, dtype=torch.bool, device=dev)
        self.toks_S_T = torch.zeros(S, T + 1, dtype=torch.long, device=dev)
        self.logp_S_T = torch.zeros(S, T + 1, dtype=torch.float32, device=dev)

    def advance_column(self) -> None:
        """Before a step: each slot's column for the token it feeds (W - 1 + t), shown in its mask."""
        self.col_S.copy_((self.t_S + (self.W - 1)).clamp_(max=self.W + self.T - 1))
        self.mask_S_L.scatter_(1, self.col_S[:, None], 1)

    def record(self, nxt_S: torch.Tensor, lp_S: torch.Tensor) -> None:
        """The step's tokens and logprobs written at each slot's count; a live slot advances and ends at `eos` or
        at T tokens; an ended slot stays where it is (its writes land past its tokens)."""
        self.toks_S_T.scatter_(1, self.t_S[:, None], nxt_S[:, None])
        self.logp_S_T.scatter_(1, self.t_S[:, None], lp_S[:, None])
        go = self.live_S.long()
        self.t_S.add_(go)
        self.pos_S.add_(go)
        self.live_S.logical_and_((nxt_S != self.eos) & (self.t_S < self.T))
        self.tok_S.copy_(nxt_S)

    def fill(self, slots: list[int], prompts: list[int], pick) -> None:
        """Give `slots` to samples of `prompts` (eager, in place): the prompt's prefilled keys and values into the
        slot's first W columns, its mask (the columns past W hidden), position, history and counters, then its
        first token drawn by `pick(logits, last tokens, seen)` from the prompt's prefill logits."""
        dev = self.t_S.device
        s, p = torch.tensor(slots, device=dev), torch.tensor(prompts, device=dev)
        for src, dst in zip(self.pre.layers, self.cache.layers):
            dst.keys[s, :, : self.W] = src.keys[p]
            dst.values[s, :, : self.W] = src.values[p]
        self.mask_S_L[s] = 0
        self.mask_S_L[s, : self.W] = self.attn_P_W[p]
        seen = None
        if self.seen_S_V is not None:
            seen = self.seen_P_V[p].clone()
            self.seen_S_V[s] = seen
        nxt, lp = pick(self.logits_P_V[p], self.last_tok_P[p][:, None], seen)
        self.toks_S_T[s, 0], self.logp_S_T[s, 0] = nxt, lp
        self.t_S[s], self.pos_S[s], self.tok_S[s] = 1, self.last_pos_P[p] + 1, nxt
        self.live_S[s] = (nxt != self.eos) & (self.T > 1)

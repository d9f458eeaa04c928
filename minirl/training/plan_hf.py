"""The memory plan's figures for the transformers generator (`training.plan`, the parts 'generate KV cache',
'sampling logits' and 'CUDA graphs'): the loop (`hf.decode`) holds the KV cache of one step's sequences at once;
the static path (`hf_decode: static`, `generation/fast_decode.py`) holds a cache of S slots x (prompt +
max_tokens), refilled as samples end, S the most that fit in what the device has left (at most one step's
sequences), and on a GPU the private pool of the captured step.

The captured step's pool is an allowance, not measured on a GPU yet (`scripts/gpu_check.py`, section
`generation`, records the real peaks): per slot the sampling's float32 copies of the vocabulary row (logits,
penalised, warped, top-p's sort and cumulative sum, softmax, the exponential draws, their ratio, log-softmax:
8) and the sort's int64 indices, the model's own logits, one decoder layer's intermediates (the residual, q, k,
v, the attention output, gate, up and their product), the attention scores and mask over the cache; plus
`GRAPH_FIXED_GB`. The prompts' prefill cache (kept while samples wait for a slot) is counted with the KV cache.
"""
from __future__ import annotations

import math

GiB = 2**30
GRAPH_FIXED_GB = 0.0625  # the graph's own bookkeeping and the allocator's rounding of its pool (not measured)


def graph_bytes_per_slot(shape, b: int, cache_len: int) -> int:
    """The captured step's pool per slot (module docstring), weights of `b` bytes, a cache of `cache_len`."""
    sampling = shape.vocab * (8 * 4 + 8 + b)
    layer = b * (4 * shape.hidden + 3 * shape.heads * shape.head_dim + 3 * shape.intermediate)
    return sampling + layer + cache_len * (4 * shape.heads + 4)


def hf_generator_parts(shape, b: int, prompts: int, seqs: int, prompt: int, max_tokens: int, static: bool,
                       gpu: bool, room_bytes: float | None) -> tuple[dict[str, float], int]:
    """(parts in GiB, slots) of the transformers generator's generation phase: `prompts` prompts of `prompt`
    tokens, `seqs` samples of up to `max_tokens`, weights of `b` bytes. The loop: every sample's KV cache and
    two float32 vocabulary rows each (slots 0). The static path: S = the most slots `room_bytes` (what the device
    has left for them; None: no limit) holds, at least 1, at most `seqs`."""
    kv, seq_len = shape.kv_bytes_per_token(b), prompt + max_tokens
    if not static:
        return {"generate KV cache": seqs * seq_len * kv / GiB, "sampling logits": seqs * shape.vocab * 4 * 2 / GiB}, 0
    per_slot = seq_len * kv + (graph_bytes_per_slot(shape, b, seq_len) if gpu else shape.vocab * 4 * 2)
    fixed = prompts * prompt * kv + (GRAPH_FIXED_GB * GiB if gpu else 0)
    slots = seqs if room_bytes is None else min(seqs, max(1, math.floor((room_bytes - fixed) / per_slot)))
    parts = {"generate KV cache": (slots * seq_len + prompts * prompt) * kv / GiB}
    if gpu:
        parts["CUDA graphs"] = (slots * graph_bytes_per_slot(shape, b, seq_len) + GRAPH_FIXED_GB * GiB) / GiB
    else:
        parts["sampling logits"] = slots * shape.vocab * 4 * 2 / GiB
    return parts, slots

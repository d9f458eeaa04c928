"""The transformers generator's static decoding path (`hf_decode: static`): the same model, the same processing
and the same distribution as `hf.decode`, laid out so that one decoding step has fixed shapes and addresses.

- **A static KV cache** (transformers' `StaticCache`), allocated once per call for rows x (prompt width +
  max_tokens): the prompts are prefilled once (as `decode` prefills them: a `DynamicCache`, so the first token's
  logits are `decode`'s bit for bit), then copied n times into it.
- **A step with no host round trip**: the forward of the rows' last tokens, the repetition-penalty history, the
  warpers (`decode`'s, in its order), the draw and the behaviour logprob, then the bookkeeping (the token and its
  logprob written into (rows, max_tokens) buffers, positions advanced, a row ended at `eos`), all in place on the
  device. On CUDA the step is captured in a CUDA graph after `WARMUP` eager steps and replayed; a capture that
  fails falls back to the same step run eagerly (`report['graphs']` says why). On CPU the same code runs eagerly.
- **Ended rows stay in the batch** (fixed shapes): an ended row goes on decoding into its slot and its tokens
  past the end are dropped on the host. The host looks every `CHECK_EVERY` steps (one sync): stop strings of the
  rows still going (`stopped`, the check `decode` makes after every token, over the tokens since the last look),
  and whether every row has ended (then decoding stops). At the end each row is cut at its first `eos` or stop
  string, exactly where `decode` ends it. Continuous refill (a finished row's slot given to a waiting sample) is
  not done: the next step for long-tailed lengths.
- **Sampling departs from `decode` in its random draws only**: the token is the argmax of p / E with E ~ Exp(1)
  per (row, token) (the exponential race: a draw from p, without the cumulative sum and search of
  `torch.multinomial`, and capturable). So a seed gives other tokens than `decode`'s, from the same distribution;
  greedy (temperature 0) gives `decode`'s tokens. A row's draws do not depend on when other rows end.

The adapter is whatever the model holds during the call (`HFGenerator` runs it under `merged_lora` when merging):
the version is fixed for the call, as in `decode`.
"""
from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache, StaticCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minirl.core.logits import Processing, min_p_cut, penalise, seen_tokens
from minirl.types import SamplingParams

DECODES = ("auto", "loop", "static")
CHECK_EVERY = 16  # decoding steps between the host's looks (stop strings, every row ended)
WARMUP = 2  # eager decoding steps before the CUDA graph is captured (lazy initialisations run outside it)


def resolve_decode(mode: str, device: torch.device | str) -> str:
    """'loop' or 'static' for `Config.hf_decode`. 'auto' is the loop everywhere for now; it will pick static on
    CUDA once the GPU measurement (`scripts/gpu_check.py`, section `generation`) has shown it faster."""
    if mode not in DECODES:
        raise ValueError(f"hf_decode={mode!r}: use one of {', '.join(DECODES)}")
    return "loop" if mode == "auto" else mode


def warpers(params: SamplingParams) -> LogitsProcessorList:
    """`decode`'s warpers, in its (and `generate`'s) order: temperature, top-k, top-p (none for greedy)."""
    warp = LogitsProcessorList()
    if params.temperature == 0:
        return warp
    if params.temperature != 1.0:
        warp.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warp.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warp.append(TopPLogitsWarper(params.top_p))
    return warp


def sample(scores_B_V: torch.Tensor, greedy: bool) -> torch.Tensor:
    """One token per row from softmax(scores): argmax for greedy, else the exponential race argmax(p / E),
    E ~ Exp(1) (a token of probability 0 is never drawn; E is kept above 0 so that p / E stays finite)."""
    if greedy:
        return scores_B_V.argmax(-1)
    e = torch.empty_like(scores_B_V).exponential_().clamp_min_(torch.finfo(scores_B_V.dtype).tiny)
    return (torch.softmax(scores_B_V, -1) / e).argmax(-1)


class _Rows:
    """The decoding state of B rows on the device, changed in place only (a CUDA graph replays on its addresses):
    the last token fed and its position, the attention mask over the whole cache (padding 0, the rest 1: causality
    hides the slots not written yet), the penalty's history, which rows go on, and the outputs."""

    def __init__(self, B: int, T: int, mask_B_L: torch.Tensor, pos_B: torch.Tensor, seen_B_V, eos: int):
        dev = mask_B_L.device
        self.T, self.eos, self.mask_B_L, self.pos_B, self.seen_B_V = T, eos, mask_B_L, pos_B, seen_B_V
        self.tok_B = torch.zeros(B, dtype=torch.long, device=dev)
        self.live_B = torch.ones(B, dtype=torch.bool, device=dev)
        self.toks_B_T = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.logp_B_T = torch.zeros(B, T, dtype=torch.float32, device=dev)
        self.t_1 = torch.zeros(1, dtype=torch.long, device=dev)  # the step being written

    def record(self, nxt_B: torch.Tensor, lp_B: torch.Tensor) -> None:
        self.toks_B_T.index_copy_(1, self.t_1, nxt_B[:, None])
        self.logp_B_T.index_copy_(1, self.t_1, lp_B[:, None])
        self.live_B.logical_and_(nxt_B != self.eos)
        self.tok_B.copy_(nxt_B)
        self.pos_B.add_(1)
        self.t_1.add_(1)


def _static_cache(model, pre: DynamicCache, rows: int, n: int, width: int, max_len: int) -> StaticCache:
    """A StaticCache of `rows` x `max_len` holding each prompt's prefilled keys and values (`pre`) n times."""
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    if any(cache.is_sliding):
        raise ValueError("hf_decode='static' does not support models with sliding-window attention layers: use "
                         "hf_decode='loop'")
    k0 = pre.layers[0].keys
    cache.early_initialization(rows, [x.keys.shape[1] for x in pre.layers], [x.keys.shape[-1] for x in pre.layers],
                               k0.dtype, k0.device)
    for src, dst in zip(pre.layers, cache.layers):
        dst.keys[:, :, :width].copy_(src.keys.repeat_interleave(n, 0))
        dst.values[:, :, :width].copy_(src.values.repeat_interleave(n, 0))
        dst.cumulative_length.fill_(width)
    return cache


def _first_stop(row: list[int], start: int, stopped: Callable[[list[int]], bool]) -> int | None:
    """The first length k > start at which `stopped(row[:k])` holds (where `decode` ends the row), or None."""
    return next((k for k in range(start + 1, len(row) + 1) if stopped(row[:k])), None)


def capture_step(step: Callable[[], None], report: dict) -> Callable[[], None]:
    """`step` captured in a CUDA graph (recorded, not run: the caller replays it for this step too); on failure
    the eager step, with the reason in `report['graphs']`."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except Exception as e:  # noqa: BLE001 - the eager step is the same computation
        report["graphs"] = f"capture failed, eager: {type(e).__name__}: {str(e)[:200]}"
        return step
    report["graphs"] = "captured"
    return graph.replay


@torch.no_grad()
def static_decode(model, input_ids, attn, params: SamplingParams, eos: int, n: int = 1,
                  stopped: Callable[[list[int]], bool] | None = None, graphs: bool | None = None,
                  check_every: int = CHECK_EVERY, report: dict | None = None
                  ) -> tuple[list[list[int]], list[list[float]]]:
    """`hf.decode`'s contract (rows i*n .. i*n+n-1 sample prompt i of the left-padded `input_ids`; each row's
    tokens, `eos` included where it ended there, and their processed logprobs) on the static path (module
    docstring). `graphs`: capture the step in a CUDA graph (None: on CUDA). `report` gets what ran: steps, host
    looks, graphs."""
    report = {} if report is None else report
    greedy = params.temperature == 0
    warp, proc = warpers(params), Processing(0.0 if greedy else params.min_p, params.repetition_penalty)
    dev = model.device
    graphs = dev.type == "cuda" if graphs is None else graphs
    P, width = input_ids.shape
    B, T = P * n, params.max_tokens
    ids, attn = input_ids.to(dev), attn.to(dev)
    pos_P_L = (attn.cumsum(-1) - 1).clamp(min=0)
    pre = DynamicCache()
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos_P_L, past_key_values=pre, use_cache=True,
                logits_to_keep=1)
    logits = out.logits[:, -1].float().repeat_interleave(n, 0)
    del out
    cache = _static_cache(model, pre, B, n, width, width + T)
    del pre
    mask = torch.cat([attn, attn.new_ones(P, T)], 1).repeat_interleave(n, 0)
    seen = None
    if proc.penalised:
        seen = seen_tokens(ids, attn, logits.shape[-1]).repeat_interleave(n, 0)
    st = _Rows(B, T, mask, pos_P_L[:, -1].repeat_interleave(n), seen, eos)

    def pick(logits_B_V: torch.Tensor, ids_B_1: torch.Tensor) -> None:
        if proc.penalised:
            logits_B_V = penalise(logits_B_V, st.seen_B_V, proc.repetition_penalty)
        scores = min_p_cut(warp(ids_B_1, logits_B_V), proc.min_p)
        nxt = sample(scores, greedy)
        st.record(nxt, torch.log_softmax(scores, -1).gather(-1, nxt[:, None]).squeeze(1))

    def step() -> None:  # fixed shapes, in place, no host sync: what the CUDA graph captures
        o = model(input_ids=st.tok_B[:, None], attention_mask=st.mask_B_L, position_ids=st.pos_B[:, None],
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
        if st.seen_B_V is not None:  # the token just fed joins its row's history
            st.seen_B_V.scatter_(1, st.tok_B[:, None], True)
        pick(o.logits[:, -1].float(), st.tok_B[:, None])

    pick(logits, ids[:, -1:].repeat_interleave(n, 0))  # the first token, from the prefill's logits
    del logits
    stop_at: list[int | None] = [None] * B
    scanned = [0] * B  # tokens of each row the stop check has looked at
    run, steps, looks = step, 1, 0
    report["graphs"] = "off"
    while steps < T:
        if steps % check_every == 0:  # the host looks: one sync every check_every steps
            looks += 1
            if _look(st, steps, stopped, stop_at, scanned):
                break
        if graphs and steps == 1 + WARMUP:
            run = capture_step(step, report)
        run()
        steps += 1
    report.update(decode="static", steps=steps, host_looks=looks)
    rows, lps = st.toks_B_T[:, :steps].tolist(), st.logp_B_T[:, :steps].tolist()
    for r in range(B):
        end = rows[r].index(eos) + 1 if eos in rows[r] else steps
        if stopped is not None and stop_at[r] is None:
            stop_at[r] = _first_stop(rows[r][:end], scanned[r], stopped)
        end = min(end, stop_at[r] or end)
        rows[r], lps[r] = rows[r][:end], lps[r][:end]
    return rows, lps


def _look(st: _Rows, steps: int, stopped, stop_at: list, scanned: list) -> bool:
    """The host's look after `steps` tokens: the rows still going that reached a stop string end (on the device
    too); True when no row goes on."""
    if stopped is not None:
        live = st.live_B.tolist()
        rows = st.toks_B_T[:, :steps].tolist()
        ended = []
        for r, go in enumerate(live):
            if go and stop_at[r] is None:
                stop_at[r] = _first_stop(rows[r], scanned[r], stopped)
                scanned[r] = steps
                if stop_at[r] is not None:
                    ended.append(r)
        if ended:
            st.live_B[torch.tensor(ended, device=st.live_B.device)] = False
    return not bool(st.live_B.any())

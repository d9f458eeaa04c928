"""The transformers generator's static decoding path (`hf_decode: static`): the same model, the same processing
and the same distribution as `hf.decode`, laid out so that one decoding step has fixed shapes and addresses.

- **A static KV cache of S slots** (`slots.py`), allocated once per call for S x (prompt width + max_tokens):
  the prompts are prefilled once (as `decode` prefills them: a `DynamicCache`, so the first token's logits are
  `decode`'s bit for bit); each slot takes one sample (prompt i's j-th) at a time, its prompt's keys and values
  copied in. S: the caller's (`HFGenerator.slots`, sized by the memory plan), else one a sample.
- **A step with no host round trip**: each slot's column and mask advanced, the forward of the slots' last
  tokens (each at its own position and cache column), the repetition-penalty history, the warpers (`decode`'s,
  in its order), the draw and the behaviour logprob, then the bookkeeping (the token and its logprob written at
  the slot's count, a slot ended at `eos` or max_tokens), all in place on the device. On CUDA the step is
  captured in a CUDA graph after `WARMUP` eager steps and replayed; a capture that fails falls back to the same
  step run eagerly (`report['graphs']` says why). On CPU the same code runs eagerly.
- **Continuous refill**: an ended slot stays in the batch (fixed shapes; its writes land past its tokens) until
  the host looks: every `check_every` steps (one sync), and when a slot must have ended (max_tokens) while
  samples wait. A look ends the rows that reached a stop string (`stopped`, the check `decode` makes after every
  token, over the tokens since the last look), cuts each ended sample where `decode` ends it, and gives its slot
  to the next waiting sample (in place: no new capture). Decoding stops when no slot holds a sample.
- **Sampling departs from `decode` in its random draws only**: the token is the argmax of p / E with E ~ Exp(1)
  per (row, token) (the exponential race: a draw from p, without the cumulative sum and search of
  `torch.multinomial`, and capturable). So a seed gives other tokens than `decode`'s, from the same distribution;
  greedy (temperature 0) gives `decode`'s tokens. Without refill (S = samples) a row's draws do not depend on
  when other rows end; with it, a seed's draws follow the slots' schedule (deterministic for a seed).

The adapter is whatever the model holds during the call (`HFGenerator` runs it under `merged_lora` when merging):
the version is fixed for the call, as in `decode`.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minirl.core.logits import Processing, min_p_cut, penalise, seen_tokens
from minirl.generation.slots import Slots, slot_cache
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
                  check_every: int = CHECK_EVERY, report: dict | None = None, slots: int | None = None
                  ) -> tuple[list[list[int]], list[list[float]]]:
    """`hf.decode`'s contract (rows i*n .. i*n+n-1 sample prompt i of the left-padded `input_ids`; each row's
    tokens, `eos` included where it ended there, and their processed logprobs) on the static path (module
    docstring), in `slots` cache rows (None: one a row; fewer: continuous refill). `graphs`: capture the step in a
    CUDA graph (None: on CUDA). `report` gets what ran: steps, host looks, refills, slots, graphs."""
    report = {} if report is None else report
    greedy = params.temperature == 0
    warp, proc = warpers(params), Processing(0.0 if greedy else params.min_p, params.repetition_penalty)
    dev = model.device
    graphs = dev.type == "cuda" if graphs is None else graphs
    P, width = input_ids.shape
    B, T = P * n, params.max_tokens
    S = B if slots is None else max(1, min(int(slots), B))
    ids, attn = input_ids.to(dev), attn.to(dev)
    pos_P_L = (attn.cumsum(-1) - 1).clamp(min=0)
    pre = DynamicCache()
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos_P_L, past_key_values=pre, use_cache=True,
                logits_to_keep=1)
    logits = out.logits[:, -1].float()
    del out
    seen = seen_tokens(ids, attn, logits.shape[-1]) if proc.penalised else None
    col_S = torch.zeros(S, dtype=torch.long, device=dev)
    cache = slot_cache(model, pre, S, width + T, col_S)
    st = Slots(S, T, cache, col_S, pre, attn, pos_P_L[:, -1], seen, logits, ids[:, -1], eos)

    def pick(logits_B_V: torch.Tensor, ids_B_1: torch.Tensor, seen_B_V) -> tuple[torch.Tensor, torch.Tensor]:
        if seen_B_V is not None:
            logits_B_V = penalise(logits_B_V, seen_B_V, proc.repetition_penalty)
        scores = min_p_cut(warp(ids_B_1, logits_B_V), proc.min_p)
        nxt = sample(scores, greedy)
        return nxt, torch.log_softmax(scores, -1).gather(-1, nxt[:, None]).squeeze(1)

    def step() -> None:  # fixed shapes, in place, no host sync: what the CUDA graph captures
        st.advance_column()
        o = model(input_ids=st.tok_S[:, None], attention_mask=st.mask_S_L, position_ids=st.pos_S[:, None],
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
        if st.seen_S_V is not None:  # the token just fed joins its row's history
            st.seen_S_V.scatter_(1, st.tok_S[:, None], True)
        st.record(*pick(o.logits[:, -1].float(), st.tok_S[:, None], st.seen_S_V))

    host = _Host(st, B, n, stopped, pick)
    host.fill(list(range(S)), 0)
    run, calls, last, looks = step, 0, 0, 0
    report["graphs"] = "off"
    while host.occupied():
        early = calls - last >= check_every or (bool(host.pending) and calls >= host.deadline(min))
        if early or calls >= host.deadline(max):  # the host looks (one sync); at the last deadline: the end
            looks, last = looks + early, calls
            host.fill(host.harvest(), calls)
            continue
        if graphs and calls == WARMUP and run is step:
            run = capture_step(step, report)
        run()
        calls += 1
    report.update(decode="static", steps=calls + 1, host_looks=looks, slots=S, refills=host.refills)
    return host.rows, host.lps


class _Host:
    """The host's side of the slots: which sample each slot holds and since which step, the samples waiting, the
    stop-string checks, and the finished samples' tokens and logprobs (in request order)."""

    def __init__(self, st: Slots, B: int, n: int, stopped, pick):
        self.st, self.n, self.stopped, self.pick = st, n, stopped, pick
        self.pending = deque(range(B))
        self.occupant: list[int | None] = [None] * st.S
        self.start, self.scanned = [0] * st.S, [0] * st.S
        self.rows: list[list[int]] = [[] for _ in range(B)]
        self.lps: list[list[float]] = [[] for _ in range(B)]
        self.refills, self._first = 0, True

    def occupied(self) -> list[int]:
        return [s for s, r in enumerate(self.occupant) if r is not None]

    def deadline(self, which) -> int:
        """The step by which the first (min) or every (max) occupied slot has ended: T tokens, the first from the
        fill, one a step after it."""
        return which(self.start[s] for s in self.occupied()) + self.st.T - 1

    def fill(self, free: list[int], step: int) -> None:
        take = [self.pending.popleft() for _ in free[: len(self.pending)]]
        slots = free[: len(take)]
        for s, r in zip(slots, take):
            self.occupant[s], self.start[s], self.scanned[s] = r, step, 0
        if slots:
            self.st.fill(slots, [r // self.n for r in take], self.pick)
            self.refills += 0 if self._first else len(slots)
        self._first = False
        if not self.pending:
            self.st.pre = None  # no sample waits for a slot: the prefill's cache goes now

    def harvest(self) -> list[int]:
        """Read the slots back (one sync): a sample that ended (`eos`, T tokens, or a stop string since the last
        look, where `decode` ends it) is cut there and its slot freed (and stopped on the device); the freed slots."""
        st = self.st
        t, live = st.t_S.tolist(), st.live_S.tolist()
        toks, lps = st.toks_S_T.tolist(), st.logp_S_T.tolist()
        freed, halted = [], []
        for s in self.occupied():
            row, end = toks[s][: t[s]], None
            if self.stopped is not None:
                end = _first_stop(row, self.scanned[s], self.stopped)
                self.scanned[s] = t[s]
            if end is None and live[s]:
                continue
            end = end or t[s]
            r = self.occupant[s]
            self.rows[r], self.lps[r], self.occupant[s] = row[:end], lps[s][:end], None
            freed.append(s)
            halted += [s] if live[s] else []
        if halted:
            st.live_S[torch.tensor(halted, device=st.live_S.device)] = False
        return freed

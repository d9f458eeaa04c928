"""Transformers generation split across processes of one core each (`gen_workers` > 1, CPU).

Why: decoding a small model on CPU is largely Python and per-step overhead that a second torch thread does not
share. On the long-tail workload of `bench pipeline` (AVX2 machine, ebc302a) the same step's tokens took 71.5 s on
2 threads and 85.2 s on 1 (1.19x for twice the cores). Processes do not share that overhead: each of W workers,
pinned to its own core(s), generates its share of the step's groups, and the groups come back in prompt order.

Each worker is a `ProcGenerator` (`hf_process.py`: the trainer's model code, its own model copy, the adapter
through its own shared-memory buffer), so the synchronous loop pushes the adapter to every worker after a step
(`ShmSync`, a few ms each) and the sync check runs on each of them (`replicas`: a worker left on an old adapter
fails it, named). A worker's samples follow its own seed (the step's seed mixed with its first prompt's index),
so tokens differ from a single generator's for the same seed; greedy decoding does not depend on it.
"""
from __future__ import annotations

import concurrent.futures as cf
from dataclasses import replace
from typing import Sequence

from ..types import Group, Prompt, SamplingParams
from .hf_process import GeneratorProcessError, ProcGenerator
from .vllm import request_seed  # a pure function: the module imports vllm only where an engine is made


def shares(items: Sequence, n: int) -> list[list]:
    """`items` in n contiguous runs, sizes differing by at most one (empty runs left out)."""
    q, r = divmod(len(items), n)
    out, i = [], 0
    for k in range(n):
        j = i + q + (k < r)
        if j > i:
            out.append(list(items[i:j]))
        i = j
    return out


class ProcPool:
    """`Generator` over W `ProcGenerator` workers (started together): `generate` gives each a contiguous share of
    the prompts and joins their groups in prompt order; `push` / `load_adapter` reach every worker; `replicas`
    lets the run's sync check verify each one."""

    name = "hf"
    same_numerics = True

    def __init__(self, cfg, tensors, places: list[list[int] | None], device: str = "cpu"):
        self._ex = cf.ThreadPoolExecutor(len(places), thread_name_prefix="minirl-genpool")
        starts = [self._ex.submit(ProcGenerator, cfg, tensors, cores=p, device=device) for p in places]
        cf.wait(starts)
        self.workers = [f.result() for f in starts if f.exception() is None]
        failed = next((f.exception() for f in starts if f.exception() is not None), None)
        if failed is not None:
            self.close()
            raise failed
        for i, (w, p) in enumerate(zip(self.workers, places)):
            w.cores = p
            w.url = f"generator process {i} (cores {','.join(map(str, p))})" if p else f"generator process {i}"
        self.nbytes = sum(w.nbytes for w in self.workers)
        self.dtype = self.workers[0].dtype

    @property
    def replicas(self) -> list[ProcGenerator]:
        return self.workers

    @property
    def version(self) -> int:
        return self.workers[0].version

    def _all(self, fn) -> list:
        return [f.result() for f in [self._ex.submit(fn, w) for w in self.workers]]

    def served_version(self) -> int:
        """The version every worker serves, or the first that differs from the one pushed."""
        got = self._all(lambda w: w.served_version())
        return next((v for v in got if v != self.version), got[0])

    def push(self, version: int) -> None:
        self._all(lambda w: w.push(version))

    def load_adapter(self, path: str, version: int) -> None:
        self._all(lambda w: w.load_adapter(path, version))

    def generate(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> list[Group]:
        parts = shares(list(prompts), len(self.workers))
        futs = [self._ex.submit(w.generate, part, n, params if params.seed is None or k == 0 else
                                replace(params, seed=request_seed(params.seed, part[0].index, k)))
                for k, (w, part) in enumerate(zip(self.workers, parts))]
        return [g for f in futs for g in f.result()]

    def score(self, prompt_ids, completion_ids, temperature: float) -> list[float]:
        return self.workers[0].score(prompt_ids, completion_ids, temperature)

    def close(self) -> None:
        for w in getattr(self, "workers", []):
            w.close()
        self._ex.shutdown(wait=False)


__all__ = ["ProcPool", "GeneratorProcessError", "shares"]

"""What the asynchronous generators share (`VLLMGenerator`, `ServerGenerator`): the loop thread they run on, the
per-request seed, the table of the adapters they serve, `stream` / `generate` / `submit`, and closing. Imports no
vLLM.

A subclass defines `generate_group` (one prompt's G completions, on the loop) and gives its engine to the loop
thread (`self._engine.llm`, shut down at close).
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import hashlib
import weakref
from collections import Counter
from typing import Any, AsyncIterator, Callable, Hashable, Sequence

from minirl.generation.engine_thread import EngineThread, gather_or_cancel, in_finish_order
from minirl.types import Group, Prompt, SamplingParams


def request_seed(seed: int, *key: int) -> int:
    """The one deterministic per-request seed: of a prompt's visit (`seed, prompt index, visit`), of an episode's
    turn (`seed, turn` / `seed, prompt, sample, turn`), of a resubmitted sequence. vLLM gives sample j of a
    request seed + j."""
    digest = hashlib.blake2b(":".join(map(str, (seed, *key))).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x3FFFFFFF


class ServedAdapters:
    """The adapters a generator serves: the one new requests get (`serving`: adapter, version), how many requests
    in flight use each, and when a replaced one may go. `key(adapter)` names an adapter in the engine (None: the
    base model, never counted nor removed). Single-threaded on the generator's loop, except `serving`, which is
    replaced whole (one read gives a matching adapter and version)."""

    def __init__(self, key: Callable[[Any], Hashable | None], base: Any = None):
        self.key = key
        self.serving: tuple[Any, int] = (base, 0)
        self._inflight: Counter = Counter()

    @property
    def version(self) -> int:
        return self.serving[1]

    def acquire(self) -> tuple[Any, int]:
        """The adapter and version for a new request, counted as in flight until `release`."""
        adapter, version = self.serving
        k = self.key(adapter)
        if k is not None:
            self._inflight[k] += 1
        return adapter, version

    def release(self, adapter: Any) -> bool:
        """A request on `adapter` ended; True when the adapter was replaced and nothing uses it any more (the
        caller removes it from the engine)."""
        k = self.key(adapter)
        if k is None:
            return False
        self._inflight[k] -= 1
        if self._inflight[k] > 0:
            return False
        del self._inflight[k]
        return k != self.key(self.serving[0])

    def serve(self, adapter: Any, version: int) -> Any | None:
        """New requests get `adapter` as `version`. Returns the adapter it replaces when that one may be removed
        now (no request in flight uses it, and it is not the same engine adapter swapped in place); else None (it
        goes at its last `release`)."""
        old = self.serving[0]
        self.serving = (adapter, version)
        k = self.key(old)
        if k is None or k == self.key(adapter) or self._inflight.get(k):
            return None
        return old

    def in_flight(self) -> set:
        """Keys of the adapters requests in flight use."""
        return set(self._inflight)


class LoopGenerator:
    """A generator on a loop thread of its own (`EngineThread`): callers in other threads use `generate` /
    `submit` / `call`; code on the loop (the async pipeline) awaits `generate_group` or iterates `stream`.
    Per-request seeds count each prompt's visits (`restart_seeds` starts over)."""

    name = "?"
    dtype = "float32"
    same_numerics = False  # vLLM's kernels, not the trainer's model code
    on_event: Callable[..., None] | None = None  # no engine events (ServerGenerator's servers have some)
    adapters: ServedAdapters

    def __init__(self):
        self._engine = EngineThread()
        # Shut down at garbage collection, and at interpreter exit before multiprocessing's own exit hook
        # (registered earlier, so it runs later) would kill the engine under its loop.
        self._finalizer = weakref.finalize(self, self._engine.close)
        atexit.register(self._engine.close)
        self._visits: dict[int, int] = {}  # prompt index -> times submitted (for per-request seeds)
        self.tokens_generated = 0

    async def generate_group(self, prompt: Prompt, n: int, params: SamplingParams) -> Group:
        raise NotImplementedError

    def _next_seed(self, prompt: Prompt, params: SamplingParams) -> int | None:
        """The seed of this visit of `prompt` (None: unseeded)."""
        if params.seed is None:
            return None
        visit = self._visits.get(prompt.index, 0)
        self._visits[prompt.index] = visit + 1
        return request_seed(params.seed, prompt.index, visit)

    def restart_seeds(self) -> None:
        """Forget how often each prompt was submitted: per-request seeds start over (benchmarks replaying work)."""
        self._visits.clear()

    @property
    def version(self) -> int:
        """The adapter version new requests are served with."""
        return self.adapters.version

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The generator's event loop (for pipeline code that schedules coroutines onto it)."""
        return self._engine.loop

    @property
    def closed(self) -> bool:
        return self._engine.closed

    @property
    def replicas(self) -> list:
        """One engine: checked itself."""
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {}

    def call(self, coro):
        """Run `coro` on the generator's loop and wait for its result (its exception is raised here)."""
        return self._engine.call(coro)

    async def stream(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> AsyncIterator[Group]:
        """Groups in the order they finish (no batch barrier). Iterate on `loop`."""
        groups = in_finish_order(self.generate_group(p, n, params) for p in prompts)
        async with contextlib.aclosing(groups):  # the rest cancelled at once if we stop
            async for g in groups:
                yield g

    async def _gather(self, prompts, n, params, on_group=None) -> list[Group]:
        async def one(p):
            g = await self.generate_group(p, n, params)
            if on_group is not None:
                on_group(g)
            return g
        return await gather_or_cancel(one(p) for p in prompts)  # on an error the other groups stop too

    def submit(self, prompts: Sequence[Prompt], n: int, params: SamplingParams,
               on_group: Callable[[Group], None] | None = None) -> concurrent.futures.Future:
        """Start generating from any thread. `on_group(group)` is called on the loop as each group finishes; the
        returned future resolves to all groups in prompt order (or raises the engine's error)."""
        if self._engine.closed:
            raise RuntimeError(f"the {self.name} generator is closed")
        return asyncio.run_coroutine_threadsafe(self._gather(list(prompts), n, params, on_group), self._engine.loop)

    def generate(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> list[Group]:
        """Blocking: one Group of n completions per prompt, in prompt order."""
        return self.call(self._gather(list(prompts), n, params))

    def close(self) -> None:
        """Cancel what is in flight, shut the engine down and stop the thread. Idempotent."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

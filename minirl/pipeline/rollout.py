"""The asynchronous pipeline: generation and training overlap through a bounded rollout buffer.

Two sides, joined by one bounded buffer and one version signal:

  generation loop (engine thread)                          trainer (caller thread)
  ──────────────────────────────                           ───────────────────────
  for step s:                                               for step s:
    wait until engine version >= s - K   ◄── version ───      batch = buffer.take(s)      (across threads)
    launch step s: stream groups ──► score ──► buffer         drop groups older than S    (counted)
                                                              train → version s+1 → push adapter → signal

K = `max_async_steps` bounds how far generation runs ahead: the batch for step s is sampled by a policy at
most K versions old. K = 0 is the synchronous loop. S = `max_staleness` drops groups whose oldest token is too
old. Every group is accounted for: trained, dropped as stale, dropped for no reward spread (dynamic sampling) or
unused at shutdown (counted in `accounting`).

Dynamic sampling (DAPO; `refill` given): a group without reward spread waits aside while the step's generation goes
on; then, round by round, `refill(step, round, n, used)` gives fresh prompts for the n slots still without spread,
their groups are generated and scored together, and the informative ones take those slots in prompt order. What is
left without spread after `max_rounds` rounds fills the remaining slots. The slots a step's batch is read in do not
depend on timing: with the same rewards, the same prompts land in the same slots.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from minirl.rewards.advantages import informative
from minirl.types import Group, Prompt, RolloutSource, ScoredGroup

STOP = object()  # the shutdown marker the producer puts in the buffer


class RolloutBuffer:
    """Bounded and group-aware; lives on the generation loop. Groups are filed under the step they were
    generated for, in the slot order of that step's prompts, so a batch is assembled deterministically."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._steps: dict[int, dict[int, ScoredGroup]] = defaultdict(dict)
        self._cond = asyncio.Condition()
        self.depth = 0
        self.closed = False

    async def put(self, step: int, slot: int, group: ScoredGroup) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.depth < self.capacity or self.closed)
            self._steps[step][slot] = group
            self.depth += 1
            self._cond.notify_all()

    async def take(self, step: int, n: int) -> list[ScoredGroup] | object:
        """The n groups of `step`, in slot order; STOP when the buffer is closed first."""
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._steps[step]) >= n or self.closed)
            if len(self._steps[step]) < n:
                return STOP
            got = self._steps.pop(step)
            self.depth -= len(got)
            self._cond.notify_all()
            return [got[k] for k in sorted(got)]

    async def close(self) -> None:
        async with self._cond:
            self.closed = True
            self._cond.notify_all()

    def leftover(self) -> int:
        return self.depth


@dataclass
class Timeline:
    """Busy intervals per side (seconds since the pipeline started): who waits on whom."""
    t0: float = field(default_factory=time.perf_counter)
    gen: list[tuple[float, float]] = field(default_factory=list)
    train: list[tuple[float, float]] = field(default_factory=list)
    _gen_active: int = 0
    _gen_since: float = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def gen_begin(self) -> None:
        if self._gen_active == 0:
            self._gen_since = self.now()
        self._gen_active += 1

    def gen_end(self) -> None:
        self._gen_active -= 1
        if self._gen_active == 0:
            self.gen.append((self._gen_since, self.now()))

    def snapshot(self) -> dict[str, list[tuple[float, float]]]:
        """Busy intervals so far; a generation still running counts up to now."""
        gen = list(self.gen) + ([(self._gen_since, self.now())] if self._gen_active else [])
        return {"gen": gen, "train": list(self.train)}

    def intervals(self) -> list[tuple[str, tuple[float, float]]]:
        """(side, (start, end)) for every busy interval so far, generation's first."""
        return [(side, iv) for side, ivs in self.snapshot().items() for iv in ivs]

    def add_train(self, start: float, end: float) -> None:
        """A training interval, in `time.perf_counter()` seconds."""
        self.train.append((start - self.t0, end - self.t0))

    def busy(self, side: str, start: float, end: float) -> float:
        """Fraction of [start, end] covered by `side`'s intervals (an open gen interval counts to now)."""
        ivs = self.snapshot()[side]
        cov = sum(max(0.0, min(e, end) - max(s, start)) for s, e in ivs)
        return cov / max(end - start, 1e-9)


class Pipeline:
    """Runs the generation side as coroutines on the generator's loop (vLLM's engine thread, or a thread of
    our own for the transformers backend) and hands batches to the caller's thread."""

    def __init__(self, generator: RolloutSource, scorer, prompts: Callable[[int], Sequence[Prompt]], sampling: Callable,
                 group_size: int, prompts_per_step: int, steps: int, max_async_steps: int, first_step: int = 0,
                 refill: Callable[[int, int, int, set[int]], Sequence[Prompt]] | None = None, max_rounds: int = 0,
                 spread: Callable[[ScoredGroup], bool] = lambda sg: informative(sg.rewards)):
        """Generates steps `first_step` .. `steps - 1` (a resumed run starts past 0). `refill` turns on dynamic
        sampling (module docstring): (step, round, n, prompt indices the step holds) -> at most n fresh prompts;
        `spread` says whether a group can teach (the run's `AdvantageSettings.informative`)."""
        self.gen, self.scorer = generator, scorer
        self.prompts_for, self.sampling = prompts, sampling
        self.G, self.P, self.steps, self.K = group_size, prompts_per_step, steps, max_async_steps
        self.first_step = first_step
        self.refill, self.max_rounds = refill, max_rounds if refill is not None else 0
        self.spread = spread
        self.resampled: dict[int, int] = defaultdict(int)  # step -> groups generated by its refill rounds
        self.timeline = Timeline()
        self.accounting = {"generated": 0, "trained": 0, "dropped_stale": 0, "unused": 0,
                           **({"dropped_no_spread": 0} if refill is not None else {})}
        self.gen_tokens: dict[int, int] = defaultdict(int)
        self.gen_seconds: dict[int, float] = {}  # step -> wall seconds its generation took
        self._serial = asyncio.Lock()  # FIFO: steps of a one-request-at-a-time generator go in order
        self.error: BaseException | None = None
        self._own_loop = generator.loop is None
        if self._own_loop:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name="minirl-gen", daemon=True)
            self._thread.start()
        else:
            self.loop = generator.loop
        self._score_pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="minirl-score")
        self.buffer: RolloutBuffer = self._call(self._make_buffer())
        self._wake: asyncio.Event = self._call(self._make_event())
        self._producer = asyncio.run_coroutine_threadsafe(self._produce(), self.loop)

    # --- generation side (runs on self.loop) -------------------------------------------------------------
    async def _make_buffer(self) -> RolloutBuffer:
        return RolloutBuffer(capacity=(self.K + 1) * self.P)

    async def _make_event(self) -> asyncio.Event:
        return asyncio.Event()

    async def _produce(self) -> None:
        tasks: list[asyncio.Task] = []
        try:
            for step in range(self.first_step, self.steps):
                while self.gen.version < step - self.K:  # the depth bound: at most K versions ahead
                    self._wake.clear()
                    await self._wake.wait()
                prompts = list(self.prompts_for(step))
                tasks.append(asyncio.ensure_future(self._gen_step(step, prompts, self.sampling(step))))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _gen_step(self, step: int, prompts: list[Prompt], params) -> None:
        slots: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(prompts):
            slots[p.index].append(i)
        held: dict[int, ScoredGroup] | None = {} if self.refill is not None else None  # slot -> group without spread
        scoring: list[asyncio.Future] = []
        try:
            # a generator without a loop of its own serves one request at a time: a step's generation starts at its turn
            async with self._turn(step):
                async for batch in self._stream(prompts, params):
                    self._count(step, batch)
                    # each batch (a streamed group, or a whole step of a generator that does not stream) is
                    # scored by its own task, outside the generator's turn: a slow reward does not hold the
                    # next step's generation, and waits once per batch of calls
                    put = [(slots[g.prompt.index].pop(0), g) for g in batch]
                    scoring.append(asyncio.ensure_future(self._score_put(step, put, held)))
            await asyncio.gather(*scoring)
            if held is not None:
                await self._refill(step, prompts, params, held)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # reaches the trainer thread through take()
            self.error = e
            await self.buffer.close()
            raise
        finally:
            for t in scoring:
                t.cancel()

    @contextlib.asynccontextmanager
    async def _turn(self, step: int):
        """A generation turn of `step`: serialised for a generator without a loop of its own, timed."""
        async with self._serial if self._own_loop else contextlib.nullcontext():
            self.timeline.gen_begin()
            t0 = self.timeline.now()
            try:
                yield
            finally:  # generation only, not scoring
                self.gen_seconds[step] = self.gen_seconds.get(step, 0.0) + self.timeline.now() - t0
                self.timeline.gen_end()

    def _count(self, step: int, groups: Sequence[Group]) -> None:
        for g in groups:
            self.gen_tokens[step] += sum(len(c.token_ids) for c in g.completions)
            self.accounting["generated"] += 1

    async def _refill(self, step: int, prompts: list[Prompt], params, held: dict[int, ScoredGroup]) -> None:
        """Dynamic sampling's rounds for `step`, then the slots still `held` (groups without spread) filled."""
        used = {p.index for p in prompts}
        for rnd in range(1, self.max_rounds + 1):
            if not held:
                break
            fresh = list(self.refill(step, rnd, len(held), set(used)))[:len(held)]
            if not fresh:
                break
            used |= {p.index for p in fresh}
            seed = params.seed + 7_919 * rnd if params.seed is not None else None  # new samples, same each run
            groups: list[Group] = []
            async with self._turn(step):
                async for batch in self._stream(fresh, dataclasses.replace(params, seed=seed)):
                    groups += batch
            self._count(step, groups)
            self.resampled[step] += len(groups)
            order = {p.index: i for i, p in enumerate(fresh)}
            groups.sort(key=lambda g: order[g.prompt.index])
            scored = await asyncio.get_running_loop().run_in_executor(self._score_pool, self.scorer.score_groups,
                                                                      groups)
            free = sorted(held)
            for sg in scored:  # each drops one group: the one without spread it replaces, or itself
                self.accounting["dropped_no_spread"] += 1
                if self.spread(sg) and free:
                    slot = free.pop(0)
                    held.pop(slot)
                    await self.buffer.put(step, slot, sg)
        for slot in sorted(held):
            await self.buffer.put(step, slot, held.pop(slot))

    async def _score_put(self, step: int, put: list[tuple[int, Group]],
                         held: dict[int, ScoredGroup] | None = None) -> None:
        groups = [g for _, g in put]
        scored = await asyncio.get_running_loop().run_in_executor(self._score_pool, self.scorer.score_groups, groups)
        for (slot, _), sg in zip(put, scored):
            if held is not None and not self.spread(sg):
                held[slot] = sg  # waits for a replacement (`_refill`)
            else:
                await self.buffer.put(step, slot, sg)

    async def _stream(self, prompts: list[Prompt], params):
        """Batches of groups: one per group as a streaming generator finishes it, else the whole step at once."""
        if not self._own_loop:
            async for g in self.gen.stream(prompts, self.G, params):
                yield [g]
        else:
            yield await asyncio.get_running_loop().run_in_executor(None, self.gen.generate, prompts, self.G, params)

    # --- trainer side (runs on the caller's thread) -----------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def take(self, step: int) -> list[ScoredGroup] | None:
        """Block until the batch of `step` is complete; None if the generation side stopped (its error, if any,
        is raised here with its traceback)."""
        got = self._call(self.buffer.take(step, self.P))
        if got is STOP:
            if self.error is not None:
                raise self.error
            return None
        return got

    def filter_stale(self, groups: list[ScoredGroup], trainer_version: int,
                     max_staleness: int | None) -> tuple[list[ScoredGroup], int]:
        if max_staleness is None:
            kept = groups
        else:
            kept = [g for g in groups if trainer_version - g.group.oldest_version <= max_staleness]
        dropped = len(groups) - len(kept)
        self.accounting["dropped_stale"] += dropped
        self.accounting["trained"] += len(kept)
        return kept, dropped

    def batches(self, version: Callable[[], int], max_staleness: int | None, go: Callable[[], bool]):
        """The trainer's side, step by step: (step, groups kept, the step's generation metrics); `version()` is the
        trainer's. Ends when `go()` says stop between steps, or the generation side stopped."""
        tl = self.timeline
        t_prev = tl.now()
        for step in range(self.first_step, self.steps):
            if not go():
                return
            t_wait = tl.now()
            groups = self.take(step)
            if groups is None:
                return
            kept, dropped = self.filter_stale(groups, version(), max_staleness)
            stale = [version() - v for g in kept for x in g.group.completions for v in x.sampled_versions]
            now = tl.now()
            n_tok = self.gen_tokens.pop(step, 0)
            gen_s = self.gen_seconds.pop(step, now - t_prev)
            yield step, kept, {"time/wait_s": now - t_wait, "staleness/dropped_groups": dropped,
                               "buffer/depth": self.buffer.depth, "time/gen_s": gen_s,
                               "throughput/gen_tok_s": n_tok / max(gen_s, 1e-9),
                               "busy/gen": tl.busy("gen", t_prev, now), "busy/train": tl.busy("train", t_prev, now),
                               "staleness/mean": sum(stale) / len(stale) if stale else None,
                               "staleness/max": max(stale, default=None),
                               **({"batch/resampled_groups": self.resampled.pop(step, 0),
                                   "batch/informative_groups": sum(map(self.spread, kept))}
                                  if self.refill is not None else {})}
            t_prev = now

    def signal_version(self) -> None:
        """Tell the generation side a new adapter is being served."""
        self.loop.call_soon_threadsafe(self._wake.set)

    def interrupt(self) -> None:
        """From any thread: wake a trainer blocked in take() (it gets None)."""
        asyncio.run_coroutine_threadsafe(self.buffer.close(), self.loop)

    def close(self, timeout: float = 10.0) -> None:
        if not self._producer.done():
            self.loop.call_soon_threadsafe(self._producer.cancel)
        try:
            self._producer.result(timeout)
        except (cf.CancelledError, cf.TimeoutError, Exception):  # noqa: BLE001 - raised to the trainer already
            pass
        try:
            self._call(self.buffer.close(), timeout)
            self.accounting["unused"] = self.buffer.leftover()
        except Exception:  # noqa: BLE001 - the loop may already be gone
            pass
        self._score_pool.shutdown(wait=False, cancel_futures=True)
        if self._own_loop:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

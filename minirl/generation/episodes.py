"""The episode runner: G episodes per row, run concurrently on the generator, each one token-exact.

An episode is the unit of a group, as a completion is in a single-turn run; the runner hands the pipeline
(`rollout.py`) and the synchronous loop the same `Group`s a generator does, so everything downstream (rewards,
staleness, the loss, the dashboard) takes episodes as they come. One episode, turn by turn:

    prompt ids ─► reply 1 (sampled ids) ─► env part 1 (ids) ─► reply 2 ─► env part 2 ─► ... ─► the end
                  trained                  context only          trained

The generator is given the prompt + everything so far as token ids and its sampled ids are appended as they are;
the env's messages are rendered once as the template's delta and appended as ids (`chat.py`). The trainer learns
from that very sequence: the `Completion` holds every token after the prompt with `mask` marking the sampled
ones, their behaviour logprobs and versions. Versions are per request, so a new adapter served between two turns
shows in the later turn's tokens.

Two ways to run episodes concurrently:
- `EpisodeRunner`: any generator with `generate(prompts, n, params)` (transformers, in-process or in its own
  process): each turn, the live episodes' next replies are sampled in one batch.
- `AsyncEpisodeRunner`: vLLM, each episode its own coroutine on the engine loop; a turn is one engine request
  (`VLLMGenerator.sample`), so episodes never wait for each other.

The episode ends when the env says done, after `max_turns` replies, or when the next env part or reply would not
fit in `max_episode_tokens` (the last two recorded as truncated). An env that raises (`SystemExit` too: a tool
that runs the model's code in-process may call `exit()`), answers with something that is not an `EnvStep` or with
a reward that is not a number, or takes longer than `step_timeout_s` in one reset or step, ends its episode as a
recorded failure (the `env` reward fails, the sample is left out of the loss); the run goes on. A hung step's thread
is abandoned (Python cannot stop it).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import inspect
import math
from typing import Any, Callable, Sequence

from minirl.generation.base import request_seed
from minirl.generation.chat import ChatFormat
from minirl.generation.engine_thread import gather_or_cancel, in_finish_order
from minirl.generation.env_calls import (
    STEP_TIMEOUT_S,
    EnvThread,
    StepTimeout,
    cannot_make,
    check_messages,
    one_line,
    step_timeout,
)
from minirl.generation.envs import Env, EnvStep, plain_tool_prompt, tool_schema
from minirl.rewards.worker_main import number
from minirl.types import Completion, Episode, Generator, Group, Prompt, RolloutSource, SamplingParams, TurnSampler


class _Live:
    """One episode in progress: its env, the ids after the prompt with their mask, logprobs and versions."""

    def __init__(self, prompt: Prompt):
        self.prompt, self.env = prompt, None
        self.ids: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.messages: list[dict] = []
        self.rewards: list[float] = []
        self.turns = 0
        self.end: str | None = None
        self.error: str | None = None

    def add(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float], versions: Sequence[int]) -> None:
        self.ids += ids
        self.mask += [sampled] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def fail(self, e: BaseException) -> None:
        self.end, self.error = "error", one_line(e)


class EpisodeRunner:
    """Runs episodes of `make_env` on `generator`, batching each turn of the live episodes (see the module); a
    `RolloutSource` without a loop of its own. Of `generator` it uses `generate` and `version` (a `RolloutSource`)."""
    loop = None
    gen: RolloutSource

    def __init__(self, generator: RolloutSource | TurnSampler, make_env: Callable[[], Env], tokenizer, max_turns: int,
                 max_episode_tokens: int, template_kwargs: dict | None = None,
                 step_timeout_s: float = STEP_TIMEOUT_S):
        self.gen, self.make_env, self.tok = generator, make_env, tokenizer
        self.step_timeout_s = step_timeout_s
        self._worker: EnvThread | None = None
        self.chat = ChatFormat(tokenizer, template_kwargs)
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.rows: dict[int, dict] = {}  # prompt index -> its dataset row (what `reset` gets)

    @property
    def version(self) -> int:
        return self.gen.version

    # --- prompts: the opening of each row's episodes -----------------------------------------------------------
    def opening(self, env: Env, row: dict) -> tuple[list[dict], list[int]]:
        """(messages, token ids) that open an episode of `env` on `row`: `reset(row)`, with the env's tools given
        through the template's tool format, or else described in a system message (`envs.plain_tool_prompt`)."""
        messages = check_messages(env.reset(dict(row)), "reset(row)")
        fns = env.tools()
        if not fns:
            return messages, self.chat.encode(self.chat.opening(messages))
        if self.chat.tool_format:
            return messages, self.chat.encode(self.chat.opening(messages, [tool_schema(f) for f in fns]))
        about = plain_tool_prompt(fns)
        if messages and messages[0]["role"] == "system":
            shown = [{**messages[0], "content": messages[0]["content"] + "\n\n" + about}] + messages[1:]
        else:
            shown = [{"role": "system", "content": about}] + messages
        return messages, self.chat.encode(self.chat.opening(shown))

    def prompts(self, rows: Sequence[dict], prompt_column: str = "prompt", max_prompt_tokens: int | None = None,
                start_index: int = 0, indices: Sequence[int] | None = None) -> list[Prompt]:
        """One Prompt per row, opened by a throwaway env (the episodes open the same way); its index is
        `indices[i]` when given, else `start_index + i` (distinct over every prompt of the runner: an episode finds
        its row by it). Errors name the row."""
        out = []
        for i, row in enumerate(rows):
            try:
                env = self.make_env()
            except Exception as e:
                raise ValueError(cannot_make(e)) from e
            try:
                messages, ids = self.opening(env, row)
            except Exception as e:
                raise ValueError(f"the env could not open an episode on row {i} ({one_line(e)}); fix its reset "
                                 "(during training an env error is a recorded failure instead)") from e
            if max_prompt_tokens and len(ids) > max_prompt_tokens:
                raise ValueError(f"the episode of row {i} opens with {len(ids)} tokens, more than the limit "
                                 f"{max_prompt_tokens}; shorten it or raise max_prompt_tokens")
            index = indices[i] if indices is not None else start_index + i
            self.rows[index] = dict(row)
            text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"]
                        if messages else "")
            out.append(Prompt(index, tuple(ids), text, {k: v for k, v in row.items() if k != prompt_column}))
        return out

    # --- one episode's steps (both runners) -------------------------------------------------------------------
    def _start(self, prompt: Prompt) -> _Live:
        e = _Live(prompt)
        try:
            e.env = self.make_env()
            messages, ids = self.opening(e.env, self.rows[prompt.index])
            if tuple(ids) != prompt.token_ids:
                raise ValueError("reset opened this episode with other messages than the row's prompt: the opening "
                                 "must depend on the row only (keep hidden state out of the messages)")
            e.messages = messages
        except Exception as ex:  # noqa: BLE001 - a recorded failure of this episode
            e.fail(ex)
        return e

    def _start_in_worker(self, prompt: Prompt) -> _Live:
        return self._opened(prompt, self._in_worker(lambda: self._start(prompt)))

    def _opened(self, prompt: Prompt, out: Any) -> _Live:
        """What starting an episode gave: its `_Live`, or else a failed episode recording what the start raised or
        that its reset did not return (both runners)."""
        if isinstance(out, _Live):
            return out
        e = _Live(prompt)
        e.fail(step_timeout(self.step_timeout_s, "reset") if isinstance(out, StepTimeout) else out)
        return e

    def _room(self, e: _Live, params: SamplingParams) -> int:
        return min(params.max_tokens, self.max_episode_tokens - len(e.ids))

    def _take_reply(self, e: _Live, c: Completion) -> None:
        e.add(c.token_ids, True, c.logprobs, c.versions)
        e.turns += 1
        e.messages.append({"role": "assistant", "content": c.text})

    def _take_step(self, e: _Live, out: Any, c: Completion) -> None:
        """The env's answer `out` to reply `c` (an EnvStep, or what it raised): record it, end the episode or
        append the env's part as token ids (masked out of the loss; the version of the reply it answers)."""
        try:
            if isinstance(out, BaseException):
                raise RuntimeError(f"step called exit ({out})") if isinstance(out, SystemExit) else out
            if not isinstance(out, EnvStep):
                raise TypeError(f"step returned {type(out).__name__}, expected a minirl.EnvStep")
            if out.reward is not None:
                r, why = number(out.reward)  # as a reward function's value is taken: a string is no number
                if why:
                    raise TypeError(f"step's reward {why}")
                if not math.isfinite(r):
                    raise ValueError(f"step returned the reward {r}")
                e.rewards.append(r)
            messages = check_messages(out.messages, "step(reply).messages")
        except Exception as ex:  # noqa: BLE001 - a recorded failure of this episode
            e.fail(ex)
            return
        e.messages += messages
        if out.done:
            e.end = "done"
        elif e.turns >= self.max_turns:
            e.end = "max_turns"
        else:
            ids = self.chat.env_ids(c.token_ids, c.finish_reason, [self._shown(m) for m in messages])
            if len(e.ids) + len(ids) >= self.max_episode_tokens:  # no room left for a reply after it
                e.end = "max_episode_tokens"
            else:
                v = c.versions[-1] if c.versions else self.gen.version
                e.add(ids, False, [0.0] * len(ids), [v] * len(ids))

    def _shown(self, m: dict) -> dict:
        """A tool result as the template shows it: a 'tool' message, or a user message where it has no tool format."""
        if m["role"] != "tool" or self.chat.tool_format:
            return m
        return {"role": "user", "content": f"{m.get('name', 'tool')} result: {m['content']}"}

    def _completion(self, e: _Live) -> Completion:
        env = e.env
        ep = Episode(tuple(e.messages), tuple(e.rewards), e.turns, e.end or "done",
                     getattr(env, "tool_calls", 0), getattr(env, "tool_errors", 0), e.error)
        finish = "error" if ep.end == "error" else "length" if ep.truncated else "stop"
        return Completion(tuple(e.ids), tuple(e.logprobs), tuple(e.versions),
                          self.tok.decode(e.ids, skip_special_tokens=True), finish, tuple(e.mask), ep)

    def _cut(self, c: Completion, room: int) -> Completion:
        """The first `room` tokens of a reply sampled with a larger max_tokens: the same tokens and logprobs a
        request with max_tokens = room gives (sampling never looks ahead)."""
        if len(c.token_ids) <= room:
            return c
        ids = c.token_ids[:room]
        return Completion(ids, c.logprobs[:room], c.versions[:room], self.tok.decode(ids, skip_special_tokens=True),
                          "length")

    def _call_step(self, e: _Live, reply: str) -> Any:
        """`e.env.step(reply)`, or what it raised, or a StepTimeout (the batched runner's)."""
        def call():
            out = e.env.step(reply)
            return _run_awaitable(out) if inspect.isawaitable(out) else out
        return self._in_worker(call)

    def _in_worker(self, fn: Callable[[], Any]) -> Any:
        """fn() on the runner's env thread, or what it raised, or a StepTimeout after `step_timeout_s`: a step that
        hangs fails its episode instead of stopping the run (its thread is abandoned; the next call gets a new one).
        One thread for every call, so an env may hold thread-bound objects (a sqlite connection) from reset on."""
        if self._worker is None:
            self._worker = EnvThread()
        out = self._worker.call(fn, self.step_timeout_s)
        if out is EnvThread.HUNG:
            self._worker = None
            return step_timeout(self.step_timeout_s)
        return out

    # --- the batched runner ---------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> list[Group]:
        """n episodes of each prompt, one Group per prompt in prompt order. Each turn samples the next reply of
        every live episode in one `generate` call (max_tokens: the largest room left; each reply is then cut to
        its own episode's room)."""
        eps = [[self._start_in_worker(p) for _ in range(n)] for p in prompts]
        turn = 0
        while live := [e for row in eps for e in row if e.end is None]:
            rooms = [self._room(e, params) for e in live]
            seed = None if params.seed is None else request_seed(params.seed, turn)
            asks = [Prompt(k, e.prompt.token_ids + tuple(e.ids), "") for k, e in enumerate(live)]
            groups = self.gen.generate(asks, 1, dataclasses.replace(params, max_tokens=max(rooms), seed=seed))
            for e, g, room in zip(live, groups, rooms):
                c = self._cut(g.completions[0], room)
                self._take_reply(e, c)
                self._take_step(e, self._call_step(e, c.text), c)
            turn += 1
        return [Group(p, tuple(self._completion(e) for e in row), params.temperature) for p, row in zip(prompts, eps)]

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


class AsyncEpisodeRunner(EpisodeRunner):
    """vLLM: every episode a coroutine on the engine loop, one engine request per turn (`generator.sample`);
    the env's `reset` and `step` run in the loop's executor (an `async def step` is awaited on the loop). Of
    `generator` it uses `loop`, `sample`, `call` and `version` (a `TurnSampler`)."""
    gen: TurnSampler  # the base runner's `RolloutSource` narrowed: this one samples turn by turn

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.gen.loop

    async def _episode(self, prompt: Prompt, i: int, j: int, params: SamplingParams) -> Completion:
        e = await self._start_async(prompt)
        turn = 0
        while e.end is None:
            seed = None if params.seed is None else request_seed(params.seed, i, j, turn)
            c = await self.gen.sample(prompt.token_ids + tuple(e.ids),
                                      dataclasses.replace(params, max_tokens=self._room(e, params)), seed)
            self._take_reply(e, c)
            self._take_step(e, await self._step_async(e, c.text), c)
            turn += 1
        return self._completion(e)

    async def _start_async(self, prompt: Prompt) -> _Live:
        """`_start` in the loop's executor, under `step_timeout_s`: a reset that hangs or calls exit() fails its
        episode (the engine loop goes on)."""
        async def call():
            try:
                return await asyncio.get_running_loop().run_in_executor(None, self._start, prompt)
            except (Exception, SystemExit) as ex:  # noqa: BLE001 - _start records an Exception; SystemExit ends here
                return RuntimeError(f"reset called exit ({ex})") if isinstance(ex, SystemExit) else ex
        try:
            return self._opened(prompt, await asyncio.wait_for(call(), self.step_timeout_s))
        except asyncio.TimeoutError:
            return self._opened(prompt, step_timeout(self.step_timeout_s, "reset"))

    async def _step_async(self, e: _Live, reply: str) -> Any:
        async def call():
            try:
                if inspect.iscoroutinefunction(e.env.step):
                    return await e.env.step(reply)
                out = await asyncio.get_running_loop().run_in_executor(None, e.env.step, reply)
                return await out if inspect.isawaitable(out) else out
            except (Exception, SystemExit) as ex:  # noqa: BLE001 - recorded by _take_step (a SystemExit left in a
                return ex                          # task would stop the engine loop)
        try:
            return await asyncio.wait_for(call(), self.step_timeout_s)
        except asyncio.TimeoutError:
            return step_timeout(self.step_timeout_s)

    async def group(self, prompt: Prompt, i: int, n: int, params: SamplingParams) -> Group:
        """n concurrent episodes of one prompt (`i`: its place in the step, for the seeds)."""
        comps = await asyncio.gather(*(self._episode(prompt, i, j, params) for j in range(n)))
        return Group(prompt, tuple(comps), params.temperature)

    async def stream(self, prompts: Sequence[Prompt], n: int, params: SamplingParams):
        """Groups in the order they finish (the pipeline's producer iterates this on the engine loop)."""
        groups = in_finish_order(self.group(p, i, n, params) for i, p in enumerate(prompts))
        async with contextlib.aclosing(groups):  # the rest cancelled at once if we stop
            async for g in groups:
                yield g

    async def _gather(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> list[Group]:
        return await gather_or_cancel(self.group(p, i, n, params) for i, p in enumerate(prompts))

    def generate(self, prompts: Sequence[Prompt], n: int, params: SamplingParams) -> list[Group]:
        return self.gen.call(self._gather(list(prompts), n, params))


def make_runner(generator: Generator, make_env: Callable[[], Env], tokenizer, max_turns: int,
                max_episode_tokens: int, template_kwargs: dict | None = None,
                step_timeout_s: float = STEP_TIMEOUT_S) -> EpisodeRunner:
    """The runner for `generator`: one coroutine per episode where it samples on its own loop (vLLM), else
    batched turns. `template_kwargs`: Config.chat_template_kwargs."""
    cls = EpisodeRunner if generator.loop is None else AsyncEpisodeRunner
    return cls(generator, make_env, tokenizer, max_turns, max_episode_tokens, template_kwargs, step_timeout_s)


def _run_awaitable(aw) -> Any:
    """Run an async `step` from synchronous code (in a thread of its own if this thread runs a loop already)."""
    async def wait():
        return await aw
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with cf.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()

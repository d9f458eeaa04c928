"""`ServerGenerator` (backend 'vllm-server'): generation through one or more vLLM OpenAI-compatible servers, on
this machine (minirl starts them: `server_proc.py`) or anywhere (servers you started: `urls`).

- Groups: one `/v1/completions` request per group (n = G, prompt as token ids, per-request seed as in the
  in-process engine), sent to the server with the least outstanding work (n x max_tokens of its requests in
  flight). Every token carries its behaviour logprob and the version of the adapter the request named.
- Adapters: each version is loaded on every server under the name `minirl-v<version>` (`sync/servers.py` writes
  it once); new requests use the newest; an older version is unloaded once no request in flight uses it.
- Faults: a server whose process exits, whose connection breaks, or that does not answer a 1-token request within
  `timeout_s` (probed every `health_every_s`) is down. Its requests in flight are abandoned and their groups
  regenerated from scratch on a server that is up (a group is only ever returned whole, so none is lost or
  counted twice). With `restart=True` a server minirl started is killed, started again and given the current
  adapter; otherwise the run stops with `ServerError` naming the server and its log.
Runs on a loop thread of its own (`EngineThread`): the async pipeline's coroutines run there.
"""
from __future__ import annotations

import asyncio
import secrets
from typing import Callable, Sequence

from minirl.generation.base import LoopGenerator, ServedAdapters
from minirl.generation.server_api import (
    ServerDown,
    ServerRejected,
    completion_body,
    listed_models,
    parse_completions,
    parse_scores,
    score_body,
)
from minirl.generation.server_fleet import Fleet, Server, ServerError
from minirl.generation.server_proc import ServerOptions
from minirl.sync.wire import adapter_name
from minirl.types import AdapterUpdate, Completion, Group, Prompt, SamplingParams

MAX_ATTEMPTS = 4   # tries of one group (each on a server that was up) before the run stops

__all__ = ["ServerGenerator", "ServerError", "Replica"]


class Replica:
    """One server seen alone, for `minirl.sync.check.verify`: its served version, read back from it, and the probe's
    logprobs scored on it."""
    name = "vllm-server"
    same_numerics = False

    def __init__(self, gen: "ServerGenerator", server: Server):
        self._gen, self._s = gen, server

    @property
    def url(self) -> str:
        return self._s.url

    @property
    def alive(self) -> bool:
        return self._s.alive

    @property
    def version(self) -> int:
        return self._gen.version

    @property
    def dtype(self) -> str:
        return self._gen.dtype

    def served_version(self) -> int:
        """The newest adapter version the server lists (`/v1/models`), 0 when none."""
        return self._gen.newest_listed(self._gen.call(self._s.api.models()))

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float = 1.0) -> list[float]:
        return self._gen.call(self._gen.score_on(self._s, prompt_ids, completion_ids, temperature))


class ServerGenerator(LoopGenerator):
    """Generation through vLLM servers; satisfies the `Generator` protocol.

    `launch`: start one server per `ServerOptions` (its cores / GPU; logs in `log_dir`) with a random API key; or
    `urls`: servers already running (their key: `api_key`). `dtype`: the servers' (for the sync check's
    tolerance). `restart`, `timeout_s`, `health_every_s`, `start_timeout_s`: see `server_fleet`."""

    name = "vllm-server"

    def __init__(self, urls: Sequence[str] = (), *, launch: Sequence[ServerOptions] = (), api_key: str | None = None,
                 log_dir: str = ".", restart: bool = False, timeout_s: float = 120.0, health_every_s: float = 2.0,
                 start_timeout_s: float = 900.0, dtype: str = "float32"):
        if bool(urls) == bool(launch):
            raise ValueError("give either server urls or server options to launch, not both")
        super().__init__()
        self.dtype, self.log_dir = dtype, log_dir
        self.tag = secrets.token_hex(4)                     # this generator's adapters: adapter_name(tag, version)
        self.adapters = ServedAdapters(lambda a: a[0] or None, (0, None))  # (version, folder) new requests use
        self._target: tuple[int, str | None] = (0, None)    # the version being loaded (a restart loads it too)
        self._names: dict[str, int] = {}                    # adapter name -> version, of the versions loaded
        self._unloading: dict[int, asyncio.Task] = {}       # version -> its unload, running in the background
        self.retried_groups = 0
        key = api_key if api_key is not None or urls else secrets.token_urlsafe(24)

        async def start():
            fleet = Fleet(list(urls), list(launch), key, log_dir, restart, timeout_s, health_every_s,
                          start_timeout_s, self._needs, self._name)
            self._engine.llm = fleet  # the loop thread shuts it down at close, after cancelling the loop's tasks
            await fleet.start()
            return fleet
        try:
            self.fleet: Fleet = self._engine.call(start())
        except BaseException:
            self.close()
            raise

    def _needs(self) -> dict[int, str]:
        return {v: p for v, p in (self.adapters.serving[0], self._target) if v}

    @property
    def on_event(self) -> Callable[..., None] | None:
        """(kind, **fields), called on the generator's loop when a server goes down or is restarted."""
        return self.fleet.on_event

    @on_event.setter
    def on_event(self, fn: Callable[..., None] | None) -> None:
        self.fleet.on_event = fn

    # ---- generation -----------------------------------------------------------------------------------------

    def _name(self, version: int) -> str:
        return adapter_name(self.tag, version) if version else self.fleet.base

    async def generate_group(self, prompt: Prompt, n: int, params: SamplingParams) -> Group:
        """G = n completions of one prompt, from one request to one server; regenerated elsewhere (same seed,
        the adapter served then) if that server goes down before it answers."""
        comps = await self._complete(prompt.token_ids, n, params, self._next_seed(prompt, params), prompt.index)
        return Group(prompt, tuple(comps), params.temperature)

    async def sample(self, token_ids: Sequence[int], params: SamplingParams, seed: int | None = None) -> Completion:
        """One sequence continuing `token_ids`, sampled with exactly `seed`: a turn of an episode."""
        (c,) = await self._complete(token_ids, 1, params, seed, None)
        return c

    async def _complete(self, token_ids: Sequence[int], n: int, params: SamplingParams, seed: int | None,
                        index: int | None) -> list[Completion]:
        """n samples continuing `token_ids` from one request to one server; sent again elsewhere (same seed, the
        adapter served then) if that server goes down before it answers."""
        work = n * params.max_tokens
        for _ in range(MAX_ATTEMPTS):
            s = await self.fleet.pick()
            adapter, version = self.adapters.acquire()
            body = completion_body(self._name(version), token_ids, n, params, seed)
            s.outstanding += work
            try:
                answer = await self.fleet.on(s, s.api.complete(body))
            except ServerDown:
                self.retried_groups += 1
                continue
            finally:
                s.outstanding -= work
                if self.adapters.release(adapter):
                    self._unload_later(version)
            s.requests += 1
            comps = parse_completions(answer, n, version)
            self.tokens_generated += sum(len(c.token_ids) for c in comps)
            return comps
        what = "an episode's turn" if index is None else f"the group of prompt {index}"
        raise ServerError(f"{what} was lost with its server {MAX_ATTEMPTS} times in a "
                          "row; see the servers' logs in " + str(self.log_dir))

    # ---- adapters -------------------------------------------------------------------------------------------

    def _unload_later(self, version: int) -> None:
        task = self._unloading[version] = self.fleet.background(self._unload(version))
        task.add_done_callback(lambda _: self._unloading.pop(version, None))

    async def _unload(self, version: int) -> None:
        """Unload a version nobody uses any more from every server that is up (a failure to is harmless: the
        name stays listed, the engine's LRU cache evicts the weights)."""
        for s in self.fleet.servers:
            if version in s.loaded and s.alive:
                s.loaded.discard(version)
                self._names.pop(self._name(version), None)
                try:
                    await self.fleet.on(s, s.api.unload(self._name(version)))
                except (ServerDown, ServerRejected):
                    pass

    async def load_adapter_async(self, path: str | None, version: int) -> None:
        if version in self._unloading:  # the same version again (tests, a resumed run): after its unload
            await asyncio.wait({self._unloading[version]})
        self._target = (version, path)
        up = self.fleet.alive()
        if version:
            self._names[self._name(version)] = version
            got = await asyncio.gather(*(self.fleet.on(s, s.api.load(self._name(version), path)) for s in up),
                                       return_exceptions=True)
            for s, r in zip(up, got):
                if isinstance(r, ServerRejected):
                    raise ServerError(f"{s.where()} could not load the adapter at {path}: {r}")
                if isinstance(r, BaseException) and not isinstance(r, ServerDown):
                    raise r
                if not isinstance(r, BaseException):
                    s.loaded.add(version)
        if self.fleet.fatal is not None:
            raise self.fleet.fatal
        old = self.adapters.serve((version, path), version)
        if old is not None:
            self._unload_later(old[0])

    def update_adapter(self, deliver: Callable[[], AdapterUpdate], in_place: bool = False) -> AdapterUpdate:
        """Run the transport's delivery (`ServerSync`: the folder written where every server reads it), then load
        it on every server that is up and serve it to new requests."""
        update = deliver()
        self.call(self.load_adapter_async(update.path, update.version))
        return update

    def load_adapter(self, path: str | None, version: int) -> None:
        """Serve the peft adapter at `path` (readable by every server at that path) as `version` for new requests;
        version 0 (or path None) is the base model."""
        self.call(self.load_adapter_async(path, version))

    def versions_in_use(self) -> set[int]:
        """Versions a server may still read from their folder: served, being pushed, used by a request in flight,
        or held by a server and not on their way out."""
        held = {v for s in self.fleet.servers for v in s.loaded} - set(self._unloading)
        return held | {self.adapters.version, self._target[0]} | self.adapters.in_flight()

    # ---- scoring and verification -----------------------------------------------------------------------------

    async def score_on(self, s: Server, prompt_ids, completion_ids, temperature: float) -> list[float]:
        body = score_body(self._name(self.adapters.version), prompt_ids, completion_ids, temperature)
        return parse_scores(await self.fleet.on(s, s.api.complete(body)), completion_ids)

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float = 1.0) -> list[float]:
        """Logprobs of `completion_ids` after `prompt_ids` under the adapter served now, on the first server that
        is up, `log_softmax(logits / temperature)` (top-k / top-p not applied). `replicas` scores on each."""
        async def first():
            return await self.score_on(await self.fleet.pick(), prompt_ids, completion_ids, temperature)
        return self.call(first())

    @property
    def replicas(self) -> list[Replica]:
        """Each server on its own (the run checks every push on every server that is up)."""
        return [Replica(self, s) for s in self.fleet.servers]

    def newest_listed(self, models: dict) -> int:
        """The newest of this generator's adapter versions a `/v1/models` answer lists, 0 when none."""
        return max((self._names[m] for m in listed_models(models) if m in self._names), default=0)

    def served_version(self) -> int | None:
        """The version every server that is up lists as its newest adapter (read back from them); None when they
        disagree."""
        got = {r.served_version() for r in self.replicas if r.alive}
        return got.pop() if len(got) == 1 else None

    # ---- state ------------------------------------------------------------------------------------------------

    @property
    def num_servers(self) -> int:
        return len(self.fleet.servers)

    def servers(self) -> list[dict]:
        """Per server: url, pid (servers minirl started), alive, restarts, requests answered, log."""
        return [dict(index=s.index, url=s.url, pid=s.proc.pid if s.proc else None, alive=s.alive,
                     restarts=s.restarts, requests=s.requests, log=str(s.proc.log_path) if s.proc else None)
                for s in self.fleet.servers]

    def describe(self) -> dict:
        """For the run's start event: each server (`servers`)."""
        return {"servers": self.servers()}

    def stats(self) -> dict:
        """For the run's summary."""
        return {"servers": self.num_servers, "server_restarts": sum(s.restarts for s in self.fleet.servers),
                "server_retried_groups": self.retried_groups}


"""The servers behind `ServerGenerator`: which are up, where the next request goes, and what happens when one
fails.

A server is down when its process exits, a request's connection to it breaks, or it does not answer a 1-token
request (asked every `health_every_s`; the engine itself must answer, not only the HTTP front end) within
`timeout_s`. Its requests in flight are abandoned at once (`Fleet.on` raises `ServerDown`; the generator sends
their groups elsewhere). With `restart=True`, a server minirl started is killed, started again and given the
adapters new requests use (`needs()`) before it takes requests; otherwise, or after `MAX_RESTARTS`, the next
request raises `ServerError`, which names the server and its log. `Fleet.shutdown` (sync, run by the loop
thread at close after the loop's tasks are cancelled) stops the processes.
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Callable, Sequence

from minirl.generation.server_api import ServerAPI, ServerDown, ServerRejected, base_model_name
from minirl.generation.server_proc import ServerOptions, ServerProcess

POLL_S = 0.5
MAX_RESTARTS = 5   # restarts of one server before the run stops


class ServerError(RuntimeError):
    """A vLLM server is down and is not (or could not be) restarted, or could not start."""


class Server:
    """One server's state; lives on the generator's loop."""

    def __init__(self, index: int, opts: ServerOptions | None, url: str | None):
        self.index, self.opts, self.url = index, opts, url
        self.proc: ServerProcess | None = None
        self.api: ServerAPI | None = None
        self.alive = False
        self.epoch = 0                     # +1 at each (re)start: a stale failure report is ignored
        self.down = asyncio.Event()        # set when this epoch fails: its requests in flight give up
        self.outstanding = 0               # tokens of work in flight (n x max_tokens per request)
        self.loaded: set[int] = set()      # adapter versions loaded on it
        self.requests = 0                  # group requests it answered
        self.restarts = 0
        self.probe: asyncio.Task | None = None
        self.probe_t0 = self.last_probe = 0.0
        self.last_done = 0.0               # when a request to it last succeeded (progress: not hung)

    def where(self) -> str:
        log = f", log {self.proc.log_path}" if self.proc is not None else ""
        return f"vLLM server {self.index} ({self.url}{log})"


class Fleet:
    """The servers: minirl's own (`launch`, one `ServerOptions` each) or yours (`urls`). `needs()`: the adapters
    ({version: folder}) a restarted server must hold before it takes requests, loaded as `name(version)`. Create
    and use on one loop."""

    def __init__(self, urls: Sequence[str], launch: Sequence[ServerOptions], api_key: str | None, log_dir: str,
                 restart: bool, timeout_s: float, health_every_s: float, start_timeout_s: float,
                 needs: Callable[[], dict[int, str]], name: Callable[[int], str]):
        self.servers = [Server(i, opts, None if opts else urls[i].rstrip("/"))
                        for i, opts in enumerate(launch or [None] * len(urls))]
        self.key, self.log_dir, self.restart = api_key, log_dir, restart and bool(launch)
        self.timeout_s, self.health_every_s, self.start_timeout_s = timeout_s, health_every_s, start_timeout_s
        self.needs, self.name = needs, name
        self.base = ""                                  # the base model's name on the servers
        self.fatal: ServerError | None = None
        self.on_event: Callable[..., None] | None = None  # (kind, **fields): down, restarted (the run's log)
        self.changed = asyncio.Condition()
        self.tasks: set[asyncio.Task] = set()           # background tasks, referenced until done

    async def start(self) -> None:
        await asyncio.gather(*(self.bring_up(s) for s in self.servers))
        for s in self.servers:
            s.alive = True
            self.background(self.watch(s))

    def background(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def bring_up(self, s: Server) -> None:
        """Start (or connect to) server `s` and wait until it answers, as a new epoch; not yet marked alive."""
        if s.opts is not None:
            for attempt in range(3):  # a port taken between choosing and binding it: another free port
                s.proc = ServerProcess(s.index, s.opts, self.key, self.log_dir)
                s.url = s.proc.url
                try:
                    await self.ready(s)
                    break
                except ServerError:
                    if attempt == 2 or "address already in use" not in s.proc.log_tail().lower():
                        raise
        else:
            await self.ready(s)
        if s.probe is not None:
            s.probe.cancel()
        s.probe, s.last_probe = None, time.monotonic()
        s.epoch += 1
        s.down = asyncio.Event()

    async def ready(self, s: Server) -> None:
        if s.api is not None:
            await s.api.aclose()
        s.api = ServerAPI(s.url, self.key)
        limit = self.start_timeout_s if s.proc else self.timeout_s
        deadline = time.monotonic() + limit
        while True:
            if s.proc is not None and (code := s.proc.exit_code()) is not None:
                raise ServerError(f"{s.where()} exited with code {code} while starting; the end of its log:\n"
                                  f"{s.proc.log_tail()}")
            if s.proc is not None and not s.proc.listening():  # no request (no key) to a port it does not hold
                if time.monotonic() > deadline:
                    raise ServerError(f"{s.where()} did not listen on its port within {limit:.0f} s")
                await asyncio.sleep(0.5)
                continue
            try:
                base = base_model_name(await s.api.models(timeout_s=10.0))
                self.base = self.base or base
                # the engine itself answers (its first request is slow: lazy set-up), not only the front end
                await s.api.probe(base, max(1.0, deadline - time.monotonic()))
                return
            except ServerRejected as e:
                if e.status == 401:
                    raise ServerError(f"{s.where()} refused the API key: set VLLM_API_KEY to the key the server "
                                      "was started with (--api-key)") from e
                if s.proc is None:
                    raise ServerError(f"{s.where()}: {e}") from e
            except ServerDown as e:
                if time.monotonic() > deadline:
                    hint = "" if s.proc else "; is it running, and reachable from here?"
                    raise ServerError(f"{s.where()} did not answer within {limit:.0f} s ({e}){hint}") from e
            await asyncio.sleep(0.5)

    def event(self, kind: str, **fields) -> None:
        print(f"minirl: {kind}: " + ", ".join(f"{k}={v}" for k, v in fields.items()), file=sys.stderr, flush=True)
        if self.on_event is not None:
            try:
                self.on_event(kind, **fields)
            except Exception:  # noqa: BLE001 - a log write never takes generation down
                pass

    async def fail(self, s: Server, epoch: int, reason: str) -> None:
        """Server `s` (in its start `epoch`) is down: its requests give up; restart it or stop the run."""
        if s.epoch != epoch or not s.alive:
            return  # already handled
        s.alive = False
        s.down.set()
        self.event("server_down", server=s.index, url=s.url, reason=reason)
        if self.restart and s.restarts < MAX_RESTARTS:
            self.background(self.restart_server(s))
        else:
            more = ("it was restarted too often" if self.restart else
                    "set restart_servers=True to restart it and go on" if s.proc else "restart it and run again")
            await self.stop_run(ServerError(f"{s.where()} {reason}; {more}"))

    async def stop_run(self, err: ServerError) -> None:
        self.fatal = self.fatal or err
        async with self.changed:
            self.changed.notify_all()

    async def restart_server(self, s: Server) -> None:
        s.restarts += 1
        t0 = time.monotonic()
        try:
            await asyncio.get_running_loop().run_in_executor(None, s.proc.stop, 0.0)  # it stopped answering: kill
            await self.bring_up(s)
            s.loaded = set()  # up once it holds the adapters new requests use
            while set(want := self.needs()) - s.loaded:  # a push may land meanwhile: load that too
                for v in sorted(set(want) - s.loaded):
                    await s.api.load(self.name(v), want[v])
                    s.loaded.add(v)
            s.alive = True
        except Exception as e:  # noqa: BLE001 - any failure to come back stops the run, with its reason
            await self.stop_run(ServerError(f"{s.where()} could not be restarted: {e}"))
            return
        self.event("server_restarted", server=s.index, url=s.url, seconds=round(time.monotonic() - t0, 1),
                    versions=sorted(s.loaded))
        async with self.changed:
            self.changed.notify_all()

    async def watch(self, s: Server) -> None:
        """Every POLL_S: has the process exited? Every health_every_s: a 1-token request; the server is hung when
        neither it nor any other request to it was answered for timeout_s (a busy engine on a loaded CPU can be
        slow to fit a new request in: BENCHMARKS.md, "Figures moved out of docstrings"). The probe has no read
        timeout of its own:
        a slow probe on a server whose other requests finish is not a hang."""
        while True:
            await asyncio.sleep(POLL_S)
            if not s.alive:
                continue
            epoch, now = s.epoch, time.monotonic()
            if s.proc is not None and (code := s.proc.exit_code()) is not None:
                await self.fail(s, epoch, f"exited with code {code}")
            elif s.probe is None:
                if now - s.last_probe >= self.health_every_s:
                    # no read timeout of its own: the check below decides, from the progress of every request
                    s.probe, s.probe_t0 = asyncio.ensure_future(s.api.probe(self.base, None)), now
            elif s.probe.done():
                err = s.probe.exception()
                s.probe, s.last_probe = None, now
                if err is not None:
                    await self.fail(s, epoch, f"failed a health check ({err})")
            elif now - max(s.probe_t0, s.last_done) > self.timeout_s:  # neither the probe nor anything else answered
                s.probe.cancel()
                s.probe = None
                await self.fail(s, epoch, f"did not answer a 1-token request within {self.timeout_s:.0f} s")

    async def on(self, s: Server, coro):
        """Await `coro` (a request to `s`); `ServerDown` when `s` goes down meanwhile, however that is noticed."""
        epoch, down = s.epoch, s.down
        task = asyncio.ensure_future(coro)
        gone = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            raise ServerDown(f"{s.where()} went down")
        try:
            result = task.result()
            s.last_done = time.monotonic()
            return result
        except ServerDown as e:
            await self.fail(s, epoch, f"stopped answering ({e})")
            raise
        except ServerRejected as e:  # an engine dying answers 500 first: is the server still there?
            if e.status >= 500 and not await self.answers(s):
                await self.fail(s, epoch, f"failed ({e})")
                raise ServerDown(str(e)) from e
            raise

    async def answers(self, s: Server) -> bool:
        """Is `s` still running and healthy (a second later)?"""
        await asyncio.sleep(1.0)
        try:
            await s.api.health(self.timeout_s)
        except (ServerDown, ServerRejected):
            return False
        return s.proc is None or s.proc.exit_code() is None

    async def pick(self) -> Server:
        """The server that is up with the least outstanding work; waits (bounded) while all are restarting."""
        deadline = time.monotonic() + self.start_timeout_s
        async with self.changed:
            while True:
                if self.fatal is not None:
                    raise self.fatal
                alive = [s for s in self.servers if s.alive]
                if alive:
                    return min(alive, key=lambda s: (s.outstanding, s.index))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerError(f"no vLLM server came back up within {self.start_timeout_s:.0f} s")
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except asyncio.TimeoutError:
                    pass

    def alive(self) -> list[Server]:
        return [s for s in self.servers if s.alive]

    def shutdown(self) -> None:
        """Stop the processes minirl started: all signalled at once, then each waited for."""
        procs = [s.proc for s in self.servers if s.proc is not None]
        for p in procs:
            p.terminate()
        for p in procs:
            p.stop()

"""A daemon thread running an asyncio event loop, and the engine that lives on it (`VLLMGenerator`'s `AsyncLLM`):
calls from other threads wait for coroutines run there; `close` cancels the pending work before shutting the
engine down, so that no caller waits forever on a dead engine. Imports no vLLM."""
from __future__ import annotations

import asyncio
import atexit
import threading


async def in_finish_order(coros):
    """Run the coroutines concurrently and yield their results as they finish; the ones left are cancelled when
    the consumer stops early (or fails)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        for fut in asyncio.as_completed(tasks):
            yield await fut
    finally:
        for t in tasks:
            t.cancel()


async def gather_or_cancel(coros) -> list:
    """Run the coroutines concurrently and return their results in order; on the first error (or a cancel) the
    others are cancelled, not left running on the engine."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


class EngineThread:
    """The thread, its loop and the engine (`llm`, set by the owner on the loop; vLLM's `AsyncLLM`). Holds no
    reference to its owner, so a weakref finalizer can shut it down at garbage collection or interpreter exit."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.llm = None
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="minirl-vllm", daemon=True)
        self.thread.start()

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro):
        """Run `coro` on the engine loop and wait; its exception (with traceback) is raised here."""
        if self.closed:
            coro.close()
            raise RuntimeError("the vLLM generator is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:  # KeyboardInterrupt included: abort the engine-side work too
            fut.cancel()
            raise

    def close(self):
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        llm, self.llm = self.llm, None
        if llm is not None:
            async def _shutdown():  # cancel pending work first, so no caller waits forever on a dead engine
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                if tasks:
                    await asyncio.wait(tasks, timeout=10)
                llm.shutdown()
            try:
                if self.thread.is_alive():
                    asyncio.run_coroutine_threadsafe(_shutdown(), self.loop).result(timeout=60)
                else:
                    llm.shutdown()
            except Exception:
                llm.shutdown()
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)

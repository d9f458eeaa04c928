"""A run in a background thread: the caller (a notebook kernel) stays free, and can pause, resume or stop it.

`Background` is the thread control a `Run` inherits; the subclass gives `run()` (blocking, returns the summary)
and `_interrupt()` (wake whatever the run's thread is blocked on). Its loop calls `_go()` between steps.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class Background:
    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._stop, self._running = threading.Event(), threading.Event()
        self._running.set()
        self._thread: threading.Thread | None = None

    def run(self) -> dict[str, Any]:
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Wake the run's thread where it waits (for a batch, say); it then sees the stop."""

    def _go(self) -> bool:
        """Between steps: wait while paused; False once stopped."""
        self._running.wait()
        return not self._stop.is_set()

    def start(self) -> "Background":
        """Run in a background thread; the caller (a notebook kernel) stays free."""
        def target() -> None:
            try:
                self.run()
            except BaseException:  # noqa: BLE001 - kept in self.error, re-raised by wait()
                pass
        self._thread = threading.Thread(target=target, name="minirl-run", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Until the run ends (or `timeout`); its summary, or its error raised here."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.summary

    def pause(self) -> None:
        """Hold before the next step (the current one finishes)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def stop(self, timeout: float | None = 60) -> None:
        """End after the current step; the run saves as it would at its end. Waits up to `timeout` seconds."""
        self._stop.set()
        self._running.set()
        self._interrupt()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def attempt(what: str, fn: Callable[[], Any]) -> list[tuple[str, BaseException]]:
    """Run one closing step; [(what, error)] if it failed (closing goes on: the caller reports the first)."""
    try:
        fn()
        return []
    except BaseException as e:  # noqa: BLE001 - reported by the caller
        return [(what, e)]

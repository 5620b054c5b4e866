"""Run what concurrent threads ask for together: one call for every request that arrived
while the previous call ran.

Nothing waits on a timer. A caller that finds no call running makes one at once, for
everything waiting; the others wait for its answers, and when it is done the oldest waiter
makes the next call. Alone, a request pays nothing extra; under load, requests share calls.
A worker uses it for query embeddings (one model call) and for job-store transitions (one
Redis round trip): with hundreds of threads each round trip or call is also a GIL hand-off.

    coalescer = Coalescer(lambda batch: [x * 2 for x in batch], max_batch=64)
    coalescer.call(21)  # 42, from any number of threads

``run`` answers one result per request, in order. An exception ``run`` raises reaches every
caller of the call.
"""

from __future__ import annotations

import _thread
import copy
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Request = TypeVar("Request")
Result = TypeVar("Result")


def _copy(error: BaseException) -> BaseException:
    """A copy of ``error`` to raise in another thread (one exception object raised in many
    threads would mix their tracebacks), caused by it; the error itself if it cannot be."""
    try:
        clone = copy.copy(error)
    except Exception:
        return error
    clone.__cause__, clone.__traceback__ = error, None
    return clone


class _Waiter(Generic[Request, Result]):
    """One caller's request, and then its result or its error."""

    __slots__ = ("_wake", "answered", "error", "request", "result")

    def __init__(self, request: Request, *, waits: bool) -> None:
        self.request = request
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.answered = False
        # a bare lock, held until woken (answered, or made the next runner): lighter than an
        # Event, and a caller that runs at once makes none
        self._wake = _thread.allocate_lock() if waits else None
        if self._wake is not None:
            self._wake.acquire()

    def wait(self) -> None:
        assert self._wake is not None
        self._wake.acquire()

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.release()

    def answer(self) -> Result:
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]


class Coalescer(Generic[Request, Result]):
    """Runs concurrent requests together with ``run``, at most one call at a time; a call
    takes up to ``max_batch`` requests (``size`` counts how much of it each one takes)."""

    def __init__(
        self,
        run: Callable[[list[Request]], Sequence[Result]],
        *,
        max_batch: int = 64,
        size: Callable[[Request], int] = lambda _: 1,
    ) -> None:
        self._run = run
        self.max_batch = max_batch
        self._size = size
        self._lock = threading.Lock()
        self._waiting: list[_Waiter[Request, Result]] = []
        self._running = False

    @property
    def waiting(self) -> int:
        """Requests queued behind the running call."""
        return len(self._waiting)

    def call(self, request: Request) -> Result:
        with self._lock:
            runs_now = not self._running
            self._running = True
            waiter: _Waiter[Request, Result] = _Waiter(request, waits=not runs_now)
            self._waiting.append(waiter)
        if not runs_now:
            waiter.wait()
            if waiter.answered:
                return waiter.answer()
        # This caller makes the next call; it is the oldest waiter, so it is in it.
        self._run_once()
        return waiter.answer()

    def _run_once(self) -> None:
        batch: list[_Waiter[Request, Result]] = []
        try:
            with self._lock:
                size = 0
                while self._waiting and (
                    not batch or size + self._size(self._waiting[0].request) <= self.max_batch
                ):
                    size += self._size(self._waiting[0].request)
                    batch.append(self._waiting.pop(0))
            results = self._run([w.request for w in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for {len(batch)} requests")
        except BaseException as exc:  # every caller in the call gets the error, its own copy
            for w in batch:
                w.error = exc if w is batch[0] else _copy(exc)
        else:
            for w, result in zip(batch, results, strict=True):
                w.result = result
        finally:
            with self._lock:
                nxt = self._waiting[0] if self._waiting else None
                self._running = nxt is not None
            for w in batch:
                w.answered = True
                w.wake()
            if nxt is not None:
                nxt.wake()  # it finds no answer, so it makes the next call

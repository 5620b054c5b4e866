"""The provider limiter: bounds model calls in flight and pauses every thread after a 429.

One limiter per worker process, shared by all its threads. The rerank retry loop
(owned by the core's caller) uses it like this:

    limiter = ProviderLimiter(max_in_flight=200)
    with limiter.slot(deadline=deadline):        # at most 200 calls in flight
        limiter.wait(deadline=deadline)          # honour any pause before sending
        try:
            reply = client.call(...)
        except RateLimited as exc:
            limiter.pause(exc.retry_after or 1.0)  # every thread holds off until then
            raise

``deadline`` is a ``time.monotonic()`` instant. Both calls raise
:class:`~worker.errors.DeadlineExceeded` rather than wait past it. The pause is
per process; N worker processes each honour their own 429s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from worker.core.budget import DEFAULT_429_PAUSE_SECONDS, MIN_ATTEMPT_SECONDS
from worker.core.pipeline import WAIT_CHECK_SECONDS
from worker.core.ports import SEND_CHECK, Reranker
from worker.core.types import RerankPrompt, RerankReply
from worker.errors import AttemptOutcome, DeadlineExceeded, RerankAttemptError

MAX_PAUSE_SECONDS = 60.0  # a retry-after longer than this is capped


class ProviderLimiter:
    """An in-flight bound plus a shared "pause until" instant that every sender respects."""

    def __init__(
        self,
        max_in_flight: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self._clock = clock
        # two conditions on one lock: a freed slot wakes a thread waiting for a slot, never
        # one waiting out a pause (with one condition, notify() woke the longest waiting,
        # often a pause's, and the slot's waiter slept on with a slot free)
        lock = threading.Lock()
        self._pause_over = threading.Condition(lock)
        self._slot_freed = threading.Condition(lock)
        self._in_flight = 0
        self._paused_until = 0.0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def paused_until(self) -> float:
        return self._paused_until

    def pause(self, seconds: float) -> None:
        """Hold every sender off for ``seconds`` from now (never shortens a longer pause)."""
        seconds = min(max(seconds, 0.0), MAX_PAUSE_SECONDS)
        with self._pause_over:
            self._paused_until = max(self._paused_until, self._clock() + seconds)

    def wait(self, deadline: float | None = None) -> None:
        """Block while a pause is on. Raises DeadlineExceeded if it would outlast ``deadline``,
        or if the thread, having waited, is woken past it (a busy process wakes late)."""
        waited = False
        with self._pause_over:
            while True:
                now = self._clock()
                if now >= self._paused_until:
                    if waited and deadline is not None and now > deadline:
                        raise DeadlineExceeded("the pause ended too late for the deadline")
                    return
                if deadline is not None and self._paused_until >= deadline:
                    raise DeadlineExceeded("the provider asked to pause past the search deadline")
                self._pause_over.wait(self._paused_until - now)
                waited = True

    @contextmanager
    def slot(
        self, deadline: float | None = None, check: Callable[[], None] | None = None
    ) -> Iterator[None]:
        """Hold one of the ``max_in_flight`` places for the duration of one model call.
        Raises DeadlineExceeded if none is free by ``deadline``; a thread that waited and got
        one only past it (woken late, or freed as its wait timed out) takes none either.
        ``check`` (a batch item's cancel check) is asked every ``WAIT_CHECK_SECONDS`` of the
        wait, outside the lock, and once more when a wait ends with a place: what it raises
        ends the wait, the place given back. Unasked, a canceled batch's items waiting here
        made their calls once places freed (all 8 of 10 at 2 places)."""
        waited = False
        with self._slot_freed:
            while self._in_flight >= self.max_in_flight:
                timeout = None if deadline is None else deadline - self._clock()
                if timeout is not None and timeout <= 0:
                    raise DeadlineExceeded("no rerank slot became free before the deadline")
                if check is not None:
                    timeout = min(timeout or WAIT_CHECK_SECONDS, WAIT_CHECK_SECONDS)
                self._slot_freed.wait(timeout)
                waited = True
                if check is not None and self._in_flight >= self.max_in_flight:
                    self._slot_freed.release()  # none free, so no wake-up is lost here
                    try:
                        check()
                    finally:
                        self._slot_freed.acquire()
            if waited and deadline is not None and self._clock() > deadline:
                self._slot_freed.notify()  # the slot it was woken for goes to another waiter
                raise DeadlineExceeded("a rerank slot became free too late for the deadline")
            self._in_flight += 1
        try:
            if waited and check is not None:
                check()  # a cancel during the last part of the wait
            yield
        finally:
            with self._slot_freed:
                self._in_flight -= 1
                self._slot_freed.notify()


class LimitedReranker:
    """Wraps a ``Reranker`` so every call takes a limiter slot, honours the pause, and a 429
    pauses every thread for its ``retry-after``. The retry loop stays in the core.

    reranker = LimitedReranker(AnthropicReranker("claude-haiku-4-5"), ProviderLimiter(200))

    ``pauses`` False: the slot only, the 429's pause left to the cluster's rate budget, which
    holds every process's calls at their reservation, where the search's cancel check
    follows the wait. Paused here too, a call reserved just before the 429 (no wait, so no
    check) waited out this process's pause here and was sent after its batch's cancel.
    """

    def __init__(
        self,
        inner: Reranker,
        limiter: ProviderLimiter,
        clock: Callable[[], float] = time.monotonic,
        *,
        pauses: bool = True,
    ) -> None:
        self.inner = inner
        self.limiter = limiter
        self.pauses = pauses
        self.model = inner.model
        self.effort = inner.effort
        self._clock = clock

    def rerank(self, prompt: RerankPrompt, timeout_seconds: float) -> RerankReply:
        """One attempt. When the pause or a full limiter outlasts the attempt's timeout, the
        attempt is a ``rate_limited`` one (with the pause left as ``retry_after``), so the
        core's budget and failure policy decide, as for a 429 from the provider; but it is
        marked not ``sent``: it pauses no one else and is not a request in the usage."""
        deadline = self._clock() + timeout_seconds
        # a call must still have MIN_ATTEMPT_SECONDS once the slot and the pause allow it
        # (one sent with what a pause left, milliseconds, timed out at once, perhaps billed)
        send_by = deadline - MIN_ATTEMPT_SECONDS
        try:
            with self.limiter.slot(deadline=send_by, check=SEND_CHECK.get()):
                if self.pauses:
                    self.limiter.wait(deadline=send_by)
                try:
                    return self.inner.rerank(prompt, max(0.0, deadline - self._clock()))
                except RerankAttemptError as exc:
                    if self.pauses and exc.outcome is AttemptOutcome.RATE_LIMITED:
                        self.limiter.pause(exc.retry_after or DEFAULT_429_PAUSE_SECONDS)
                    raise
        except DeadlineExceeded as exc:
            left = max(0.0, self.limiter.paused_until - self._clock())
            raise RerankAttemptError(
                AttemptOutcome.RATE_LIMITED,
                f"not sent: {exc.message}",
                retry_after=left or None,
                sent=False,
            ) from exc

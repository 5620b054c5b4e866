"""Backpressure: past ``SIFT_MAX_BACKLOG`` queued searches and batch items, refuse new work.

The backlog is the job store's count of ``queued`` searches and batch items (one HGETALL),
read at most every ``READ_EVERY_SECONDS`` so the hot path stays one cached comparison. Work
this gateway admits is added to its cached reading at once, so a burst between two readings
cannot overshoot the limit by more than what the other gateways admitted meanwhile.

    backlog = Backlog(store, limit=10_000)
    backlog.admit(len(items))   # raises BacklogFull (429 with Retry-After) past the limit
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from worker.jobstore import JobStore

READ_EVERY_SECONDS = 0.5
RETRY_AFTER_SECONDS = 5


class BacklogFull(Exception):
    """The backlog is at its limit: answer 429 with ``Retry-After``."""

    def __init__(self, queued: int, adding: int, limit: int) -> None:
        self.queued, self.adding, self.limit = queued, adding, limit
        super().__init__(
            f"the backlog is full: {queued} searches and batch items are queued, and "
            f"{adding} more would pass the limit of {limit} (SIFT_MAX_BACKLOG); "
            f"retry after {RETRY_AFTER_SECONDS} s"
        )


class Backlog:
    """A cached reading of the queued count, and the admission decision. Thread-safe."""

    def __init__(
        self,
        store: JobStore,
        limit: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.limit = limit
        self._clock = clock
        self._lock = threading.Lock()
        self._queued = 0
        self._read_at: float | None = None

    def admit(self, items: int) -> None:
        """Count ``items`` in, or raise :class:`BacklogFull` (all or nothing). Blocking."""
        if self.limit <= 0:
            return
        with self._lock:
            now = self._clock()
            if self._read_at is None or now - self._read_at >= READ_EVERY_SECONDS:
                self._queued = self.store.in_flight()["queued"]
                self._read_at = now
            if self._queued + items > self.limit:
                raise BacklogFull(self._queued, items, self.limit)
            self._queued += items

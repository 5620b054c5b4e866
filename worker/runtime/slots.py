"""CPU slots: how many threads of a process run a search's CPU-bound stages at once.

A worker keeps hundreds of searches in flight on threads, because most of a search is
waiting on the model. The query embedding and the embedded backend's retrieval are CPU
work, and past about one thread per core more threads in them only queue for the GIL: each
hand-off is a futex wake and a context switch, which perf put at a quarter of the worker's
CPU. So a search holds a slot through its first half (embedding, retrieval, fusion, the
prompt; not a retry's back-off), and when every slot is taken it waits for one off the GIL.
Elasticsearch's retrieval waits on the network, so there only the embedding holds one
(:func:`worker.runtime.bootstrap.build_pipeline` decides).

    slots = cpu_slots(settings.cpu_slots)  # SIFT_CPU_SLOTS; 0 is one per core, plus one
    SearchPipeline(EmbeddedBackend(data_dir), embedder, cpu_slots=slots)  # the first half
    SearchPipeline(elasticsearch, SlottedEmbedder(embedder, slots))  # the embedding alone

The slots have two lines of waiters. A batch's items all go on the process's item pool at
once (300 threads at the defaults) and queue for the slots; a single search queued behind
them, in one line, waited for every one of them (two seconds, seven at worst, behind a
20,000-item batch, for 5 ms of its own work). So a thread running batch items marks its work
(:func:`behind_searches`), and a freed slot goes to the longest-waiting search first, then to
the longest-waiting batch item: first come, first served within each line. Not for ever, though:
once :data:`SEARCHES_AHEAD` searches in a row have had a freed slot while batch items waited,
the next goes to the longest-waiting item, so searches that keep coming cannot starve a batch
(with strict order, 3 searches looping on 2 slots left an item waiting 10 s and on).

    with behind_searches():  # the item pool's runner, around the items it runs
        ...
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any

from worker.core.ports import Embedder
from worker.processes.machine import cpu_count

Slots = AbstractContextManager[Any]


# Searches in a row a freed slot goes to while batch items wait; the next goes to an item.
SEARCHES_AHEAD = 4
# Told each wait for a slot: its line ("search" or "batch") and its seconds (0: one was free).
Waited = Callable[[str, float], None]
# Whether this thread's slot waits go behind every search's: set by a batch item's runner.
_BEHIND_SEARCHES: ContextVar[bool] = ContextVar("behind_searches", default=False)


def cpu_slots(slots: int, waited: Waited | None = None) -> CpuSlots:
    """``slots`` CPU slots to share between the stages; 0 is one per core and one more, so
    a core need not idle while a slot's holder waits on a read (measured best for a worker:
    532 batch queries/s with 3 slots on 2 cores, against 488 with 2). ``waited`` hears of
    each wait for one (the metrics' :func:`~worker.observability.metrics.slot_waited`)."""
    return CpuSlots(slots or cpu_count() + 1, waited)


@contextmanager
def behind_searches() -> Iterator[None]:
    """Within it, this thread waits for a slot behind every search waiting for one: a batch
    item's. Anything else (a search, an ingest's embedding) waits ahead of the batch items."""
    token = _BEHIND_SEARCHES.set(True)
    try:
        yield
    finally:
        _BEHIND_SEARCHES.reset(token)


class CpuSlots:
    """``size`` slots, held with ``with slots:``; a freed slot passes straight to the first
    waiter of the searches' line, else of the batch items' (:func:`behind_searches`), so no
    thread arriving meanwhile takes it ahead of them; after :data:`SEARCHES_AHEAD` searches
    in a row served while items wait, to the first item's.

    >>> slots = CpuSlots(1)
    >>> with slots:
    ...     slots.free
    0
    """

    def __init__(self, size: int, waited: Waited | None = None) -> None:
        self.size = size
        self.free = size
        self._waited = waited
        self._lock = threading.Lock()
        self._searches: deque[threading.Lock] = deque()
        self._batch: deque[threading.Lock] = deque()
        self._searches_in_a_row = 0  # served while batch items waited

    def __enter__(self) -> None:
        self.acquire(urgent=not _BEHIND_SEARCHES.get())

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self, *, urgent: bool) -> None:
        """Hold a slot: at once if one is free and nobody of this line, or of a line ahead of
        it, waits; else once a holder hands one over."""
        asked = time.monotonic()
        with self._lock:
            line = self._searches if urgent else self._batch
            ahead = self._searches if urgent else (self._searches or self._batch)
            handed = None
            if self.free and not ahead:
                self.free -= 1
            else:
                handed = threading.Lock()
                handed.acquire()
                line.append(handed)
        if handed is not None:
            try:
                handed.acquire()  # released by the holder that hands its slot over
            except BaseException:  # a signal's handler raised (a Ctrl-C in sift eval)
                self._leave(line, handed)
                raise
        if self._waited is not None:
            self._waited("search" if urgent else "batch", time.monotonic() - asked)

    def release(self) -> None:
        with self._lock:  # the slot goes to a waiter, if any, never back to free
            if self._batch and (not self._searches or self._searches_in_a_row >= SEARCHES_AHEAD):
                self._searches_in_a_row = 0
                self._batch.popleft().release()
            elif self._searches:
                self._searches_in_a_row = self._searches_in_a_row + 1 if self._batch else 0
                self._searches.popleft().release()
            elif self.free < self.size:
                self.free += 1
            else:
                raise ValueError("a CPU slot released more times than it was held")

    def _leave(self, line: deque[threading.Lock], handed: threading.Lock) -> None:
        """A waiter ended by an exception leaves its line; if a holder handed it the slot
        meanwhile, the slot goes on to the next waiter (or back to the free ones), where it
        was lost for the process's life."""
        with self._lock:
            if handed in line:
                line.remove(handed)
                return
        self.release()

    def waiting(self) -> tuple[int, int]:
        """How many searches and how many batch items wait for a slot now."""
        with self._lock:
            return len(self._searches), len(self._batch)


class SlottedEmbedder:
    """An :class:`~worker.core.ports.Embedder` whose model calls each hold a CPU slot."""

    def __init__(self, inner: Embedder, slots: Slots) -> None:
        self.inner = inner
        self.slots = slots
        self.model_id: str = inner.model_id
        self.dimension: int = inner.dimension

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        with self.slots:
            return self.inner.embed(texts)

"""A process's CPU slots (:mod:`worker.runtime.slots`): a search waiting for one goes ahead
of the batch items waiting, which keep their own order, but for one item after every
:data:`~worker.runtime.slots.SEARCHES_AHEAD` searches in a row."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import pytest

from tests.fakes import FakeEmbedder, InMemoryBackend
from worker.contract import DocumentIn, SearchSpec
from worker.core.pipeline import SearchPipeline
from worker.runtime.inprocess import Runtime
from worker.runtime.slots import SEARCHES_AHEAD, CpuSlots, behind_searches


def _until(check: Callable[[], bool]) -> None:
    """Poll ``check`` until true (a thread has reached its wait): the test's timeout bounds it."""
    while not check():
        time.sleep(0.001)


class _Waiters:
    """Threads waiting for a slot, noting the order they get one in (each lets it go at once)."""

    def __init__(self, slots: CpuSlots) -> None:
        self.slots = slots
        self.order: list[str] = []
        self.threads: list[threading.Thread] = []

    def start(self, name: str, *, batch: bool) -> None:
        def run() -> None:
            if batch:
                with behind_searches(), self.slots:
                    self.order.append(name)
            else:
                with self.slots:
                    self.order.append(name)

        searches, items = self.slots.waiting()
        thread = threading.Thread(target=run, name=name)
        thread.start()
        self.threads.append(thread)
        # each waits before the next comes: their arrival order is the one started in
        _until(lambda: self.slots.waiting() == ((searches + 1, items) if not batch
                                               else (searches, items + 1)))  # fmt: skip

    def join(self) -> None:
        for thread in self.threads:
            thread.join()


def test_a_search_gets_the_next_slot_ahead_of_the_batch_items_waiting_before_it() -> None:
    # A batch's chunk puts 300 items a process on the item pool at once and they queue for
    # the slots: in one line, a single search sent then waited for every one of them (two
    # seconds, seven at worst, behind a 20,000-item batch, for 5 ms of its own work).
    slots = CpuSlots(1)  # handed on one waiter at a time: the order they had it in is clear
    waiters = _Waiters(slots)
    slots.acquire(urgent=False)  # held by a batch item
    for i in range(5):
        waiters.start(f"item-{i}", batch=True)
    waiters.start("search-0", batch=False)
    waiters.start("item-5", batch=True)
    waiters.start("search-1", batch=False)
    slots.release()
    waiters.join()
    # the searches first, in their order; the items in theirs
    assert waiters.order == ["search-0", "search-1"] + [f"item-{i}" for i in range(6)]
    assert slots.free == 1 and slots.waiting() == (0, 0)


def test_after_searches_ahead_of_them_in_a_row_a_batch_item_has_the_next_slot() -> None:
    slots = CpuSlots(1)
    waiters = _Waiters(slots)
    slots.acquire(urgent=True)
    for i in range(2):
        waiters.start(f"item-{i}", batch=True)
    searches = [f"search-{i}" for i in range(2 * SEARCHES_AHEAD + 2)]
    for name in searches:
        waiters.start(name, batch=False)
    slots.release()
    waiters.join()
    first, second = SEARCHES_AHEAD, 2 * SEARCHES_AHEAD  # an item after each SEARCHES_AHEAD
    in_turn = [*searches[:first], "item-0", *searches[first:second], "item-1", *searches[second:]]
    assert waiters.order == in_turn  # (seen: every search first)
    assert slots.free == 1 and slots.waiting() == (0, 0)


def test_a_batch_item_has_a_slot_while_searches_keep_waiting_for_them() -> None:
    # With a search always waiting, a freed slot always went to one: an item waited for as
    # long as they kept coming (3 searches looping on 5 ms of work held one for 10 s and on).
    slots = CpuSlots(1)
    holders: list[str] = []
    stop = threading.Event()  # the item has had a slot, or the searches gave up on it
    item_thread = threading.Thread(target=lambda: item())

    def item() -> None:
        with behind_searches(), slots:
            holders.append("item")
            stop.set()

    def search() -> None:  # holds the slot until another search waits, then asks again
        while not stop.is_set():
            with slots:
                holders.append("search")
                if len(holders) == 3:  # the item joins its line while this one holds
                    item_thread.start()
                    _until(lambda: slots.waiting()[1] == 1)
                if len(holders) == 100:
                    stop.set()
                _until(lambda: slots.waiting()[0] == 1 or stop.is_set())

    threads = [threading.Thread(target=search) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in [*threads, item_thread]:
        thread.join()
    # the search that saw it join, SEARCHES_AHEAD more, the item (seen: 101, the searches gone)
    assert holders.index("item") == 3 + SEARCHES_AHEAD, holders


def test_a_freed_slot_goes_to_a_waiter_not_to_a_thread_arriving_after_it() -> None:
    slots = CpuSlots(1)
    waiters = _Waiters(slots)
    slots.acquire(urgent=True)
    waiters.start("item-0", batch=True)
    slots.release()  # handed to item-0, never free in between
    waiters.join()
    assert waiters.order == ["item-0"] and slots.free == 1


def test_a_batch_item_arriving_while_searches_wait_waits_behind_them() -> None:
    slots = CpuSlots(1)
    slots.acquire(urgent=True)
    waiters = _Waiters(slots)
    waiters.start("search-0", batch=False)
    slots.release()  # to search-0, which lets it go at once
    waiters.join()
    with behind_searches(), slots:  # free again, and nobody waits: at once
        assert slots.free == 0
    assert slots.free == 1


def test_a_slot_released_more_times_than_held_is_an_error() -> None:
    slots = CpuSlots(1)
    with pytest.raises(ValueError, match="released more times"):
        slots.release()


def test_each_wait_is_told_with_its_line() -> None:
    # The wait was in no metric: a search's two seconds behind a batch's items showed nowhere.
    told: list[tuple[str, float]] = []
    slots = CpuSlots(1, lambda line, seconds: told.append((line, seconds)))
    waiters = _Waiters(slots)
    with slots:  # free: told as no wait
        waiters.start("item-0", batch=True)
    waiters.join()
    assert [line for line, _ in told] == ["search", "batch"]
    assert told[0][1] >= 0.0 and told[1][1] > 0.0  # the item waited for the holder's end


class _Interrupted(Exception):
    pass


def test_a_wait_interrupted_gives_back_the_slot_handed_to_it() -> None:
    """A wait ended by an exception (a Ctrl-C in ``sift eval``'s main thread, here a signal's
    handler) leaves its line: the slot freed after goes back to the free ones, where it was
    handed to the dead waiter and lost for the process's life."""
    slots = CpuSlots(1)
    let_go = threading.Event()

    def holder() -> None:
        with slots:
            _until(lambda: slots.waiting() == (1, 0))  # the main thread waits for it
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
            let_go.wait()

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    thread = threading.Thread(target=holder)
    try:
        thread.start()
        _until(lambda: slots.free == 0)
        with pytest.raises(_Interrupted):
            slots.acquire(urgent=True)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert slots.waiting() == (0, 0)
    let_go.set()
    thread.join()
    assert slots.free == 1


def test_a_retrieval_back_off_interrupted_taking_its_slot_again_lets_go_of_no_other_s() -> None:
    """A retrieval retry's back-off lets the search's slot go and takes it again; a wait to
    take it again ended by an exception (a signal's handler, as above) leaves the line, and
    the search's own ``with`` then let go of the slot another thread held: counted free
    under it, and that thread's release raised ValueError."""
    slots = CpuSlots(1)
    other_holds, let_go = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:  # waits for the search's slot, has it during the back-off
        try:
            with slots:
                other_holds.set()
                _until(lambda: slots.waiting() == (1, 0))  # the search waits to take it again
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
                let_go.wait()
        except BaseException as exc:
            errors.append(exc)

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    def back_off(seconds: float) -> None:  # the other thread takes the slot let go
        thread.start()
        other_holds.wait()

    backend = InMemoryBackend()
    pipeline = SearchPipeline(backend, FakeEmbedder(), sleep=back_off, cpu_slots=slots)
    Runtime(pipeline).ingest("docs", "acme", [DocumentIn(id="d1", text="volcano ash")])
    backend.fail_next = 1  # retryable: the retrieval backs off
    previous = signal.signal(signal.SIGUSR1, interrupt)
    thread = threading.Thread(target=other)
    try:
        with pytest.raises(_Interrupted):
            pipeline.search(SearchSpec(index="docs", query="volcano ash"), "acme")
        assert slots.free == 0  # the other thread holds it (seen: 1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        let_go.set()
        if thread.is_alive():
            thread.join()
    assert errors == []  # (seen: ValueError, released more times than it was held)
    assert slots.free == 1 and slots.waiting() == (0, 0)

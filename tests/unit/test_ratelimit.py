"""The provider limiter: the in-flight bound and the shared pause after a 429."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from tests.fakes import FakeClock
from worker.errors import AttemptOutcome, DeadlineExceeded, RerankAttemptError
from worker.runtime.ratelimit import LimitedReranker, ProviderLimiter


def test_the_in_flight_bound_holds() -> None:
    limiter = ProviderLimiter(3)
    peak = 0
    lock = threading.Lock()

    def call() -> None:
        nonlocal peak
        with limiter.slot():
            with lock:
                peak = max(peak, limiter.in_flight)
            time.sleep(0.01)

    threads = [threading.Thread(target=call) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak == 3 and limiter.in_flight == 0


class _ScriptedClock:
    """A monotonic clock that answers the readings it was given, in turn, then the last one
    again and again; ``left`` counts those not read yet."""

    def __init__(self, *readings: float) -> None:
        self._readings = list(readings)

    def __call__(self) -> float:
        return self._readings.pop(0) if len(self._readings) > 1 else self._readings[0]

    @property
    def left(self) -> int:
        return len(self._readings) - 1


def test_a_pause_holds_every_sender() -> None:
    """``wait`` returns only once its clock shows the pause over: the clock reads 0 (the
    pause), 0 (the wait: paused), 0.1 (still paused), 0.2 (over). A wait that returned before
    its clock reached the pause's end leaves readings unread. (Each reading still paused
    costs a real wait of what is left, here 0.3 s in all.)"""
    clock = _ScriptedClock(0.0, 0.0, 0.1, 0.2)
    limiter = ProviderLimiter(10, clock=clock)
    limiter.pause(0.2)
    assert limiter.paused_until == 0.2
    limiter.wait()
    assert clock.left == 0
    limiter.pause(0.05)
    limiter.pause(0.01)  # a shorter pause never shortens the longer one
    assert limiter.paused_until == pytest.approx(0.25)


def test_no_wait_past_the_deadline() -> None:
    limiter = ProviderLimiter(1)
    limiter.pause(5)
    with pytest.raises(DeadlineExceeded):
        limiter.wait(deadline=time.monotonic() + 0.1)
    with (
        limiter.slot(),
        pytest.raises(DeadlineExceeded),
        limiter.slot(deadline=time.monotonic() + 0.05),
    ):
        pass


class _Flaky:
    """Answers every call with a 429 (``retry_after`` 0.15 s); ``sent_at`` holds the time of
    each call, on the limiter's clock (the real one unless ``clock`` is given)."""

    model = "m"
    effort = None

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.calls = 0
        self.sent_at: list[float] = []
        self._clock = clock

    def rerank(self, prompt: object, timeout_seconds: float) -> object:
        self.calls += 1
        self.sent_at.append(self._clock())
        raise RerankAttemptError(AttemptOutcome.RATE_LIMITED, "429", retry_after=0.15)


def test_a_429_pauses_every_later_call() -> None:
    """The 429's pause runs from its answer for its ``retry_after``; the next call is sent
    only once that pause is over, by the limiter's own clock (an order of events, not a
    duration)."""
    limiter = ProviderLimiter(4)
    inner = _Flaky()
    reranker = LimitedReranker(inner, limiter)  # type: ignore[arg-type]
    with pytest.raises(RerankAttemptError):
        reranker.rerank(None, 5.0)  # type: ignore[arg-type]
    pause_over = limiter.paused_until
    assert pause_over >= inner.sent_at[0] + 0.15  # from the answer, for its retry-after
    with pytest.raises(RerankAttemptError):
        reranker.rerank(None, 5.0)  # type: ignore[arg-type]
    assert inner.calls == 2
    assert inner.sent_at[1] >= pause_over  # the second call waited out the pause
    assert limiter.in_flight == 0


def test_without_its_own_pause_a_429_holds_no_later_call_here() -> None:
    """With the cluster's rate budget on, the process keeps no pause of its own (``pauses``
    False): the budget holds the calls at their reservation, where a search checks its
    cancel after the wait; here a call waited out this pause with no check after it."""
    clock = FakeClock()  # never moves: a call that waited here would not be sent
    inner = _Flaky(clock)
    limiter = ProviderLimiter(4, clock=clock)
    reranker = LimitedReranker(inner, limiter, clock=clock, pauses=False)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(RerankAttemptError):
            reranker.rerank(None, 5.0)  # type: ignore[arg-type]
    assert inner.calls == 2 and limiter.paused_until == 0.0 and clock.sleeps == []


def test_an_attempt_a_pause_outlasts_is_not_sent_and_says_what_is_left_of_it() -> None:
    clock = FakeClock()  # never moves here: nothing is waited
    inner = _Flaky(clock)
    limiter = ProviderLimiter(4, clock=clock)
    reranker = LimitedReranker(inner, limiter, clock=clock)  # type: ignore[arg-type]
    limiter.pause(1.0)
    with pytest.raises(RerankAttemptError) as caught:  # not sent: the pause outlasts it
        reranker.rerank(None, 0.05)  # type: ignore[arg-type]
    assert caught.value.outcome is AttemptOutcome.RATE_LIMITED
    assert caught.value.sent is False
    assert caught.value.retry_after == 1.0  # all of the pause: the clock has not moved
    assert inner.calls == 0
    assert clock.sleeps == []


def test_a_freed_slot_reaches_a_thread_waiting_for_one_while_others_wait_out_a_pause() -> None:
    """A holds a slot and waits out a 429's pause; C waits for a slot; B frees one. The
    release used to wake one waiter of the limiter's single condition, the longest waiting:
    A, which went back to its pause, while C slept on with a slot free (until A's pause
    ended and A let go of its own; at the defaults, until its attempt's time was spent and
    it went unsent)."""
    reads = 0
    both_waiting = threading.Event()

    def clock() -> float:  # the real time; the third reading is C's, A's having been taken
        nonlocal reads
        now = time.monotonic()
        reads += 1
        if reads == 3:  # the pause's, A's (in its wait) and C's (in its wait for a slot)
            both_waiting.set()
        return now

    limiter = ProviderLimiter(2, clock=clock)
    limiter.pause(2.0)
    a_holds = threading.Event()
    order: list[str] = []

    def a() -> None:
        with limiter.slot():
            a_holds.set()
            limiter.wait(deadline=time.monotonic() + 30)
            order.append("A's pause over")

    def c() -> None:
        with limiter.slot(deadline=time.monotonic() + 30):
            order.append("C has a slot")

    holder_a = threading.Thread(target=a)
    holder_a.start()
    a_holds.wait()
    with limiter.slot():  # B: the second slot, so that C has to wait
        waiter_c = threading.Thread(target=c)
        waiter_c.start()
        # each read the clock under the limiter's lock and holds it until it waits: B's
        # release, which takes that lock, comes once both are waiting
        both_waiting.wait()
    waiter_c.join()
    holder_a.join()
    assert order == ["C has a slot", "A's pause over"]


def test_a_pause_that_leaves_the_attempt_no_real_time_sends_nothing() -> None:
    """The pause ends 10 ms before the attempt's time is up: too little for a call (the
    core starts none with under MIN_ATTEMPT_SECONDS left). It used to be sent with those
    10 ms, to time out at once, counted as a timeout, perhaps billed. (The attempt starts
    at the instant its timeout was measured from, however late the thread gets to it.)"""
    limiter = ProviderLimiter(4)
    inner = _Flaky()
    start = [time.monotonic()]
    clock = lambda: start.pop() if start else time.monotonic()  # noqa: E731
    reranker = LimitedReranker(inner, limiter, clock=clock)  # type: ignore[arg-type]
    limiter.pause(0.5)
    timeout = limiter.paused_until - start[0] + 0.01
    with pytest.raises(RerankAttemptError) as caught:
        reranker.rerank(None, timeout)  # type: ignore[arg-type]
    assert caught.value.outcome is AttemptOutcome.RATE_LIMITED
    assert caught.value.sent is False
    assert inner.calls == 0


class _SteppedClock:
    """A monotonic clock the test moves by hand; ``read_enough`` is set at its ``reads``-th
    reading (the value read is taken before the event is set, so moving the clock after the
    event never changes what that reading saw)."""

    def __init__(self, reads: int) -> None:
        self.now = 0.0
        self.read_enough = threading.Event()
        self._reads_left = reads

    def __call__(self) -> float:
        value = self.now
        self._reads_left -= 1
        if self._reads_left == 0:
            self.read_enough.set()
        return value

    def expect(self, reads: int) -> None:
        """Set ``read_enough`` again, at the ``reads``-th reading from now."""
        self.read_enough.clear()
        self._reads_left = reads


def _attempt_in_thread(
    reranker: LimitedReranker, timeout: float
) -> tuple[threading.Thread, list[RerankAttemptError]]:
    """Start one attempt on a thread of its own; the list gets the attempt error it raises."""
    caught: list[RerankAttemptError] = []

    def attempt() -> None:
        try:
            reranker.rerank(None, timeout)  # type: ignore[arg-type]
        except RerankAttemptError as exc:
            caught.append(exc)

    thread = threading.Thread(target=attempt)
    thread.start()
    return thread, caught


def test_a_slot_freed_with_less_than_an_attempts_worth_left_sends_nothing() -> None:
    """The attempt waits for the process's one slot, which comes free only once 20 ms of the
    attempt's time are left (on a busy worker, a waiter also wakes late: the same thing). The
    slot's loop took the free slot without a look at the time, and the call was sent with
    those 20 ms, to time out at once, perhaps billed, though the limiter must send nothing
    with under MIN_ATTEMPT_SECONDS left. The clock is the test's, so nothing here is timed."""
    clock = _SteppedClock(reads=2)  # the attempt's start, then its wait for the slot
    limiter = ProviderLimiter(1, clock=clock)
    inner = _Flaky()
    reranker = LimitedReranker(inner, limiter, clock=clock)  # type: ignore[arg-type]
    with limiter.slot():  # another call holds the slot
        waiter, caught = _attempt_in_thread(reranker, 100.0)
        clock.read_enough.wait()  # the waiter saw 99.95 s to wait, under the limiter's lock
        clock.now = 100.0 - 0.02
    # the release took the limiter's lock, so the waiter was waiting: it has the slot now
    waiter.join()
    assert inner.calls == 0
    (error,) = caught
    assert error.outcome is AttemptOutcome.RATE_LIMITED
    assert error.sent is False
    assert limiter.in_flight == 0


def test_a_waiter_woken_too_late_passes_its_slot_on() -> None:
    """Two threads wait for the one slot: W1 until 10, W2 until 1000. The slot comes free at
    20: W1, woken first, is past its deadline and takes none, and the slot must go to W2
    (the notification W1 was woken by is passed on: W2 would otherwise sleep on with the
    slot free, here for 1000 s, and the test would hit its timeout)."""
    clock = _SteppedClock(reads=1)
    limiter = ProviderLimiter(1, clock=clock)
    outcome: dict[str, str] = {}

    def waiter(name: str, deadline: float) -> None:
        try:
            with limiter.slot(deadline=deadline):
                outcome[name] = "slot"
        except DeadlineExceeded:
            outcome[name] = "too late"

    with limiter.slot():
        w1 = threading.Thread(target=waiter, args=("W1", 10.0))
        w1.start()
        clock.read_enough.wait()  # W1 is waiting (it read the clock under the lock)
        clock.expect(reads=1)
        w2 = threading.Thread(target=waiter, args=("W2", 1000.0))
        w2.start()
        clock.read_enough.wait()  # W2 too, after W1
        clock.now = 20.0
    w1.join()
    w2.join()
    assert outcome == {"W1": "too late", "W2": "slot"}
    assert limiter.in_flight == 0


def test_a_pause_waited_out_but_woken_past_the_send_by_sends_nothing() -> None:
    """The pause ends at 1, well before the attempt's send-by (5.05 - 0.05); the thread
    waiting it out is woken only at 5.02 (a busy process). The pause's wait returned all the
    same, and the call went with 30 ms. (The clock is the test's: the thread waits 1 s of
    real time, again if the clock has not moved yet.)"""
    clock = _SteppedClock(reads=3)  # the pause's, the attempt's start, its wait
    limiter = ProviderLimiter(4, clock=clock)
    inner = _Flaky()
    reranker = LimitedReranker(inner, limiter, clock=clock)  # type: ignore[arg-type]
    limiter.pause(1.0)
    thread, caught = _attempt_in_thread(reranker, 5.05)
    clock.read_enough.wait()
    clock.now = 5.02
    thread.join()
    assert inner.calls == 0
    (error,) = caught
    assert error.outcome is AttemptOutcome.RATE_LIMITED
    assert error.sent is False


def test_an_attempt_the_limiter_did_not_hold_goes_to_the_provider() -> None:
    """No slot to wait for, no pause: the attempt is the provider's to answer, however
    little time it has (only the core decides not to start one). A limiter that refused it
    would call it rate_limited, held back in the worker, which it was not."""
    readings = iter([0.0])
    clock = lambda: next(readings, 0.03)  # noqa: E731  (later readings: 30 ms on)
    inner = _Flaky()
    reranker = LimitedReranker(inner, ProviderLimiter(4, clock=clock), clock=clock)  # type: ignore[arg-type]
    with pytest.raises(RerankAttemptError) as caught:
        reranker.rerank(None, 0.06)  # type: ignore[arg-type]
    assert inner.calls == 1
    assert caught.value.sent is True  # the provider's 429 (the fake's answer)

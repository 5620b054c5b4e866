"""One deadline per search and a bounded retry budget, in one layer (tenacity).

Every model or backend call goes through :func:`call_within_budget`: no attempt starts
unless time is left, each attempt's timeout is ``min(cap, time left)``, waits honour
``retry-after``, and the loop stops at whichever comes first, the attempt budget or the
deadline. Only errors marked ``retryable`` are retried.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt
from tenacity.stop import stop_base
from tenacity.wait import wait_random_exponential

from worker.errors import DeadlineExceeded, SiftError

T = TypeVar("T")

# An attempt with less time than this left is not worth starting.
MIN_ATTEMPT_SECONDS = 0.05
# How long a provider's 429 without ``retry-after`` pauses the senders: the process's
# limiter (worker/runtime/ratelimit.py) and the shared rate budget (the pipeline) alike.
# A ``retry-after`` asking for no wait (0, a date past) counts as none, as the SDK's own
# retries take it (anthropic's ``_calculate_retry_timeout`` uses only a value above 0).
DEFAULT_429_PAUSE_SECONDS = 1.0


@dataclass(slots=True)
class Deadline:
    """A point in monotonic time by which the whole search must be done.

    ``spent``: the seconds earlier runs of the same search already used (a task retry, or a
    redelivery after a worker was lost): the deadline is one for the search, not per run.

    >>> ticks = iter([100.0, 104.0, 104.0, 104.0])
    >>> deadline = Deadline(30.0, lambda: next(ticks), spent=25.0)
    >>> deadline.remaining(), deadline.elapsed(), deadline.run_elapsed()
    (1.0, 29.0, 4.0)
    """

    seconds: float
    clock: Callable[[], float] = time.monotonic
    spent: float = 0.0
    started: float = field(init=False)
    left_out: float = field(init=False, default=0.0)  # the waits :meth:`leave_out` was told

    def __post_init__(self) -> None:
        self.started = self.clock() - self.spent

    def remaining(self) -> float:
        return self.seconds - (self.clock() - self.started)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def run_elapsed(self) -> float:
        """This run's own seconds: what a per-run measure (the search latency metric) takes,
        so a retried search's earlier runs are not observed again."""
        return self.elapsed() - self.spent

    def leave_out(self, seconds: float) -> None:
        """Leave ``seconds`` just waited out of the deadline: a queue's wait, not the
        search's (a CPU slot's, again after a retrieval retry's back-off)."""
        self.started += max(0.0, seconds)
        self.left_out += max(0.0, seconds)


def answer_date(value: str | None) -> datetime | None:
    """The instant an answer's ``Date`` header states, on its sender's clock; None when
    absent or unreadable. The instants the same answer states (a ``Retry-After`` date, a
    rate limit's reset) are on that clock too: read against this one, they need no host's
    clock to agree with the sender's.

    >>> answer_date("Wed, 21 Oct 2015 12:00:00 GMT")
    datetime.datetime(2015, 10, 21, 12, 0, tzinfo=datetime.timezone.utc)
    >>> answer_date("noon") is None, answer_date(None) is None
    (True, True)
    """
    if value is None:
        return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)  # "-0000": UTC


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """The wait a ``Retry-After`` header asks for, in seconds, in either of its forms (RFC
    9110 10.2.3): delay-seconds, or an HTTP-date (the time left until it from ``now``; one
    already past is 0). ``None`` when absent or neither, or a date no clock holds (its year
    past 9999: the parse overflows); the caller caps it.

    >>> retry_after_seconds("120"), retry_after_seconds("soon"), retry_after_seconds(None)
    (120.0, None, None)
    >>> noon = datetime(2015, 10, 21, 12, 0, tzinfo=UTC)
    >>> retry_after_seconds("Wed, 21 Oct 2015 12:01:30 GMT", noon)
    90.0
    >>> retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", noon)
    0.0
    >>> retry_after_seconds("Wed, 21 Oct 99999999999999999999 07:28:00 GMT") is None
    True
    """
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, OverflowError):
            return None
        if when.tzinfo is None:  # "-0000": UTC, of unknown origin (RFC 5322 3.3)
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class _Wait:
    """Exponential backoff with full jitter, or the provider's ``retry-after`` when longer."""

    def __init__(self, initial: float, maximum: float) -> None:
        self._backoff = wait_random_exponential(multiplier=initial, max=maximum)

    def __call__(self, state: RetryCallState) -> float:
        backoff = self._backoff(state)
        error = state.outcome.exception() if state.outcome else None
        retry_after = getattr(error, "retry_after", None)
        return max(backoff, retry_after) if retry_after else backoff


class _StopAtDeadline(stop_base):
    """Stop when the next wait would leave too little time for another attempt."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline

    def __call__(self, state: RetryCallState) -> bool:
        upcoming = state.upcoming_sleep or 0.0
        return self.deadline.remaining() - upcoming < MIN_ATTEMPT_SECONDS


def _retryable(error: BaseException) -> bool:
    return isinstance(error, SiftError) and error.retryable


def call_within_budget(
    attempt: Callable[[float], T],
    *,
    deadline: Deadline,
    max_attempts: int,
    attempt_timeout: float,
    sleep: Callable[[float], None] = time.sleep,
    initial_backoff: float = 0.25,
    max_backoff: float = 4.0,
) -> T:
    """Run ``attempt(timeout)`` until it succeeds, fails permanently, or the budget runs out.

    Raises the last attempt's error, or DeadlineExceeded if no attempt could start.
    """

    retrying = Retrying(
        stop=stop_after_attempt(max_attempts) | _StopAtDeadline(deadline),
        wait=_Wait(initial_backoff, max_backoff),
        retry=retry_if_exception(_retryable),
        sleep=sleep,
        reraise=True,
    )
    for state in retrying:
        with state:
            remaining = deadline.remaining()
            if remaining < MIN_ATTEMPT_SECONDS:
                raise DeadlineExceeded(
                    f"the search deadline of {deadline.seconds:g}s ran out before the call"
                )
            return attempt(min(attempt_timeout, remaining))
    raise AssertionError("unreachable: tenacity either returns or reraises")  # pragma: no cover

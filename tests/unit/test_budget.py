"""The deadline and the bounded retry budget: never exceeded, retry-after honoured."""

from __future__ import annotations

import pytest

from tests.fakes import FakeClock
from worker.core.budget import Deadline, call_within_budget
from worker.errors import AttemptOutcome, DeadlineExceeded, RerankAttemptError


def failing(
    clock: FakeClock, outcome: AttemptOutcome, takes: float, retry_after: float | None = None
):
    timeouts: list[float] = []

    def attempt(timeout: float) -> str:
        timeouts.append(timeout)
        clock.now += min(takes, timeout)
        raise RerankAttemptError(outcome, "scripted", retry_after=retry_after)

    return attempt, timeouts


@pytest.mark.parametrize(
    "outcome",
    [
        AttemptOutcome.TIMEOUT,
        AttemptOutcome.HTTP_5XX,
        AttemptOutcome.CONNECTION,
        AttemptOutcome.MALFORMED,
    ],
)
def test_retryable_classes_use_the_whole_attempt_budget(outcome: AttemptOutcome) -> None:
    clock = FakeClock()
    attempt, timeouts = failing(clock, outcome, takes=0.1)
    with pytest.raises(RerankAttemptError):
        call_within_budget(
            attempt,
            deadline=Deadline(60, clock),
            max_attempts=3,
            attempt_timeout=5,
            sleep=clock.sleep,
        )
    assert len(timeouts) == 3


def test_http_4xx_is_never_retried() -> None:
    clock = FakeClock()
    attempt, timeouts = failing(clock, AttemptOutcome.HTTP_4XX, takes=0.1)
    with pytest.raises(RerankAttemptError):
        call_within_budget(
            attempt,
            deadline=Deadline(60, clock),
            max_attempts=5,
            attempt_timeout=5,
            sleep=clock.sleep,
        )
    assert len(timeouts) == 1


@pytest.mark.parametrize("deadline_s", [0.5, 1.0, 2.5, 7.0, 19.9])
@pytest.mark.parametrize("cap", [0.3, 1.0, 4.0])
def test_the_deadline_is_never_exceeded(deadline_s: float, cap: float) -> None:
    clock = FakeClock()
    deadline = Deadline(deadline_s, clock)
    attempt, timeouts = failing(clock, AttemptOutcome.TIMEOUT, takes=10.0)
    with pytest.raises((RerankAttemptError, DeadlineExceeded)):
        call_within_budget(
            attempt, deadline=deadline, max_attempts=10, attempt_timeout=cap, sleep=clock.sleep
        )
    assert deadline.elapsed() <= deadline_s + 1e-9
    assert all(t <= cap for t in timeouts)


def test_retry_after_is_honoured() -> None:
    clock = FakeClock()
    attempt, timeouts = failing(clock, AttemptOutcome.RATE_LIMITED, takes=0.01, retry_after=3.0)
    with pytest.raises(RerankAttemptError):
        call_within_budget(
            attempt,
            deadline=Deadline(60, clock),
            max_attempts=3,
            attempt_timeout=5,
            sleep=clock.sleep,
        )
    assert clock.sleeps and all(s >= 3.0 for s in clock.sleeps)
    assert len(timeouts) == 3


def test_a_retry_after_beyond_the_deadline_stops_instead_of_waiting() -> None:
    clock = FakeClock()
    attempt, timeouts = failing(clock, AttemptOutcome.RATE_LIMITED, takes=0.01, retry_after=30)
    with pytest.raises(RerankAttemptError):
        call_within_budget(
            attempt,
            deadline=Deadline(10, clock),
            max_attempts=3,
            attempt_timeout=5,
            sleep=clock.sleep,
        )
    assert len(timeouts) == 1 and clock.sleeps == []


def test_no_attempt_starts_without_time_left() -> None:
    clock = FakeClock()
    deadline = Deadline(1.0, clock)
    clock.now += 1.0
    calls: list[float] = []
    with pytest.raises(DeadlineExceeded):
        call_within_budget(
            calls.append, deadline=deadline, max_attempts=3, attempt_timeout=5, sleep=clock.sleep
        )
    assert calls == []


def test_success_after_failures_returns_the_value() -> None:
    clock = FakeClock()
    answers = iter([RerankAttemptError(AttemptOutcome.HTTP_5XX, "529"), "done"])

    def attempt(timeout: float) -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert (
        call_within_budget(
            attempt,
            deadline=Deadline(10, clock),
            max_attempts=3,
            attempt_timeout=5,
            sleep=clock.sleep,
        )
        == "done"
    )

"""A worker process's stop deadline never cuts the wait a stop gives a warm-up still making
the embedding graph (a loaded CI machine's worker, soft shutdown 1 s, was ended at 16 s,
status 1, while its warm-up still had 30 s to finish the graph), and counts that wait only
while a warm-up runs: without one, a stop on a Redis that never answers took 45 s at the
defaults where the soft shutdown and the grace (25 s) would do. Its line says what held the
process (batch items and tasks still running, or else Redis), and its exit status is its own."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from celery.signals import worker_shutting_down

from worker.constants import WARM_UP_STOP_WAIT_SECONDS
from worker.processes import workers
from worker.processes.workers import (
    KILL_MARGIN_SECONDS,
    STOP_DEADLINE_STATUS,
    STOP_GRACE_SECONDS,
    exit_by_deadline,
    stop_deadline,
    supervisor_stop_deadline,
)
from worker.settings import Settings

DEFAULT_SOFT = Settings().worker_soft_shutdown_seconds


@pytest.mark.parametrize("soft", [1.0, 10.0, 60.0])
def test_the_stop_deadline_outlasts_the_warm_up_wait_and_the_soft_shutdown(soft: float) -> None:
    seconds = stop_deadline(Settings(worker_soft_shutdown_seconds=soft), warming_up=True)
    assert seconds >= WARM_UP_STOP_WAIT_SECONDS + STOP_GRACE_SECONDS
    assert seconds >= soft + STOP_GRACE_SECONDS


@pytest.mark.parametrize("soft", [1.0, 10.0, 60.0])
def test_without_a_warm_up_the_stop_deadline_is_the_soft_shutdown_and_the_grace(
    soft: float,
) -> None:
    seconds = stop_deadline(Settings(worker_soft_shutdown_seconds=soft), warming_up=False)
    assert seconds == soft + STOP_GRACE_SECONDS


def test_the_supervisor_waits_out_a_process_at_its_longest() -> None:
    settings = Settings()
    longest = max(DEFAULT_SOFT, WARM_UP_STOP_WAIT_SECONDS) + STOP_GRACE_SECONDS
    assert supervisor_stop_deadline(settings) == longest + KILL_MARGIN_SECONDS


Timer = tuple[float, Callable[..., None], tuple[float, ...]]


@pytest.fixture
def timers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Timer]]:
    """The timers :func:`exit_by_deadline` sets, kept here, not started; its stop signal's
    receiver taken off again after the test."""
    kept: list[Timer] = []
    monkeypatch.setattr(
        workers, "_daemon_timer", lambda s, call, *args: kept.append((s, call, args))
    )
    yield kept
    worker_shutting_down.disconnect(dispatch_uid="sift-stop-deadline")


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []
    monkeypatch.setattr(os, "_exit", codes.append)
    return codes


def _fire(timer: Timer) -> None:
    _, call, args = timer
    call(*args)


def test_a_stop_with_no_warm_up_ends_the_process_at_the_soft_shutdown_and_the_grace(
    timers: list[Timer], exits: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    exit_by_deadline(Settings(), lambda: False)
    worker_shutting_down.send(sender=None, sig="SIGTERM", how="Warm", exitcode=0)
    worker_shutting_down.send(sender=None, sig="SIGTERM", how="Warm", exitcode=0)  # again
    assert [seconds for seconds, _, _ in timers] == [DEFAULT_SOFT + STOP_GRACE_SECONDS]
    _fire(timers[0])
    assert exits == [STOP_DEADLINE_STATUS]
    gave_up = f"not stopped {DEFAULT_SOFT + STOP_GRACE_SECONDS:g} s after the stop signal"
    assert gave_up + " (Redis not answering?); exiting now" in capsys.readouterr().err


def test_a_stop_held_by_batch_items_still_running_says_so(
    timers: list[Timer], exits: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """Items still in their model calls at the deadline are named, not Redis: the line
    blamed Redis whatever held the process."""
    running = [3]
    exit_by_deadline(Settings(), lambda: False, lambda: running[0])
    worker_shutting_down.send(sender=None, sig="SIGTERM", how="Warm", exitcode=0)
    running[0] = 2  # asked at the deadline, not at the stop
    _fire(timers[0])
    assert exits == [STOP_DEADLINE_STATUS]
    err = capsys.readouterr().err
    assert "after the stop signal (2 batch items still running); exiting now" in err, err
    assert "Redis" not in err


def test_a_stop_held_by_a_task_still_running_names_it(
    timers: list[Timer], exits: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """A search in its model call holds the stop as items do: its task is named, by name, not
    Redis (the line counted batch items alone); a batch chunk's task waits for its items,
    which are named instead."""
    tasks = {"sift.search": 1}
    exit_by_deadline(Settings(), lambda: False, lambda: 0, lambda: tasks)
    worker_shutting_down.send(sender=None, sig="SIGTERM", how="Warm", exitcode=0)
    tasks.update({"sift.batch_chunk": 1, "sift.webhook": 2})  # asked at the deadline
    _fire(timers[0])
    assert exits == [STOP_DEADLINE_STATUS]
    err = capsys.readouterr().err
    held = "(1 sift.batch_chunk task, 1 sift.search task, 2 sift.webhook tasks still running)"
    assert held in err, err
    assert "Redis" not in err


def test_a_warm_up_running_at_the_deadline_gets_its_wait(
    timers: list[Timer], exits: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """Asked when the first deadline comes, not at the stop: a warm-up that began after the
    stop (the worker was still starting) is seen."""
    warm = [False]
    exit_by_deadline(Settings(), lambda: warm[0])
    worker_shutting_down.send(sender=None, sig="SIGTERM", how="Warm", exitcode=0)
    warm[0] = True
    _fire(timers[0])
    assert exits == []
    longest = max(DEFAULT_SOFT, WARM_UP_STOP_WAIT_SECONDS) + STOP_GRACE_SECONDS
    seconds, _, (_, deadline) = timers[1]
    assert deadline == longest
    assert 0 < seconds <= longest  # what is left of it
    _fire(timers[1])  # the warm-up still running: its wait is over all the same
    assert exits == [STOP_DEADLINE_STATUS]
    assert len(timers) == 2
    assert f"not stopped {longest:g} s after" in capsys.readouterr().err

"""The dead-worker check's beats, as the tests count them.

A :class:`~worker.queue.reaper.Reaper` finds a worker dead once it was silent on two checks
at least two beats apart, and what the checks saw (kept in Redis, shared by every checker)
is forgotten when no check was made for more than three beats. With the tests' 0.05 s beat
and the real clock, a second check run 0.16 s after the first (a 0.11 s sleep, 40 ms late
on a loaded machine) found nothing dead, and a test expecting a death failed (under ``-n 2``
with two busy cores, checks 0.153 to 0.265 s apart were seen starting over). The reapers in
these tests count beats on :class:`Beats`, which only the test moves: two checks are as many
beats apart as the test says, however late the machine runs them. Real time still passes
(the sleep), for what the check compares with kombu's wall-clock take times.
"""

from __future__ import annotations

import time

from worker.queue.reaper import Reaper

BEAT = 0.05  # seconds: the reaper's "two beats apart" is then 0.1 s


class Beats:
    """A reaper's clock that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def pass_two(self) -> None:
        """Two beats pass, as a reaper sees them; as much real time passes too, so a delivery
        taken before is older than a ``dead_after`` of two beats."""
        time.sleep(2 * BEAT + 0.01)
        self.now += 2 * BEAT


def check_twice(r: Reaper, beats: Beats) -> dict[str, int]:
    """Two checks two beats apart (``r`` counting ``beats``): a worker silent on both is dead."""
    r.check()
    beats.pass_two()
    return r.check()

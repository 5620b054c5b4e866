"""A worker process's stop deadline never cuts the wait a stop gives a warm-up still making
the embedding graph (a loaded CI machine's worker, soft shutdown 1 s, was ended at 16 s,
status 1, while its warm-up still had 30 s to finish the graph)."""

from __future__ import annotations

import pytest

from worker.constants import WARM_UP_STOP_WAIT_SECONDS
from worker.processes.workers import STOP_GRACE_SECONDS, stop_deadline
from worker.settings import Settings


@pytest.mark.parametrize("soft", [1.0, 10.0, 60.0])
def test_the_stop_deadline_outlasts_the_warm_up_wait_and_the_soft_shutdown(soft: float) -> None:
    seconds = stop_deadline(Settings(worker_soft_shutdown_seconds=soft))
    assert seconds >= WARM_UP_STOP_WAIT_SECONDS + STOP_GRACE_SECONDS
    assert seconds >= soft + STOP_GRACE_SECONDS

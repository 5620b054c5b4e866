"""A task's retry backoff: equal jitter, between half the ceiling and the ceiling, where the
ceiling doubles from ``RETRY_BASE_SECONDS`` with each retry up to ``RETRY_CAP_SECONDS``."""

from __future__ import annotations

import pytest

from worker.queue import tasks
from worker.queue.base import RETRY_BASE_SECONDS, RETRY_CAP_SECONDS

DRAWS = 400


@pytest.mark.parametrize("retries", [0, 1, 2, 3, 5, 6, 7, 12])
def test_each_retry_waits_between_half_its_ceiling_and_its_ceiling(retries: int) -> None:
    ceiling = min(RETRY_CAP_SECONDS, RETRY_BASE_SECONDS * 2**retries)
    tasks.search.push_request(retries=retries)
    try:
        waits = [tasks.search.backoff() for _ in range(DRAWS)]
    finally:
        tasks.search.pop_request()
    assert all(ceiling / 2 <= wait <= ceiling for wait in waits), (ceiling, min(waits), max(waits))
    # spread over the whole range, not pinned to one end (400 uniform draws: each of these
    # fails by chance with a probability of 0.95^400, about 1e-9)
    assert min(waits) < ceiling * 0.525 and max(waits) > ceiling * 0.975, (min(waits), max(waits))

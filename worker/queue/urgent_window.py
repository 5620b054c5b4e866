"""The re-drive's urgent window: the next two sweeps look at every active job, not only the
stalled ones, because a message may have just been lost (:mod:`worker.queue.redrive` says
why and how its sweeps read it).

Whoever sees such an event opens it: the re-drive's own sweep (Redis restarted), a worker's
consumer starting again after its broker connection dropped, and the dead-worker check of
:mod:`worker.queue.liveness`. It is one key, ``sift:redrive:urgent``, with a time to live;
this module is below both the re-drive and the liveness check, so neither imports the other
for it.
"""

from __future__ import annotations

import logging

import redis

from worker.constants import REDRIVE_URGENT_KEY

# the re-drive's window: its line is logged as the re-drive's
log = logging.getLogger("worker.queue.redrive")

# An urgent window lasts this many intervals: the next two sweeps, with room for one that runs
# a little late (the lock's holder wakes an interval after its last sweep ended).
URGENT_WINDOW_INTERVALS = 2.5


def open_urgent_window(client: redis.Redis, interval_seconds: float, reason: str) -> None:
    """Make the next two sweeps look at every active job, not only the stalled ones: a message
    may have just been lost (``reason`` says how; logged). A window already open is extended.
    Nothing when the re-drive is off (``interval_seconds`` 0)."""
    if interval_seconds <= 0:
        return
    window_ms = max(1, int(URGENT_WINDOW_INTERVALS * interval_seconds * 1000))
    client.set(REDRIVE_URGENT_KEY, reason, px=window_ms)
    log.warning(
        "re-drive: %s; for the next %gs its sweeps look at every active job, not only idle ones",
        reason,
        window_ms / 1000,
    )

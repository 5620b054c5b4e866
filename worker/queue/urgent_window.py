"""The re-drive's urgent window: the next two sweeps look at every active job, not only the
stalled ones, because a message may have just been lost (:mod:`worker.queue.redrive` says
why and how its sweeps read it).

Whoever sees such an event opens it: the re-drive's own sweep (Redis restarted), a worker's
consumer starting again after its broker connection dropped, and the dead-worker check of
:mod:`worker.queue.liveness`. It is one key, ``sift:redrive:urgent``, with a time to live;
this module is below both the re-drive and the liveness check, so neither imports the other
for it.

Opening a window also brings the next sweep to within :func:`urgent_sweep_seconds` (5 s) of
the last, not an interval on: it shortens the sweep lock (``sift:redrive:leader``) to that,
and every worker's sweeper looks that often. So does a sweep in a window that saw positions
lost, for the sweep that confirms them; the window's other sweeps keep to the interval. A
message lost by a worker SIGKILLed as its ``BRPOP`` reply came (a busy queue always has one
on its way) went out again on the second sweep after the window opened: 30 to 60 s after the
dead worker was found at the default interval, where the messages that worker held came back
at once; it now goes within about 5 to 15 s.
"""

from __future__ import annotations

import logging

import redis

from worker.constants import REDRIVE_LEADER_KEY, REDRIVE_URGENT_KEY

# the re-drive's window: its line is logged as the re-drive's
log = logging.getLogger("worker.queue.redrive")

# An urgent window lasts this many intervals: the next two sweeps, with room for one that runs
# a little late (the lock's holder wakes an interval after its last sweep ended).
URGENT_WINDOW_INTERVALS = 2.5
# While a window is open, a sweep at most this long after the last (the interval if shorter)
URGENT_SWEEP_SECONDS = 5.0

# KEYS: the sweep lock. ARGV: the most it may still hold (ms). Shortens it to that, never
# lengthens it (nor sets one that is not there).
_SHORTEN_LOCK = """
local left = redis.call('PTTL', KEYS[1])
if left > tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
"""


def urgent_sweep_seconds(interval_seconds: float) -> float:
    """How long after a sweep the next one comes while a window is open."""
    return min(interval_seconds, URGENT_SWEEP_SECONDS)


def hurry_next_sweep(client: redis.Redis, interval_seconds: float) -> None:
    """Let the next sweep come within :func:`urgent_sweep_seconds`: the sweep lock, held an
    interval from its sweep's start, is cut down to that."""
    limit_ms = max(1, int(urgent_sweep_seconds(interval_seconds) * 1000))
    client.eval(_SHORTEN_LOCK, 1, REDRIVE_LEADER_KEY, limit_ms)


def open_urgent_window(
    client: redis.Redis, interval_seconds: float, reason: str, *, hurry: bool = True
) -> None:
    """Make the next two sweeps look at every active job, not only the stalled ones, and come
    soon (:func:`hurry_next_sweep`; not with ``hurry`` false: a sweep that opens it, finding
    Redis restarted, reads every active job itself, and its end decides): a message may have
    just been lost (``reason`` says how; logged). A window already open is extended. Nothing
    when the re-drive is off (``interval_seconds`` 0)."""
    if interval_seconds <= 0:
        return
    window_ms = max(1, int(URGENT_WINDOW_INTERVALS * interval_seconds * 1000))
    client.set(REDRIVE_URGENT_KEY, reason, px=window_ms)
    if hurry:  # not under a sweep still running: no second one beside it
        hurry_next_sweep(client, interval_seconds)
    log.warning(
        "re-drive: %s; for the next %gs its sweeps look at every active job, not only idle ones",
        reason,
        window_ms / 1000,
    )

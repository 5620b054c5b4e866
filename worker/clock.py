"""The shared clock: Redis's ``TIME``, read in this process without a round trip.

Why. A time one host writes and another reads (a job's ``created_at`` and its
``started_at``, a webhook retry's due time, an economy poll's expected time, a webhook's
signature timestamp that a receiver checks against its own clock) must be on one clock.
Each host's own wall clock may be minutes off the others' (an NTP misconfiguration, a VM
restored from a snapshot): a worker 6 minutes ahead signed every webhook out of a
receiver's 5 minute tolerance, and its retries' due times held them back 6 minutes on
every other worker. Redis's clock is the one every gateway and worker already shares.

How. A process reads ``TIME`` now and then (the worker's liveness heartbeat, every beat;
the gateway, every :data:`RECALIBRATE_SECONDS`), adds half the round trip, and keeps the
reading with its own monotonic clock's: :meth:`SharedClock.now` is that reading plus the
monotonic time since, so neither a step of the local wall clock nor its skew moves it.
Before its first reading a process falls back on its wall clock (a unit test's store, a
CLI command), which is what every time was before.

    CLOCK.calibrate(reply, sent=t0, received=t1)  # reply: redis.time(), between t0 and t1
    CLOCK.now()                                   # epoch seconds on Redis's clock
    CLOCK.skew()                                  # this host's wall clock minus it
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: How often a gateway reads Redis's clock again (a worker does at every heartbeat).
RECALIBRATE_SECONDS = 30.0
#: How many readings a process takes as it starts, the surest kept: a busy start (imports,
#: other processes starting) slows a round trip, and half of it is the most a reading is off.
FIRST_READINGS = 5
#: A host whose wall clock is further than this off Redis's is warned of, once.
SKEW_WARNING_SECONDS = 5.0
#: How fast a monotonic clock may drift from Redis's (100 ppm: a quartz clock without NTP
#: drifts less), for weighing an old reading against a new one.
MAX_DRIFT = 1e-4


@dataclass(frozen=True, slots=True)
class Calibration:
    """One reading of Redis's clock: its time (half the round trip added) at ``monotonic``,
    this process's monotonic clock then, its wall clock then (``local``), and the most the
    reading can be off by (``error``: half the round trip, as Redis read its clock somewhere
    within it)."""

    shared: float
    monotonic: float
    local: float
    error: float = 0.0

    @property
    def skew(self) -> float:
        """This host's wall clock minus Redis's, at the reading: positive when it is ahead.

        >>> Calibration(shared=1000.0, monotonic=5.0, local=1360.0).skew
        360.0
        """
        return self.local - self.shared

    def at(self, monotonic: float) -> float:
        """Redis's time when this process's monotonic clock reads ``monotonic``.

        >>> Calibration(shared=1000.0, monotonic=5.0, local=1360.0).at(7.5)
        1002.5
        """
        return self.shared + (monotonic - self.monotonic)

    def error_at(self, monotonic: float) -> float:
        """The most :meth:`at` can be off by at ``monotonic``: the reading's error, and the
        monotonic clock's drift from Redis's since (:data:`MAX_DRIFT`).

        >>> Calibration(shared=1000.0, monotonic=5.0, local=1000.0, error=0.001).error_at(105.0)
        0.011
        """
        return self.error + (monotonic - self.monotonic) * MAX_DRIFT


def server_seconds(reply: tuple[int, int] | list[int]) -> float:
    """Redis's ``TIME`` (seconds and microseconds) as epoch seconds: the one clock the
    gateways and the workers share. A deadline one process sets and another, on another
    host, checks is read on it; each host's own clock may be seconds off the others'.

    >>> server_seconds((1700000000, 250000))
    1700000000.25
    """
    seconds, micros = reply
    return int(seconds) + int(micros) / 1_000_000


def calibration(
    reply: tuple[int, int] | list[int], *, sent: float, received: float, local: float
) -> Calibration:
    """The reading of a ``TIME`` ``reply`` sent at monotonic ``sent`` and answered at
    ``received``: Redis read its clock about half way through the round trip.

    >>> calibration((1000, 0), sent=10.0, received=10.5, local=1360.5)
    Calibration(shared=1000.25, monotonic=10.5, local=1360.5, error=0.25)
    """
    shared = server_seconds(reply)
    half = (received - sent) / 2
    return Calibration(shared + half, received, local, half)


class SharedClock:
    """Redis's clock as this process last read it, carried forward on its monotonic clock."""

    def __init__(
        self,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._monotonic = monotonic
        self._wall = wall
        self._reading: Calibration | None = None
        self._skew: float | None = None
        self._warned = False
        self._lock = threading.Lock()

    def now(self) -> float:
        """Epoch seconds on Redis's clock; this host's wall clock before the first reading."""
        reading = self._reading
        return self._wall() if reading is None else reading.at(self._monotonic())

    def skew(self) -> float | None:
        """This host's wall clock minus Redis's, as last measured; None before any reading."""
        return self._skew

    def stale(self, seconds: float = RECALIBRATE_SECONDS) -> bool:
        """Whether the last reading is older than ``seconds`` (or there is none)."""
        reading = self._reading
        return reading is None or self._monotonic() - reading.monotonic > seconds

    def calibrate(
        self, reply: tuple[int, int] | list[int], *, sent: float, received: float
    ) -> float:
        """Record a ``TIME`` reply sent at monotonic ``sent`` and answered at ``received``
        (read them around the call with :attr:`monotonic`); the skew it measured. The new
        reading replaces the one kept unless that one, aged by the drift since, is still the
        surer (a round trip slowed by a busy process or network is off by up to its half:
        a gateway's 0.4 s round trip at its start put a job's ``created_at`` after its
        ``started_at``). The first skew past :data:`SKEW_WARNING_SECONDS` is logged as a
        warning."""
        fresh = calibration(reply, sent=sent, received=received, local=self._wall())
        with self._lock:
            kept = self._reading
            if kept is None or fresh.error <= kept.error_at(fresh.monotonic):
                kept = self._reading = fresh
            skew = self._skew = fresh.local - kept.at(fresh.monotonic)
            warn = abs(skew) > SKEW_WARNING_SECONDS and not self._warned
            self._warned = self._warned or warn
        if warn:
            log.warning(
                "this host's clock is %+.1f s off Redis's: Sift times its jobs, webhooks and "
                "retries on Redis's clock, but check this host's NTP",
                skew,
            )
        return skew

    def read(self, time_command: Callable[[], tuple[int, int] | list[int]]) -> float:
        """Calibrate on one ``TIME`` round trip (``client.time``); the skew measured."""
        sent = self._monotonic()
        reply = time_command()
        return self.calibrate(reply, sent=sent, received=self._monotonic())

    async def aread(
        self, time_command: Callable[[], Awaitable[tuple[int, int] | list[int]]]
    ) -> float:
        """:meth:`read`, awaited (the gateway's ``redis.asyncio`` client)."""
        sent = self._monotonic()
        reply = await time_command()
        return self.calibrate(reply, sent=sent, received=self._monotonic())

    @property
    def monotonic(self) -> Callable[[], float]:
        """The monotonic clock the readings are carried on (to time a ``TIME`` call with)."""
        return self._monotonic


#: This process's shared clock: read by every time another host reads too.
CLOCK = SharedClock()


def now() -> float:
    """Epoch seconds on the clock every gateway and worker shares (:data:`CLOCK`)."""
    return CLOCK.now()

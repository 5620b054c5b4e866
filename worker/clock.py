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
#: A host whose wall clock is further than this off Redis's is warned of, once.
SKEW_WARNING_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Calibration:
    """One reading of Redis's clock: its time (half the round trip added) at ``monotonic``,
    this process's monotonic clock then, and its wall clock then (``local``)."""

    shared: float
    monotonic: float
    local: float

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


def calibration(
    reply: tuple[int, int] | list[int], *, sent: float, received: float, local: float
) -> Calibration:
    """The reading of a ``TIME`` ``reply`` sent at monotonic ``sent`` and answered at
    ``received``: Redis read its clock about half way through the round trip.

    >>> calibration((1000, 0), sent=10.0, received=10.2, local=1360.2)
    Calibration(shared=1000.1, monotonic=10.2, local=1360.2)
    """
    seconds, micros = reply  # as worker.redis_client.server_seconds reads it (no redis here:
    # the webhooks, which must not import it, read this clock)
    shared = int(seconds) + int(micros) / 1_000_000
    return Calibration(shared + (received - sent) / 2, received, local)


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
        self._warned = False
        self._lock = threading.Lock()

    def now(self) -> float:
        """Epoch seconds on Redis's clock; this host's wall clock before the first reading."""
        reading = self._reading
        return self._wall() if reading is None else reading.at(self._monotonic())

    def skew(self) -> float | None:
        """This host's wall clock minus Redis's, as last measured; None before any reading."""
        reading = self._reading
        return None if reading is None else reading.skew

    def stale(self, seconds: float = RECALIBRATE_SECONDS) -> bool:
        """Whether the last reading is older than ``seconds`` (or there is none)."""
        reading = self._reading
        return reading is None or self._monotonic() - reading.monotonic > seconds

    def calibrate(
        self, reply: tuple[int, int] | list[int], *, sent: float, received: float
    ) -> float:
        """Record a ``TIME`` reply sent at monotonic ``sent`` and answered at ``received``
        (read them around the call with :attr:`monotonic`); the skew it measured. A reply
        slower than the last reading's is kept too: the clock moves on in either case, and
        the round trip's half is the most it can be off by. The first skew past
        :data:`SKEW_WARNING_SECONDS` is logged as a warning."""
        reading = calibration(reply, sent=sent, received=received, local=self._wall())
        with self._lock:
            self._reading = reading
            warn = abs(reading.skew) > SKEW_WARNING_SECONDS and not self._warned
            self._warned = self._warned or warn
        if warn:
            log.warning(
                "this host's clock is %+.1f s off Redis's: Sift times its jobs, webhooks and "
                "retries on Redis's clock, but check this host's NTP",
                reading.skew,
            )
        return reading.skew

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

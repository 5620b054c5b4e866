"""What a ``sift worker`` supervisor measures of its worker processes: how many run against
how many it keeps, and how many exited unasked (each is restarted after a back-off).

The supervisor serves ``/metrics`` whatever its processes do, so ``up`` says nothing of them:
processes killed on sight (an OOM killer, a crash at start) left a target that answered every
scrape, and no alert, while no job ran. These two are what tells.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge

from worker.constants import METRIC_CLOCK_SKEW, METRIC_WORKER_PROCESSES, METRIC_WORKER_RESTARTS
from worker.observability.metrics._recording import never_raises

WORKER_PROCESS_STATES: Final = ("running", "expected")
# how a process ended: killed by a signal (SIGKILL: the OOM killer), a non-zero status, or
# status 0 (Celery exits so on an "Unrecoverable error")
WORKER_EXIT_CAUSES: Final = ("signal", "error", "clean")

WORKER_PROCESSES = Gauge(
    METRIC_WORKER_PROCESSES,
    "A sift worker supervisor's Celery worker processes: running now, and expected "
    "(--processes). Fewer running than expected: some exited and wait for their restart.",
    ["state"],
    multiprocess_mode="livemax",  # the supervisor's alone; gone with it
)
# a gateway's or worker's own clock against the one they share (worker/clock.py): Sift times
# nothing on the host's clock, but the host's logs, its TLS and its other software do
CLOCK_SKEW = Gauge(
    METRIC_CLOCK_SKEW,
    "This host's wall clock minus Redis's (the clock Sift's gateways and workers share), as "
    "last measured: positive when the host is ahead. By role: gateway, worker.",
    ["role"],  # a labelled metric makes no value file at import, before the folder is made
    multiprocess_mode="livemostrecent",
)
WORKER_RESTARTS = Counter(
    METRIC_WORKER_RESTARTS,
    "Worker processes that exited while their supervisor was not stopping them (each is "
    "restarted after a back-off), by cause: signal, error (non-zero status), clean (status 0).",
    ["cause"],
)


@never_raises
def worker_processes(running: int, expected: int) -> None:
    """The supervisor's count of its processes, after a start, an exit or a restart; the
    restarts' series are made at zero with it, so ``increase()`` sees the first one."""
    WORKER_PROCESSES.labels("running").set(running)
    WORKER_PROCESSES.labels("expected").set(expected)
    for cause in WORKER_EXIT_CAUSES:
        WORKER_RESTARTS.labels(cause)


@never_raises
def worker_restart(status: int) -> None:
    """A worker process exited unasked with ``status`` (a Popen return code: negative for a
    signal) and will be restarted."""
    cause = "signal" if status < 0 else "error" if status > 0 else "clean"
    WORKER_RESTARTS.labels(cause).inc()


@never_raises
def clock_skew(role: str, seconds: float) -> None:
    """This process's host measured its wall clock ``seconds`` off Redis's (a reading of
    the shared clock: a ``worker``'s liveness beat, a ``gateway``'s read)."""
    CLOCK_SKEW.labels(role).set(seconds)

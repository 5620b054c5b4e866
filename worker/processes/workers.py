"""``sift worker`` on every core: N Celery worker processes under one supervisor.

One Celery threads-pool process is bound by the GIL to about one core, so by default
(``SIFT_WORKER_PROCESSES=0``) ``sift worker`` starts one worker process per core, each a
``sift worker --processes 1`` with its own threads pool and node name (``NAME-1@host``, …).
The supervisor (this process):

- starts each child again when it exits, after a back-off, with a line on stderr
  (:class:`worker.processes.supervisor.Supervisor`, the one ``sift up`` uses), but for a child that
  refused to start (exit 2, its reason on its ``error:`` line: an API keys file broken since,
  say), which no restart changes: it stops them all and exits 2 too, where it started that
  child again after each back-off for as long as it ran;
- passes a stop (SIGTERM, SIGINT) on to every child, so a rolling restart hands the work back
  as a single worker does (:mod:`worker.queue.liveness`, :mod:`worker.queue.items`), and exits
  once they all have: the first as SIGTERM (Celery's warm shutdown), a second Ctrl-C as SIGQUIT
  (its cold shutdown, :func:`_as_child_stop`). The children run in a process group of their
  own, so a terminal's Ctrl-C reaches them once, through us; and they receive SIGTERM if we
  die (``PR_SET_PDEATHSIG``);
- bounds the stop: a worker process told to stop exits within :func:`stop_deadline` even if
  its warm shutdown hangs on a Redis that never answers (:func:`exit_by_deadline`); one still
  there :data:`KILL_MARGIN_SECONDS` later is SIGKILLed, its process group with it;
- serves the one ``/metrics`` on ``SIFT_WORKER_METRICS_PORT``, summing the children's files
  (Prometheus multiprocess mode, :mod:`worker.observability.metrics`); a dead child's live gauges
  are dropped. It answers whatever the children do, so it adds its own count of them:
  ``sift_worker_processes{state="running"|"expected"}`` and ``sift_worker_restarts_total``.

``--processes 1`` runs the Celery worker in the process itself, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

from worker.constants import BATCH_CHUNK_TASK, WARM_UP_STOP_WAIT_SECONDS
from worker.pids import alive
from worker.processes.machine import cpu_count
from worker.processes.stack import (
    REFUSED_STATUS,
    Service,
    child_env,
    parent_death_signal,
    sift_command,
)
from worker.processes.supervisor import Supervisor
from worker.settings import Settings

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What the supervisor's queue of stop signals receives when a worker process refused to start
# (exit REFUSED_STATUS): a stop of them all, the supervisor then exiting with that status too
REFUSED = 0

# A worker process's warm shutdown talks to Redis (it hands work back, closes its queues): a
# Redis that accepts connections and never answers held it there for good. Past its soft
# shutdown and this grace it exits at once, as after a crash: what it held comes back as a
# killed worker's does (the visibility timeout, the liveness check).
STOP_GRACE_SECONDS = 15.0
# How much longer the supervisor waits for a process before it SIGKILLs it
KILL_MARGIN_SECONDS = 5.0
# The exit status of a worker process that ended at its stop deadline (os._exit): its own,
# so the supervisor tells it from Celery's cold shutdown (a second Ctrl-C), which exits 1
STOP_DEADLINE_STATUS = 3


def stop_deadline(settings: Settings, *, warming_up: bool) -> float:
    """The seconds a worker process told to stop takes at most: its soft shutdown, then the
    grace; with a warm-up still making the embedding graph (``warming_up``), the wait a stop
    gives it (cut, its seconds were lost) instead when longer. Only then: counted on every
    stop, a Redis that never answered held each 45 s at the defaults where 25 would do."""
    waits = settings.worker_soft_shutdown_seconds
    if warming_up:
        waits = max(waits, WARM_UP_STOP_WAIT_SECONDS)
    return waits + STOP_GRACE_SECONDS


def supervisor_stop_deadline(settings: Settings) -> float:
    """The seconds ``sift worker``'s supervisor takes at most to stop its processes (each at
    its longest, a warm-up running): whoever stops it (``sift up``) waits longer than this
    before a SIGKILL."""
    return stop_deadline(settings, warming_up=True) + KILL_MARGIN_SECONDS


def exit_by_deadline(
    settings: Settings,
    warming_up: Callable[[], bool],
    running: Callable[[], int] = lambda: 0,
    tasks: Callable[[], Mapping[str, int]] = dict,
    who: str = "sift worker",
) -> None:
    """In a Celery worker process: once a stop begins (Celery's ``worker_shutting_down``,
    sent from its signal handler), end the process :func:`stop_deadline` later if it is still
    there (``os._exit``, from a daemon timer: the main thread may be blocked on a socket),
    with a line from ``who`` (a supervised process's name in it: ``sift worker worker-1``)
    saying what held it (:func:`held_by`: the batch items still ``running()`` and the Celery
    tasks still running, ``tasks()`` by name, or else, most likely, Redis).

    The timer is set for the deadline without a warm-up; when it fires, a warm-up still
    running (``warming_up()``) moves it to the one with. Asked then, not at the stop, a
    warm-up begun after the stop (one that came while the worker started) is seen, and one
    that ended soon after it holds nothing up."""
    from celery.signals import worker_shutting_down

    armed = threading.Event()
    longest = stop_deadline(settings, warming_up=True)

    def give_up(stopped_at: float, seconds: float) -> None:
        if seconds < longest and warming_up():
            _daemon_timer(longest - (time.monotonic() - stopped_at), give_up, stopped_at, longest)
            return
        print(f"{who}: not stopped {seconds:g} s after the stop signal "
              f"({held_by(running(), tasks())}); exiting now", file=sys.stderr,
              flush=True)  # fmt: skip
        os._exit(STOP_DEADLINE_STATUS)

    def arm(**_: object) -> None:
        if not armed.is_set():  # a second signal keeps the first deadline
            armed.set()
            seconds = stop_deadline(settings, warming_up=False)
            _daemon_timer(seconds, give_up, time.monotonic(), seconds)

    worker_shutting_down.connect(arm, weak=False, dispatch_uid="sift-stop-deadline")


def held_by(items: int, tasks: Mapping[str, int] | None = None) -> str:
    """What a worker process still there at its stop deadline was held by: its batch items
    still running (their model calls) and its Celery tasks still running, by name (a search
    in its model call, an ingest, a webhook's POST); with none, most likely a Redis that
    never answers. A batch chunk's task is left out while items run: it waits for them. It
    blamed Redis when a search held it, as it did when batch items held it before.

    >>> held_by(0), held_by(1), held_by(3)
    ('Redis not answering?', '1 batch item still running', '3 batch items still running')
    >>> held_by(0, {"sift.search": 1})
    '1 sift.search task still running'
    >>> held_by(2, {"sift.batch_chunk": 1, "sift.search": 2, "sift.webhook": 1})
    '2 batch items, 2 sift.search tasks, 1 sift.webhook task still running'
    >>> held_by(0, {"sift.batch_chunk": 1})  # in a Redis call of its own, maybe: named
    '1 sift.batch_chunk task still running'
    """
    held = [_counted(items, "batch item")] if items else []
    for name, count in sorted((tasks or {}).items()):
        if count and not (items and name == BATCH_CHUNK_TASK):
            held.append(_counted(count, f"{name} task"))
    return f"{', '.join(held)} still running" if held else "Redis not answering?"


def _counted(count: int, what: str) -> str:
    """``count`` ``what``, plural past one: ``1 batch item``, ``2 batch items``."""
    return f"{count} {what}{'s' if count != 1 else ''}"


def _daemon_timer(seconds: float, call: Callable[[float, float], None], *args: float) -> None:
    """Call ``call(*args)`` ``seconds`` from now on a daemon thread (one that does not hold
    the process's exit)."""
    timer = threading.Timer(seconds, call, args=args)
    timer.daemon = True
    timer.start()


METRICS_DIR_PREFIX = "sift-metrics-"


def temporary_metrics_dir() -> str:
    """A new folder for the metrics files where ``PROMETHEUS_MULTIPROC_DIR`` is unset, named
    after this process (``sift-metrics-PID-…`` in the temporary folder) and removed when it
    exits. The folders of processes gone are removed first: one SIGKILLed (the OOM killer)
    removes nothing, and each was left behind for good."""
    _remove_orphaned_metrics_dirs()
    me = os.getpid()
    path = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{me}-")
    atexit.register(_remove_if_mine, me, path)
    return path


def _remove_if_mine(owner: int, path: str) -> None:
    """At exit: remove ``path`` in the process that made it, not in a forked child (a Celery
    prefork child inherits the hook) while its parent still writes there."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _remove_orphaned_metrics_dirs() -> None:
    """Remove this user's ``sift-metrics-PID-…`` folders whose process no longer runs."""
    for folder in Path(tempfile.gettempdir()).glob(f"{METRICS_DIR_PREFIX}*-*"):
        pid = folder.name.removeprefix(METRICS_DIR_PREFIX).split("-", 1)[0]
        with contextlib.suppress(OSError):
            if pid.isdigit() and folder.stat().st_uid == os.getuid() and not alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)


def resolve_processes(setting: int) -> int:
    """How many worker processes: ``setting``, or one per core for 0."""
    return setting or cpu_count()


def follow_supervisor(supervisor_pid: int) -> None:
    """In a child: receive SIGTERM when the supervisor dies (so a SIGKILLed supervisor leaves
    no worker behind), and stop at once if it is already gone."""
    follow_parent = parent_death_signal()
    if follow_parent is not None:
        follow_parent()
    if os.getppid() != supervisor_pid:
        raise SystemExit("sift worker: the supervising process is gone")


#: What the supervisor's lines call it, as its processes' name theirs (``worker-1``)
SUPERVISOR = "supervisor"


def _say(message: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp} sift worker {SUPERVISOR}: {message}", file=sys.stderr, flush=True)


def run_workers(
    settings: Settings,
    count: int,
    name: str,
    child_args: Sequence[str],
    before_start: Callable[[], None] = lambda: None,
) -> None:
    """Run ``count`` supervised worker processes until SIGTERM or SIGINT, then stop them all.

    ``child_args`` are the ``sift worker`` options each child gets besides its name.
    ``before_start`` (``sift worker``'s wait for its Redis and its start checks) runs once
    ``/metrics`` is served and before any process starts: a pod waiting for its Redis passes
    its startup probe (it served nothing until Redis answered, and was killed past 120 s)."""
    from worker.observability import metrics

    created = None
    directory = metrics.multiprocess_dir()
    if directory is None:
        directory = created = temporary_metrics_dir()
    metrics.setup_multiprocess(directory)  # exports PROMETHEUS_MULTIPROC_DIR to the children
    env = child_env({"SIFT_WORKER_METRICS_PORT": "0"})  # we serve it, for all of them
    me = str(os.getpid())
    services = []
    for i in range(1, count + 1):
        command = sift_command("worker", "--processes", "1", "--name", f"{name}-{i}",
                               "--supervised-by", me, *child_args)  # fmt: skip
        services.append(Service(f"worker {name}-{i}", command, None, env, own_group=True))
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()

    def on_refused(_: Service) -> None:
        supervisor.stop_watching()
        signals.put(REFUSED)

    supervisor = Supervisor(
        _say,
        on_exit=lambda service: _exited_unasked(service, services),
        on_restart=lambda _: _count_running(services),
        on_refused=on_refused,
    )

    def on_signal(signum: int, _frame: object) -> None:
        supervisor.stop_watching()
        signals.put(signum)

    try:
        if settings.worker_metrics_port:
            _serve_metrics(settings)
        before_start()  # its own Ctrl-C: our handlers are not set yet
        for signum in STOP_SIGNALS:
            signal.signal(signum, on_signal)
        for service in services:
            service.start()
            supervisor.watch(service)
        _count_running(services)
        _say(f"{count} worker processes started (pids "
             f"{', '.join(str(s.proc.pid) for s in services if s.proc)})")  # fmt: skip
        with supervisor:  # leaving it joins its thread: no restart races the stop below
            first = _next_signal(signals, lambda: False)
        assert first is not None
        why = "a worker process refused to start" if first == REFUSED else (
            signal.Signals(first).name
        )  # fmt: skip
        _say(f"{why}: stopping {count} worker processes")
        # a process already down (killed, waiting out its restart's back-off) had no warm
        # shutdown to finish: not counted; one dead since the supervisor's last look is said
        supervisor.note_exits()
        down = [s for s in services if s.proc is None or s.proc.returncode is not None]
        _forward(services, signal.SIGTERM)  # the first stop, however asked: see _as_child_stop
        kill_at = time.monotonic() + supervisor_stop_deadline(settings)
        done = lambda: _all_exited(services) or time.monotonic() >= kill_at  # noqa: E731
        while (more := _next_signal(signals, done)) is not None:
            _forward(services, _as_child_stop(more))
        killed = _kill_left(services, supervisor_stop_deadline(settings))
        for service in services:
            _dead(service)
        cut = _cut_short([s for s in services if s not in down], killed)
        if cut:
            _say(f"every worker process stopped, {_counted_cuts(cut)} (what they held comes "
                 "back as a killed worker's does)")  # fmt: skip
            raise SystemExit(STOP_DEADLINE_STATUS)
        if first == REFUSED:
            _say("every worker process stopped, one having refused to start (its error line "
                 "above)")  # fmt: skip
            raise SystemExit(REFUSED_STATUS)
        _say("every worker process stopped")
    finally:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)


AT_THE_DEADLINE = "at the stop deadline"
KILLED_DURING_THE_STOP = "killed during the stop"
# what a process told to stop dies of as asked: Celery's warm and cold shutdowns handle
# them, but a process still importing, with no handler yet, dies of the signal itself
ASKED_TO_STOP = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})


def stop_outcome(code: int | None, killed_by_us: bool) -> str | None:
    """How a worker process told to stop ended, when not as asked: at the stop deadline (its
    own, exit :data:`STOP_DEADLINE_STATUS`, or the supervisor's SIGKILL past it,
    ``killed_by_us``), or killed during the stop by a signal no one asked it to stop with
    (the OOM killer's SIGKILL). Every SIGKILL was counted as the deadline's, one the
    supervisor never sent too (the OOM killer's, striking as the stop began).

    >>> stop_outcome(0, False), stop_outcome(1, False), stop_outcome(-15, False)
    (None, None, None)
    >>> stop_outcome(3, False), stop_outcome(-9, True)
    ('at the stop deadline', 'at the stop deadline')
    >>> stop_outcome(-9, False), stop_outcome(-11, False)
    ('killed during the stop', 'killed during the stop')
    """
    if code == STOP_DEADLINE_STATUS or killed_by_us:
        return AT_THE_DEADLINE
    if code is not None and code < 0 and -code not in ASKED_TO_STOP:
        return KILLED_DURING_THE_STOP
    return None


def _cut_short(services: Sequence[Service], killed: Collection[Service]) -> Counter[str]:
    """How the stopped ``services`` that did not end their warm shutdown ended
    (:func:`stop_outcome`; ``killed``: those the supervisor SIGKILLed), counted by how. Each
    gets a line; the supervisor said ``every worker process stopped`` and exited 0, as after
    a clean stop."""
    cut: Counter[str] = Counter()
    for service in services:
        code = service.proc.returncode if service.proc is not None else None
        if how := stop_outcome(code, service in killed):
            cut[how] += 1
            _say(
                f"{service.name} did not finish its warm shutdown"
                + ("" if how == AT_THE_DEADLINE else f": {how}")
                + f" (exit status {code})"
            )
    return cut


def _counted_cuts(cut: Counter[str]) -> str:
    """The stop's cuts in words: ``2 of them at the stop deadline, 1 killed during the stop``."""
    return ", ".join(
        f"{n} of them {how}" if i == 0 else f"{n} {how}"
        for i, (how, n) in enumerate(sorted(cut.items()))
    )


def _next_signal(signals: queue.SimpleQueue[int], done: Callable[[], bool]) -> int | None:
    """The next stop signal received, or None once ``done()`` answers true."""
    while True:
        with contextlib.suppress(queue.Empty):
            return signals.get(timeout=0.2)
        if done():
            return None


def _as_child_stop(signum: int) -> int:
    """What a stop signal after the first is passed on as. The first goes as SIGTERM, Celery's
    warm shutdown, what its first SIGINT is too: a process still importing, with no Celery
    handler yet, dies of it quietly, where a SIGINT printed a KeyboardInterrupt traceback.
    A second Ctrl-C is Celery's cold shutdown, which its SIGQUIT is (the SIGINT it forwarded
    would now be a first one); a second SIGTERM stays one (Celery takes no notice)."""
    return signal.SIGQUIT if signum == signal.SIGINT else signum


def _forward(services: Sequence[Service], signum: int) -> None:
    for service in services:
        if service.proc is not None and service.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                service.proc.send_signal(signum)


def _kill_left(services: Sequence[Service], waited: float) -> list[Service]:
    """SIGKILL the process group of every child still running (each leads its own); the
    services killed."""
    killed = []
    for service in services:
        if service.proc is not None and service.proc.poll() is None:
            _say(f"{service.name} not stopped after {waited:g} s: killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.proc.pid, signal.SIGKILL)
            service.proc.wait()
            killed.append(service)
    return killed


def _all_exited(services: Sequence[Service]) -> bool:
    return all(s.proc is None or s.proc.poll() is not None for s in services)


def _exited_unasked(service: Service, services: Sequence[Service]) -> None:
    """A child exited while we were not stopping it: its live gauges go, and the exit and the
    processes left running are counted (``sift_worker_restarts_total``,
    ``sift_worker_processes``), since our ``/metrics`` answers whatever the children do."""
    from worker.observability.metrics import worker_restart

    _dead(service)
    if service.proc is not None and service.proc.returncode is not None:
        worker_restart(service.proc.returncode)
    _count_running(services)


def _count_running(services: Sequence[Service]) -> None:
    """``sift_worker_processes``: how many of ``services`` run, of how many."""
    from worker.observability.metrics import worker_processes

    running = sum(s.proc is not None and s.proc.poll() is None for s in services)
    worker_processes(running, len(services))


def _dead(service: Service) -> None:
    """A child exited: its share of the live gauges goes, and its counters and histograms are
    merged into the folder's merged files (their counts stay; its files go, where one set more
    was left at each restart)."""
    from worker.observability.metrics import mark_process_dead, merge_dead_process

    if service.proc is not None and service.proc.poll() is not None:
        mark_process_dead(service.proc.pid)
        merge_dead_process(service.proc.pid)


def _serve_metrics(settings: Settings) -> None:
    from worker.observability.metrics import serve_worker_metrics_when_free

    try:
        served = serve_worker_metrics_when_free(settings, _say)
    except OSError as exc:
        _say(f"worker metrics not served on :{settings.worker_metrics_port}: {exc}")
        return
    if served:
        _say(f"metrics of every worker process on :{settings.worker_metrics_port}/metrics")

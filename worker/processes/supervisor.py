"""``sift up``'s and ``sift worker``'s supervisor: a process of theirs that exits is started
again, after a back-off, its log rotated as it grows (:class:`Supervisor`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.processes.stack import LOG_KEEP, LOG_MAX_BYTES, REFUSED_STATUS, Service

logger = logging.getLogger(__name__)


RESTART_FIRST_DELAY_SECONDS = 1.0
RESTART_MAX_DELAY_SECONDS = 30.0
# a process that stayed up this long before exiting is restarted after the first delay again
RESTART_RESET_AFTER_SECONDS = 60.0


@dataclass
class _Watched:
    service: Service
    failures: int = 0  # exits in a row, each within RESTART_RESET_AFTER_SECONDS of its start
    restart_at: float | None = None  # when the exited process is started again
    rotation_failed: bool = False  # its log's rotation failed, said, and has not worked since


@dataclass
class Supervisor:
    """Starts again a stack process that exits while the stack runs (``sift up``).

    Any exit counts: the stack was not stopping, and Celery even exits with status 0 on an
    "Unrecoverable error". Each restart waits a back-off, 1 s doubling to 30 s, so a crash
    loop does not spin; a process that stayed up a minute starts the count again. Every exit
    and restart is one line in the process's own log and one through ``report`` (the console).
    A restarted process is not waited for: a worker restarted while Redis is down connects
    once Redis is back. Each check also rotates a process's log past ``log_max_bytes``,
    keeping ``log_keep`` rotated ones (:func:`rotate_log`): appended to on every run and
    restart, they grew without bound. A rotation that fails (a full disk) is said once, until
    one works again, and never keeps a process from its restart."""

    report: Callable[[str], None]
    poll_seconds: float = 0.5
    log_max_bytes: int = LOG_MAX_BYTES
    log_keep: int = LOG_KEEP
    # called once with a service whose process just exited (its ``proc`` still the dead one)
    on_exit: Callable[[Service], None] | None = None
    # called with a service whose process was just started again
    on_restart: Callable[[Service], None] | None = None
    # called once with a service whose process refused to start (exit REFUSED_STATUS): it is
    # not started again, and the caller stops the others; None restarts it as any exit
    on_refused: Callable[[Service], None] | None = None
    _watched: list[_Watched] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _closed: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def watch(self, service: Service) -> None:
        self._watched.append(_Watched(service))

    def start(self) -> None:
        """Start watching, on a thread of its own: the one that starts the processes it
        restarts, so it lives until :meth:`close`, for a process that follows its parent
        (``Service.follow``: SIGTERM when the thread that started it ends)."""
        self._thread = threading.Thread(target=self._run, name="sift-supervisor", daemon=True)
        self._thread.start()

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        """Stop watching: the processes are stopped by their own contexts after this."""
        self.close()

    def stop_watching(self) -> None:
        """From now on an exit is expected (safe in a signal handler: Ctrl-C reaches the
        whole process group, and the processes exit on their own)."""
        self._stopping.set()

    def close(self) -> None:
        """Stop watching, and end the thread (for ``sift up``: once the processes it
        restarted, which follow the thread, have stopped)."""
        self._stopping.set()
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def note_exits(self) -> None:
        """Say each exit not seen yet, as a look would (its line and ``on_exit``), without a
        restart: for a stop, once the thread is joined. A process that died since the last
        look (up to :attr:`poll_seconds` before) was left out of the stop without a word."""
        for watched in self._watched:
            service, proc = watched.service, watched.service.proc
            if watched.restart_at is None and proc is not None and proc.poll() is not None:
                self._hook(self.on_exit, service)
                self._say(service, f"{service.name} exited with status {proc.returncode}")

    def _run(self) -> None:
        while not self._closed.wait(self.poll_seconds):
            for watched in self._watched:
                self._check_or_log(watched)

    def _check_or_log(self, watched: _Watched) -> None:
        """Check one process, logging what fails: the thread must outlive any failure, for it
        is the one that restarts every process, and the processes it restarted receive
        SIGTERM when it ends (``Service.follow``, a worker process's ``--supervised-by``)."""
        try:
            self._check(watched, time.monotonic())
        except Exception:
            logger.exception("supervisor: checking %s failed; going on", watched.service.name)

    def _hook(self, hook: Callable[[Service], None] | None, service: Service) -> None:
        """Call ``hook`` (``on_exit``, ``on_restart``), logging what it raises: the exit or
        restart is handled all the same."""
        if hook is None:
            return
        try:
            hook(service)
        except Exception:
            logger.exception("supervisor: a hook failed for %s; going on", service.name)

    def _check(self, watched: _Watched, now: float) -> None:
        """One look at one process: its exit or restart first, then its log's rotation. The
        other way round, a log that could not be rotated (a full disk) raised before the
        exit was seen, at every check: the process stayed down until there was room."""
        self._restart(watched, now)
        self._rotate(watched)

    def _rotate(self, watched: _Watched) -> None:
        """Rotate the process's log, saying once that it cannot (until it can again): the
        log then grows past its size, which beats stopping the process or a line a tick."""
        service = watched.service
        try:
            service.rotate_log(self.log_max_bytes, self.log_keep)
        except OSError as exc:
            if not watched.rotation_failed:
                watched.rotation_failed = True
                why = exc.strerror or exc
                self._say(service, f"{service.name}'s log could not be rotated ({why}); "
                                   "it grows until it can be")  # fmt: skip
            return
        watched.rotation_failed = False

    def _restart(self, watched: _Watched, now: float) -> None:
        """Note the process's exit and its back-off, or start it again once that is over."""
        service = watched.service
        if service.proc is None or service.proc.poll() is None or self._stopping.is_set():
            return
        if watched.restart_at is None:  # it just exited
            self._hook(self.on_exit, service)
            if service.proc.returncode == REFUSED_STATUS and self.on_refused is not None:
                self._refused(watched)
                return
            if now - service.started_at >= RESTART_RESET_AFTER_SECONDS:
                watched.failures = 0
            delay = min(
                RESTART_FIRST_DELAY_SECONDS * 2**watched.failures, RESTART_MAX_DELAY_SECONDS
            )
            watched.failures += 1
            watched.restart_at = now + delay
            self._say(service, f"{service.name} exited with status {service.proc.returncode}; "
                               f"restarting it in {delay:g} s")  # fmt: skip
        elif now >= watched.restart_at:
            watched.restart_at = None
            try:
                proc = service.start()
            except OSError as exc:  # cannot even start it: counts as one more exit
                service.started_at = now
                self._say(service, f"{service.name} could not be started: {exc}")
                return
            self._say(service, f"{service.name} restarted (pid {proc.pid})")
            self._hook(self.on_restart, service)

    def _refused(self, watched: _Watched) -> None:
        """A process exited as a ``sift`` command that refuses to start does (exit 2, its
        reason on one ``error:`` line): what it refused (a setting, the API keys file, its
        Redis) does not change by itself, and it was started again after each back-off for as
        long as the supervisor ran. It is left down, said with its reason, and the caller told
        (``on_refused``), which stops the rest."""
        service = watched.service
        watched.restart_at = float("inf")  # never: the caller stops every process
        why = service.refusal() or "its error line above"
        self._say(service, f"{service.name} refused to start (exit status {REFUSED_STATUS}: "
                           f"{why}); a restart would not change it: stopping")  # fmt: skip
        self._hook(self.on_refused, service)

    def _say(self, service: Service, message: str) -> None:
        if service.log is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            with contextlib.suppress(OSError), open(service.log, "a") as log:
                log.write(f"{stamp} sift up: {message}\n")
        self.report(message)

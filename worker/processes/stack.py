"""Starts Sift's local processes: a Redis of its own, Celery workers, the gateway.

``sift up``, ``sift demo`` and the end-to-end tests all start the stack through this one
module. Each process runs on a loopback port, appends to a log file in its own directory,
and is stopped (SIGTERM, then SIGKILL) when its context ends.

    with redis_server(Path(".sift/redis")) as redis_url:
        with worker_process(dir, env), gateway_process(dir, env) as url:
            ...

``sift up`` also keeps them running (:class:`~worker.processes.supervisor.Supervisor`: a
process that exits is started again, after a back-off) and refuses to start over another
stack's ports (:func:`check_port_free`) or data folder
(:func:`~worker.processes.folder_locks.claim_data_dir`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import http.client
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import redis

from worker.errors import ConfigError

READY_TIMEOUT_SECONDS = 60.0
# The exit status of a ``sift`` command that refused to start (a bad setting, a Redis it must
# not run on: ``stop`` in worker/cli/_common.py), which no restart changes
REFUSED_STATUS = 2

FREE_PORTS_FROM = 20000  # above most services' well-known ports
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A loopback port nothing listens on, for a server about to be started on it.

    Picked below the kernel's ephemeral range, never by binding port 0: a port from that range
    can be taken, between this check and the server's own bind, by any outgoing connection on
    the machine (a busy test run opens thousands), and the server then dies of "address already
    in use". A port is handed out once per process; the choice is random, so that processes
    picking at the same time rarely try the same one. Binding port 0 is the fallback where the
    range leaves no room below it.
    """
    low, high = FREE_PORTS_FROM, _ephemeral_low() - 1
    with _handed_out_lock:
        for _ in range(64 if high - low >= 1000 else 0):
            port = random.randint(low, high)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


_PROC_NET_TCP = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_TCP_LISTEN = "0A"  # the "st" column of a listening socket in /proc/net/tcp


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` itself holds a listening TCP socket on ``port``: its open
    sockets (``/proc/PID/fd``) against the kernel's listening ones (``/proc/net/tcp``,
    ``tcp6``). None where there is no ``/proc`` to tell (not Linux).

    What answers on a port is not always the process started for it: another process that
    picked the same free port at the same time may have bound it first, and the one
    started for it then exits on "address already in use"."""
    if not _PROC_NET_TCP[0].exists():
        return None
    sockets = set()
    for table in _PROC_NET_TCP:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                # sl local_address rem_address st ... inode (the tenth column)
                fields = line.split()
                if fields[3] == _TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    sockets.add(f"socket:[{fields[9]}]")
    if not sockets:
        return False
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # it exited
        return False
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(fd) in sockets:
                return True
    return False


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM, a grace period, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class StartInterrupted(Exception):
    """The start was called off (Ctrl-C while a process warmed up): nothing failed."""


class StartRefused(RuntimeError):
    """A process of the stack refused to start (exit :data:`REFUSED_STATUS`, its reason on
    its ``error:`` line), or the stack refused one (its own ``redis-server`` too old): what
    the user must change, which no restart does (its command exits 2, as after a start)."""


def wait_until(
    check: Callable[[], object],
    what: str,
    proc: subprocess.Popen[bytes],
    log: Path | None,
    timeout: float = READY_TIMEOUT_SECONDS,
    offset: int = 0,
    cancel: threading.Event | None = None,
) -> None:
    """Poll ``check`` until it is true; fail with the log's tail (what this process wrote,
    from ``offset`` on) if the process dies first; raise :class:`StartInterrupted` once
    ``cancel`` is set (checked first: a Ctrl-C reaches the process too, which may die of it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cancel is not None and cancel.is_set():
            raise StartInterrupted(what)
        if proc.poll() is not None:
            if proc.returncode == REFUSED_STATUS and (why := refusal_line(log, offset)):
                raise StartRefused(f"{what} refused to start ({why})")
            raise RuntimeError(
                f"{what} exited early ({_exit_status(proc.returncode)}):\n{_log_tail(log, offset)}"
            )
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not become ready:\n{_log_tail(log, offset)}")


def _exit_status(code: int) -> str:
    """How a process ended: its exit status, or the signal that killed it (a crash in a
    library leaves no word in its log).

    >>> _exit_status(1), _exit_status(-11)
    ('exit status 1', 'killed by SIGSEGV')
    """
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


def _log_tail(log: Path | None, offset: int) -> str:
    if log is None:
        return "(its output is ours)"
    return log.read_bytes()[offset:][-4000:].decode(errors="replace")


def refusal_line(log: Path | None, offset: int = 0) -> str | None:
    """The last ``error:`` line a process wrote to ``log`` from ``offset`` on (a ``sift``
    command's refusal, :data:`REFUSED_STATUS`), without its prefix; None without one."""
    if log is None:
        return None
    try:
        with open(log, "rb") as file:
            file.seek(offset)
            lines = file.read()[-16000:].decode(errors="replace").splitlines()
    except OSError:
        return None
    found = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    return found[-1] if found else None


def _log_size(log: Path | None) -> int:
    if log is None:
        return 0
    try:
        return log.stat().st_size
    except FileNotFoundError:
        return 0


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_signal() -> Callable[[], None] | None:
    """What makes the calling process receive SIGTERM when its parent dies, even by SIGKILL
    (Linux's ``PR_SET_PDEATHSIG``, kept across an exec; it fires when the *thread* that
    started the process ends, so only threads that outlive their child start one). Looked up
    in the caller, so a child about to exec runs no lookup. None elsewhere than on Linux."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _dies_with(parent: int) -> Callable[[], None] | None:
    """What a child runs before its command so that it receives SIGTERM when we die
    (:func:`parent_death_signal`), and stops at once if we are gone already."""
    follow_parent = parent_death_signal()
    if follow_parent is None:
        return None

    def follow() -> None:
        follow_parent()
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return follow


def spawn(
    command: list[str],
    log: Path | None,
    env: Mapping[str, str] | None = None,
    *,
    own_group: bool = False,
    follow: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``command`` appending its output to ``log`` (never truncating it: a log may be a
    running process's, and a restarted one's follows the lines that led to the restart), or
    writing to ours if ``log`` is None. ``own_group``: in a process group of its own, so a
    terminal's Ctrl-C reaches only us, and we pass it on (once). ``follow``: it receives
    SIGTERM when we die (:func:`_dies_with`)."""
    group = 0 if own_group else None
    env = None if env is None else dict(env)
    before = _dies_with(os.getpid()) if follow else None
    if log is None:
        return subprocess.Popen(command, env=env, process_group=group, preexec_fn=before)
    with open(log, "ab") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=group,
            preexec_fn=before,
        )  # fmt: skip


# ``sift up``'s logs: one past LOG_MAX_BYTES is rotated (:func:`rotate_log`), and LOG_KEEP
# rotated ones are kept beside it, so each process's log takes at most about 40 MiB
LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_KEEP = 3


def rotate_log(log: Path, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP) -> bool:
    """Rotate ``log`` if it has reached ``max_bytes``: ``NAME.1`` … shift up one (the one
    past ``keep`` is dropped), its lines are copied to ``NAME.1``, and it is emptied in place.
    Answers whether it rotated.

    In place (logrotate's ``copytruncate``), not renamed: the process writing it holds it
    open, and renamed it would go on writing into ``NAME.1`` for good. It appends
    (:func:`spawn` opens it ``O_APPEND``), so its next line lands at the start of the emptied
    file, not past a hole the old lines' size. A line written between the copy and the
    truncation is lost, as with ``copytruncate``.

    The copy is made aside (``NAME.rotating``) before anything is shifted: on a full disk it
    raises OSError with the log and its rotated ones as they were. Copied straight to
    ``NAME.1`` after the shift, a full disk left ``NAME.1`` to ``NAME.3`` empty, their lines
    gone, and the log as big as before."""
    try:
        if log.stat().st_size < max_bytes:
            return False
    except FileNotFoundError:
        return False
    kept = [log.with_name(f"{log.name}.{n}") for n in range(1, keep + 1)]
    aside = log.with_name(f"{log.name}.rotating")
    try:
        shutil.copyfile(log, aside)
    except BaseException:
        aside.unlink(missing_ok=True)  # its part copied gives the room back
        raise
    for newer, older in reversed(list(itertools.pairwise(kept))):
        if newer.exists():  # NAME.2 to NAME.3 first, then NAME.1 to NAME.2
            newer.replace(older)
    aside.replace(kept[0])
    os.truncate(log, 0)
    return True


def child_env(extra: Mapping[str, str], *, inherit_sift: bool = True) -> dict[str, str]:
    """The environment of a child: ours (optionally without ``SIFT_*``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if inherit_sift or not k.startswith("SIFT_")}
    env.update(extra)
    return env


@contextlib.contextmanager
def redis_server(
    directory: Path,
    *,
    port: int | None = None,
    appendonly: bool = False,
    appendfsync: str = "everysec",
) -> Iterator[str]:
    """A redis-server of our own on loopback, yielding its URL (``redis://127.0.0.1:PORT``).

    With ``appendonly`` it keeps an AOF in ``directory`` (fsynced ``appendfsync``: ``always``,
    ``everysec`` or ``no``), so a restart on the same port and directory finds its data."""

    def make(port: int | None) -> tuple[Service, str]:
        return redis_service(directory, port=port, appendonly=appendonly, appendfsync=appendfsync)

    with running_on_a_port(make, port) as url:
        yield url


def redis_memory_limit() -> int:
    """The ``maxmemory`` of the Redis ``sift up`` runs: a quarter of the machine's memory.
    Without a limit ``noeviction`` never refuses a write (Redis's 0 is none): a Redis holding
    every result for the retention grew until the OOM killer stopped it, the broker with it;
    at the limit it refuses new jobs (the gateway's ``503``) and reads go on."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4


def redis_service(
    directory: Path,
    *,
    port: int | None = None,
    appendonly: bool = False,
    appendfsync: str = "everysec",
    log: Path | None = None,
) -> tuple[Service, str]:
    """The redis-server of :func:`redis_server`, not started yet, and its URL; its log is
    ``log``, else ``redis.log`` in ``directory`` (``sift up`` keeps it with the others)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError(
            "redis-server is not installed: run ./scripts/install-services.sh, "
            "or set SIFT_REDIS_URL to a Redis you run"
        )
    directory.mkdir(parents=True, exist_ok=True)
    log = log or directory / "redis.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"redis://127.0.0.1:{port}"

    def ping() -> bool:
        client = redis.Redis.from_url(url)
        try:
            return bool(client.ping())
        finally:
            client.close()

    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
               "--save", "", "--appendonly", "yes" if appendonly else "no",
               "--appendfsync", appendfsync, "--maxmemory", str(redis_memory_limit()),
               "--maxmemory-policy", "noeviction", "--daemonize", "no"]  # fmt: skip
    # a group of its own: a terminal's Ctrl-C reaching Redis with the rest killed it at once,
    # while the workers' warm shutdown still needed it (they hung, and were left orphaned);
    # whoever started it stops it, after the processes that use it
    service = Service("redis-server", command, log, None, ready=ping, own_group=True,
                      port=port)  # fmt: skip
    return service, url


def require_redis_7(service: Service, url: str) -> None:
    """Raise :class:`StartRefused` naming the binary, its version and 7.0 when the
    ``redis-server`` just started (``sift up``'s and ``sift demo``'s own, at ``url``) is
    older than Sift needs: a distribution's apt installs Redis 6 (Ubuntu 22.04, Debian 11),
    whose refusal by the worker ended them naming a SIFT_REDIS_URL no one had set."""
    from worker.redis_client import OLDEST_REDIS, info_at_start, too_old

    if version := too_old(info_at_start(url, "server")):
        oldest = ".".join(map(str, OLDEST_REDIS))
        raise StartRefused(
            f"{service.command[0]} is Redis {version}, older than Sift needs ({oldest} or "
            "later): install a newer one (scripts/install-services.sh says how)"
        )


def adopt_logs(old: Path, new: Path, keep: int = LOG_KEEP) -> None:
    """Move the log ``old`` and its rotated copies (``NAME.1`` … ``NAME.{keep}``) to ``new``
    and beside it, each one ``new`` has none of: a data folder from before ``sift up`` kept
    Redis's log with its AOF (``redis/redis.log``, where no one looked for it) goes on in
    ``logs/`` with its history, and one already moved is left as it is."""
    suffixes = ["", *(f".{n}" for n in range(1, keep + 1))]
    for suffix in suffixes:
        source, target = old.with_name(old.name + suffix), new.with_name(new.name + suffix)
        if source.exists() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            source.replace(target)


def sift_command(*args: str) -> list[str]:
    """``sift ARGS`` run by this interpreter, whether or not the console script is on PATH."""
    return [sys.executable, "-m", "worker.cli", *args]


@contextlib.contextmanager
def worker_process(
    directory: Path,
    env: Mapping[str, str],
    name: str = "worker",
    *,
    concurrency: int | None = None,
    pool: str | None = None,
    processes: int | None = 1,
    queues: str | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """One ``sift worker`` consuming every queue (or ``queues``, comma-separated), yielded
    once Celery says it is ready (with several ``processes``: once the first of them is)."""
    service = worker_service(
        directory,
        env,
        name,
        concurrency=concurrency,
        pool=pool,
        processes=processes,
        queues=queues,
    )
    with running(service):
        assert service.proc is not None
        yield service.proc


def worker_service(
    directory: Path,
    env: Mapping[str, str],
    name: str = "worker",
    *,
    concurrency: int | None = None,
    pool: str | None = None,
    processes: int | None = 1,
    queues: str | None = None,
) -> Service:
    """The ``sift worker`` of :func:`worker_process`, not started yet. ``processes``: one by
    default (the process started is the Celery worker); None leaves it to
    ``SIFT_WORKER_PROCESSES`` (one per core unless set)."""
    directory.mkdir(parents=True, exist_ok=True)
    args = ["worker", "--name", name]
    if processes is not None:
        args += ["--processes", str(processes)]
    if concurrency:
        args += ["--concurrency", str(concurrency)]
    if pool:
        args += ["--pool", pool]
    if queues:
        args += ["--queues", queues]
    what = name if name == "worker" else f"worker {name}"
    return Service(what, sift_command(*args), directory / f"{name}.log", env,
                   ready_line=b" ready.")  # fmt: skip


@contextlib.contextmanager
def gateway_process(
    directory: Path,
    env: Mapping[str, str],
    name: str = "gateway",
    *,
    port: int | None = None,
) -> Iterator[str]:
    """``sift gateway`` on loopback, yielding its base URL once it listens on its port and
    ``/readyz`` answers 200."""

    def make(port: int | None) -> tuple[Service, str]:
        return gateway_service(directory, env, name, port=port)

    with running_on_a_port(make, port) as url:
        yield url


def gateway_service(
    directory: Path, env: Mapping[str, str], name: str = "gateway", *, port: int | None = None
) -> tuple[Service, str]:
    """The ``sift gateway`` of :func:`gateway_process`, not started yet, and its URL."""
    directory.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    command = sift_command("gateway", "--host", "127.0.0.1", "--port", str(port))
    ready = functools.partial(gateway_ready, port)
    return Service(name, command, directory / f"{name}.log", env, ready=ready, port=port), url


def gateway_ready(port: int) -> bool:
    """The gateway on loopback ``port`` answers ``/readyz`` 200 within a second. A plain HTTP
    request: an httpx client reads the CA bundle as it is made, about 20 ms of CPU, and this
    is asked every 50 ms while a gateway starts."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        connection.request("GET", "/readyz")
        return connection.getresponse().status == 200
    finally:
        connection.close()


@dataclass
class Service:
    """One process of the stack: how to start it, and how to tell it is ready (``ready``
    answers true, or the log gains ``ready_line``). ``proc`` is the running process."""

    name: str
    command: list[str]
    log: Path | None  # None: the process writes to our stdout and stderr
    env: Mapping[str, str] | None
    ready: Callable[[], object] | None = None
    ready_line: bytes | None = None
    own_group: bool = False  # see spawn()
    follow: bool = False  # it receives SIGTERM when we die, even by SIGKILL (see spawn())
    stop_timeout: float = 15.0  # from SIGTERM to SIGKILL (see stop())
    proc: subprocess.Popen[bytes] | None = None
    # the port it serves on: it is ready only once its own process listens there, whatever
    # else answers ``ready`` on it (:func:`listens_on`)
    port: int | None = None
    started_at: float = 0.0
    _offset: int = 0  # the log's size when the process started: its own lines follow

    def rotate_log(self, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP) -> None:
        """Rotate its log once past ``max_bytes`` (:func:`rotate_log`); its lines since the
        start are then those of the emptied log."""
        if self.log is not None and rotate_log(self.log, max_bytes, keep):
            self._offset = 0

    def refusal(self) -> str | None:
        """Why its process refused to start: the last ``error:`` line it wrote to its log
        (:func:`refusal_line`); None without a log of its own or such a line."""
        return refusal_line(self.log, self._offset)

    def start(self) -> subprocess.Popen[bytes]:
        """Start the process (again), appending to its log; answers it without waiting."""
        self._offset = _log_size(self.log)
        self.proc = spawn(
            self.command, self.log, self.env, own_group=self.own_group, follow=self.follow
        )
        self.started_at = time.monotonic()
        return self.proc

    def wait_ready(
        self, timeout: float = READY_TIMEOUT_SECONDS, cancel: threading.Event | None = None
    ) -> None:
        """Wait until the process just started is ready; fail if it exits first (see
        :func:`wait_until`)."""
        assert self.proc is not None
        offset, line, ready = self._offset, self.ready_line, self.ready
        check: Callable[[], object]
        if line is not None:
            assert self.log is not None
            log = self.log
            check = lambda: line in log.read_bytes()[offset:]  # noqa: E731
        else:
            assert ready is not None
            check = ready
        if self.port is not None:
            pid, port, answers = self.proc.pid, self.port, check
            check = lambda: answers() and listens_on(pid, port) is not False  # noqa: E731
        wait_until(check, self.name, self.proc, self.log, timeout, offset, cancel)


@contextlib.contextmanager
def running(service: Service, cancel: threading.Event | None = None) -> Iterator[Service]:
    """Start ``service``, wait until it is ready (or ``cancel`` is set), yield it; stop its
    process at the end (the one running then: the :class:`Supervisor` may have started
    another)."""
    service.start()
    try:
        service.wait_ready(cancel=cancel)
        yield service
    finally:
        if service.proc is not None:
            stop(service.proc, service.stop_timeout)


PORT_PICKS = 3  # starts of a server on a port free_port picked (see running_on_a_port)


@contextlib.contextmanager
def running_on_a_port(
    make: Callable[[int | None], tuple[Service, str]], port: int | None
) -> Iterator[str]:
    """``make(port)``'s service :func:`running`, yielding its URL. With no ``port``, ``make``
    picks one (:func:`free_port`), and a process that exits because another took that port
    first is started again on a new pick, ``PORT_PICKS`` starts in all: two test processes
    may pick the same free port at once (each rules out only its own picks), and only one
    of their servers binds it."""
    with contextlib.ExitStack() as stack:
        for picks_left in reversed(range(PORT_PICKS if port is None else 1)):
            service, url = make(port)
            try:
                stack.enter_context(running(service))
            except RuntimeError:
                if picks_left and _lost_its_port(service):
                    continue
                raise
            yield url
            return


def _lost_its_port(service: Service) -> bool:
    """``service``'s process exited, and something else listens on its port."""
    proc, port = service.proc, service.port
    exited = proc is not None and proc.poll() is not None
    return exited and port is not None and not _bindable(port)


class StackInUse(ConfigError):
    """Another stack holds a port or the data folder this one needs."""


def check_port_free(port: int, what: str, option: str, host: str = "127.0.0.1") -> None:
    """Raise :class:`StackInUse` naming ``port`` if something already listens on it."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise StackInUse(
                f"the {what} port {port} is in use (by another stack?): {exc.strerror}; "
                f"stop it, or choose another: {option}"
            ) from exc

"""The embedded backend's connections: a pool per process, lent one per operation, and the
transactions, deadline and error translation every operation runs its statements under.

:class:`_Pool` is the base of every part of :class:`~worker.adapters.embedded.EmbeddedBackend`
and holds all of its state: the pool, and the caches (:mod:`._caches`), which a fork
resets with the pool."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import apsw

from worker.errors import BackendRequestError, BackendUnavailable, ConfigError

from ._schema import _SCHEMA, DB_FILE, SCHEMA_VERSION, _check_schema_version, _date_tombstones

log = logging.getLogger("worker.adapters.embedded")

if TYPE_CHECKING:
    from worker.core.types import Document

    from ._caches import _Vectors

BUSY_TIMEOUT_MS = 10_000
CACHE_KIB = 32 * 1024  # page cache per connection
MMAP_BYTES = 1 << 30  # reads through the OS page cache, shared by every process
#: How long a delete's tombstone is kept, by default: as long as Elasticsearch keeps one
#: (SIFT_ELASTICSEARCH_GC_DELETES_SECONDS' default, which a worker passes), past the longest
#: an ingest accepted before the delete can still run at the default settings (26,940 s,
#: ``worker.queue.config.ingest_redelivery_window``).
TOMBSTONE_SECONDS = 27_000

#: The vector loads' locks per process (:meth:`_Pool._load_lock`): more than a worker
#: process's CPU slots, so loads of different indexes seldom wait for each other.
LOAD_LOCKS = 64

_UNAVAILABLE = (
    apsw.BusyError,
    apsw.LockedError,
    apsw.IOError,
    apsw.CantOpenError,
    apsw.FullError,
    apsw.InterruptError,
    apsw.ConnectionClosedError,
)


class _Pool:
    """The backend's state and its connections (see :class:`EmbeddedBackend`)."""

    name: str

    def __init__(
        self,
        data_dir: Path,
        vector_min_similarity: float | None = None,
        *,
        max_indexes_per_tenant: int = 0,
        tombstone_seconds: float = TOMBSTONE_SECONDS,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.vector_min_similarity = vector_min_similarity
        self.max_indexes_per_tenant = max_indexes_per_tenant  # 0: no limit
        self.tombstone_seconds = tombstone_seconds
        self._lock = threading.Lock()
        # Use order, the least recently used let go first (_caches._recall). An OrderedDict, as
        # a dict's next(iter()) walks every slot deleted since its last resize: 2 ms per
        # full-cache search measured.
        self._documents: OrderedDict[int, Document] = OrderedDict()
        self._document_bytes = 0  # their titles' and texts' (_caches._weight), under a budget
        # By (index, tenant), the least recently searched first; their blocks' bytes, under a
        # budget (_caches.VECTOR_CACHE_BYTES).
        self._vectors: OrderedDict[tuple[str, str], _Vectors] = OrderedDict()
        self._vector_bytes = 0
        self._load_locks = _load_locks()  # one load of an index's vectors at a time
        self._schema_seen: int | None = None  # the schema version last swept at (None: sweep)
        self._connections: list[apsw.Connection] = []  # every open one, lent or idle
        self._idle: list[apsw.Connection] = []  # the pool: the last given back on top
        self._epoch = 0  # bumped by close(): a connection lent before is not taken back
        self._inherited: list[apsw.Connection] = []  # kept referenced, so never closed here
        self._pid = os.getpid()
        self._schema_ready = False

    @contextlib.contextmanager
    def _conn(self) -> Iterator[apsw.Connection]:
        """A connection of this process, the caller's alone until the block ends.

        Connections are lent from one pool, the last one given back lent first, so the
        process holds as many as were ever in use at once (searches run under a worker's
        few CPU slots) and a search runs on a connection that ran one a moment ago. One
        per thread, as before, gave each of a worker's ~600 threads its own: every tenant's
        first write (a CREATE VIRTUAL TABLE) made each of them parse the whole schema again
        (33 ms of CPU each at 1,000 tenant indexes) and hold its own copy of it in memory.
        A connection a failed COMMIT or ROLLBACK left in a transaction is closed, not lent.
        """
        with self._lock:
            if os.getpid() != self._pid:  # forked: never use (nor close) the parent's
                self._inherited += self._connections
                self._pid, self._connections = os.getpid(), []
                self._idle, self._documents, self._document_bytes = [], OrderedDict(), 0
                self._forget_vectors()
                self._load_locks = _load_locks()  # one a parent's thread held stays held
            conn = self._idle.pop() if self._idle else None
            epoch = self._epoch
        if conn is None:
            conn = self._open()
            with self._lock:
                if epoch == self._epoch:
                    self._connections.append(conn)
        try:
            yield conn
        finally:
            with self._lock:
                if epoch != self._epoch or os.getpid() != self._pid:
                    pass  # closed by close() meanwhile, or the parent's: not ours to keep
                elif conn.in_transaction:
                    self._connections.remove(conn)
                    conn.close()
                else:
                    self._idle.append(conn)

    def _load_lock(self, key: tuple[str, str]) -> threading.Lock:
        """The lock a load of the tenant's index's vectors holds: one of
        :data:`LOAD_LOCKS`, by the key's hash, so loads of two indexes run at once unless
        their keys share one, and the locks are as many however many indexes there are."""
        return self._load_locks[hash(key) % LOAD_LOCKS]

    def _forget_vectors(self) -> None:
        """Let go of every cached vector block (with the lock held); a search holding one
        reads on, its block alive for as long as it holds it."""
        self._vectors, self._vector_bytes = OrderedDict(), 0

    def _open(self) -> apsw.Connection:
        with _translated("open"):
            self.data_dir.mkdir(parents=True, exist_ok=True)
            conn = apsw.Connection(str(self.data_dir / DB_FILE))
            conn.set_busy_timeout(BUSY_TIMEOUT_MS)
            # Plans never read bound values (no statistics are kept, no LIKE is asked). Without
            # this, SQLite compiled the BM25 statement (its join of the FTS5 table with docs
            # read the bound index name) and, past one FTS5 segment, a statement of FTS5's own
            # again at every search: most of the BM25 CPU on a small index. Set before any
            # statement: one compiled without it kept being compiled again.
            conn.config(apsw.SQLITE_DBCONFIG_ENABLE_QPSG, 1)
            conn.execute("PRAGMA journal_mode=WAL")
            # A deleted row's bytes are zeroed, not only marked free: a deleted or dropped
            # document's text, metadata and vector leave the file (docs/security.md).
            conn.execute("PRAGMA secure_delete=ON")
            conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            conn.execute(f"PRAGMA mmap_size={MMAP_BYTES}")
            if not self._schema_ready:
                with _write(conn):
                    _check_schema_version(conn, self.data_dir)
                    dated = conn.execute(
                        "SELECT EXISTS(SELECT 1 FROM sqlite_master WHERE name = 'tombstones')"
                    ).get
                    conn.execute(_SCHEMA)
                    if not dated:
                        _date_tombstones(conn, time.time())
                    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                self._schema_ready = True
        return conn

    def check(self) -> None:
        """Open the data dir now (making it and its schema if new), so a data dir of another
        schema version stops a worker at its start with :class:`ConfigError`, rather than
        failing each job it takes; so does a data dir it cannot make or open (a path under a
        file, a folder it may not write), naming ``SIFT_DATA_DIR``, where ``mkdir``'s
        ``OSError`` was a traceback."""
        try:
            with self._conn():
                pass
        except OSError as exc:
            raise ConfigError(
                f"SIFT_DATA_DIR ({self.data_dir}): cannot make or open it: "
                f"{exc.strerror or exc}; give a folder this user can write"
            ) from exc

    def close(self) -> None:
        """Close every connection this backend opened; it reopens on next use. Meant for
        when no operation runs (shutdown, tests); one lent meanwhile is not taken back."""
        with self._lock:
            if os.getpid() != self._pid:
                return  # the parent's: never closed here (the next use starts afresh)
            connections, self._connections, self._idle = self._connections, [], []
            self._epoch += 1
            self._forget_vectors()
        for conn in connections:
            conn.close()


def _load_locks() -> tuple[threading.Lock, ...]:
    return tuple(threading.Lock() for _ in range(LOAD_LOCKS))


@contextlib.contextmanager
def _read(conn: apsw.Connection) -> Iterator[None]:
    """One read transaction, so every statement of a search sees the same snapshot."""
    conn.execute("BEGIN")
    try:
        yield
    finally:
        if conn.in_transaction:
            conn.execute("COMMIT")


@contextlib.contextmanager
def _write(conn: apsw.Connection) -> Iterator[None]:
    """One write transaction, taking the write lock up front (no deadlock on upgrade)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextlib.contextmanager
def _erasing(conn: apsw.Connection) -> Iterator[None]:
    """After the block (a delete's or a drop's write, committed), copy the WAL into the
    database file and truncate it, so the file holds no frame of the removed documents.

    ``secure_delete`` zeroes a deleted row in the page's new version, but the WAL keeps the
    page's older frames (the ingest's, with the text) until a checkpoint copies the newest
    over the database file and the log is reused, which may be never for a frame past its
    next use. A ``TRUNCATE`` checkpoint waits (the busy timeout) for the reads of an older
    snapshot in flight and the other writers. One that cannot finish, in that time or at
    all (the disk too full for the database file to take the WAL's pages, where the write
    fitted in the WAL), leaves the removed rows' bytes in the WAL until a later checkpoint,
    and says so in the log: the write is committed and the documents are in no channel, so
    the job has done what it reports (raised, a job whose retries ran out reported failed a
    delete it had made, and a drop's settings were never cleared).
    """
    yield
    try:
        conn.wal_checkpoint(mode=apsw.SQLITE_CHECKPOINT_TRUNCATE)
    except apsw.Error as exc:
        log.warning(
            "the WAL checkpoint after a delete could not finish (%s): the removed rows' "
            "bytes stay in %s-wal until a later checkpoint",
            exc, DB_FILE,
        )  # fmt: skip


@contextlib.contextmanager
def _deadline(conn: apsw.Connection, seconds: float | None) -> Iterator[None]:
    """Interrupt SQLite work that runs past ``seconds`` (surfaces as InterruptError)."""
    if seconds is None:
        yield
        return
    end = time.monotonic() + max(seconds, 0.0)
    conn.set_progress_handler(lambda: time.monotonic() > end, 10_000)
    try:
        yield
    finally:
        conn.set_progress_handler(None)


@contextlib.contextmanager
def _translated(operation: str) -> Iterator[None]:
    """apsw errors as Sift's: busy, locked, I/O and timeouts retryable; the rest permanent."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise BackendUnavailable(f"embedded backend {operation}: {exc}") from exc
    except apsw.Error as exc:
        raise BackendRequestError(f"embedded backend {operation}: {exc}") from exc

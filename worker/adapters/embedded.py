"""The embedded search backend: BM25 and exact kNN over one SQLite file per data dir.

Why this shape (DESIGN.md §6, §10):

* **One SQLite database (through ``apsw``) holds everything**: a narrow ``docs``
  row per document (index, tenant, id, revision, metadata: what filters read),
  its title and text in ``bodies``, its vector as a float32 blob in ``vectors``,
  all keyed by the row's ``seq``, and an FTS5 table per index and tenant for BM25
  (an ``indexes`` row per (name, tenant): each tenant's index is its own). An upsert
  by id therefore replaces the text, the BM25 postings and the vector in one
  transaction: atomic and durable. WAL mode and a busy timeout let several worker
  processes read and write the same directory. ``apsw`` is used because it ships a
  current SQLite with FTS5; the stdlib module here cannot load extensions.
* **BM25 is FTS5's own ``bm25()``** over title and text, tokenizer ``porter
  unicode61 remove_diacritics 2``. The MATCH expression is built here from the
  query's word tokens, English stopwords removed, each term quoted and OR-ed, so no
  user text is ever parsed as FTS5 syntax. Statistics are per tenant's index (one FTS
  table each): another tenant's documents change neither the caller's scores nor the
  cost of its search.
* **kNN is exact cosine with numpy**: a dot product of unit vectors over an
  in-memory float32 matrix loaded from SQLite. Rows get a monotonic ``seq``
  (AUTOINCREMENT; a replaced document gets a new one) and each index a
  ``generation`` bumped by every write, so a query checks one integer inside its
  read transaction and loads only what changed. The matrix is kept per tenant's
  index, with each row's id, revision and metadata, so a kNN search scans only
  its tenant's rows and reads nothing from SQLite but its hits' bodies. At 50-100k
  vectors a full scan takes a few milliseconds, so no approximate index is needed
  (and none is hand-written).
* **Hard filters run inside each channel, before the window**: tenant and metadata
  equality are SQL ``WHERE`` clauses of the BM25 query, and the kNN scan covers
  only the rows that pass them. Another tenant's documents can never take a slot.
* **Bodies are read once per search**: each channel ranks on narrow rows, then one
  statement reads the title and text of the union of both channels' hits, and a hit
  found by both channels shares one ``Document``.
* **Connections are lent from a pool, one per operation, not kept per thread**: a
  tenant's first write creates a table, and every open connection then parses the whole
  schema again and holds a copy of it, so a process keeps only as many as it used at
  once. A drop or delete that leaves a tenant's index empty drops its FTS5 table for the
  same reason: a tenant's index exists while it holds one of the tenant's documents.

Usage::

    backend = EmbeddedBackend(Path(".sift/data"))
    backend.upsert("docs", "acme", [Document(id="1", text="...")], vectors)
    results = backend.retrieve(ChannelQuery(index="docs", filters=HardFilters("acme"),
                                            channels=("bm25", "knn"), size=120,
                                            text="query", vector=query_vector))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import apsw
import numpy as np
import numpy.typing as npt

from worker.contract import Channel, FilterValue
from worker.core.catalog import IndexInfo, StoredDocument
from worker.core.types import (
    ChannelHit,
    ChannelQuery,
    ChannelResults,
    Document,
    HardFilters,
    IndexProbe,
)
from worker.errors import (
    BackendRequestError,
    BackendUnavailable,
    ConfigError,
    EmbeddingModelMismatch,
    IndexNotFound,
    InvalidRequest,
    ModeUnavailable,
)

logger = logging.getLogger(__name__)

DB_FILE = "sift.db"
BUSY_TIMEOUT_MS = 10_000
CACHE_KIB = 32 * 1024  # page cache per connection
# Built Documents by seq. A seq names one immutable version (a replace gets a new seq,
# and seqs are never reused), so an entry can go stale only by never being asked for.
DOCUMENT_CACHE_SIZE = 20_000
MMAP_BYTES = 1 << 30  # reads through the OS page cache, shared by every process
FTS_TOKENIZER = "porter unicode61 remove_diacritics 2"

_NLTK_STOPWORDS = """
    i me my myself we our ours ourselves you you're you've you'll you'd your yours
    yourself yourselves he him his himself she she's her hers herself it it's its
    itself they them their theirs themselves what which who whom this that that'll
    these those am is are was were be been being have has had having do does did
    doing a an the and but if or because as until while of at by for with about
    against between into through during before after above below to from up down in
    out on off over under again further then once here there when where why how all
    any both each few more most other some such no nor not only own same so than too
    very s t can will just don don't should should've now d ll m o re ve y ain aren
    aren't couldn couldn't didn didn't doesn doesn't hadn hadn't hasn hasn't haven
    haven't isn isn't ma mightn mightn't mustn mustn't needn needn't shan shan't
    shouldn shouldn't wasn wasn't weren weren't won won't wouldn wouldn't
"""
#: The common English stopword list (NLTK's 179 words), removed from queries only.
ENGLISH_STOPWORDS: frozenset[str] = frozenset(_NLTK_STOPWORDS.split())

_WORD = re.compile(r"\w+")
_FILTER_KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_UNAVAILABLE = (
    apsw.BusyError,
    apsw.LockedError,
    apsw.IOError,
    apsw.CantOpenError,
    apsw.FullError,
    apsw.InterruptError,
    apsw.ConnectionClosedError,
)

SCHEMA_VERSION = 2  # bump on any change to _SCHEMA; an older data dir is refused, never misread


def _check_schema_version(conn: apsw.Connection, data_dir: Path) -> None:
    found = conn.execute("PRAGMA user_version").fetchone()
    version = int(found[0]) if found else 0
    has_tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    if has_tables and has_tables[0] and version != SCHEMA_VERSION:
        raise ConfigError(
            f"SIFT_DATA_DIR {data_dir} holds embedded-index schema v{version}, this Sift "
            f"reads v{SCHEMA_VERSION}: point SIFT_DATA_DIR at a new directory and re-ingest"
        )


_SCHEMA = """
CREATE TABLE IF NOT EXISTS indexes(
    num INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    tenant TEXT NOT NULL,
    dimension INTEGER,
    generation INTEGER NOT NULL DEFAULT 0,
    UNIQUE(name, tenant)
);
CREATE TABLE IF NOT EXISTS docs(
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    idx TEXT NOT NULL,
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    revision TEXT NOT NULL,
    metadata TEXT NOT NULL,
    has_vector INTEGER NOT NULL,
    UNIQUE(idx, tenant, id)
);
CREATE INDEX IF NOT EXISTS docs_vectors ON docs(idx, tenant, seq) WHERE has_vector;
CREATE TABLE IF NOT EXISTS bodies(seq INTEGER PRIMARY KEY, title TEXT NOT NULL, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS vectors(seq INTEGER PRIMARY KEY, vector BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS writes(
    idx TEXT NOT NULL,
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    version INTEGER NOT NULL,
    deleted INTEGER NOT NULL,
    PRIMARY KEY(idx, tenant, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS catalog(
    idx TEXT NOT NULL,
    tenant TEXT NOT NULL,
    floor INTEGER NOT NULL DEFAULT 0,
    model TEXT,
    last_write REAL,
    PRIMARY KEY(idx, tenant)
) WITHOUT ROWID;
"""
# v2: ``indexes`` is keyed by (name, tenant), so each tenant's index has its own FTS5 table
# (BM25 statistics), dimension and generation; a v1 data dir (one per name) is refused.


def match_expression(query: str) -> str | None:
    """The FTS5 MATCH text for a query: its non-stopword terms, quoted and OR-ed.

    >>> match_expression("What is the role of p53?")
    '"role" OR "p53"'

    ``None`` when no term is left; such a query has an empty BM25 channel.
    """
    terms = dict.fromkeys(
        token for token in _WORD.findall(query.lower()) if token not in ENGLISH_STOPWORDS
    )
    return " OR ".join(f'"{term}"' for term in terms) or None


def derive_revision(title: str, text: str, metadata: Mapping[str, FilterValue]) -> str:
    """A stable revision for a document that came without one: same content, same revision."""
    payload = json.dumps([title, text, dict(metadata)], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class _Block:
    """One tenant's index's vectors, rows in ``seq`` order; ``matrix`` may have spare rows.

    Besides the vectors it holds what a hit needs from ``docs`` (id, revision, metadata
    as stored), so a kNN search reads only the hits' bodies from SQLite. A ``seq`` never
    changes content (a replaced document gets a new one), so these never go stale.
    """

    seqs: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    ids: list[str] = field(default_factory=list)
    revisions: list[str] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)
    matrix: npt.NDArray[np.float32] = field(default_factory=lambda: np.zeros((0, 0), np.float32))

    @property
    def size(self) -> int:
        return int(self.seqs.shape[0])


@dataclass
class _Vectors:
    """One tenant's index's vectors in memory, as of its ``generation``, in one block.

    Each (index, tenant) is its own index, so a kNN scan reads only its tenant's rows:
    another tenant's cost neither a multiply nor a gather, nor a reload when they change.
    """

    generation: int = -1
    max_seq: int = 0
    block: _Block = field(default_factory=_Block)

    @property
    def dimension(self) -> int:
        return int(self.block.matrix.shape[1]) if self.block.size else 0


#: What a row needs besides its body to become a ``Document``: id, revision, metadata.
_About = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class _Ranked:
    """One channel's rows, best first, before their bodies are read.

    ``about(i)`` gives the id, revision and metadata of row ``i``; it is asked only for
    the rows whose ``Document`` is not cached, so a warm search builds no tuple per hit.
    """

    seqs: list[int]
    scores: list[float]
    about: Callable[[int], _About]


_NOTHING = _Ranked([], [], lambda i: ("", "", ""))


class EmbeddedBackend:
    """The :class:`~worker.core.ports.SearchBackend` port on SQLite FTS5 and numpy.

    Safe to share between threads (each call has a pooled connection to itself) and between
    processes on one machine (WAL and a busy timeout). Opens nothing until first use.
    """

    name = "embedded"

    def __init__(self, data_dir: Path, vector_min_similarity: float | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.vector_min_similarity = vector_min_similarity
        self._lock = threading.Lock()
        # Insertion order, the oldest evicted first. An OrderedDict, as a dict's next(iter())
        # walks every slot deleted since its last resize: 2 ms per full-cache search measured.
        self._documents: OrderedDict[int, Document] = OrderedDict()
        self._vectors: dict[tuple[str, str], _Vectors] = {}  # by (index, tenant)
        self._connections: list[apsw.Connection] = []  # every open one, lent or idle
        self._idle: list[apsw.Connection] = []  # the pool: the last given back on top
        self._epoch = 0  # bumped by close(): a connection lent before is not taken back
        self._inherited: list[apsw.Connection] = []  # kept referenced, so never closed here
        self._pid = os.getpid()
        self._schema_ready = False

    # --- connections -------------------------------------------------------------

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
                self._pid, self._connections, self._vectors = os.getpid(), [], {}
                self._idle, self._documents = [], OrderedDict()
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
            conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            conn.execute(f"PRAGMA mmap_size={MMAP_BYTES}")
            if not self._schema_ready:
                with _write(conn):
                    _check_schema_version(conn, self.data_dir)
                    conn.execute(_SCHEMA)
                    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                self._schema_ready = True
        return conn

    def check(self) -> None:
        """Open the data dir now (making it and its schema if new), so a data dir of another
        schema version stops a worker at its start with :class:`ConfigError`, rather than
        failing each job it takes."""
        with self._conn():
            pass

    def close(self) -> None:
        """Close every connection this backend opened; it reopens on next use. Meant for
        when no operation runs (shutdown, tests); one lent meanwhile is not taken back."""
        with self._lock:
            if os.getpid() != self._pid:
                return  # the parent's: never closed here (the next use starts afresh)
            connections, self._connections, self._idle = self._connections, [], []
            self._epoch += 1
            self._vectors = {}
        for conn in connections:
            conn.close()

    # --- the port ----------------------------------------------------------------

    def channels(self, index: str, tenant: str) -> frozenset[Channel]:
        """``bm25`` once the tenant holds a document in the index, plus ``knn`` once one of
        them holds a vector; empty otherwise, whether or not another tenant uses the name."""
        return self.probe(index, tenant).channels

    def probe(self, index: str, tenant: str) -> IndexProbe:
        """The tenant's channels (:meth:`channels`) and its index's recorded embedding model.

        One statement, the same for every answer: two index seeks, both on the tenant's own
        rows (the vector check on the partial ``(idx, tenant, seq)`` index), so an index only
        another tenant has costs what one nobody has costs (microseconds). The model is one
        more seek, on the catalog's primary key.
        """
        with self._conn() as conn, _translated("channels"):  # one statement: one snapshot, one step
            row = conn.execute(
                "SELECT EXISTS(SELECT 1 FROM docs WHERE idx = ?1 AND tenant = ?2),"
                " EXISTS(SELECT 1 FROM docs WHERE idx = ?1 AND tenant = ?2 AND has_vector),"
                " (SELECT model FROM catalog WHERE idx = ?1 AND tenant = ?2)",
                (index, tenant),
            ).fetchone()
        if row is None or not row[0]:
            return IndexProbe(frozenset())
        channels: frozenset[Channel] = frozenset({"bm25", "knn"} if row[1] else {"bm25"})
        return IndexProbe(channels, row[2])

    def retrieve(self, query: ChannelQuery) -> ChannelResults:
        """Each asked channel's hits, best first, hard filters applied inside the query."""
        hits: dict[Channel, list[ChannelHit]] = {}
        seconds: dict[str, float] = {}
        with (
            self._conn() as conn,
            _translated("retrieve"),
            _deadline(conn, query.timeout_seconds),
            _read(conn),
        ):
            searched = _searched_index(conn, query.index, query.filters.tenant)
            if searched is None:
                # No document of the tenant in this snapshot: never written, only another
                # tenant's, or emptied (by a drop or deletes) since the pipeline's probe. Each
                # answers as a name nobody has, and the emptied one's FTS5 table is gone. Its
                # vectors are let go (a later write loads them afresh).
                with self._lock:
                    self._vectors.pop((query.index, query.filters.tenant), None)
                raise IndexNotFound(query.index)
            num, generation = searched
            ranked: dict[Channel, _Ranked] = {}
            for channel in dict.fromkeys(query.channels):
                started = time.perf_counter()
                if channel == "bm25":
                    ranked[channel] = self._bm25(conn, num, query)
                elif channel == "knn":
                    ranked[channel] = self._knn(conn, generation, query)
                else:
                    raise BackendRequestError(f"unknown channel {channel!r}")
                seconds[channel] = time.perf_counter() - started
            # Cached Documents first; the bodies of the rest in one statement, each built once.
            started = time.perf_counter()
            cache = self._documents
            found = {channel: list(map(cache.get, r.seqs)) for channel, r in ranked.items()}
            missing: dict[int, _About] = {}
            for channel, docs in found.items():
                r = ranked[channel]
                for i in [i for i, doc in enumerate(docs) if doc is None]:
                    missing.setdefault(r.seqs[i], r.about(i))
            if missing:
                built = {
                    seq: _document(title, text, missing[seq])
                    for seq, title, text in _bodies(conn, missing)
                }
                self._remember(built)
                for channel, docs in found.items():
                    seqs = ranked[channel].seqs
                    for i in [i for i, doc in enumerate(docs) if doc is None]:
                        docs[i] = built.get(seqs[i])
            for channel, docs in found.items():
                scores = ranked[channel].scores
                if missing:  # a seq without a body: a row a newer vector snapshot holds
                    hits[channel] = [
                        ChannelHit(doc, score)
                        for doc, score in zip(docs, scores, strict=True)
                        if doc is not None
                    ]
                else:
                    hits[channel] = list(map(ChannelHit, cast(list[Document], docs), scores))
            shared = (time.perf_counter() - started) / max(len(ranked), 1)
            for channel in ranked:  # the shared read, charged evenly to the channels
                seconds[channel] += shared
        return ChannelResults(hits=hits, seconds=seconds)

    def _remember(self, built: dict[int, Document]) -> None:
        with self._lock:
            self._documents.update(built)
            for _ in range(len(self._documents) - DOCUMENT_CACHE_SIZE):
                self._documents.popitem(last=False)

    def upsert(
        self,
        index: str,
        tenant: str,
        documents: Sequence[Document],
        vectors: Sequence[Sequence[float]] | npt.NDArray[np.floating[Any]] | None,
        *,
        version: int | None = None,
        model: str | None = None,
    ) -> int:
        """Insert or replace by (index, tenant, id): text, BM25 row and vector in one commit.

        A document whose ``revision`` is empty gets :func:`derive_revision`. With a
        ``version``, a document is written only if the version is newer than the id's last
        write (an upsert or a delete's tombstone) and the tenant's index floor (its last
        drop); answers how many were written.

        ``model`` (the embedder of ``vectors``) is recorded by the first write of the tenant's
        index; a write of another model's vectors raises :class:`EmbeddingModelMismatch` in
        the same transaction, before any row is written, until a drop clears the record.
        """
        if not documents:
            return 0
        matrix = _check_vectors(documents, vectors)
        rows = [_document_row(i, doc) for i, doc in enumerate(documents)]
        written = 0
        with self._conn() as conn, _translated("upsert"), _write(conn):
            num = _ensure_index(conn, index, tenant)
            fts = f"fts_{num}"
            floor = _floor(conn, index, tenant)
            for i, (doc_id, title, text, revision, metadata) in enumerate(rows):
                held = _held_version(conn, index, tenant, doc_id)
                if version is not None and version <= max(floor, held or 0):
                    continue  # a newer write (or drop) of this id was accepted after this one
                if not written and matrix is not None:  # before the first row written only:
                    # a stale write (every row skipped) claims nothing a drop freed, and
                    # another model's vectors are a model mismatch before a dimension one
                    if model is not None:
                        _check_model(conn, index, tenant, model)
                    _claim_dimension(conn, num, index, matrix.shape[1])
                old = conn.execute(
                    "SELECT seq FROM docs WHERE idx = ? AND tenant = ? AND id = ?",
                    (index, tenant, doc_id),
                ).get
                if old is not None:
                    _remove_row(conn, fts, old)
                conn.execute(
                    "INSERT INTO docs(idx, tenant, id, revision, metadata, has_vector)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (index, tenant, doc_id, revision, metadata, matrix is not None),
                )
                seq = conn.last_insert_rowid()
                conn.execute("INSERT INTO bodies VALUES (?, ?, ?)", (seq, title, text))
                conn.execute(
                    f"INSERT INTO {fts}(rowid, title, text) VALUES (?, ?, ?)", (seq, title, text)
                )
                if matrix is not None:
                    conn.execute("INSERT INTO vectors VALUES (?, ?)", (seq, matrix[i].tobytes()))
                _set_version(conn, index, tenant, doc_id, version, held, deleted=False)
                written += 1
            _touch(conn, index, tenant, model if written and matrix is not None else None)
            conn.execute("UPDATE indexes SET generation = generation + 1 WHERE num = ?", (num,))
        return written

    def delete_documents(
        self, index: str, tenant: str, ids: Sequence[str], *, version: int | None = None
    ) -> int:
        """Delete the tenant's documents by id, both channels in one commit; answers how many
        existed. With a ``version``, each id gets a tombstone of that version, so an upsert
        accepted before the delete and run after it is skipped, and an id whose last write
        is newer than the delete is left alone."""
        deleted = 0
        with self._conn() as conn, _translated("delete"), _write(conn):
            row = _index_row(conn, index, tenant)
            floor = _floor(conn, index, tenant)
            for doc_id in dict.fromkeys(ids):
                held = _held_version(conn, index, tenant, doc_id)
                if version is not None and version <= max(floor, held or 0):
                    continue
                old = conn.execute(
                    "SELECT seq FROM docs WHERE idx = ? AND tenant = ? AND id = ?",
                    (index, tenant, doc_id),
                ).get
                if old is not None and row is not None:
                    _remove_row(conn, f"fts_{row[0]}", old)
                    deleted += 1
                _set_version(conn, index, tenant, doc_id, version, held, deleted=True)
            if deleted:
                _touch(conn, index, tenant, None)
            if row is not None:
                conn.execute(
                    "UPDATE indexes SET generation = generation + 1 WHERE num = ?", (row[0],)
                )
                if deleted:
                    _settle_emptied(conn, row[0], index, tenant)
        return deleted

    # --- housekeeping ------------------------------------------------------------

    def count(self, index: str, tenant: str) -> int:
        """How many documents the tenant holds in the index."""
        with self._conn() as conn, _translated("count"):
            found = conn.execute(
                "SELECT count(*) FROM docs WHERE idx = ? AND tenant = ?", (index, tenant)
            ).get
        return int(found)

    def delete_index(self, index: str, tenant: str, *, version: int | None = None) -> int:
        """Delete all of the tenant's documents in the index (rows, BM25 postings, vectors);
        answers how many went. With a ``version``, only documents written before it go, and
        the tenant's index keeps it as a floor: an upsert accepted before the drop and run
        after it is skipped. The tenant's tombstones below the floor are dropped with it."""
        with self._conn() as conn, _translated("delete_index"), _write(conn):
            row = _index_row(conn, index, tenant)
            gone = 0
            if row is not None:
                above = "" if version is None else " AND version > ?"
                keep = (
                    set()
                    if version is None
                    else {
                        doc_id
                        for (doc_id,) in conn.execute(
                            "SELECT id FROM writes WHERE idx = ? AND tenant = ?" + above,
                            (index, tenant, version),
                        )
                    }
                )
                seqs = [
                    seq
                    for seq, doc_id in conn.execute(
                        "SELECT seq, id FROM docs WHERE idx = ? AND tenant = ?", (index, tenant)
                    )
                    if doc_id not in keep
                ]
                for seq in seqs:
                    _remove_row(conn, f"fts_{row[0]}", seq)
                gone = len(seqs)
                conn.execute(
                    "UPDATE indexes SET generation = generation + 1 WHERE num = ?", (row[0],)
                )
                _settle_emptied(conn, row[0], index, tenant)
            if version is not None:
                conn.execute(
                    "DELETE FROM writes WHERE idx = ? AND tenant = ? AND version <= ?",
                    (index, tenant, version),
                )
                conn.execute(
                    "INSERT INTO catalog(idx, tenant, floor, last_write) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT(idx, tenant) DO UPDATE SET"
                    " floor = max(floor, excluded.floor), last_write = excluded.last_write",
                    (index, tenant, version, time.time()),
                )
        return gone

    # --- the catalog -------------------------------------------------------------

    def indexes(self, tenant: str) -> list[IndexInfo]:
        """The tenant's indexes (those holding one of its documents), by name."""
        with self._conn() as conn, _translated("indexes"), _read(conn):
            rows = cast(
                list[tuple[str, int, int | None, str | None, float | None]],
                conn.execute(
                    "SELECT d.idx, count(*), i.dimension, c.model, c.last_write FROM docs AS d"
                    " JOIN indexes AS i ON i.name = d.idx AND i.tenant = d.tenant"
                    " LEFT JOIN catalog AS c ON c.idx = d.idx AND c.tenant = d.tenant"
                    " WHERE d.tenant = ? GROUP BY d.idx ORDER BY d.idx",
                    (tenant,),
                ).fetchall(),
            )
        return [
            IndexInfo(name, int(count), self.name, model, dimension, last_write)
            for name, count, dimension, model, last_write in rows
        ]

    def index_info(self, index: str, tenant: str) -> IndexInfo | None:
        """The tenant's part of one index; None when it holds none of the tenant's documents
        (whether or not another tenant uses the name)."""
        with self._conn() as conn, _translated("index_info"), _read(conn):
            row = conn.execute(
                "SELECT count(*), i.dimension, c.model, c.last_write FROM docs AS d"
                " JOIN indexes AS i ON i.name = d.idx AND i.tenant = d.tenant"
                " LEFT JOIN catalog AS c ON c.idx = d.idx AND c.tenant = d.tenant"
                " WHERE d.idx = ? AND d.tenant = ?",
                (index, tenant),
            ).fetchone()
        if row is None or not row[0]:
            return None
        count, dimension, model, last_write = row
        return IndexInfo(index, int(count), self.name, model, dimension, last_write)

    def document(self, index: str, tenant: str, doc_id: str) -> StoredDocument | None:
        """One of the tenant's documents as stored (no vector); None if it has no such one."""
        with self._conn() as conn, _translated("document"), _read(conn):
            row = conn.execute(
                "SELECT d.revision, d.metadata, b.title, b.text, w.version FROM docs AS d"
                " JOIN bodies AS b ON b.seq = d.seq"
                " LEFT JOIN writes AS w ON w.idx = d.idx AND w.tenant = d.tenant AND w.id = d.id"
                " WHERE d.idx = ? AND d.tenant = ? AND d.id = ?",
                (index, tenant, doc_id),
            ).fetchone()
        if row is None:
            return None
        revision, metadata, title, text, version = row
        return StoredDocument(doc_id, text, title, revision, json.loads(metadata), version)

    # --- channels ----------------------------------------------------------------

    def _bm25(self, conn: apsw.Connection, num: int, query: ChannelQuery) -> _Ranked:
        expression = match_expression(query.text)
        if expression is None or query.size <= 0:
            return _NOTHING
        where, params = _filter_sql(query.filters)
        # The hits come back as one JSON row: apsw lets go of the GIL at every step, and with
        # hundreds of searches in flight each let-go is a wait to get it back. (SQLite's JSON
        # writes a REAL with enough digits to read back the same float.)
        sql = (
            "SELECT json_group_array(json_array(seq, score, id, revision, metadata)"
            " ORDER BY score DESC, id) FROM ("
            f"SELECT d.seq, -bm25(fts_{num}) AS score, d.id, d.revision, d.metadata"
            f" FROM fts_{num} JOIN docs AS d ON d.seq = fts_{num}.rowid"
            f" WHERE fts_{num} MATCH ? AND d.idx = ? AND {where}"
            " ORDER BY score DESC, d.id LIMIT ?)"
        )
        found = conn.execute(sql, (expression, query.index, *params, query.size)).get
        rows = cast(list[tuple[int, float, str, str, str]], json.loads(cast(str, found)))
        return _Ranked([r[0] for r in rows], [r[1] for r in rows], lambda i: rows[i][2:])

    def _knn(self, conn: apsw.Connection, generation: int, query: ChannelQuery) -> _Ranked:
        if query.vector is None:
            raise BackendRequestError("the knn channel needs a query vector")
        snapshot = self._refresh(conn, query.index, query.filters.tenant, generation)
        if snapshot.block.size == 0:  # the tenant's own vectors decide, as in probe()
            if not conn.execute(
                "SELECT EXISTS(SELECT 1 FROM docs WHERE idx = ? AND tenant = ? AND has_vector)",
                (query.index, query.filters.tenant),
            ).get:
                raise ModeUnavailable(f"index {query.index!r} holds no vectors; knn is unavailable")
            return _NOTHING  # a newer snapshot's block, emptied since this one
        q = np.asarray(query.vector, dtype=np.float32).reshape(-1)
        if q.shape[0] != snapshot.dimension:
            raise BackendRequestError(
                f"query vector has dimension {q.shape[0]}, index holds {snapshot.dimension}"
            )
        norm = math.sqrt(float(np.dot(q, q)))
        if not math.isfinite(norm) or norm == 0.0 or query.size <= 0:
            return _NOTHING
        block = snapshot.block
        rows = self._passing_rows(conn, block, query)  # None: every row of the tenant passes
        n = block.size
        if rows is not None and rows.size == 0:
            return _NOTHING
        unit = q / norm
        if rows is None:  # no gather; scores[k] is row k's
            scores = _dot(block.matrix[:n], unit)
        elif rows.size * 4 > n:  # a mostly-full mask: one contiguous pass, then select
            scores = _dot(block.matrix[:n], unit)[rows]
        else:
            scores = _dot(block.matrix[rows], unit)
        if self.vector_min_similarity is not None:
            keep = np.flatnonzero(scores >= self.vector_min_similarity)
            rows, scores = (keep if rows is None else rows[keep]), scores[keep]
        if scores.size > query.size:  # top-size, keeping every tie at the boundary
            kth = np.partition(scores, scores.size - query.size)[scores.size - query.size]
            keep = np.flatnonzero(scores >= kth)
            rows, scores = (keep if rows is None else rows[keep]), scores[keep]
        elif rows is None:
            rows = np.arange(scores.size)
        # Best first, ties by id: numpy orders by score; Python re-sorts only on a tie.
        order = np.argsort(-scores, kind="stable")
        ordered, places = scores[order], rows[order]
        values: list[float] = ordered.tolist()
        if order.size > 1 and (ordered[1:] == ordered[:-1]).any():
            ids = block.ids
            pairs = sorted(
                zip(values, places.tolist(), strict=True), key=lambda p: (-p[0], ids[p[1]])
            )
            values, places = [p[0] for p in pairs], np.array([p[1] for p in pairs], np.intp)
        places = places[: query.size]
        positions: list[int] = places.tolist()
        ids, revisions, metadata = block.ids, block.revisions, block.metadata

        def about(i: int) -> _About:
            j = positions[i]
            return ids[j], revisions[j], metadata[j]

        return _Ranked(block.seqs[places].tolist(), values[: query.size], about)

    def _passing_rows(
        self, conn: apsw.Connection, block: _Block, query: ChannelQuery
    ) -> npt.NDArray[np.intp] | None:
        """Positions in the tenant's block of the rows that pass the other filters; None: all."""
        if not query.filters.fields:
            return None
        where, params = _filter_sql(query.filters)
        allowed = np.fromiter(
            (
                seq
                for (seq,) in conn.execute(
                    f"SELECT seq FROM docs AS d WHERE d.idx = ? AND has_vector AND {where}",
                    (query.index, *params),
                )
            ),
            dtype=np.int64,
        )
        return np.flatnonzero(np.isin(block.seqs[: block.size], allowed))

    def _refresh(self, conn: apsw.Connection, index: str, tenant: str, generation: int) -> _Vectors:
        """The tenant's index's vectors as of ``generation``, loading only rows added since."""
        with self._lock:
            cached = self._vectors.get((index, tenant), _Vectors())
            if cached.generation >= generation:
                return cached
            old = cached.block
            rows: npt.NDArray[np.intp] = np.arange(old.size)
            if old.size:
                alive = conn.execute(
                    "SELECT count(*) FROM docs"
                    " WHERE idx = ? AND tenant = ? AND has_vector AND seq <= ?",
                    (index, tenant, cached.max_seq),
                ).get
                if alive < old.size:
                    alive_seqs = np.fromiter(
                        (
                            s
                            for (s,) in conn.execute(
                                "SELECT seq FROM docs"
                                " WHERE idx = ? AND tenant = ? AND has_vector AND seq <= ?",
                                (index, tenant, cached.max_seq),
                            )
                        ),
                        dtype=np.int64,
                    )
                    rows = np.flatnonzero(np.isin(old.seqs, alive_seqs))
            more = cast(
                list[tuple[int, str, str, str, bytes]],
                conn.execute(
                    "SELECT d.seq, d.id, d.revision, d.metadata, v.vector"
                    " FROM docs AS d JOIN vectors AS v ON v.seq = d.seq"
                    " WHERE d.idx = ? AND d.tenant = ? AND d.has_vector AND d.seq > ?"
                    " ORDER BY d.seq",
                    (index, tenant, cached.max_seq),
                ).fetchall(),
            )
            whole = rows.size == old.size
            block = old
            if not more and rows.size == 0:
                block = _Block()  # emptied (a drop): no spare rows of the old width kept
            elif more or not whole:
                block = _Block(
                    seqs=np.concatenate([old.seqs[rows], np.array([r[0] for r in more], np.int64)]),
                    ids=_kept(old.ids, rows, whole) + [r[1] for r in more],
                    revisions=_kept(old.revisions, rows, whole) + [r[2] for r in more],
                    metadata=_kept(old.metadata, rows, whole) + [r[3] for r in more],
                    matrix=_grow(old.matrix, old.size, rows, [r[4] for r in more]),
                )
                logger.debug(
                    "index %s of %s: %d vectors (+%d, -%d)",
                    index,
                    tenant,
                    block.size,
                    len(more),
                    old.size - rows.size,
                )
            fresh = _Vectors(
                generation=generation,
                max_seq=max(cached.max_seq, more[-1][0] if more else 0),
                block=block,
            )
            self._vectors[(index, tenant)] = fresh
            return fresh


# --- helpers -------------------------------------------------------------------------


#: Above this many multiply-adds a kNN scan goes to BLAS ``@``, below to ``np.vecdot``.
BLAS_MIN_PRODUCT = 1 << 24  # about 44k rows at 384 dimensions: some 4 ms on one core


def _dot(matrix: npt.NDArray[np.float32], unit: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
    """The scores ``matrix @ unit``: single-threaded for small scans, BLAS threads for large.

    BLAS spreads one product over its threads, which in a busy worker wait a scheduler
    tick to wake: 8 ms measured for 5k rows, against 0.3 ms on one core (and a worker
    runs searches in parallel anyway). Past ``BLAS_MIN_PRODUCT`` that wake-up is small
    against the scan, and the threads halve it on an idle pair of cores.

    The one-core scan is ``np.vecdot``: a BLAS dot per row, each far below the size at
    which BLAS starts threads. On SciFact's 5k rows it measured about 20% faster than
    ``einsum`` (and than ``@`` held to one thread by threadpoolctl).
    """
    if matrix.shape[0] * matrix.shape[1] >= BLAS_MIN_PRODUCT:
        scores: npt.NDArray[Any] = matrix @ unit
    else:
        scores = np.vecdot(matrix, unit)
    return scores


def _kept(values: list[str], rows: npt.NDArray[np.intp], whole: bool) -> list[str]:
    """The values at ``rows`` (a copy of all of them when ``whole``)."""
    return list(values) if whole else [values[k] for k in rows.tolist()]


def _grow(
    matrix: npt.NDArray[np.float32], size: int, kept: npt.NDArray[np.intp], blobs: list[bytes]
) -> npt.NDArray[np.float32]:
    """Append vectors after the kept rows, reusing spare capacity (1.5x growth, from 16 rows:
    one block per tenant's index, so many small tenants stay small).

    Rows already visible to other readers are never written: appends go past ``size``,
    and a deletion or a full buffer builds a new matrix.
    """
    dim = len(blobs[0]) // 4 if blobs else matrix.shape[1]
    added = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), dim)
    total = kept.size + len(blobs)
    if kept.size == size and matrix.shape[0] >= total and matrix.shape[1] == dim:
        out = matrix  # append in place, past every reader's row count
    else:
        out = np.empty((max(total + total // 2, 16), dim), dtype=np.float32)
        if kept.size:
            out[: kept.size] = matrix[:size] if kept.size == size else matrix[kept]
    out[kept.size : total] = added
    return out


def _check_vectors(
    documents: Sequence[Document],
    vectors: Sequence[Sequence[float]] | npt.NDArray[np.floating[Any]] | None,
) -> npt.NDArray[np.float32] | None:
    """The vectors as unit-length float32 rows, or InvalidRequest naming what is wrong."""
    if vectors is None:
        return None
    try:
        matrix = np.asarray(vectors, dtype=np.float32)
    except ValueError as exc:
        raise InvalidRequest("vectors", f"not a matrix of numbers ({exc})") from exc
    if matrix.ndim != 2 or matrix.shape[0] != len(documents) or matrix.shape[1] == 0:
        raise InvalidRequest(
            "vectors", f"expected {len(documents)} vectors of one dimension, got {matrix.shape}"
        )
    norms = np.linalg.norm(matrix, axis=1)
    bad = np.flatnonzero(~np.isfinite(norms) | (norms == 0.0))
    if bad.size:
        raise InvalidRequest(f"vectors[{bad[0]}]", "zero or non-finite vector")
    return np.ascontiguousarray(matrix / norms[:, None], dtype=np.float32)


def _document(title: str, text: str, about: _About) -> Document:
    doc_id, revision, metadata = about
    return Document(doc_id, text, title, revision, json.loads(metadata) if metadata != "{}" else {})


def _document_row(i: int, doc: Document) -> tuple[str, str, str, str, str]:
    if not doc.id:
        raise InvalidRequest(f"documents[{i}].id", "empty id")
    for key, value in doc.metadata.items():
        if not _FILTER_KEY.match(key) or not isinstance(value, str | int | float | bool):
            raise InvalidRequest(f"documents[{i}].metadata", f"bad key or value for {key!r}")
    revision = doc.revision or derive_revision(doc.title, doc.text, doc.metadata)
    metadata = json.dumps(dict(doc.metadata), sort_keys=True, ensure_ascii=False)
    return doc.id, doc.title, doc.text, revision, metadata


_BODY_BATCH = 1024  # seqs per statement, far below SQLite's limit on bound parameters


def _bodies(conn: apsw.Connection, seqs: Collection[int]) -> Iterator[tuple[int, str, str]]:
    """(seq, title, text) of the given seqs, in one statement per 1,024 seqs.

    Each list is padded (with its last seq) to a power of two, so a few statement texts
    serve every size from apsw's statement cache instead of one parse per new length.
    """
    ordered = sorted(seqs)
    for at in range(0, len(ordered), _BODY_BATCH):
        batch = ordered[at : at + _BODY_BATCH]
        padded = 1 << (len(batch) - 1).bit_length()
        batch += [batch[-1]] * (padded - len(batch))
        yield from conn.execute(
            f"SELECT seq, title, text FROM bodies WHERE seq IN ({','.join('?' * padded)})", batch
        )


def _filter_sql(filters: HardFilters) -> tuple[str, list[FilterValue]]:
    """The WHERE clause (over ``docs AS d``) for the tenant and the metadata equalities."""
    clauses: list[str] = ["d.tenant = ?"]
    params: list[FilterValue] = [filters.tenant]
    for key, value in sorted(filters.fields.items()):
        if not _FILTER_KEY.match(key):
            raise InvalidRequest(f"filters.{key}", "filter names use letters, digits and _.:-")
        clauses.append(f"json_extract(d.metadata, '$.\"{key}\"') = ?")
        params.append(value)
    return " AND ".join(clauses), params


def _index_row(
    conn: apsw.Connection, index: str, tenant: str
) -> tuple[int, int | None, int] | None:
    row = conn.execute(
        "SELECT num, dimension, generation FROM indexes WHERE name = ? AND tenant = ?",
        (index, tenant),
    ).fetchone()
    return None if row is None else (int(row[0]), row[1], int(row[2]))


def _searched_index(conn: apsw.Connection, index: str, tenant: str) -> tuple[int, int] | None:
    """The number and generation of the tenant's index, if it holds one of the tenant's
    documents: one statement, a seek on each table's key. None otherwise (its FTS5 table
    may be gone: :func:`_settle_emptied`)."""
    row = conn.execute(
        "SELECT num, generation FROM indexes WHERE name = ?1 AND tenant = ?2"
        " AND EXISTS(SELECT 1 FROM docs WHERE idx = ?1 AND tenant = ?2)",
        (index, tenant),
    ).fetchone()
    return None if row is None else (int(row[0]), int(row[1]))


def _holds(conn: apsw.Connection, index: str, tenant: str) -> bool:
    """Whether the tenant holds a document in the index (one seek on its unique key)."""
    return bool(
        conn.execute(
            "SELECT EXISTS(SELECT 1 FROM docs WHERE idx = ? AND tenant = ?)", (index, tenant)
        ).get
    )


def _settle_emptied(conn: apsw.Connection, num: int, index: str, tenant: str) -> None:
    """After a delete or a drop: what goes with the last of the tenant's documents.

    A tenant's index exists while it holds one of the tenant's documents, however the last
    one went (a drop, or deletes by id). So with the last document go its FTS5 table (five
    schema rows each connection parses and holds; the next write makes it again,
    :func:`_ensure_index`) and its recorded embedding model (a versioned drop keeps the
    documents written after it, and their model with them), and with the last vector its
    claimed dimension: a new model may embed in another. Its ``indexes`` row stays, so its
    generation keeps counting for the vector caches of other processes.
    """
    if _holds(conn, index, tenant):
        conn.execute(
            "UPDATE indexes SET dimension = NULL WHERE num = ?1 AND NOT EXISTS("
            "SELECT 1 FROM docs WHERE idx = ?2 AND tenant = ?3 AND has_vector)",
            (num, index, tenant),
        )
        return
    conn.execute(f"DROP TABLE IF EXISTS fts_{num}")
    conn.execute("UPDATE catalog SET model = NULL WHERE idx = ? AND tenant = ?", (index, tenant))
    conn.execute("UPDATE indexes SET dimension = NULL WHERE num = ?", (num,))


def _remove_row(conn: apsw.Connection, fts: str, seq: int) -> None:
    for table in ("docs", "bodies", "vectors"):
        conn.execute(f"DELETE FROM {table} WHERE seq = ?", (seq,))
    conn.execute(f"DELETE FROM {fts} WHERE rowid = ?", (seq,))


def _floor(conn: apsw.Connection, index: str, tenant: str) -> int:
    """The version of the tenant's last drop of the index (0: never dropped)."""
    found = conn.execute(
        "SELECT floor FROM catalog WHERE idx = ? AND tenant = ?", (index, tenant)
    ).fetchone()
    return int(found[0]) if found else 0


def _held_version(conn: apsw.Connection, index: str, tenant: str, doc_id: str) -> int | None:
    found = conn.execute(
        "SELECT version FROM writes WHERE idx = ? AND tenant = ? AND id = ?",
        (index, tenant, doc_id),
    ).fetchone()
    return int(found[0]) if found else None


def _set_version(
    conn: apsw.Connection,
    index: str,
    tenant: str,
    doc_id: str,
    version: int | None,
    held: int | None,
    *,
    deleted: bool,
) -> None:
    """Record the id's last write (an unversioned one keeps the version it had)."""
    conn.execute(
        "INSERT OR REPLACE INTO writes VALUES (?, ?, ?, ?, ?)",
        (index, tenant, doc_id, version if version is not None else held or 0, deleted),
    )


def _touch(conn: apsw.Connection, index: str, tenant: str, model: str | None) -> None:
    """The tenant's index was written now (with ``model``'s vectors, if given). The first
    model recorded stays (:func:`_check_model` refuses another) until a drop clears it."""
    conn.execute(
        "INSERT INTO catalog(idx, tenant, model, last_write) VALUES (?, ?, ?, ?)"
        " ON CONFLICT(idx, tenant) DO UPDATE SET"
        " model = coalesce(model, excluded.model), last_write = excluded.last_write",
        (index, tenant, model, time.time()),
    )


def _check_model(conn: apsw.Connection, index: str, tenant: str, model: str) -> None:
    """Raise EmbeddingModelMismatch if the tenant's index records another embedding model."""
    held = conn.execute(
        "SELECT model FROM catalog WHERE idx = ? AND tenant = ?", (index, tenant)
    ).fetchone()
    if held is not None and held[0] is not None and held[0] != model:
        raise EmbeddingModelMismatch(index, str(held[0]), model)


def _ensure_index(conn: apsw.Connection, index: str, tenant: str) -> int:
    """The number of the tenant's index (its FTS5 table ``fts_{num}``), created if new."""
    conn.execute("INSERT OR IGNORE INTO indexes(name, tenant) VALUES (?, ?)", (index, tenant))
    num = int(
        conn.execute("SELECT num FROM indexes WHERE name = ? AND tenant = ?", (index, tenant)).get
    )
    conn.execute(
        f"CREATE VIRTUAL TABLE IF NOT EXISTS fts_{num} USING fts5("
        f"title, text, content='', contentless_delete=1, tokenize='{FTS_TOKENIZER}')"
    )
    return num


def _claim_dimension(conn: apsw.Connection, num: int, index: str, dimension: int) -> None:
    """The tenant's index (``num``) takes the dimension of its first vectors and keeps it."""
    held = conn.execute("SELECT dimension FROM indexes WHERE num = ?", (num,)).get
    if held is None:
        conn.execute("UPDATE indexes SET dimension = ? WHERE num = ?", (dimension, num))
    elif held != dimension:
        raise InvalidRequest("vectors", f"dimension {dimension}, but index {index!r} holds {held}")


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

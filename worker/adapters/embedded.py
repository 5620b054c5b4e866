"""The embedded search backend: BM25 and exact kNN over one SQLite file per data dir.

Why this shape (DESIGN.md §6, §10):

* **One SQLite database (through ``apsw``) holds everything**: a narrow ``docs``
  row per document (index, tenant, id, revision, metadata: what filters read),
  its title and text in ``bodies``, its vector as a float32 blob in ``vectors``,
  all keyed by the row's ``seq``, and an FTS5 table per index for BM25. An upsert
  by id therefore replaces the text, the BM25 postings and the vector in one
  transaction: atomic and durable. WAL mode and a busy timeout let several worker
  processes read and write the same directory. ``apsw`` is used because it ships a
  current SQLite with FTS5; the stdlib module here cannot load extensions.
* **BM25 is FTS5's own ``bm25()``** over title and text, tokenizer ``porter
  unicode61 remove_diacritics 2``. The MATCH expression is built here from the
  query's word tokens, English stopwords removed, each term quoted and OR-ed, so no
  user text is ever parsed as FTS5 syntax. Statistics are per index (one FTS table
  each), as in an Elasticsearch index.
* **kNN is exact cosine with numpy**: a dot product of unit vectors over an
  in-memory float32 matrix loaded from SQLite. Rows get a monotonic ``seq``
  (AUTOINCREMENT; a replaced document gets a new one) and each index a
  ``generation`` bumped by every write, so a query checks one integer inside its
  read transaction and loads only what changed. At 50-100k vectors a full scan
  takes a few milliseconds, so no approximate index is needed (and none is
  hand-written).
* **Hard filters run inside each channel, before the window**: tenant and metadata
  equality are SQL ``WHERE`` clauses of the BM25 query, and the kNN scan covers
  only the rows that pass them. Another tenant's documents can never take a slot.

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import apsw
import numpy as np
import numpy.typing as npt

from worker.contract import Channel, FilterValue
from worker.core.types import ChannelHit, ChannelQuery, ChannelResults, Document, HardFilters
from worker.errors import (
    BackendRequestError,
    BackendUnavailable,
    ConfigError,
    InvalidRequest,
    ModeUnavailable,
)

logger = logging.getLogger(__name__)

DB_FILE = "sift.db"
BUSY_TIMEOUT_MS = 10_000
CACHE_KIB = 32 * 1024  # page cache per connection
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

SCHEMA_VERSION = 1  # bump on any change to _SCHEMA; an older data dir is refused, never misread


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
    name TEXT NOT NULL UNIQUE,
    dimension INTEGER,
    generation INTEGER NOT NULL DEFAULT 0
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
CREATE INDEX IF NOT EXISTS docs_vectors ON docs(idx, seq) WHERE has_vector;
CREATE TABLE IF NOT EXISTS bodies(seq INTEGER PRIMARY KEY, title TEXT NOT NULL, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS vectors(seq INTEGER PRIMARY KEY, vector BLOB NOT NULL);
"""


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
class _Vectors:
    """One index's vectors in memory, rows in ``seq`` order; ``matrix`` may have spare rows."""

    generation: int = -1
    max_seq: int = 0
    seqs: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    tenants: npt.NDArray[np.int32] = field(default_factory=lambda: np.zeros(0, np.int32))
    ids: list[str] = field(default_factory=list)
    matrix: npt.NDArray[np.float32] = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    tenant_codes: dict[str, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.seqs.shape[0])


class EmbeddedBackend:
    """The :class:`~worker.core.ports.SearchBackend` port on SQLite FTS5 and numpy.

    Safe to share between threads (each thread gets its own connection) and between
    processes on one machine (WAL and a busy timeout). Opens nothing until first use.
    """

    name = "embedded"

    def __init__(self, data_dir: Path, vector_min_similarity: float | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.vector_min_similarity = vector_min_similarity
        self._local = threading.local()
        self._lock = threading.Lock()
        self._vectors: dict[str, _Vectors] = {}
        self._connections: list[apsw.Connection] = []
        self._inherited: list[apsw.Connection] = []  # kept referenced, so never closed here
        self._pid = os.getpid()
        self._schema_ready = False

    # --- connections -------------------------------------------------------------

    def _conn(self) -> apsw.Connection:
        if os.getpid() != self._pid:  # forked: never use (nor close) the parent's connections
            with self._lock:
                self._inherited += self._connections
                self._pid, self._connections, self._vectors = os.getpid(), [], {}
                self._local = threading.local()
        conn: apsw.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        with _translated("open"):
            self.data_dir.mkdir(parents=True, exist_ok=True)
            conn = apsw.Connection(str(self.data_dir / DB_FILE))
            conn.set_busy_timeout(BUSY_TIMEOUT_MS)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            conn.execute(f"PRAGMA mmap_size={MMAP_BYTES}")
            if not self._schema_ready:
                with _write(conn):
                    _check_schema_version(conn, self.data_dir)
                    conn.execute(_SCHEMA)
                    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                self._schema_ready = True
        self._local.conn = conn
        with self._lock:
            self._connections.append(conn)
        return conn

    def close(self) -> None:
        """Close every connection this backend opened; it reopens on next use."""
        with self._lock:
            connections, self._connections = self._connections, []
            self._local = threading.local()
            self._vectors = {}
        for conn in connections:
            conn.close()

    # --- the port ----------------------------------------------------------------

    def channels(self, index: str) -> frozenset[Channel]:
        """``bm25``, plus ``knn`` once the index holds a vector; empty for an unknown index."""
        conn = self._conn()
        with _translated("channels"), _read(conn):
            row = _index_row(conn, index)
            if row is None:
                return frozenset()
            has_vectors = conn.execute(
                "SELECT EXISTS(SELECT 1 FROM docs WHERE idx = ? AND has_vector)", (index,)
            ).get
        return frozenset({"bm25", "knn"}) if has_vectors else frozenset({"bm25"})

    def retrieve(self, query: ChannelQuery) -> ChannelResults:
        """Each asked channel's hits, best first, hard filters applied inside the query."""
        conn = self._conn()
        hits: dict[Channel, list[ChannelHit]] = {}
        seconds: dict[str, float] = {}
        with _translated("retrieve"), _deadline(conn, query.timeout_seconds), _read(conn):
            row = _index_row(conn, query.index)
            if row is None:
                raise BackendRequestError(f"index {query.index!r} does not exist")
            num, _dimension, generation = row
            for channel in dict.fromkeys(query.channels):
                started = time.perf_counter()
                if channel == "bm25":
                    hits[channel] = self._bm25(conn, num, query)
                elif channel == "knn":
                    hits[channel] = self._knn(conn, generation, query)
                else:
                    raise BackendRequestError(f"unknown channel {channel!r}")
                seconds[channel] = time.perf_counter() - started
        return ChannelResults(hits=hits, seconds=seconds)

    def upsert(
        self,
        index: str,
        tenant: str,
        documents: Sequence[Document],
        vectors: Sequence[Sequence[float]] | npt.NDArray[np.floating[Any]] | None,
    ) -> int:
        """Insert or replace by (index, tenant, id): text, BM25 row and vector in one commit.

        A document whose ``revision`` is empty gets :func:`derive_revision`.
        """
        if not documents:
            return 0
        matrix = _check_vectors(documents, vectors)
        rows = [_document_row(i, doc) for i, doc in enumerate(documents)]
        conn = self._conn()
        with _translated("upsert"), _write(conn):
            num = _ensure_index(conn, index)
            if matrix is not None:
                _claim_dimension(conn, index, matrix.shape[1])
            fts = f"fts_{num}"
            for i, (doc_id, title, text, revision, metadata) in enumerate(rows):
                old = conn.execute(
                    "SELECT seq FROM docs WHERE idx = ? AND tenant = ? AND id = ?",
                    (index, tenant, doc_id),
                ).get
                if old is not None:
                    for table in ("docs", "bodies", "vectors"):
                        conn.execute(f"DELETE FROM {table} WHERE seq = ?", (old,))
                    conn.execute(f"DELETE FROM {fts} WHERE rowid = ?", (old,))
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
            conn.execute("UPDATE indexes SET generation = generation + 1 WHERE num = ?", (num,))
        return len(rows)

    # --- housekeeping ------------------------------------------------------------

    def count(self, index: str, tenant: str) -> int:
        """How many documents the tenant holds in the index."""
        conn = self._conn()
        with _translated("count"):
            found = conn.execute(
                "SELECT count(*) FROM docs WHERE idx = ? AND tenant = ?", (index, tenant)
            ).get
        return int(found)

    def delete_index(self, index: str, tenant: str) -> int:
        """Delete all of the tenant's documents in the index; answers how many went."""
        conn = self._conn()
        with _translated("delete_index"), _write(conn):
            row = _index_row(conn, index)
            if row is None:
                return 0
            seqs = [
                seq
                for (seq,) in conn.execute(
                    "SELECT seq FROM docs WHERE idx = ? AND tenant = ?", (index, tenant)
                )
            ]
            for seq in seqs:
                for table in ("docs", "bodies", "vectors"):
                    conn.execute(f"DELETE FROM {table} WHERE seq = ?", (seq,))
                conn.execute(f"DELETE FROM fts_{row[0]} WHERE rowid = ?", (seq,))
            conn.execute("UPDATE indexes SET generation = generation + 1 WHERE num = ?", (row[0],))
        return len(seqs)

    # --- channels ----------------------------------------------------------------

    def _bm25(self, conn: apsw.Connection, num: int, query: ChannelQuery) -> list[ChannelHit]:
        expression = match_expression(query.text)
        if expression is None or query.size <= 0:
            return []
        where, params = _filter_sql(query.filters)
        sql = (
            f"SELECT d.seq, bm25(fts_{num}) AS score"
            f" FROM fts_{num} JOIN docs AS d ON d.seq = fts_{num}.rowid"
            f" WHERE fts_{num} MATCH ? AND d.idx = ? AND {where}"
            " ORDER BY score, d.id LIMIT ?"
        )
        ranked = cast(
            list[tuple[int, float]],
            conn.execute(sql, (expression, query.index, *params, query.size)).fetchall(),
        )
        documents = _documents_by_seq(conn, [seq for seq, _ in ranked])
        return [ChannelHit(documents[seq], -float(score)) for seq, score in ranked]

    def _knn(self, conn: apsw.Connection, generation: int, query: ChannelQuery) -> list[ChannelHit]:
        if query.vector is None:
            raise BackendRequestError("the knn channel needs a query vector")
        snapshot = self._refresh(conn, query.index, generation)
        if snapshot.size == 0:
            raise ModeUnavailable(f"index {query.index!r} holds no vectors; knn is unavailable")
        q = np.asarray(query.vector, dtype=np.float32).reshape(-1)
        if q.shape[0] != snapshot.matrix.shape[1]:
            raise BackendRequestError(
                f"query vector has dimension {q.shape[0]}, index holds {snapshot.matrix.shape[1]}"
            )
        norm = float(np.linalg.norm(q))
        if not math.isfinite(norm) or norm == 0.0 or query.size <= 0:
            return []
        rows = self._passing_rows(conn, snapshot, query)
        n = snapshot.size
        if rows.size == 0:
            return []
        # einsum, not ``@``: BLAS would spread one small product over threads that, in a
        # busy worker, wait a scheduler tick to wake (8 ms measured for 5k rows, against
        # 0.3 ms single-threaded). A worker runs searches in parallel instead.
        if rows.size == n:  # every row passes: no gather
            scores = np.einsum("ij,j->i", snapshot.matrix[:n], q / norm)
        elif rows.size * 4 > n:  # a mostly-full mask: one contiguous pass, then select
            scores = np.einsum("ij,j->i", snapshot.matrix[:n], q / norm)[rows]
        else:
            scores = np.einsum("ij,j->i", snapshot.matrix[rows], q / norm)
        if self.vector_min_similarity is not None:
            keep = scores >= self.vector_min_similarity
            rows, scores = rows[keep], scores[keep]
        if rows.size > query.size:  # top-size, keeping every tie at the boundary
            kth = np.partition(scores, rows.size - query.size)[rows.size - query.size]
            keep = scores >= kth
            rows, scores = rows[keep], scores[keep]
        values, positions = scores.tolist(), rows.tolist()
        order = sorted(range(len(values)), key=lambda j: (-values[j], snapshot.ids[positions[j]]))
        order = order[: query.size]
        seqs = [int(snapshot.seqs[rows[j]]) for j in order]
        documents = _documents_by_seq(conn, seqs)
        return [
            ChannelHit(documents[seq], float(scores[j]))
            for seq, j in zip(seqs, order, strict=True)
            if seq in documents  # a row a newer cache holds but this snapshot lacks
        ]

    def _passing_rows(
        self, conn: apsw.Connection, snapshot: _Vectors, query: ChannelQuery
    ) -> npt.NDArray[np.intp]:
        """Positions in the matrix of the rows that pass the hard filters."""
        code = snapshot.tenant_codes.get(query.filters.tenant)
        if code is None:
            return np.zeros(0, np.intp)
        mask = snapshot.tenants == code
        if query.filters.fields:
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
            mask &= np.isin(snapshot.seqs, allowed)
        return np.flatnonzero(mask)

    def _refresh(self, conn: apsw.Connection, index: str, generation: int) -> _Vectors:
        """The index's vectors as of ``generation``, loading only rows added since last time."""
        with self._lock:
            cached = self._vectors.get(index, _Vectors())
            if cached.generation >= generation:
                return cached
            kept = np.arange(cached.size)
            if cached.size:
                alive = conn.execute(
                    "SELECT count(*) FROM docs WHERE idx = ? AND has_vector AND seq <= ?",
                    (index, cached.max_seq),
                ).get
                if alive < cached.size:
                    alive_seqs = np.fromiter(
                        (
                            s
                            for (s,) in conn.execute(
                                "SELECT seq FROM docs WHERE idx = ? AND has_vector AND seq <= ?",
                                (index, cached.max_seq),
                            )
                        ),
                        dtype=np.int64,
                    )
                    kept = np.flatnonzero(np.isin(cached.seqs, alive_seqs))
            new = cast(
                list[tuple[int, str, str, bytes]],
                conn.execute(
                    "SELECT d.seq, d.tenant, d.id, v.vector FROM docs AS d"
                    " JOIN vectors AS v ON v.seq = d.seq"
                    " WHERE d.idx = ? AND d.has_vector AND d.seq > ? ORDER BY d.seq",
                    (index, cached.max_seq),
                ).fetchall(),
            )
            fresh = _Vectors(generation=generation, tenant_codes=dict(cached.tenant_codes))
            for _seq, tenant, _id, _vec in new:
                fresh.tenant_codes.setdefault(tenant, len(fresh.tenant_codes))
            added_seqs = np.array([r[0] for r in new], dtype=np.int64)
            fresh.seqs = np.concatenate([cached.seqs[kept], added_seqs])
            fresh.max_seq = int(fresh.seqs[-1]) if fresh.size else cached.max_seq
            fresh.tenants = np.concatenate(
                [
                    cached.tenants[kept],
                    np.array([fresh.tenant_codes[r[1]] for r in new], dtype=np.int32),
                ]
            )
            fresh.ids = [cached.ids[k] for k in kept] + [r[2] for r in new]
            fresh.matrix = _grow(cached.matrix, cached.size, kept, [r[3] for r in new])
            self._vectors[index] = fresh
            if new or kept.size < cached.size:
                logger.debug(
                    "index %s: %d vectors (+%d, -%d)",
                    index,
                    fresh.size,
                    len(new),
                    cached.size - kept.size,
                )
            return fresh


# --- helpers -------------------------------------------------------------------------


def _grow(
    matrix: npt.NDArray[np.float32], size: int, kept: npt.NDArray[np.intp], blobs: list[bytes]
) -> npt.NDArray[np.float32]:
    """Append vectors after the kept rows, reusing spare capacity (1.5x growth).

    Rows already visible to other readers are never written: appends go past ``size``,
    and a deletion or a full buffer builds a new matrix.
    """
    dim = len(blobs[0]) // 4 if blobs else matrix.shape[1]
    added = np.frombuffer(b"".join(blobs), dtype=np.float32).reshape(len(blobs), dim)
    total = kept.size + len(blobs)
    if kept.size == size and matrix.shape[0] >= total and matrix.shape[1] == dim:
        out = matrix  # append in place, past every reader's row count
    else:
        out = np.empty((max(total + total // 2, 1024), dim), dtype=np.float32)
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


def _document_row(i: int, doc: Document) -> tuple[str, str, str, str, str]:
    if not doc.id:
        raise InvalidRequest(f"documents[{i}].id", "empty id")
    for key, value in doc.metadata.items():
        if not _FILTER_KEY.match(key) or not isinstance(value, str | int | float | bool):
            raise InvalidRequest(f"documents[{i}].metadata", f"bad key or value for {key!r}")
    revision = doc.revision or derive_revision(doc.title, doc.text, doc.metadata)
    metadata = json.dumps(dict(doc.metadata), sort_keys=True, ensure_ascii=False)
    return doc.id, doc.title, doc.text, revision, metadata


def _document(doc_id: str, title: str, text: str, revision: str, metadata: str) -> Document:
    return Document(
        id=doc_id,
        text=text,
        title=title,
        revision=revision,
        metadata=json.loads(metadata) if metadata != "{}" else {},
    )


def _documents_by_seq(conn: apsw.Connection, seqs: list[int]) -> dict[int, Document]:
    if not seqs:
        return {}
    marks = ",".join("?" * len(seqs))
    rows = conn.execute(
        "SELECT d.seq, d.id, b.title, b.text, d.revision, d.metadata"
        f" FROM docs AS d JOIN bodies AS b ON b.seq = d.seq WHERE d.seq IN ({marks})",
        seqs,
    )
    return {row[0]: _document(*row[1:]) for row in rows}


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


def _index_row(conn: apsw.Connection, index: str) -> tuple[int, int | None, int] | None:
    row = conn.execute(
        "SELECT num, dimension, generation FROM indexes WHERE name = ?", (index,)
    ).fetchone()
    return None if row is None else (int(row[0]), row[1], int(row[2]))


def _ensure_index(conn: apsw.Connection, index: str) -> int:
    conn.execute("INSERT OR IGNORE INTO indexes(name) VALUES (?)", (index,))
    num = int(conn.execute("SELECT num FROM indexes WHERE name = ?", (index,)).get)
    conn.execute(
        f"CREATE VIRTUAL TABLE IF NOT EXISTS fts_{num} USING fts5("
        f"title, text, content='', contentless_delete=1, tokenize='{FTS_TOKENIZER}')"
    )
    return num


def _claim_dimension(conn: apsw.Connection, index: str, dimension: int) -> None:
    held = conn.execute("SELECT dimension FROM indexes WHERE name = ?", (index,)).get
    if held is None:
        conn.execute("UPDATE indexes SET dimension = ? WHERE name = ?", (dimension, index))
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

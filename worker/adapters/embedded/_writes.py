"""The embedded backend's writes: upserts, deletes by id and drops, each one transaction
holding the text, the BM25 row and the vector together, ordered by write versions
(tombstones per id, a floor per drop) and one embedding model per tenant's index.

A tombstone is kept while an ingest accepted before its delete can still run (the broker's
redelivery window, ``tombstone_seconds``), then goes with a later write: each write's
transaction lets go of the tombstones past it (:func:`_expire_tombstones`), so they cost
what the deletes of one window wrote, not every delete ever made."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import apsw
import numpy as np
import numpy.typing as npt

from worker.constants import RESULT_TTL_SECONDS
from worker.core.types import Document, derive_revision
from worker.errors import EmbeddingModelMismatch, IndexLimitReached, InvalidRequest

from ._pool import _erasing, _Pool, _read, _translated, _write
from ._schema import (
    _FILTER_KEY,
    _claim_dimension,
    _EarlierTable,
    _ensure_index,
    _holds,
    _index_row,
    _make_erasable,
    _remake_step,
    _settle_emptied,
    make_earlier_fts,
)
from ._sizes import _keep_size, _size_before, _stored_bytes, _Totals

_T = TypeVar("_T")

#: The pause after each step of a remake (:meth:`_Writes._remake_fts`): longer than the
#: longest sleep of SQLite's busy handler between two tries at the lock (100 ms), so every
#: write waiting meanwhile takes the lock before the next step does.
REMAKE_PAUSE_SECONDS = 0.2


class _Writes(_Pool):
    """The :class:`~worker.core.ports.SearchBackend` writes and the catalog's deletes."""

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
        drop); answers how many were written. The same write run again (a retry, a
        redelivery after a crash between its commit and its job's finish) changes nothing
        and answers what its first run wrote (:func:`_outcome`). One that writes no row
        makes nothing: no FTS5 table, no last write (:func:`_touch`), no new generation.

        ``model`` (the embedder of ``vectors``) is recorded by the first write of the tenant's
        index; a write of another model's vectors raises :class:`EmbeddingModelMismatch` in
        the same transaction, before any row is written, until a drop clears the record.
        """
        if not documents:
            return 0
        matrix = _check_vectors(documents, vectors)
        rows = [_document_row(i, doc) for i, doc in enumerate(documents)]
        return self._on_erasing_fts(
            index, tenant, lambda: self._upsert(index, tenant, rows, matrix, version, model)
        )

    def _upsert(
        self,
        index: str,
        tenant: str,
        rows: list[tuple[str, str, str, str, str]],
        matrix: npt.NDArray[np.float32] | None,
        version: int | None,
        model: str | None,
    ) -> int:
        written = 0
        num: int | None = None  # the tenant's index, made by the first row written
        totals = _Totals(0, 0)  # its documents and bytes, counted before the first
        with self._conn() as conn, _translated("upsert"), _write(conn):
            if (done := _outcome(conn, index, tenant, version)) is not None:
                return done
            floor = _floor(conn, index, tenant)
            for i, (doc_id, title, text, revision, metadata) in enumerate(rows):
                held = _held_version(conn, index, tenant, doc_id)
                if version is not None and version <= max(floor, held or 0):
                    continue  # a newer write (or drop) of this id was accepted after this one
                if num is None:  # before the first row written only: a stale write (every
                    # row skipped) makes no FTS5 table a drop let go, claims nothing, and
                    # another model's vectors are a model mismatch before a dimension one
                    _check_limit(conn, index, tenant, self.max_indexes_per_tenant)
                    num = _ensure_index(conn, index, tenant)
                    if matrix is not None and model is not None:
                        _check_model(conn, index, tenant, model)
                    if matrix is not None:
                        _claim_dimension(conn, num, index, matrix.shape[1])
                    totals = _size_before(conn, num, index, tenant)
                fts = f"fts_{num}"
                old = conn.execute(
                    "SELECT seq FROM docs WHERE idx = ? AND tenant = ? AND id = ?",
                    (index, tenant, doc_id),
                ).get
                if old is not None:
                    totals.remove(_remove_row(conn, fts, old))
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
                _set_version(conn, index, tenant, doc_id, _recorded(version, held), deleted=LIVE)
                totals.add(_stored_bytes(title, text, metadata))
                written += 1
            if num is not None:  # a write that wrote nothing is no last write (as a delete's)
                _touch(conn, index, tenant, model if matrix is not None else None)
                conn.execute("UPDATE indexes SET generation = generation + 1 WHERE num = ?", (num,))
                _keep_size(conn, num, totals)
            _record_outcome(conn, index, tenant, version, written)
            _expire_tombstones(conn, time.time() - self.tombstone_seconds)
        return written

    def delete_documents(
        self, index: str, tenant: str, ids: Sequence[str], *, version: int | None = None
    ) -> int:
        """Delete the tenant's documents by id, both channels in one commit; answers how many
        existed. With a ``version``, each id gets a tombstone of that version, so an upsert
        accepted before the delete and run after it is skipped, and an id whose last write
        is newer than the delete is left alone. The same delete run again (a redelivery, a
        retry) changes nothing and reports what its first run deleted, as an upsert run again
        does. A tombstone lasts ``tombstone_seconds`` (:func:`_expire_tombstones`)."""
        return self._on_erasing_fts(
            index, tenant, lambda: self._delete_documents(index, tenant, ids, version)
        )

    def _delete_documents(
        self, index: str, tenant: str, ids: Sequence[str], version: int | None
    ) -> int:
        deleted, emptied = 0, False
        with self._conn() as conn, _translated("delete"), _erasing(conn), _write(conn):
            if (done := _outcome(conn, index, tenant, version)) is not None:
                return done
            row = _index_row(conn, index, tenant)
            totals = _Totals(0, 0)
            if row is not None:
                _make_erasable(conn, row[0])
                totals = _size_before(conn, row[0], index, tenant)
            floor = _floor(conn, index, tenant)
            for doc_id in dict.fromkeys(i for i in ids if i):
                held = _held_version(conn, index, tenant, doc_id)
                if version is not None and version <= max(floor, held or 0):
                    continue  # a newer write of this id (or a drop) was accepted after this
                old = conn.execute(
                    "SELECT seq FROM docs WHERE idx = ? AND tenant = ? AND id = ?",
                    (index, tenant, doc_id),
                ).get
                if old is not None and row is not None:
                    totals.remove(_remove_row(conn, f"fts_{row[0]}", old))
                    deleted += 1
                recorded = _recorded(version, held)
                _set_version(conn, index, tenant, doc_id, recorded, deleted=TOMBSTONE)
                _date_tombstone(conn, index, tenant, doc_id, recorded)
            if deleted:
                _touch(conn, index, tenant, None)
            if row is not None:
                conn.execute(
                    "UPDATE indexes SET generation = generation + 1 WHERE num = ?", (row[0],)
                )
                _keep_size(conn, row[0], totals)
                if deleted:
                    emptied = _settle_emptied(conn, row[0], index, tenant)
            _record_outcome(conn, index, tenant, version, deleted, emptied=emptied)
            _expire_tombstones(conn, time.time() - self.tombstone_seconds)
        return deleted

    def _on_erasing_fts(self, index: str, tenant: str, write: Callable[[], _T]) -> _T:
        """Run ``write`` (one transaction). One that finds the tenant's index's FTS5 table an
        earlier release's has rolled back: the table is made again (:meth:`_remake_fts`) and
        the write runs again, on this release's table."""
        while True:
            try:
                return write()
            except _EarlierTable as earlier:
                self._remake_fts(earlier.num, index, tenant)

    def _remake_fts(self, num: int, index: str, tenant: str) -> None:
        """Make an earlier release's FTS5 table of the tenant's index again, step after step
        (:func:`_remake_step`), each a transaction of its own followed by a pause
        (:data:`REMAKE_PAUSE_SECONDS`) in which the writes waiting on the lock go first. The
        whole pass was one transaction of the first write, holding the data folder's write
        lock as long as the index took: past some 400,000 documents every other write's
        busy timeout and retries ran out behind it (backend_unavailable). Writes of the same
        index meanwhile find the same table and share the steps; its searches read the
        earlier table until the last step puts the new one in its place."""
        while True:
            with self._conn() as conn, _translated("remake"), _write(conn):
                done = _remake_step(conn, num, index, tenant)
            if done:
                return
            time.sleep(REMAKE_PAUSE_SECONDS)

    def make_earlier_fts(self) -> list[tuple[str, str, int]]:
        """Every index's FTS5 table made again as an earlier release's, in one transaction
        (:func:`_schema.make_earlier_fts`): ``sift embedded-downgrade``, with every worker
        stopped (one writing an index meanwhile makes its table erasing again)."""
        with self._conn() as conn, _translated("make_earlier_fts"), _write(conn):
            return make_earlier_fts(conn)

    def emptied(self, index: str, tenant: str, version: int) -> bool | None:
        """Whether the delete of ``version`` left the tenant's index without a document when
        it ran (None: no such write recorded): a delete run again after a newer ingest
        landed still knows it emptied the index, as the writes were accepted."""
        with self._conn() as conn, _translated("emptied"), _read(conn):
            found = conn.execute(
                "SELECT emptied FROM outcomes WHERE idx = ? AND tenant = ? AND version = ?",
                (index, tenant, version),
            ).fetchone()
        return None if found is None else bool(found[0])

    def delete_index(self, index: str, tenant: str, *, version: int | None = None) -> int:
        """Delete all of the tenant's documents in the index (rows, BM25 postings, vectors);
        answers how many went. With a ``version``, only documents written before it go, and
        the tenant's index keeps it as a floor: an upsert accepted before the drop and run
        after it is skipped. The tenant's tombstones below the floor are dropped with it, and
        their dates; without a version, every record of its writes is (they order nothing).
        The same drop run again (a redelivery after a crash between its commit and its
        job's finish) changes nothing and reports what its first run deleted. Only a drop
        that removed a document is the index's last write (as a delete by ids)."""
        return self._on_erasing_fts(
            index, tenant, lambda: self._delete_index(index, tenant, version)
        )

    def _delete_index(self, index: str, tenant: str, version: int | None) -> int:
        with self._conn() as conn, _translated("delete_index"), _erasing(conn), _write(conn):
            if (done := _outcome(conn, index, tenant, version)) is not None:
                return done
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
                held = cast(
                    list[tuple[int, str]],
                    conn.execute(
                        "SELECT seq, id FROM docs WHERE idx = ? AND tenant = ?", (index, tenant)
                    ).fetchall(),
                )
                seqs = [seq for seq, doc_id in held if doc_id not in keep]
                # when every document of the tenant's goes, its FTS5 table goes whole
                # (dropped, its pages zeroed: _settle_emptied), not a term at a time
                fts = None if len(seqs) == len(held) else f"fts_{row[0]}"
                if fts is not None:
                    _make_erasable(conn, row[0])
                totals = _size_before(conn, row[0], index, tenant)
                for seq in seqs:
                    totals.remove(_remove_row(conn, fts, seq))
                gone = len(seqs)
                conn.execute(
                    "UPDATE indexes SET generation = generation + 1 WHERE num = ?", (row[0],)
                )
                _keep_size(conn, row[0], totals)
                _settle_emptied(conn, row[0], index, tenant)
            for table in ("writes", "tombstones"):  # below the floor, they order nothing
                conn.execute(
                    f"DELETE FROM {table} WHERE idx = ? AND tenant = ? AND version <= ?",
                    (index, tenant, version if version is not None else _NEWEST),
                )
            if version is not None:
                conn.execute(
                    "INSERT INTO catalog(idx, tenant, floor, last_write) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT(idx, tenant) DO UPDATE SET"
                    " floor = max(floor, excluded.floor),"
                    " last_write = coalesce(excluded.last_write, last_write)",
                    (index, tenant, version, time.time() if gone else None),
                )
            _record_outcome(conn, index, tenant, version, gone)
            _expire_tombstones(conn, time.time() - self.tombstone_seconds)
        return gone


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


def _remove_row(conn: apsw.Connection, fts: str | None, seq: int) -> int:
    """Remove a document's rows, its terms in ``fts`` too (FTS5's ``delete`` command, given
    the text it was indexed with: :func:`._schema._create_fts`; None: the table is dropped
    next), all zeroed in the file; answers the bytes it held (:func:`._sizes._stored_bytes`).
    The FTS5 table is one :func:`._schema._make_erasable` saw."""
    body = conn.execute(
        "SELECT b.title, b.text, d.metadata FROM bodies AS b JOIN docs AS d ON d.seq = b.seq"
        " WHERE b.seq = ?",
        (seq,),
    ).fetchone()
    if body is not None and fts is not None:
        conn.execute(
            f"INSERT INTO {fts}({fts}, rowid, title, text) VALUES ('delete', ?, ?, ?)",
            (seq, body[0], body[1]),
        )
    for table in ("docs", "bodies", "vectors"):
        conn.execute(f"DELETE FROM {table} WHERE seq = ?", (seq,))
    return 0 if body is None else _stored_bytes(*body)


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


#: ``writes.deleted``: the id's last write was an upsert (``LIVE``) or a delete (a
#: tombstone; an earlier release wrote 2 for one that removed a document, and a row of the
#: empty id for a drop's count, both now read by nothing: :func:`_outcome` keeps counts).
LIVE, TOMBSTONE = 0, 1

#: Above every write version (SQLite's largest integer): an unversioned drop's own.
_NEWEST = (1 << 63) - 1


def _outcome(conn: apsw.Connection, index: str, tenant: str, version: int | None) -> int | None:
    """What the write of ``version`` counted when it ran before (None: not run yet, or
    unversioned). A job's write is one transaction, so it ran whole or not at all."""
    if version is None:
        return None
    found = conn.execute(
        "SELECT count FROM outcomes WHERE idx = ? AND tenant = ? AND version = ?",
        (index, tenant, version),
    ).fetchone()
    return int(found[0]) if found else None


def _record_outcome(
    conn: apsw.Connection,
    index: str,
    tenant: str,
    version: int | None,
    count: int,
    *,
    emptied: bool = False,
) -> None:
    """Keep what the write of ``version`` counted (and whether it left the tenant's index
    without a document), in the write's transaction, for 7 days (``RESULT_TTL_SECONDS``,
    whatever ``SIFT_RESULT_RETENTION_SECONDS`` says: a job's message is run again within
    hours of its first run, at most); the older records go with it."""
    if version is None:
        return
    now = time.time()
    conn.execute("DELETE FROM outcomes WHERE at < ?", (now - RESULT_TTL_SECONDS,))
    conn.execute(
        "INSERT INTO outcomes VALUES (?, ?, ?, ?, ?, ?)",
        (index, tenant, version, count, emptied, now),
    )


def _recorded(version: int | None, held: int | None) -> int:
    """The version an id's write records: the write's own, or for an unversioned one the
    version the id had (``held``; 0 for none). One rule for the ``writes`` row and the
    tombstone's, which :func:`_expire_tombstones` matches against each other.

    >>> _recorded(7, 3), _recorded(None, 3), _recorded(None, None)
    (7, 3, 0)
    """
    return version if version is not None else held or 0


def _set_version(
    conn: apsw.Connection, index: str, tenant: str, doc_id: str, version: int, *, deleted: int
) -> None:
    """Record the id's last write (``version``: :func:`_recorded`'s), and what it was
    (``deleted``: :data:`LIVE` or :data:`TOMBSTONE`)."""
    conn.execute(
        "INSERT OR REPLACE INTO writes VALUES (?, ?, ?, ?, ?)",
        (index, tenant, doc_id, version, deleted),
    )


def _date_tombstone(
    conn: apsw.Connection, index: str, tenant: str, doc_id: str, version: int
) -> None:
    """Keep when the id's tombstone (``version``, the one :func:`_set_version` recorded) was
    written, for :func:`_expire_tombstones`, until then or a drop above it. A delete of the
    id made again later dates its own in its place."""
    conn.execute(
        "INSERT OR REPLACE INTO tombstones VALUES (?, ?, ?, ?, ?)",
        (time.time(), index, tenant, doc_id, version),
    )


def _expire_tombstones(conn: apsw.Connection, before: float) -> None:
    """Let go of the tombstones written before ``before`` (now less the backend's
    ``tombstone_seconds``), in the calling write's transaction.

    A tombstone orders a delete against an upsert of the same id accepted before it and run
    after it (a redelivery, a retry): that upsert finds the id's newer version and writes
    nothing. Such an upsert runs within the broker's redelivery window of being taken, which
    was before the delete's task ran (one queue, taken in order), so a tombstone older than
    the window has nothing left to refuse; kept, it was a row per deleted id for good. Only a
    ``writes`` row still holding that delete goes: an id written or deleted again since holds
    a newer version (a later delete dates its own tombstone), and a drop took the older ones.
    Each tombstone is read and deleted once, by the first write after its window: the cost of
    the delete that made it, paid once more."""
    expired = conn.execute(
        "SELECT idx, tenant, id, version FROM tombstones WHERE at < ?", (before,)
    ).fetchall()
    if not expired:
        return
    conn.executemany(
        "DELETE FROM writes WHERE idx = ? AND tenant = ? AND id = ? AND version = ?"
        f" AND deleted != {LIVE}",
        expired,
    )
    conn.execute("DELETE FROM tombstones WHERE at < ?", (before,))


def _touch(conn: apsw.Connection, index: str, tenant: str, model: str | None) -> None:
    """The tenant's index was written now (with ``model``'s vectors, if given). The first
    model recorded stays (:func:`_check_model` refuses another) until a drop clears it."""
    conn.execute(
        "INSERT INTO catalog(idx, tenant, model, last_write) VALUES (?, ?, ?, ?)"
        " ON CONFLICT(idx, tenant) DO UPDATE SET"
        " model = coalesce(model, excluded.model), last_write = excluded.last_write",
        (index, tenant, model, time.time()),
    )


def _check_limit(conn: apsw.Connection, index: str, tenant: str, limit: int) -> None:
    """Raise IndexLimitReached if writing into the tenant's index would make it one more
    than ``limit`` (0: none). An index exists while it holds a document (as listed), so an
    emptied one counts no more. Read in the write's own transaction: SQLite's one writer
    makes the check and the write one step for every process."""
    if not limit or _holds(conn, index, tenant):
        return
    held = int(
        conn.execute(
            "SELECT count(*) FROM indexes i WHERE i.tenant = ?1"
            " AND EXISTS(SELECT 1 FROM docs WHERE idx = i.name AND tenant = ?1)",
            (tenant,),
        ).get
    )
    if held >= limit:
        raise IndexLimitReached(index, held, limit)


def _check_model(conn: apsw.Connection, index: str, tenant: str, model: str) -> None:
    """Raise EmbeddingModelMismatch if the tenant's index records another embedding model."""
    held = conn.execute(
        "SELECT model FROM catalog WHERE idx = ? AND tenant = ?", (index, tenant)
    ).fetchone()
    if held is not None and held[0] is not None and held[0] != model:
        raise EmbeddingModelMismatch(index, str(held[0]), model)

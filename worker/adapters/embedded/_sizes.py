"""The running totals of each tenant's index: its documents and the UTF-8 bytes of their
title, text and metadata, kept in ``index_sizes`` by the writes that change them, in their
own transaction, so a worker's reading after each write job is a seek (0.01 ms), not a sum
over every body of the index (93 ms of CPU at 200,000 documents of 1 kB, growing with them:
``benchmarks/bench_index_sizes.py``).

A row holds the ``generation`` of its index it was counted at. Every write of the index
that may change its documents, this release's or an earlier one's, bumps that generation
(:mod:`._writes`); only this release's moves the totals with it. So a row whose generation
is not the index's is stale (an earlier release wrote the index since, across a rollback),
as is a missing one (an index written before the table was made): the next write of the
index counts it again from its rows, once (:func:`_size_before`), and a reading meanwhile
sums the rows itself (:func:`_read_size`). No data dir is read whole at its first open.

The totals move by explicit statements, not triggers on ``docs`` and ``bodies``: a
statement that fires a trigger runs in a statement journal, whose savepoint makes FTS5
write its pending terms out at every document: an ingest of SciFact took 0.64 CPU-s where
it takes 0.33, and 2,000 of its documents left 14 FTS5 segments where they leave 3."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import apsw

from worker.core.catalog import IndexSize

#: A sum over the rows of the tenant's index (every body): a stale or missing row's count.
RECOUNT = (
    "SELECT count(*), coalesce(sum(length(CAST(b.title AS BLOB))"
    " + length(CAST(b.text AS BLOB)) + length(CAST(d.metadata AS BLOB))), 0)"
    " FROM docs AS d JOIN bodies AS b ON b.seq = d.seq WHERE d.idx = ?1 AND d.tenant = ?2"
)

#: The totals of the tenant's index, if counted at its generation: a seek on each key.
CURRENT = (
    "SELECT s.documents, s.bytes FROM indexes AS i JOIN index_sizes AS s"
    " ON s.num = i.num AND s.generation = i.generation WHERE i.name = ? AND i.tenant = ?"
)


@dataclass(slots=True)
class _Totals:
    """The totals of one index within a write: counted before it, moved by each row."""

    documents: int
    stored: int

    def add(self, stored: int) -> None:
        self.documents, self.stored = self.documents + 1, self.stored + stored

    def remove(self, stored: int) -> None:
        self.documents, self.stored = self.documents - 1, self.stored - stored


def _stored_bytes(title: str, text: str, metadata: str) -> int:
    """What a document adds to its index's bytes, as SQLite counts them (a cast to a blob:
    UTF-8, past a U+0000 too).

    >>> _stored_bytes("Tea", "é\\x00", "{}")
    8
    """
    return len(title.encode()) + len(text.encode()) + len(metadata.encode())


def _size_before(conn: apsw.Connection, num: int, index: str, tenant: str) -> _Totals:
    """The totals of the tenant's index (``num``) before a write changes its rows, in the
    write's transaction: its row's, or a recount of its rows if that is stale or missing."""
    found = conn.execute(
        "SELECT s.documents, s.bytes FROM index_sizes AS s JOIN indexes AS i"
        " ON i.num = s.num AND i.generation = s.generation WHERE s.num = ?",
        (num,),
    ).fetchone()
    if found is None:
        found = conn.execute(RECOUNT, (index, tenant)).fetchone()
    documents, stored = cast(tuple[int, int], found)
    return _Totals(int(documents), int(stored))


def _keep_size(conn: apsw.Connection, num: int, totals: _Totals) -> None:
    """Store the totals of the tenant's index (``num``) at its generation, after the write
    bumped it, in the write's transaction."""
    conn.execute(
        "INSERT OR REPLACE INTO index_sizes(num, generation, documents, bytes)"
        " SELECT num, generation, ?, ? FROM indexes WHERE num = ?",
        (totals.documents, totals.stored, num),
    )


def _read_size(conn: apsw.Connection, index: str, tenant: str) -> IndexSize | None:
    """The tenant's index's totals (None: it holds no document), in one read transaction:
    its row, or, stale or missing (no write of this release since an earlier one's), a
    recount of its rows."""
    found = conn.execute(CURRENT, (index, tenant)).fetchone()
    if found is None:
        found = conn.execute(RECOUNT, (index, tenant)).fetchone()
    documents, stored = cast(tuple[int, int], found)
    return IndexSize(int(documents), int(stored)) if documents else None

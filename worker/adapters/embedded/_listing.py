"""The embedded backend's catalog reads: the tenant's indexes, one index, one document as
stored, a page of its documents by id, and a count; each only ever the tenant's own."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import cast

from worker.constants import DOCUMENT_PREVIEW_CHARS
from worker.contract import FilterValue
from worker.core.catalog import IndexInfo, IndexSize, ListedDocument, StoredDocument
from worker.core.pipeline import holds_filters

from ._pool import _Pool, _read, _translated
from ._schema import _holds
from ._sizes import _read_size


class _Listing(_Pool):
    """The :class:`~worker.core.ports.IndexCatalog` reads."""

    def count(self, index: str, tenant: str) -> int:
        """How many documents the tenant holds in the index."""
        with self._conn() as conn, _translated("count"):
            found = conn.execute(
                "SELECT count(*) FROM docs WHERE idx = ? AND tenant = ?", (index, tenant)
            ).get
        return int(found)

    def indexes(
        self, tenant: str, after: str | None = None, limit: int | None = None
    ) -> list[IndexInfo]:
        """Up to ``limit`` of the tenant's indexes (those holding one of its documents)
        named after ``after``, by name; ``name > ''`` is every name (none is empty), and
        SQLite's ``LIMIT -1`` no limit. Only the tenant's own rows are read (its names from
        ``indexes_by_tenant``, then a count of each one's documents on ``docs``'s key), so a
        list's time tells nothing of the documents other tenants hold."""
        asked = (tenant, after or "", -1 if limit is None else limit)
        with self._conn() as conn, _translated("indexes"), _read(conn):
            rows = cast(
                list[tuple[str, int, int | None, str | None, float | None]],
                conn.execute(INDEXES_PAGE, asked).fetchall(),
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

    def index_size(self, index: str, tenant: str) -> IndexSize | None:
        """The tenant's documents in the index and the UTF-8 bytes of their title, text and
        metadata; None when it holds none. Its running totals (:mod:`._sizes`), kept by
        each write in its transaction: a worker reads them after each write job, where a sum
        over every body of the index took 93 ms of CPU at 200,000 documents of 1 kB, and
        grew with them."""
        with self._conn() as conn, _translated("index_size"), _read(conn):
            return _read_size(conn, index, tenant)

    def document(self, index: str, tenant: str, doc_id: str) -> StoredDocument | None:
        """One of the tenant's documents as stored (no vector); None if it has no such one."""
        return self.stored_documents(index, tenant, [doc_id]).get(doc_id)

    def stored_documents(
        self, index: str, tenant: str, ids: Sequence[str]
    ) -> dict[str, StoredDocument]:
        """The tenant's documents of these ids as stored (no vector), by id: one seek each on
        ``docs``'s unique (idx, tenant, id) index, in one statement (a JSON array of the ids,
        so any number of them binds as one parameter)."""
        if not ids:
            return {}
        with self._conn() as conn, _translated("document"), _read(conn):
            rows = cast(
                list[tuple[str, str, str, str, str, int | None]],
                conn.execute(STORED_DOCUMENTS, (index, tenant, json.dumps(list(ids)))).fetchall(),
            )
        return {
            doc_id: StoredDocument(doc_id, text, title, revision, json.loads(metadata), version)
            for doc_id, revision, metadata, title, text, version in rows
        }

    def holds_filters(self, document: StoredDocument, filters: Mapping[str, FilterValue]) -> bool:
        """Whether a search with ``filters`` finds ``document``: its metadata compared as
        JSON values, as the typed SQLite filters of a search compare (:func:`holds_filters`)."""
        return holds_filters(document.metadata, filters)

    def documents(
        self, index: str, tenant: str, after: str | None, limit: int
    ) -> list[ListedDocument] | None:
        """Up to ``limit`` of the tenant's documents after id ``after``, by id; None when the
        tenant holds none in the index. A range seek on ``docs``'s unique (idx, tenant, id)
        index, read in its order (no sort step), then one seek per row on ``bodies`` and
        ``writes``: a page costs its own rows, wherever in the index it starts (the
        query plan is pinned by ``test_embedded_lifecycle.py``). The text is cut in SQLite
        (``substr``; ``length`` counts characters as Python does), so at most
        ``DOCUMENT_PREVIEW_CHARS`` of each leaves the database; but both stop at a text's
        first U+0000 (which the ingest takes), so a text holding one is read whole and cut
        here (rare: ``instr`` on its bytes finds it)."""
        with self._conn() as conn, _translated("documents"), _read(conn):
            rows = cast(
                list[tuple[str, str, str, str, str, int, int | None, str | None]],
                conn.execute(DOCUMENTS_PAGE, (index, tenant, after or "", limit)).fetchall(),
            )
            if not rows and not _holds(conn, index, tenant):
                return None
        return [
            ListedDocument(
                doc_id,
                title,
                revision,
                preview if whole is None else whole[:DOCUMENT_PREVIEW_CHARS],
                length if whole is None else len(whole),
                json.loads(meta),
                version,
            )
            for doc_id, revision, meta, title, preview, length, version, whole in rows
        ]


#: A tenant's documents of the ids in a JSON array, as stored.
STORED_DOCUMENTS = (
    "SELECT d.id, d.revision, d.metadata, b.title, b.text, w.version FROM docs AS d"
    " JOIN bodies AS b ON b.seq = d.seq"
    " LEFT JOIN writes AS w ON w.idx = d.idx AND w.tenant = d.tenant AND w.id = d.id"
    " WHERE d.idx = ?1 AND d.tenant = ?2 AND d.id IN (SELECT value FROM json_each(?3))"
)

#: One page of a tenant's indexes: its names after the cursor, each with its documents (an
#: ``indexes`` row outlives its last document, so a name with none is left out).
INDEXES_PAGE = (
    "SELECT i.name, count(*), i.dimension, c.model, c.last_write FROM indexes AS i"
    " JOIN docs AS d ON d.idx = i.name AND d.tenant = i.tenant"
    " LEFT JOIN catalog AS c ON c.idx = i.name AND c.tenant = i.tenant"
    " WHERE i.tenant = ? AND i.name > ? GROUP BY i.name ORDER BY i.name LIMIT ?"
)

#: One page of a tenant's documents; ``id > ''`` is every id (the gateway takes none empty);
#: the last column is the whole text of one holding a U+0000 (NULL for any other).
DOCUMENTS_PAGE = (
    "SELECT d.id, d.revision, d.metadata, b.title,"
    f" substr(b.text, 1, {DOCUMENT_PREVIEW_CHARS}), length(b.text), w.version,"
    " CASE WHEN instr(CAST(b.text AS BLOB), x'00') THEN b.text END FROM docs AS d"
    " JOIN bodies AS b ON b.seq = d.seq"
    " LEFT JOIN writes AS w ON w.idx = d.idx AND w.tenant = d.tenant AND w.id = d.id"
    " WHERE d.idx = ? AND d.tenant = ? AND d.id > ? ORDER BY d.id LIMIT ?"
)

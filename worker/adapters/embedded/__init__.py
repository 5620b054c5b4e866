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
  query's word tokens, English stopwords removed (all of them kept when the query has
  nothing else), each term quoted and OR-ed, so no user text is ever parsed as FTS5
  syntax. Statistics are per tenant's index (one FTS table each): another tenant's
  documents change neither the caller's scores nor the cost of its search.
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

The package's modules, one part each: :mod:`._schema` (tables, schema version, each tenant's
index and FTS5 table), :mod:`._pool` (connections, transactions, error translation),
:mod:`._caches` (vectors and documents in memory), :mod:`._search` (probe and channels),
:mod:`._writes` (upserts, deletes, drops, write versions), :mod:`._listing` (the catalog's
reads) and :mod:`._settings` (each index's own search settings).
:class:`EmbeddedBackend` is made of one class from each; within the package imports are
relative, so ``benchmarks/baseline.py`` can load a whole earlier version beside it.
"""

from __future__ import annotations

from worker.core.types import derive_revision

from ._caches import DOCUMENT_CACHE_SIZE
from ._listing import _Listing
from ._pool import BUSY_TIMEOUT_MS, CACHE_KIB, MMAP_BYTES, TOMBSTONE_SECONDS
from ._schema import DB_FILE, FTS_TOKENIZER, SCHEMA_VERSION, upgrade_from_v1
from ._search import BLAS_MIN_PRODUCT, ENGLISH_STOPWORDS, _Search, match_expression
from ._settings import _Settings
from ._writes import _Writes

__all__ = [
    "BLAS_MIN_PRODUCT",
    "BUSY_TIMEOUT_MS",
    "CACHE_KIB",
    "DB_FILE",
    "DOCUMENT_CACHE_SIZE",
    "ENGLISH_STOPWORDS",
    "FTS_TOKENIZER",
    "MMAP_BYTES",
    "SCHEMA_VERSION",
    "TOMBSTONE_SECONDS",
    "EmbeddedBackend",
    "derive_revision",
    "match_expression",
    "upgrade_from_v1",
]


class EmbeddedBackend(_Search, _Writes, _Listing, _Settings):
    """The :class:`~worker.core.ports.SearchBackend` port on SQLite FTS5 and numpy.

    Safe to share between threads (each call has a pooled connection to itself) and between
    processes on one machine (WAL and a busy timeout). Opens nothing until first use.
    """

    name = "embedded"

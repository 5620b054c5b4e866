"""The embedded backend's in-memory caches, per process: each tenant's index's vectors (the
matrix a kNN search scans, refreshed by the index's generation, loading only rows added
since, let go once the index is emptied, whoever emptied it, or once the blocks pass their
byte budget, the least recently searched first) and built ``Document``s by ``seq``."""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import compress
from typing import cast

import apsw
import numpy as np
import numpy.typing as npt

from worker.core.types import Document

from ._pool import _Pool
from ._schema import _holds

# The package's logger, as before the split (log settings and tests name it).
logger = logging.getLogger(__package__)

# Built Documents by seq. A seq names one immutable version (a replace gets a new seq,
# and seqs are never reused), so an entry can go stale only by never being asked for.
# Bounded by count and by its texts' bytes, the least recently used let go first (a hit
# moves its entry to the end: let go by age, a document most searches meet was built again
# after every DOCUMENT_CACHE_SIZE new ones). By count alone,
# 20,000 documents at the API's 100,000 characters held 2 GB in each worker process (4 to
# 8 GB in a script CPython stores at 2 or 4 bytes a character). 64 MiB holds about 670
# documents at the limit (160 at 4 bytes a character); 20,000 SciFact abstracts take 37 MB
# (1.9 KB each), so there the count binds, as before.
DOCUMENT_CACHE_SIZE = 20_000
DOCUMENT_CACHE_BYTES = 64 * 1024 * 1024

# Every tenant's index's vector block, by bytes (its matrix with its spare rows, its seqs,
# ids, revisions and metadata: about 1.8 KB a document at 384 dimensions, 2.5 KB with spare
# rows), the least recently searched index's let go first. Without it a process kept every
# block it ever loaded: a worker serving many tenants' indexes grew by 180 to 250 MB per
# 100,000 documents it had searched, for as long as it ran. A block let go is loaded again
# by its index's next kNN search, at about 3.5 ms of CPU per 1,000 rows (0.34 s for
# 100,000, a search of them in memory 8 ms: benchmarks/bench_vector_reload.py),
# so the budget keeps a process's working set: some 200,000 documents, two indexes at the
# exact scan's intended size, about 1.2 GB a worker process at most with the model.
VECTOR_CACHE_BYTES = 512 * 1024 * 1024


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
    strings: int = 0  # the bytes of ids, revisions and metadata (_strings), counted once

    @property
    def size(self) -> int:
        return int(self.seqs.shape[0])

    @property
    def nbytes(self) -> int:
        """What the block holds in memory, as the budget counts it: the matrix with its
        spare rows, the seqs, and the strings with the lists' slots for them."""
        return int(self.matrix.nbytes) + int(self.seqs.nbytes) + self.strings


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


class _VectorCache(_Pool):
    """The caches' reads and writes (their state is :class:`_Pool`'s).

    A vector block is let go by dropping the cache's reference alone: a search that got
    it from :meth:`_refresh` scans it on, outside the lock, and the block lives as long as
    a search holds it. Nothing writes a row a reader may see (:func:`_grow`), and a block
    loaded again is a new one, so a search never sees rows change under it; the memory of
    a block let go is freed when its last search ends.
    """

    def _recall(self, seqs: list[int]) -> list[Document | None]:
        """The cached Documents of ``seqs`` (None where not cached), each one found made the
        most recently used, under the lock a let-go takes. All in C (a Document is true,
        None false): 20 µs for a hybrid search's 240 hits, 12 µs more than the lookups alone,
        within the noise of its 2 ms (docs/embedded-backend.md)."""
        with self._lock:
            cache = self._documents
            found = list(map(cache.get, seqs))
            deque(map(cache.move_to_end, compress(seqs, found)), maxlen=0)
        return found

    def _remember(self, built: dict[int, Document]) -> None:
        with self._lock:
            cache = self._documents
            for seq, document in built.items():
                if (earlier := cache.get(seq)) is not None:  # built by two searches at once
                    self._document_bytes -= _weight(earlier)
                cache[seq] = document
                self._document_bytes += _weight(document)
            while cache and (
                len(cache) > DOCUMENT_CACHE_SIZE or self._document_bytes > DOCUMENT_CACHE_BYTES
            ):
                self._document_bytes -= _weight(cache.popitem(last=False)[1])

    def _refresh(self, conn: apsw.Connection, index: str, tenant: str, generation: int) -> _Vectors:
        """The tenant's index's vectors as of ``generation``, loading only rows added since
        (and any other index's let go, once emptied: :meth:`_let_go_of_emptied`).

        The load runs outside the lock every operation of the process takes to borrow a
        connection: 0.34 s of CPU for 100,000 rows, and again each time the byte budget let
        the block go, during which another index's search, a write or a probe waited. It
        holds its index's load lock instead (:meth:`_Pool._load_lock`), so two loads of one
        index never run at once: an append writes its matrix's spare rows in place, and two
        would write the same ones. A block cached meanwhile by a load of another snapshot
        (one lock, in turn) is as good: a newer one is kept, as the lock held did before.

        A sweep (:meth:`_let_go_of_emptied`) may run meanwhile too, seeing the index dropped
        while it was not cached yet: the block, read from a snapshot before the drop, would
        then be kept until the schema changed again. So a block read at another schema
        version than the last sweep's (one ran since the search's snapshot began) is kept
        with the sweep forgotten, and the next kNN search of another index sweeps again.
        """
        key = (index, tenant)
        with self._load_lock(key):
            with self._lock:
                self._let_go_of_emptied(conn, key)
                cached = self._vectors.get(key, _Vectors())
                if cached.generation >= generation:
                    if key in self._vectors:
                        self._vectors.move_to_end(key)  # now the most recently searched
                    return cached
            fresh = _load(conn, index, tenant, cached, generation)
            schema = _schema_version(conn)  # the load's snapshot's
            with self._lock:
                self._keep_vectors(key, fresh)
                if schema != self._schema_seen:
                    self._schema_seen = None
            return fresh

    def _keep_vectors(self, key: tuple[str, str], vectors: _Vectors) -> None:
        """Cache ``vectors`` as the most recently searched, then let go of the least recently
        searched others while the blocks pass :data:`VECTOR_CACHE_BYTES` (with the lock held).

        The block just loaded is kept even alone past the budget: it is the one a search
        scans now, and letting it go would load the whole index again at each search."""
        self._drop_vectors(key)
        self._vectors[key] = vectors
        self._vector_bytes += vectors.block.nbytes
        while self._vector_bytes > VECTOR_CACHE_BYTES and len(self._vectors) > 1:
            oldest = next(iter(self._vectors))
            logger.debug("index %s of %s: vectors let go (byte budget)", *oldest)
            self._drop_vectors(oldest)

    def _drop_vectors(self, key: tuple[str, str]) -> None:
        """Let go of one tenant's index's block, if cached (with the lock held)."""
        if (gone := self._vectors.pop(key, None)) is not None:
            self._vector_bytes -= gone.block.nbytes

    def _let_go_of_emptied(self, conn: apsw.Connection, searched: tuple[str, str]) -> None:
        """Drop the vectors of every other cached index that holds no document now (dropped,
        or its last documents deleted by id, by any process), if the schema changed since the
        last look; called with the lock held, in a kNN search's read transaction.

        A search of an emptied index lets its vectors go (:meth:`_Search.retrieve`), but a
        process that never searched that name again kept them for as long as it ran: 150 MB
        for 100,000 documents of 384 dimensions, in every worker process that had searched
        it. Emptying an index drops its FTS5 table (:func:`._schema._settle_emptied`), which
        changes ``PRAGMA schema_version``, a read of the database header: asked only when
        another index's vectors are cached (the searched one's own emptying is seen by its
        search), so a process searching one index runs no statement more (a load reads it
        once, :meth:`_refresh`). A change since the last look makes one, a seek per cached
        index, made again only after the next change (an index emptied or made, by any
        tenant), or after a load read at another version than the last look's."""
        if all(key == searched for key in self._vectors):
            return
        schema = _schema_version(conn)
        if schema == self._schema_seen:
            return
        self._schema_seen = schema
        for index, tenant in list(self._vectors):
            if not _holds(conn, index, tenant):
                self._drop_vectors((index, tenant))


def _schema_version(conn: apsw.Connection) -> int:
    """The schema's version in the connection's snapshot (a read of the database header),
    which emptying or making an index changes (its FTS5 table dropped or made)."""
    return int(conn.execute("PRAGMA schema_version").get)


def _load(
    conn: apsw.Connection, index: str, tenant: str, cached: _Vectors, generation: int
) -> _Vectors:
    """The tenant's index's vectors as of ``generation``, from ``cached`` and its rows in
    SQLite: the rows deleted since let go, the rows added since (``seq`` past its
    ``max_seq``) appended, in its matrix's spare rows when it has them (:func:`_grow`)."""
    old = cached.block
    rows: npt.NDArray[np.intp] = np.arange(old.size)
    if old.size:
        alive = conn.execute(
            "SELECT count(*) FROM docs WHERE idx = ? AND tenant = ? AND has_vector AND seq <= ?",
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
        ids = _kept(old.ids, rows, whole) + [r[1] for r in more]
        revisions = _kept(old.revisions, rows, whole) + [r[2] for r in more]
        metadata = _kept(old.metadata, rows, whole) + [r[3] for r in more]
        block = _Block(
            seqs=np.concatenate([old.seqs[rows], np.array([r[0] for r in more], np.int64)]),
            ids=ids,
            revisions=revisions,
            metadata=metadata,
            matrix=_grow(old.matrix, old.size, rows, [r[4] for r in more]),
            strings=(
                old.strings + _strings([r[1:4] for r in more])
                if whole
                else _strings(zip(ids, revisions, metadata, strict=True))
            ),
        )
        logger.debug(
            "index %s of %s: %d vectors (+%d, -%d)",
            index,
            tenant,
            block.size,
            len(more),
            old.size - rows.size,
        )
    return _Vectors(
        generation=generation,
        max_seq=max(cached.max_seq, more[-1][0] if more else 0),
        block=block,
    )


def _weight(document: Document) -> int:
    """The bytes a cached document's title and text hold: ``sys.getsizeof`` counts CPython's
    1, 2 or 4 bytes a character (by the string's widest) and its header, without a walk."""
    return sys.getsizeof(document.text) + sys.getsizeof(document.title)


def _strings(rows: Iterable[tuple[str, ...]]) -> int:
    """The bytes of the rows' strings (``sys.getsizeof``: header and characters) and of the
    lists' slots for them, as a block holds them (one list per column)."""
    return sum(sum(map(sys.getsizeof, row)) + 8 * len(row) for row in rows)


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

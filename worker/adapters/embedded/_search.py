"""The embedded backend's reads for a search: the channel probe, and each channel's ranked
hits (BM25 by FTS5, exact kNN by numpy over :mod:`._caches`) with the hard filters applied
inside, then their bodies read once for both channels."""

from __future__ import annotations

import json
import math
import re
import time
import unicodedata
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, cast

import apsw
import numpy as np
import numpy.typing as npt

from worker.contract import Channel, FilterValue
from worker.core.types import (
    ChannelHit,
    ChannelQuery,
    ChannelResults,
    Document,
    HardFilters,
    IndexProbe,
)
from worker.errors import BackendRequestError, IndexNotFound, InvalidRequest, ModeUnavailable

from ._caches import _Block, _VectorCache
from ._pool import _deadline, _read, _translated
from ._schema import _FILTER_KEY, _holds, _searched_index

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

_WORD = re.compile(r"\w")
_NOT_A_WORD = re.compile(r"[^\w\s]")

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


class _Search(_VectorCache):
    """The :class:`~worker.core.ports.SearchBackend` reads: channels, probe, retrieve."""

    def channels(self, index: str, tenant: str) -> frozenset[Channel]:
        """``bm25`` once the tenant holds a document in the index, plus ``knn`` once one of
        them holds a vector; empty otherwise, whether or not another tenant uses the name."""
        return self.probe(index, tenant).channels

    def holds(self, index: str, tenant: str) -> bool:
        """Whether the tenant holds a document in the index now: one seek on its own rows
        (nothing is remembered between reads here, :meth:`channels` neither)."""
        with self._conn() as conn, _translated("holds"):
            return _holds(conn, index, tenant)

    def probe(self, index: str, tenant: str, *, timeout_seconds: float | None = None) -> IndexProbe:
        """The tenant's channels (:meth:`channels`) and its index's recorded embedding model
        (``timeout_seconds`` unused: a local read of microseconds).

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
                    self._drop_vectors((query.index, query.filters.tenant))
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
            found = {channel: self._recall(r.seqs) for channel, r in ranked.items()}
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


def match_expression(query: str) -> str | None:
    """The FTS5 MATCH text for a query: its non-stopword terms, quoted and OR-ed.

    >>> match_expression("What is the role of p53?")
    '"role" OR "p53"'

    A query of stopwords alone searches all its terms: dropped, "The Who" or "to be or not
    to be" had no term left, and an empty BM25 channel that said nothing. The documents
    hold every word (stopwords are dropped from queries only), and BM25's idf ranks the
    rarer words first.

    >>> match_expression("The Who")
    '"the" OR "who"'

    ``None`` when the query has no word at all (``"?!"``); such a query has an empty BM25
    channel (the gateway refuses a query with no letter, digit or symbol).

    A word keeps its combining marks: see :func:`query_words`.

    >>> match_expression("Zu\u0308rich")
    '"zürich"'
    """
    words = dict.fromkeys(query_words(query))
    terms = [word for word in words if word not in ENGLISH_STOPWORDS] or list(words)
    return " OR ".join(f'"{term}"' for term in terms) or None


def query_words(query: str) -> list[str]:
    """The query's words, NFC-normalised and lower-cased, each with its combining marks.

    A word is a run of letters, digits, ``_`` and combining marks. ``\\w+`` alone cut a
    word at a mark, which FTS5's ``unicode61`` keeps inside the word (and folds away): an
    accent typed as a mark (NFD, as macOS gives it) made "résumé" the word "sume", "Zürich"
    the words "zu" and "rich", and "İstanbul" (lower-cased "i" and a combining dot)
    "stanbul". Each word is quoted, and FTS5 tokenizes a quoted word as it tokenized the
    documents, so a mark FTS5 does cut at (Devanagari's vowel signs) makes the word the
    phrase of its pieces, found where the document holds that word.

    >>> query_words("İstanbul, pin\u0303ata!")
    ['i̇stanbul', 'piñata']
    """
    text = unicodedata.normalize("NFC", query).lower()
    spaced = _NOT_A_WORD.sub(_space_unless_a_mark, text)
    return [word for word in spaced.split() if _WORD.search(word)]


def _space_unless_a_mark(match: re.Match[str]) -> str:
    char = match.group()
    return char if unicodedata.category(char).startswith("M") else " "


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


def _document(title: str, text: str, about: _About) -> Document:
    doc_id, revision, metadata = about
    return Document(doc_id, text, title, revision, json.loads(metadata) if metadata != "{}" else {})


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
    """The WHERE clause (over ``docs AS d``) for the tenant and the metadata equalities.

    Each compares JSON values (docs/architecture.md, "Metadata filters"): SQLite reads a
    JSON ``true`` as the integer 1, so a boolean is matched by its JSON type and a number
    only against a number (SQLite compares an integer and a real exactly: ``5 = 5.0``); a
    string is text, which no number equals."""
    clauses: list[str] = ["d.tenant = ?"]
    params: list[FilterValue] = [filters.tenant]
    for key, value in sorted(filters.fields.items()):
        if not _FILTER_KEY.match(key):
            raise InvalidRequest(f"filters.{key}", "filter names use letters, digits and _.:-")
        path = f"'$.\"{key}\"'"
        if isinstance(value, bool):
            clauses.append(f"json_type(d.metadata, {path}) = ?")
            params.append("true" if value else "false")
        elif isinstance(value, str):
            clauses.append(f"json_extract(d.metadata, {path}) = ?")
            params.append(value)
        else:
            clauses.append(
                f"json_extract(d.metadata, {path}) = ?"
                f" AND json_type(d.metadata, {path}) IN ('integer', 'real')"
            )
            params.append(value)
    return " AND ".join(clauses), params

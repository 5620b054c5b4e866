"""Retrieval latency of the embedded backend beside the raw library calls on the same data.

Both sides answer the same question: *a tenant-filtered search that returns each hit's
id, score, title and text*, window 120 (``max(4 * 30, 32)``, DESIGN.md §3). Every corpus
is loaded twice over: once under the benchmarked tenant ``bench`` and once, with as many
documents (the same texts and vectors under other ids), under a ``noise`` tenant, so the
tenant filter has to do real work (without it, half of every window would be noise).
Query vectors are computed before timing, so embedding is excluded on both sides.

What each side does per query (warm caches on both; the two are timed interleaved, so a
noisy machine hits both alike):

* ``fts``
    - Sift: ``EmbeddedBackend.retrieve`` with the BM25 channel, as the pipeline calls it
      (builds the MATCH expression, one read transaction, FTS5 ``bm25()`` joined to the
      tenant's rows, ties by id, ``Document`` objects with revision and metadata).
    - raw: one statement, the MATCH expression prepared outside the timing, on the same
      page cache and mmap settings as Sift. Five forms are tried on 50 queries before the
      timing and the fastest is timed (the run prints which):

      - ``rank``: a plain FTS5 table ``t(id UNINDEXED, tenant UNINDEXED, title, text)``
        holding both tenants, ``SELECT id, title, text, rank FROM t WHERE t MATCH ? AND
        tenant = ? ORDER BY rank LIMIT ?`` (FTS5 sorts by ``bm25`` itself and reads a
        row for the tenant check only as far as the limit needs);
      - ``bm25``: the same with ``bm25(t) AS score ... ORDER BY score``;
      - ``join``, ``join-rank``: a plain table ``d(id, tenant, title, text)`` with an
        external-content FTS5 index ``j`` on it, ``... FROM j JOIN d ON d.rowid =
        j.rowid WHERE j MATCH ? AND d.tenant = ? ORDER BY score`` (or ``j.rank``);
      - ``join-late``: the join ranking rowids and scores in a subquery with the
        ``LIMIT``, and joining ``d`` again only for the hits' title and text.

      None adds Sift's tie order by id.
* ``vector``
    - Sift: the kNN channel (snapshot check, exact cosine over the tenant's block of
      rows: single-threaded ``np.vecdot``, or BLAS ``@`` past ``BLAS_MIN_PRODUCT``
      multiply-adds as on the 100k corpus; deterministic top 120; the hits' bodies from
      its ``Document`` cache or SQLite; a ``ChannelHit`` per hit).
    - raw: numpy over the tenant's rows, with the tenant's sub-matrix and its ids,
      titles and texts gathered into arrays and Python lists once, outside the timing,
      as a user caching their data would: the scores, by the quickest call in a trial
      before timing at Sift's thread budget (single-threaded ``einsum`` or ``np.vecdot``
      for a block Sift scans on one core; those or ``@`` on every BLAS thread past
      ``BLAS_MIN_PRODUCT``), ``argpartition`` then
      ``argsort`` of the top 120, and the ids, titles and texts read from the lists.
      Raw holds every text in memory; Sift reads the hits' bodies from its SQLite file.
* ``hybrid``
    - Sift: one ``retrieve`` with both channels, then ``admit`` and
      ``worker.core.fusion.rrf_fuse`` to the coarse limit 30, as ``Pipeline`` does.
    - raw: the two raw calls above, then a minimal dict-based RRF (constant 60, ties by
      id) to 30 hits. The minimal RRF is the fusion a user would write; what
      ``rrf_fuse`` does beyond it (the per-channel ranks and scores kept for the trace)
      is counted as Sift's overhead.

    python benchmarks/bench_retrieval.py [--scifact PATH] [--docs 100000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import apsw
import numpy as np
import numpy.typing as npt

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from worker.adapters.embedded import (  # noqa: E402
    BLAS_MIN_PRODUCT,
    CACHE_KIB,
    FTS_TOKENIZER,
    MMAP_BYTES,
    EmbeddedBackend,
    match_expression,
)
from worker.contract import Channel  # noqa: E402
from worker.core.fusion import admit, rrf_fuse  # noqa: E402
from worker.core.types import ChannelQuery, Document, HardFilters  # noqa: E402

COARSE = 30  # the coarse limit with rerank on
WINDOW = max(4 * COARSE, 32)  # 120: the channel window (DESIGN.md §3)
TENANT = "bench"
NOISE = "noise"  # a second tenant with as many documents, so the filter matters
NOISE_PREFIX = "noise-"
Matrix = npt.NDArray[np.float32]


def load_scifact(
    path: Path, max_queries: int, cache: Path | None, model: bool
) -> tuple[list[Document], Matrix, list[str], Matrix]:
    """SciFact's documents and claims, with MiniLM vectors (or random ones when ``model`` is off).

    Embedding the 5,183 abstracts takes minutes on two cores; ``cache`` keeps them in an
    ``.npy`` file outside the repository.
    """
    from worker.adapters.embedder import OnnxMiniLMEmbedder

    with open(path / "corpus.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    with open(path / "queries.jsonl", encoding="utf-8") as f:
        queries = [json.loads(line)["text"] for line in f][:max_queries]
    docs = [Document(id=r["_id"], title=r["title"], text=r["text"], revision="") for r in rows]
    embedder = OnnxMiniLMEmbedder()
    started = time.perf_counter()
    if cache is not None and cache.exists():
        vectors = np.load(cache).astype(np.float32)
        print(f"  read {len(vectors):,} SciFact document vectors from {cache}")
    elif model:
        vectors = embedder.embed_array([f"{d.title}. {d.text}" for d in docs])
        print(f"  embedded {len(docs):,} documents in {time.perf_counter() - started:.0f}s")
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            np.save(cache, vectors)
    else:
        vectors = unit(np.random.default_rng(1).standard_normal((len(docs), 384), np.float32))
        print("  random document vectors (--quick without --scifact-vectors)")
    return docs, vectors, queries, embedder.embed_array(queries)


def word(rank: int) -> str:
    letters = "bcdfghjklmnpqrstvwxz"
    out = ""
    rank += 1
    while rank:
        rank, r = divmod(rank, len(letters))
        out += letters[r] + "aeiou"[r % 5]
    return out


def unit(rows: Matrix) -> Matrix:
    normed: Matrix = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)
    return normed


def synthetic(
    n_docs: int, n_queries: int, dim: int = 384, vocab: int = 30_000, seed: int = 42
) -> tuple[list[Document], Matrix, list[str], Matrix]:
    """Deterministic docs of Zipf-distributed words, random unit vectors, 3-5 word queries."""
    rng = np.random.default_rng(seed)
    words = np.array([word(i) for i in range(vocab)])
    p = 1.0 / np.arange(1, vocab + 1) ** 1.07
    p /= p.sum()
    lengths = rng.integers(20, 120, size=n_docs)
    tokens = rng.choice(vocab, size=int(lengths.sum()), p=p)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    docs = [
        Document(
            id=f"d{i:06d}",
            title=" ".join(words[tokens[bounds[i] : bounds[i] + 4]]),
            text=" ".join(words[tokens[bounds[i] + 4 : bounds[i + 1]]]),
            revision="1",
        )
        for i in range(n_docs)
    ]
    # Query terms from the middle of the distribution: the head would be stopwords.
    queries = [
        " ".join(words[rng.integers(30, 5_000, size=rng.integers(3, 6))]) for _ in range(n_queries)
    ]
    vectors = unit(rng.standard_normal((n_docs, dim), dtype=np.float32))
    return docs, vectors, queries, unit(rng.standard_normal((n_queries, dim), dtype=np.float32))


Raw = tuple[list[str], list[str], list[str]]  # ids, titles, texts of the tenant's rows


def build_raw(path: Path, docs: Sequence[Document]) -> apsw.Connection:
    """A plain FTS5 table with the tenant as an UNINDEXED column; each doc and its noise twin."""
    conn = apsw.Connection(str(path))
    conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")  # the page cache and mmap Sift uses
    conn.execute(f"PRAGMA mmap_size={MMAP_BYTES}")
    conn.execute(
        "CREATE VIRTUAL TABLE t USING fts5("
        f"id UNINDEXED, tenant UNINDEXED, title, text, tokenize='{FTS_TOKENIZER}')"
    )
    # The join a user might write instead: a plain table and an external-content FTS5 index.
    conn.execute("CREATE TABLE d(id TEXT, tenant TEXT, title TEXT, text TEXT)")
    conn.execute(
        "CREATE VIRTUAL TABLE j USING fts5("
        f"title, text, content='d', content_rowid='rowid', tokenize='{FTS_TOKENIZER}')"
    )
    with conn:
        for tenant, prefix in ((TENANT, ""), (NOISE, NOISE_PREFIX)):
            rows = [(prefix + d.id, tenant, d.title, d.text) for d in docs]
            conn.executemany("INSERT INTO t(id, tenant, title, text) VALUES (?, ?, ?, ?)", rows)
            conn.executemany("INSERT INTO d(id, tenant, title, text) VALUES (?, ?, ?, ?)", rows)
        conn.execute("INSERT INTO j(j) VALUES ('rebuild')")
    return conn


def timed(
    sift: Sequence[Callable[[], object]], raw: Sequence[Callable[[], object]]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Milliseconds per call, Sift's and raw's interleaved so machine noise hits both alike."""
    for call in [*sift[:5], *raw[:5]]:  # warm-up: page caches, the vector load
        call()
    out = np.empty((2, len(sift)))
    for i, pair in enumerate(zip(sift, raw, strict=True)):
        for side in (i % 2, 1 - i % 2):
            started = time.perf_counter()
            pair[side]()
            out[side, i] = time.perf_counter() - started
    return out[0] * 1000.0, out[1] * 1000.0


def fastest(candidates: dict[str, Callable[[int], object]], n: int) -> str:
    """The name of the quickest candidate over ``n`` trial queries (the raw side's best)."""
    best: dict[str, float] = {}
    for _ in range(3):
        for name, call in candidates.items():
            started = time.perf_counter()
            for i in range(n):
                call(i)
            took = time.perf_counter() - started
            best[name] = min(best.get(name, took), took)
    return min(best, key=best.__getitem__)


def raw_rrf(channels: Sequence[Sequence[tuple[str, str, str, float]]], limit: int) -> list[Any]:
    """Minimal RRF over (id, title, text, score) lists: constant 60, ties by id."""
    scores: dict[str, float] = {}
    rows: dict[str, tuple[str, str, str, float]] = {}
    for hits in channels:
        for rank, hit in enumerate(hits, start=1):
            scores[hit[0]] = scores.get(hit[0], 0.0) + 1.0 / (60 + rank)
            rows.setdefault(hit[0], hit)
    best = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    return [(doc_id, score, rows[doc_id][1], rows[doc_id][2]) for doc_id, score in best]


def run(
    name: str, docs: list[Document], vectors: Matrix, queries: list[str], qvecs: Matrix, tmp: Path
) -> list[tuple[str, ...]]:
    started = time.perf_counter()
    backend = EmbeddedBackend(tmp / name)
    noise = [replace(d, id=NOISE_PREFIX + d.id) for d in docs]
    for at in range(0, len(docs), 2_000):  # the tenants' batches interleave, as in life
        backend.upsert(name, TENANT, docs[at : at + 2_000], vectors[at : at + 2_000])
        backend.upsert(name, NOISE, noise[at : at + 2_000], vectors[at : at + 2_000])
    raw = build_raw(tmp / f"{name}-raw.db", docs)
    # What a user caches for the tenant: its rows' vectors contiguous, its ids and bodies.
    matrix = np.ascontiguousarray(vectors, dtype=np.float32)
    ids, titles, texts = [d.id for d in docs], [d.title for d in docs], [d.text for d in docs]
    print(
        f"  indexed {len(docs):,} + {len(noise):,} noise documents twice"
        f" in {time.perf_counter() - started:.1f}s"
    )

    def sift(channels: tuple[Channel, ...], i: int) -> Callable[[], object]:
        query = ChannelQuery(
            name, HardFilters(TENANT), channels, WINDOW, queries[i], vector=qvecs[i]
        )

        def call() -> object:
            results = backend.retrieve(query)
            if len(channels) == 2:
                return rrf_fuse(admit(results.hits, None), limit=COARSE)
            return results

        return call

    expressions = [match_expression(q) or '""' for q in queries]
    fts_sql = {
        "rank": "SELECT id, title, text, rank FROM t WHERE t MATCH ? AND tenant = ?"
        " ORDER BY rank LIMIT ?",
        "bm25": "SELECT id, title, text, bm25(t) AS score FROM t WHERE t MATCH ? AND tenant = ?"
        " ORDER BY score LIMIT ?",
        "join": "SELECT d.id, d.title, d.text, bm25(j) AS score FROM j JOIN d ON d.rowid = j.rowid"
        " WHERE j MATCH ? AND d.tenant = ? ORDER BY score LIMIT ?",
        "join-rank": "SELECT d.id, d.title, d.text, j.rank FROM j JOIN d ON d.rowid = j.rowid"
        " WHERE j MATCH ? AND d.tenant = ? ORDER BY j.rank LIMIT ?",
        "join-late": "SELECT d.id, d.title, d.text, r.score FROM (SELECT j.rowid AS rid,"
        " bm25(j) AS score FROM j JOIN d ON d.rowid = j.rowid WHERE j MATCH ? AND d.tenant = ?"
        " ORDER BY score LIMIT ?) AS r JOIN d ON d.rowid = r.rid ORDER BY r.score",
    }
    fts_choice = fastest(
        {
            k: (lambda i, sql=sql: raw.execute(sql, (expressions[i], TENANT, WINDOW)).fetchall())
            for k, sql in fts_sql.items()
        },
        min(len(queries), 50),
    )
    sql = fts_sql[fts_choice]

    def fts_rows(i: int) -> list[tuple[str, str, str, float]]:
        return raw.execute(sql, (expressions[i], TENANT, WINDOW)).fetchall()  # type: ignore[no-any-return]

    def scores_matmul(q: Matrix) -> Matrix:
        return matrix @ q  # type: ignore[no-any-return]

    def scores_einsum(q: Matrix) -> Matrix:
        return np.einsum("ij,j->i", matrix, q)  # type: ignore[no-any-return]

    def scores_vecdot(q: Matrix) -> Matrix:
        return np.vecdot(matrix, q)  # type: ignore[no-any-return]

    # Like for like: Sift scans a block this small on one core on purpose (a worker runs many
    # searches at once, and BLAS threads spinning on a busy machine cost 10x), so the raw
    # baseline is the best one-core call; the all-cores ``@`` is printed beside it, as a note.
    one_core = matrix.shape[0] * matrix.shape[1] < BLAS_MIN_PRODUCT
    scorers = {"@": scores_matmul, "einsum": scores_einsum, "vecdot": scores_vecdot}
    if one_core:
        del scorers["@"]
    knn_choice = fastest(
        {k: (lambda i, f=f: f(qvecs[i])) for k, f in scorers.items()}, min(len(queries), 50)
    )
    score = scorers[knn_choice]

    def knn_rows(i: int, score: Callable[[Matrix], Matrix] = score) -> list[Any]:
        scores = score(qvecs[i])
        if scores.shape[0] > WINDOW:
            top = np.argpartition(-scores, WINDOW)[:WINDOW]
        else:
            top = np.arange(scores.shape[0])
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(ids[j], titles[j], texts[j], float(scores[j])) for j in top.tolist()]

    def raw_hybrid(i: int) -> list[Any]:
        return raw_rrf((fts_rows(i), knn_rows(i)), COARSE)

    print(f"  raw fts statement: {fts_choice}; raw knn scores: {knn_choice}")
    n = range(len(queries))
    modes: list[tuple[str, list[Callable[[], object]], list[Callable[[], object]]]] = [
        ("fts", [sift(("bm25",), i) for i in n], [partial(fts_rows, i) for i in n]),
        ("vector", [sift(("knn",), i) for i in n], [partial(knn_rows, i) for i in n]),
        ("hybrid", [sift(("bm25", "knn"), i) for i in n], [partial(raw_hybrid, i) for i in n]),
    ]
    check_same_answers(backend, name, queries, qvecs, fts_rows, knn_rows)
    table: list[tuple[str, ...]] = []
    for mode, sift_calls, raw_calls in modes:
        s, r = timed(sift_calls, raw_calls)
        s50, s95, r50, r95 = (float(np.percentile(x, p)) for x in (s, r) for p in (50, 95))
        label = f"{name} ({len(docs):,} docs + {len(noise):,} noise, {len(queries)} q)"
        table.append(
            (label, mode, f"{s50:.2f}", f"{s95:.2f}", f"{r50:.2f}", f"{r95:.2f}",
             f"{s50 / r50:.2f}x", f"{s95 / r95:.2f}x")
        )  # fmt: skip
    if one_core:
        s, r = timed(modes[1][1], [partial(knn_rows, i, scores_matmul) for i in n])
        s50, r50 = float(np.percentile(s, 50)), float(np.percentile(r, 50))
        print(
            f"  note: raw vector with BLAS @ on all cores: p50 {r50:.2f} ms against Sift's "
            f"one-core {s50:.2f} ms ({s50 / r50:.2f}x); not the baseline (see above)"
        )
    backend.close()
    raw.close()
    return table


def check_same_answers(
    backend: EmbeddedBackend,
    name: str,
    queries: list[str],
    qvecs: Matrix,
    fts_rows: Callable[[int], list[tuple[str, str, str, float]]],
    knn_rows: Callable[[int], list[tuple[str, str, str, float]]],
) -> None:
    """Both sides return the tenant's hits, the same ones up to score ties; else stop."""
    for i in range(min(len(queries), 20)):
        got = backend.retrieve(
            ChannelQuery(name, HardFilters(TENANT), ("bm25", "knn"), WINDOW, queries[i], qvecs[i])
        ).hits
        for channel, raw_hits in (("bm25", fts_rows(i)), ("knn", knn_rows(i))):
            sift_hits = got[channel]  # type: ignore[index]
            assert len(sift_hits) == len(raw_hits), (channel, i)
            assert not any(h.document.id.startswith(NOISE_PREFIX) for h in sift_hits)
            assert not any(h[0].startswith(NOISE_PREFIX) for h in raw_hits)
            sift_scores = np.array([abs(h.score) for h in sift_hits])
            raw_scores = np.array([abs(h[3]) for h in raw_hits])
            assert np.allclose(sift_scores, raw_scores, rtol=1e-4, atol=1e-5), (channel, i)
            assert sift_hits[0].document.text == next(
                h[2] for h in raw_hits if h[0] == sift_hits[0].document.id
            ), (channel, i)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scifact", type=Path, default=REPO_ROOT.parent / "shared/data/scifact")
    parser.add_argument("--docs", type=int, default=100_000, help="synthetic corpus size")
    parser.add_argument("--queries", type=int, default=300, help="queries per corpus")
    parser.add_argument("--quick", action="store_true", help="20k synthetic docs, 100 queries")
    parser.add_argument("--skip-scifact", action="store_true")
    parser.add_argument(
        "--scifact-vectors",
        type=Path,
        help="an .npy cache of the SciFact document vectors: read if present, else written",
    )
    args = parser.parse_args()
    if args.quick:
        args.docs, args.queries = min(args.docs, 20_000), min(args.queries, 100)

    print(f"window {WINDOW}, coarse limit {COARSE}; tenant {TENANT!r} plus an equal {NOISE!r}")
    rows: list[tuple[str, ...]] = []
    with tempfile.TemporaryDirectory(prefix="sift-bench-") as tmp:
        if not args.skip_scifact:
            print("scifact:")
            scifact = load_scifact(args.scifact, args.queries, args.scifact_vectors, not args.quick)
            rows += run("scifact", *scifact, Path(tmp))
        print("synthetic:")
        rows += run("synthetic", *synthetic(args.docs, args.queries), Path(tmp))

    header = ("corpus", "mode", "sift p50", "sift p95", "raw p50", "raw p95", "p50 x", "p95 x")
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]
    print("\nper-query latency in ms; x = sift / raw")
    for row in [header, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()

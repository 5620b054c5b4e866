"""Retrieval latency of the embedded backend against the bare library calls it wraps.

For SciFact (real text, real MiniLM vectors) and a synthetic corpus (Zipfian words,
random unit vectors), it times per query, window 120:

* ``fts``: ``EmbeddedBackend.retrieve`` BM25 channel vs. the bare FTS5 statement
  ``SELECT rowid FROM t WHERE t MATCH ? ORDER BY bm25(t) LIMIT n`` on a plain apsw
  connection to a plain FTS5 table holding the same text;
* ``vector``: the kNN channel vs. bare numpy ``matrix @ q`` plus ``argpartition``;
* ``hybrid``: both channels (plus ``worker.core.fusion.rrf_fuse`` when it exists)
  vs. the two bare calls back to back.

Query vectors are computed before timing, so embedding is excluded on both sides.

    python benchmarks/bench_retrieval.py [--scifact PATH] [--docs 100000] [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import apsw
import numpy as np
import numpy.typing as npt

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from worker.adapters.embedded import FTS_TOKENIZER, EmbeddedBackend, match_expression  # noqa: E402
from worker.contract import Channel  # noqa: E402
from worker.core.types import ChannelQuery, Document, HardFilters  # noqa: E402

WINDOW = 120  # max(4 * 30, 32): the channel window with rerank on (DESIGN.md §3)
TENANT = "bench"
Matrix = npt.NDArray[np.float32]


def fusion() -> Callable[..., Any] | None:
    """``worker.core.fusion.rrf_fuse`` if this checkout has it."""
    try:
        module = importlib.import_module("worker.core.fusion")
    except ImportError:
        return None
    fuse: Callable[..., Any] | None = getattr(module, "rrf_fuse", None)
    return fuse


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


def build_raw(path: Path, docs: Sequence[Document]) -> apsw.Connection:
    conn = apsw.Connection(str(path))
    conn.execute(f"CREATE VIRTUAL TABLE t USING fts5(title, text, tokenize='{FTS_TOKENIZER}')")
    with conn:
        conn.executemany(
            "INSERT INTO t(rowid, title, text) VALUES (?, ?, ?)",
            ((i, d.title, d.text) for i, d in enumerate(docs)),
        )
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


def run(
    name: str, docs: list[Document], vectors: Matrix, queries: list[str], qvecs: Matrix, tmp: Path
) -> list[tuple[str, ...]]:
    started = time.perf_counter()
    backend = EmbeddedBackend(tmp / name)
    for at in range(0, len(docs), 2_000):
        backend.upsert(name, TENANT, docs[at : at + 2_000], vectors[at : at + 2_000])
    raw = build_raw(tmp / f"{name}-raw.db", docs)
    matrix = np.ascontiguousarray(vectors)
    print(f"  indexed {len(docs):,} documents twice in {time.perf_counter() - started:.1f}s")
    fuse = fusion()

    def sift(channels: tuple[Channel, ...], i: int) -> Callable[[], object]:
        query = ChannelQuery(
            name, HardFilters(TENANT), channels, WINDOW, queries[i], vector=qvecs[i]
        )

        def call() -> object:
            results = backend.retrieve(query)
            if fuse is not None and len(channels) == 2:
                return fuse(results.hits)
            return results

        return call

    expressions = [match_expression(q) or '""' for q in queries]

    def raw_fts(i: int) -> Callable[[], object]:
        sql = "SELECT rowid FROM t WHERE t MATCH ? ORDER BY bm25(t) LIMIT ?"
        return lambda: raw.execute(sql, (expressions[i], WINDOW)).fetchall()

    def raw_knn(i: int) -> Callable[[], object]:
        def call() -> object:
            scores = matrix @ qvecs[i]
            top = np.argpartition(-scores, WINDOW)[:WINDOW]
            return top[np.argsort(-scores[top])]

        return call

    def both(i: int) -> Callable[[], object]:
        fts, knn = raw_fts(i), raw_knn(i)
        return lambda: (fts(), knn())

    n = range(len(queries))
    modes: list[tuple[str, list[Callable[[], object]], list[Callable[[], object]]]] = [
        ("fts", [sift(("bm25",), i) for i in n], [raw_fts(i) for i in n]),
        ("vector", [sift(("knn",), i) for i in n], [raw_knn(i) for i in n]),
        ("hybrid", [sift(("bm25", "knn"), i) for i in n], [both(i) for i in n]),
    ]
    table: list[tuple[str, ...]] = []
    for mode, sift_calls, raw_calls in modes:
        s, r = timed(sift_calls, raw_calls)
        s50, s95, r50, r95 = (float(np.percentile(x, p)) for x in (s, r) for p in (50, 95))
        label = f"{name} ({len(docs):,} docs, {len(queries)} q)"
        table.append(
            (label, mode, f"{s50:.2f}", f"{s95:.2f}", f"{r50:.2f}", f"{r95:.2f}",
             f"{s50 / r50:.2f}x", f"{s95 / r95:.2f}x")
        )  # fmt: skip
    backend.close()
    raw.close()
    return table


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

    print(f"window {WINDOW}; rrf_fuse {'timed' if fusion() else 'absent: hybrid = retrieve'}")
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

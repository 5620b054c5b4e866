"""CPU per retrieval of the embedded backend with one thread and with a worker's hundreds.

    python benchmarks/bench_retrieval_threads.py [--baseline 66e1ffc] [--corpus scifact]
                                                 [--batch 500] [--optimize]
                                                 [--threads 1,300] [--retrievals 1200]
                                                 [--rounds 3] [--wait 0.02]

Issue 14's stage table put the embedded backend's ``retrieve`` at 0.59-0.83 ms of thread CPU
per search in the worker against 0.12 ms one call at a time. This imitates the worker's use
of the backend in one process, so the two figures can be taken apart: a persistent thread
pool of ``--threads`` (the worker's item pool is 300), each task holding one of the worker's
CPU slots (``worker.runtime.slots.cpu_slots(0)``: one per core, plus one) through the search's
``probe`` and ``retrieve`` (both channels, tenant-filtered, the window of a reranked search:
120), then letting it go and sleeping ``--wait`` seconds, as a search waits on its model, so
the pool spreads the searches over all of its threads as the worker's does.

Two backends read the same index side by side (each its own copy, written by its own code):
``--baseline``'s ``EmbeddedBackend`` (its ``worker/adapters/embedded.py``, loaded with
``git show``) and today's, each with its own persistent pool, in alternating order round by round.
Each round prints, per side and thread count, the thread CPU (``time.thread_time``: waits on
the GIL, the slots or the disk are not counted) per ``retrieve`` and per ``probe``, the
process CPU per search (everything, the pool's hand-offs included), how many SQLite
connections the backend holds, and the load average. The first round includes each thread's
first search.

The corpus: SciFact's 5,183 abstracts (``--corpus scifact``; titles and texts are real, so
BM25 is) or the 30-document sample corpus that ``bench_rerank_cpu.py`` searches
(``--corpus sample``), each with random unit vectors of 384 dimensions (the kNN scan's cost
does not depend on the values; embedding SciFact would cost some 90 CPU-seconds), under the
tenant ``bench`` plus an equal ``noise`` tenant, so the tenant filter does real work. Each
write transaction (``--batch`` documents) adds an FTS5 segment until FTS5 merges them, as
a service's ingests do; ``--optimize`` merges them into one, as a single bulk load leaves it
(``bench_rerank_cpu.py``'s index is one write of 30 documents: one segment).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from types import ModuleType
from typing import Any

import apsw
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.baseline import module_at  # noqa: E402
from benchmarks.bench_queue import corpus as sample_corpus  # noqa: E402
from benchmarks.bench_queue import queries as sample_queries  # noqa: E402
from worker.adapters.embedded import DB_FILE, EmbeddedBackend  # noqa: E402
from worker.core.query import channel_window, coarse_limit  # noqa: E402
from worker.core.types import ChannelQuery, Document, HardFilters  # noqa: E402
from worker.runtime.slots import cpu_slots  # noqa: E402

INDEX = "bench"
TENANT = "bench"
NOISE = "noise"
DIMENSION = 384
SCIFACT = REPO.parent / "shared" / "data" / "scifact"


def baseline_module(commit: str) -> ModuleType:
    """``worker/adapters/embedded.py`` as it was at ``commit``, as a module of its own."""
    return module_at(commit, "worker/adapters/embedded.py", "bench_baseline_embedded")


def load_corpus(name: str, scifact: Path) -> tuple[list[Document], list[str]]:
    """The documents and the query texts of ``name``."""
    if name == "sample":
        docs = [
            Document(r["id"], r["text"], r["title"], "", r["metadata"]) for r in sample_corpus()
        ]
        return docs, sample_queries(300)
    with open(scifact / "corpus.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    with open(scifact / "queries.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return [Document(r["_id"], r["text"], r["title"], "") for r in rows], texts


def unit_rows(rng: np.random.Generator, n: int) -> Any:
    rows = rng.standard_normal((n, DIMENSION), dtype=np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def build(
    backend_type: Any, data_dir: Path, docs: list[Document], batch: int, optimize: bool
) -> int:
    """The index: every document under ``bench`` and again (other ids) under ``noise``, in
    transactions of ``batch`` documents (each adds an FTS5 segment, until FTS5 merges
    them); ``optimize`` merges them all into one. Answers the count of segments of
    ``bench``'s FTS5 table (``fts_1``, written first, in either schema). Each side builds
    its own data dir: a schema version reads no other's."""
    backend = backend_type(data_dir)
    rng = np.random.default_rng(7)
    for tenant in (TENANT, NOISE):
        for at in range(0, len(docs), batch):
            part = docs[at : at + batch]
            if tenant == NOISE:
                part = [Document(f"n{d.id}", d.text, d.title, "", d.metadata) for d in part]
            backend.upsert(INDEX, tenant, part, unit_rows(rng, len(part)))
    backend.close()
    conn = apsw.Connection(str(data_dir / DB_FILE))  # either side's: its own, not the pool's
    if optimize:
        conn.execute("INSERT INTO fts_1(fts_1) VALUES ('optimize')")
    segments = conn.execute("SELECT count(DISTINCT segid) FROM fts_1_idx").get
    conn.close()
    return int(segments)


class Side:
    """One backend with its own persistent pool of threads and the worker's CPU slots."""

    def __init__(self, name: str, backend: Any, threads: int) -> None:
        self.name = name
        self.backend = backend
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"{name}-{threads}")
        self.slots = cpu_slots(0)
        self.lock = threading.Lock()
        self.sums = {"retrieve": 0.0, "probe": 0.0}

    def search(self, ask: ChannelQuery, pause: float) -> None:
        with self.slots:
            started = time.thread_time()
            self.backend.probe(ask.index, ask.filters.tenant)
            probed = time.thread_time()
            results = self.backend.retrieve(ask)
            done = time.thread_time()
        assert results.hits["bm25"] and results.hits["knn"]
        with self.lock:
            self.sums["probe"] += probed - started
            self.sums["retrieve"] += done - probed
        if pause:
            time.sleep(pause)

    def round(self, asks: list[ChannelQuery], pause: float) -> dict[str, float]:
        """Every ask once; CPU ms per search (thread CPU per call; the process's per search)."""
        self.sums = {"retrieve": 0.0, "probe": 0.0}
        started = time.process_time()
        futures = [self.pool.submit(self.search, ask, pause) for ask in asks]
        wait(futures)
        process = time.process_time() - started
        n = len(asks)
        # ``wait`` keeps a search's exception (a baseline that cannot read the index, no hits)
        # in its future: a round whose searches failed measured other work, so none is shown
        failed = [exc for exc in (f.exception() for f in futures) if exc is not None]
        if failed:
            raise SystemExit(f"not a measure: {len(failed)} of {n} {self.name} searches "
                             f"failed, the first: {failed[0]!r}")  # fmt: skip
        return {
            "retrieve": 1000 * self.sums["retrieve"] / n,
            "probe": 1000 * self.sums["probe"] / n,
            "process": 1000 * process / n,
            "connections": len(self.backend._connections),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--baseline", default="66e1ffc", help="the commit to compare with")
    parser.add_argument("--corpus", choices=("scifact", "sample"), default="scifact")
    parser.add_argument("--scifact", type=Path, default=SCIFACT)
    parser.add_argument("--batch", type=int, default=500, help="documents per write")
    parser.add_argument("--optimize", action="store_true", help="merge FTS5's segments")
    parser.add_argument("--threads", default="1,300", help="thread counts, comma-separated")
    parser.add_argument("--retrievals", type=int, default=1200, help="searches per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait", type=float, default=0.02, help="seconds after each search")
    parser.add_argument(
        "--single-wait", type=float, default=0.0, help="the same for one thread (default: none)"
    )
    args = parser.parse_args()

    docs, texts = load_corpus(args.corpus, args.scifact)
    rng = np.random.default_rng(11)
    size = channel_window(coarse_limit(10, 30, True))
    asks = [
        ChannelQuery(
            index=INDEX,
            filters=HardFilters(TENANT, {}),
            channels=("bm25", "knn"),
            size=size,
            text=texts[i % len(texts)],
            vector=vector.tolist(),
        )
        for i, vector in enumerate(unit_rows(rng, args.retrievals))
    ]
    old = baseline_module(args.baseline)
    counts = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory(prefix="sift-bench-") as tmp:
        dirs = {"baseline": Path(tmp) / "baseline", "today": Path(tmp) / "today"}
        segments = build(old.EmbeddedBackend, dirs["baseline"], docs, args.batch, args.optimize)
        build(EmbeddedBackend, dirs["today"], docs, args.batch, args.optimize)
        print(
            f"{args.corpus}: {len(docs):,} documents per tenant, written {args.batch} per "
            f"transaction, {segments} FTS5 segments; window {size}, "
            f"{args.retrievals} searches per round, {os.cpu_count()} CPUs, "
            f"{cpu_slots(0).size} CPU slots"
        )
        sides = {
            t: [
                Side("baseline", old.EmbeddedBackend(dirs["baseline"]), t),
                Side("today", EmbeddedBackend(dirs["today"]), t),
            ]
            for t in counts
        }
        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        print("round threads side      retrieve  probe  process/search  conns  load")
        for r in range(args.rounds):
            for t in counts:
                pair = sides[t] if r % 2 == 0 else sides[t][::-1]
                for side in pair:
                    row = side.round(asks, args.wait if t > 1 else args.single_wait)
                    results.setdefault((side.name, t), []).append(row)
                    load = os.getloadavg()[0]
                    print(
                        f"{r + 1:<5} {t:<7} {side.name:<9} {row['retrieve']:8.3f} "
                        f"{row['probe']:6.3f} {row['process']:15.3f} {row['connections']:6d}"
                        f"  {load:.1f}"
                    )
        print("\nmedian over the rounds after the first (ms of CPU); ratio baseline/today")
        for t in counts:
            later = {
                name: results[(name, t)][1:] or results[(name, t)] for name in ("baseline", "today")
            }
            for key in ("retrieve", "probe", "process"):
                b = statistics.median(x[key] for x in later["baseline"])
                n = statistics.median(x[key] for x in later["today"])
                print(f"  {t:>4} threads {key:<9} baseline {b:7.3f}  today {n:7.3f}  x{b / n:.2f}")
        for pair in sides.values():
            for side in pair:
                side.pool.shutdown()
                side.backend.close()


if __name__ == "__main__":
    main()

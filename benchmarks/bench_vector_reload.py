"""What a kNN search pays when its index's vectors are not in memory: the embedded backend's
load of one tenant's index's block from SQLite, cold, against the warm search after it.

    python benchmarks/bench_vector_reload.py [--sizes 10000 100000] [--dimension 384]
                                             [--rounds 5]

For each size, one tenant's index of that many short documents with random unit vectors is
written to a fresh data dir. Each round lets go of the process's vectors (as the byte budget
does, ``VECTOR_CACHE_BYTES``) and runs one kNN search, which loads the block again, then one
more on the block in memory. It prints the CPU of the searching thread (``time.thread_time``;
the load runs in it) and the wall time of each, the median over the rounds, the block's
bytes as the budget counts them, and the load's CPU per 1,000 rows. It exits non-zero if a
search found no hit, or if the first search of a round did not load the block.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.adapters.embedded import EmbeddedBackend  # noqa: E402
from worker.core.types import ChannelQuery, Document, HardFilters  # noqa: E402

INDEX, TENANT, BATCH = "idx", "acme", 2_000


def build(data_dir: Path, size: int, dimension: int) -> EmbeddedBackend:
    backend = EmbeddedBackend(data_dir)
    rng = np.random.default_rng(7)
    for at in range(0, size, BATCH):
        n = min(BATCH, size - at)
        vectors = rng.standard_normal((n, dimension)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        docs = [Document(f"doc-{at + i}", f"text of document {at + i}", "") for i in range(n)]
        backend.upsert(INDEX, TENANT, docs, vectors)
    return backend


def search(backend: EmbeddedBackend, vector: np.ndarray) -> tuple[float, float]:
    """One kNN search's thread CPU and wall time, in seconds."""
    query = ChannelQuery(INDEX, HardFilters(TENANT), ("knn",), 120, "", vector=vector)
    cpu, wall = time.thread_time(), time.perf_counter()
    hits = backend.retrieve(query).hits["knn"]
    spent = time.thread_time() - cpu, time.perf_counter() - wall
    if len(hits) != 120:
        raise SystemExit(f"a search found {len(hits)} hits, not 120: no figure printed")
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--dimension", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(11)
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as folder:
            backend = build(Path(folder), size, args.dimension)
            cold: list[tuple[float, float]] = []
            warm: list[tuple[float, float]] = []
            weight = 0
            for _ in range(args.rounds):
                with backend._lock:
                    backend._forget_vectors()
                vector = rng.standard_normal(args.dimension).astype(np.float32)
                cold.append(search(backend, vector))
                if backend._vectors[(INDEX, TENANT)].block.size != size:
                    raise SystemExit("the search did not load the whole block: no figure printed")
                warm.append(search(backend, vector))
                weight = backend._vector_bytes
            backend.close()
        cold_cpu = statistics.median(c for c, _ in cold)
        print(
            f"{size:>9,} rows x {args.dimension}: block {weight / 2**20:7.1f} MiB;"
            f" search with a load {cold_cpu * 1e3:8.1f} ms CPU"
            f" ({statistics.median(w for _, w in cold) * 1e3:.1f} ms wall),"
            f" warm {statistics.median(c for c, _ in warm) * 1e3:6.2f} ms CPU;"
            f" load {cold_cpu / size * 1e6:.2f} ms CPU per 1,000 rows"
        )


if __name__ == "__main__":
    main()

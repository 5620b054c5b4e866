"""What the embedded backend's running index totals (``index_sizes``) cost its writes, and
what they spare the reading a worker makes after every write job.

    python benchmarks/bench_index_sizes.py --corpus ../shared/data/scifact/corpus.jsonl \\
        --before ../main [--rounds 3] [--big 200000] [--big-bytes 1000]

* writes: the corpus (read in place) upserted into a fresh data dir, 500 documents a call
  (``sift ingest``'s request), with random unit vectors of 384 dimensions (the embedder is
  not under test), then upserted again (every document replaced), then dropped; once with
  this tree's code and once with ``--before``'s (a checkout of the release before), each in
  a process of its own, alternately, ``--rounds`` times. It prints the median CPU of each
  step (``time.thread_time``: SQLite runs in the calling thread) and the difference, and
  the FTS5 segments each left after the ingest.
* reads: one tenant's index of ``--big`` documents of ``--big-bytes`` of text, written
  through the backend without vectors, 5,000 a call; then the release before's reading (a
  sum over every body of the index) against ``index_size``'s (a seek), median of five
  each, CPU and wall, the file in the OS page cache.

It exits non-zero if the totals differ from the sum.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("BENCH_CODE", str(REPO)))  # the code under test

from worker.adapters.embedded import EmbeddedBackend  # noqa: E402
from worker.core.catalog import IndexSize  # noqa: E402
from worker.core.types import Document  # noqa: E402
from worker.evaluation.inputs import read_corpus  # noqa: E402

#: The release before's ``index_size``: a sum over every body of the tenant's index.
SUM = (
    "SELECT count(*), coalesce(sum(length(CAST(b.title AS BLOB))"
    " + length(CAST(b.text AS BLOB)) + length(CAST(d.metadata AS BLOB))), 0)"
    " FROM docs AS d JOIN bodies AS b ON b.seq = d.seq WHERE d.idx = ?1 AND d.tenant = ?2"
)
STEPS = ("ingest", "replace", "drop")


def summed(backend: EmbeddedBackend, index: str, tenant: str) -> IndexSize:
    with backend._conn() as conn:
        count, stored = conn.execute(SUM, (index, tenant)).fetchone()
    return IndexSize(int(count), int(stored))


def cpu(step: Callable[[], object]) -> float:
    start = time.thread_time()
    step()
    return time.thread_time() - start


def write_round(corpus: Path) -> dict[str, float]:
    """One round of writes with the code this process imported (a child's)."""
    docs = [
        Document(d.id, d.text, title=d.title or "", metadata=dict(d.metadata or {}))
        for d in read_corpus(corpus)
    ]
    vectors = np.random.default_rng(7).standard_normal((len(docs), 384)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        backend = EmbeddedBackend(Path(tmp))
        backend.check()
        version = iter(range(1, 10**6))

        def upsert_all() -> None:
            for i in range(0, len(docs), 500):
                backend.upsert(
                    "sci", "acme", docs[i : i + 500], vectors[i : i + 500], version=next(version)
                )

        took = {"ingest": cpu(upsert_all)}
        with backend._conn() as conn:
            took["segments"] = conn.execute("SELECT count(DISTINCT segid) FROM fts_1_idx").get
        took["replace"] = cpu(upsert_all)
        if backend.index_size("sci", "acme") != summed(backend, "sci", "acme"):
            sys.exit("the totals differ from the sum")
        took["drop"] = cpu(lambda: backend.delete_index("sci", "acme", version=next(version)))
        backend.close()
        return took


def child_round(code: Path, corpus: Path) -> dict[str, float]:
    env = {**os.environ, "BENCH_CODE": str(code.resolve())}
    out = subprocess.run(
        [sys.executable, __file__, "--corpus", str(corpus), "--child"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout))


def reads(documents: int, size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        backend = EmbeddedBackend(data_dir)
        words = " ".join(f"w{i}" for i in range(size // 4))[:size]
        for first in range(0, documents, 5_000):
            rows = range(first, min(first + 5_000, documents))
            backend.upsert("big", "acme", [Document(f"d{i}", words) for i in rows], None)
        expected = summed(backend, "big", "acme")
        if backend.index_size("big", "acme") != expected or expected.documents != documents:
            sys.exit(f"the totals differ from the sum: {expected}")
        file_mb = (data_dir / "sift.db").stat().st_size / 1e6
        print(f"\nreads: {documents:,} documents of {size:,} B, {file_mb:,.0f} MB file")
        for name, read in (
            ("sum over every body (before)", lambda: summed(backend, "big", "acme")),
            ("index_size (running totals)", lambda: backend.index_size("big", "acme")),
        ):
            read()  # warm: the file in the OS page cache
            times = []
            for _ in range(5):
                wall = time.perf_counter()
                times.append((cpu(read), time.perf_counter() - wall))
            print(
                f"  {name:30} CPU {statistics.median(t[0] for t in times) * 1e3:10.3f} ms"
                f"   wall {statistics.median(t[1] for t in times) * 1e3:10.3f} ms"
            )
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--before", type=Path, help="a checkout of the release before")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big", type=int, default=200_000)
    parser.add_argument("--big-bytes", type=int, default=1_000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(write_round(args.corpus)))
        return
    if args.before is not None:
        trees = {"before": args.before, "this": REPO}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in trees if r % 2 == 0 else reversed(trees):
                runs[name].append(child_round(trees[name], args.corpus))
        print(f"writes: the corpus, 500 documents a call, median CPU of {args.rounds} rounds")
        for step in (*STEPS, "segments"):
            before, this = (statistics.median(run[step] for run in runs[t]) for t in trees)
            unit = "" if step == "segments" else " s"
            print(
                f"  {step:8} before {before:7.2f}{unit}   this {this:7.2f}{unit}"
                f"   ({(this / before - 1) * 100:+.1f} %)"
            )
    reads(args.big, args.big_bytes)


if __name__ == "__main__":
    main()

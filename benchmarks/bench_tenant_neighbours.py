"""A noisy neighbour on the embedded backend: tenant B's BM25 search with and without a big A.

    python benchmarks/bench_tenant_neighbours.py [--baseline e02e0e8] [--copies 4]
                                                 [--queries 300] [--rounds 3]

Tenant ``b`` holds SciFact's 5,183 abstracts in the index ``sci``; in a second data dir,
tenant ``a`` also holds ``--copies`` copies of them (other ids) under the same name. B then
runs SciFact's queries, BM25 only, the window of a reranked search (120), on four backends
side by side: ``--baseline``'s ``EmbeddedBackend`` (its ``worker/adapters/embedded.py``,
loaded with ``git show``: one FTS5 table per index name, shared by its tenants) and today's
(one per index and tenant), each alone and beside A, each in a data dir its own code wrote,
in a new order every round. It prints the thread CPU (``time.thread_time``) per search,
median over the rounds, and how many of B's queries got other top-10 scores, and other
top-10 ids or order, beside A than alone: A's documents entering B's BM25 statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.baseline import module_at  # noqa: E402
from worker.adapters.embedded import EmbeddedBackend  # noqa: E402
from worker.core.types import ChannelQuery, Document, HardFilters  # noqa: E402

SCIFACT = REPO.parent / "shared" / "data" / "scifact"
INDEX = "sci"
WINDOW = 120
BATCH = 500


def load(backend: Any, tenant: str, docs: list[Document], prefix: str) -> None:
    for at in range(0, len(docs), BATCH):
        part = [Document(f"{prefix}{d.id}", d.text, d.title, "") for d in docs[at : at + BATCH]]
        backend.upsert(INDEX, tenant, part, None)


def top(backend: Any, texts: list[str]) -> list[list[tuple[str, float]]]:
    return [
        [
            (h.document.id, h.score)
            for h in backend.retrieve(
                ChannelQuery(INDEX, HardFilters("b"), ("bm25",), WINDOW, text)
            ).hits["bm25"][:10]
        ]
        for text in texts
    ]


def cpu_per_search(backend: Any, texts: list[str]) -> float:
    """Thread CPU per BM25 search, in ms."""
    started = time.thread_time()
    for text in texts:
        backend.retrieve(ChannelQuery(INDEX, HardFilters("b"), ("bm25",), WINDOW, text))
    return 1e3 * (time.thread_time() - started) / len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--baseline",
        default="e02e0e8",
        help="the commit to compare with (default: the last with one FTS5 table per index name)",
    )
    parser.add_argument("--copies", type=int, default=4, help="A's size, in SciFacts")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as f:
        docs = [Document(r["_id"], r["text"], r["title"], "") for r in map(json.loads, f)]
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][: args.queries]
    old = module_at(args.baseline, "worker/adapters/embedded.py", "bench_baseline_embedded")
    kinds = {"baseline": old.EmbeddedBackend, "today": EmbeddedBackend}
    with tempfile.TemporaryDirectory(prefix="sift-bench-") as tmp:
        backends: dict[tuple[str, str], Any] = {}
        for side, kind in kinds.items():
            for neighbour in ("alone", "beside A"):
                backend = kind(Path(tmp) / f"{side}-{neighbour}")
                load(backend, "b", docs, "")
                if neighbour == "beside A":
                    for copy in range(args.copies):
                        load(backend, "a", docs, f"a{copy}-")
                backends[(side, neighbour)] = backend
        print(
            f"B: {len(docs):,} SciFact abstracts in {INDEX!r}; A beside it: "
            f"{args.copies * len(docs):,}; {len(texts)} queries, BM25, window {WINDOW}; "
            f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
        )
        for side in kinds:
            alone, beside = (top(backends[(side, n)], texts) for n in ("alone", "beside A"))
            # every query has a term in B's abstracts: an empty answer is a backend that did
            # not search (another schema, a filter that matches nothing), and "no query
            # changed" beside A would then be no measure
            empty = {
                n: sum(not t for t in tops) for n, tops in (("alone", alone), ("beside A", beside))
            }
            if any(empty.values()):
                sys.exit(
                    f"not a measure: {side} answered no hit to {empty} of {len(texts)} queries"
                )
            pairs = list(zip(alone, beside, strict=True))
            scores = sum(a != b for a, b in pairs)
            order = sum([i for i, _ in a] != [i for i, _ in b] for a, b in pairs)
            print(f"  {side:8} queries whose top-10 A changed: scores {scores}, ids/order {order}")
        rng = random.Random(7)
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in backends}
        for _ in range(args.rounds):
            for key in rng.sample(sorted(backends), len(backends)):
                samples[key].append(cpu_per_search(backends[key], texts))
        print(
            f"thread CPU per search, ms (median of {args.rounds} rounds; load after: "
            f"{os.getloadavg()[0]:.2f}):"
        )
        for side in kinds:
            a, b = (statistics.median(samples[(side, n)]) for n in ("alone", "beside A"))
            print(f"  {side:8} alone {a:6.3f}   beside A {b:6.3f}   x{b / a:.2f}")
        for backend in backends.values():
            backend.close()


if __name__ == "__main__":
    main()

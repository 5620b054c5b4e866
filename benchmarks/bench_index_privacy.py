"""Index-name privacy, timed: does an index only another tenant has cost what a missing one does?

    python benchmarks/bench_index_privacy.py [--documents 20000] [--rounds 2000]

On the embedded backend in a temporary data directory, tenant acme holds ``--documents``
documents (with vectors) in the index ``secret``. Tenant beta then asks the pipeline for
``secret`` and for ``nothing-here``, interleaved, ``--rounds`` times each: both end in
``IndexNotFound`` after one ``channels()`` statement; the script prints the median and p99
of each, in microseconds. It then times a first one-document write by a new tenant into
``secret`` against one into a name nobody has: on the embedded backend both create the
writer's own FTS5 table (each tenant's index is its own), which docs/security.md states.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fakes import FakeEmbedder  # noqa: E402
from worker.adapters.embedded import EmbeddedBackend  # noqa: E402
from worker.contract import SearchSpec  # noqa: E402
from worker.core.pipeline import PipelineConfig, SearchPipeline  # noqa: E402
from worker.core.types import Document  # noqa: E402
from worker.errors import IndexNotFound  # noqa: E402

WORDS = "heron launch march budget plan river stone delta jazz chess salt tea green ash".split()


def micros(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"median {1e6 * statistics.median(ordered):7.1f} us   p99 {1e6 * p99:7.1f} us"


def timed(run: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    run(*args)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2_000)
    parser.add_argument("--writes", type=int, default=100)
    args = parser.parse_args()
    rng = random.Random(7)
    embedder = FakeEmbedder()
    with tempfile.TemporaryDirectory() as data:
        backend = EmbeddedBackend(Path(data))
        for start in range(0, args.documents, 1_000):
            docs = [
                Document(str(i), " ".join(rng.choices(WORDS, k=12)), "", "1", {})
                for i in range(start, min(start + 1_000, args.documents))
            ]
            backend.upsert("secret", "acme", docs, embedder.embed([d.text for d in docs]))
        pipeline = SearchPipeline(backend, embedder, config=PipelineConfig())
        assert pipeline.search(SearchSpec(index="secret", query="heron"), "acme").hits

        def refused(name: str) -> Callable[[], object]:
            def run() -> None:
                try:
                    pipeline.search(SearchSpec(index=name, query="heron launch"), "beta")
                except IndexNotFound:
                    return
                raise AssertionError(f"{name!r} answered beta")

            return run

        times: dict[str, list[float]] = {"secret": [], "nothing-here": []}
        for _ in range(args.rounds):
            for name in rng.sample(sorted(times), 2):  # interleaved, in random order
                times[name].append(timed(refused(name)))
        print(f"acme holds {args.documents:,} documents in 'secret'; beta searches, refused:")
        for name, samples in times.items():
            print(f"  {name!r:16} {micros(samples)}")

        writes: dict[str, list[float]] = {"into 'secret'": [], "into a new name": []}
        doc = [Document("x", "heron launch notes", "", "1", {})]
        vector = embedder.embed([doc[0].text])
        for i in range(args.writes):
            tenant = f"writer{i}"  # a first write by this tenant, every time
            writes["into 'secret'"].append(timed(backend.upsert, "secret", tenant, doc, vector))
            writes["into a new name"].append(
                timed(backend.upsert, f"fresh{i}", tenant, doc, vector)
            )
        print("a tenant's first one-document write (upsert only, no embedding, no queue):")
        for what, samples in writes.items():
            print(f"  {what:16} {micros(samples)}")
        backend.close()


if __name__ == "__main__":
    main()

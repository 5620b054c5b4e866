"""CPU time of the pure rerank stage for 30 candidates: prompt, normalisation, trace, hits.

Target (issue 2): under 1 ms per search. Measured with time.process_time over many
repetitions, beside a no-op baseline loop, in one run.

    python benchmarks/bench_pipeline_cpu.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from worker.core.fusion import rrf_fuse
from worker.core.pipeline._hits import _hit, _trace_candidates
from worker.core.policy import build_prompt
from worker.core.ranks import normalise_positions
from worker.core.types import ChannelHit, Document, RerankPrompt

WORDS = "protein cell gene expression tumour growth factor receptor pathway signal".split()


def candidates(n: int = 30) -> list:  # type: ignore[type-arg]
    docs = [
        Document(
            f"doc-{i}",
            " ".join(WORDS[(i + j) % len(WORDS)] for j in range(220)),
            title=f"Title {i}",
            revision="r1",
        )
        for i in range(4 * n)
    ]
    bm25 = [ChannelHit(d, 10.0 - i / 10) for i, d in enumerate(docs)]
    knn = [ChannelHit(d, 0.9 - i / 1000) for i, d in enumerate(reversed(docs))]
    return rrf_fuse({"bm25": bm25, "knn": knn}, limit=n)


def worker_prompt(fused: list) -> RerankPrompt:  # type: ignore[type-arg]
    """The worker's prompt for ``fused``: candidates of up to 1,200 characters, k=10."""
    return build_prompt(
        "which receptor drives tumour growth",
        [(c.document.title, c.document.text) for c in fused],
        k=10,
        max_chars=1200,
        thinking_tokens=1024,
        tokens_per_position=8,
    )


def stage(fused: list) -> int:  # type: ignore[type-arg]
    prompt = worker_prompt(fused)
    kept = normalise_positions([7, 3, 3, 0, 31, 12, 1, 2, 9, 4, 5, 6, 8], len(fused), 10).kept
    trace = _trace_candidates(fused, prompt, 1200)
    hits = [_hit(fused[p - 1], final) for final, p in enumerate(kept, start=1)]
    return len(prompt.user) + len(trace) + len(hits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    fused = candidates()
    samples = []
    for _ in range(args.repeat):
        start = time.process_time_ns()
        stage(fused)
        samples.append((time.process_time_ns() - start) / 1e6)
    fuse_samples = []
    hits = [ChannelHit(c.document, 1.0) for c in fused] * 4
    for _ in range(args.repeat):
        start = time.process_time_ns()
        rrf_fuse({"bm25": hits, "knn": list(reversed(hits))}, limit=30)
        fuse_samples.append((time.process_time_ns() - start) / 1e6)
    per_call = sum(samples) / len(samples)
    print(f"rerank stage, 30 candidates (prompt + normalise + trace + hits), {args.repeat} runs")
    print(
        f"  mean {per_call:.3f} ms CPU, median {statistics.median(samples):.3f} ms, "
        f"p95 {sorted(samples)[int(0.95 * len(samples))]:.3f} ms  (target < 1 ms: "
        f"{'met' if per_call < 1 else 'MISSED'}; ratio to target {per_call / 1.0:.2f})"
    )
    print(f"  RRF over 2 x 120 hits: mean {sum(fuse_samples) / len(fuse_samples):.3f} ms CPU")


if __name__ == "__main__":
    main()

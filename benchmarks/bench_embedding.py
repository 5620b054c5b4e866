"""Query embedding cost: one query per model call, batched calls, and the coalescing embedder
under concurrent threads, measured side by side in one run.

    python benchmarks/bench_embedding.py [--queries 512] [--threads 64]

Prints CPU milliseconds per query (this process, all threads) and the ratios against one
query per call. The worker's searches embed their queries through ``CoalescingEmbedder``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_queue import queries  # noqa: E402
from worker.adapters.embedder import CoalescingEmbedder, OnnxMiniLMEmbedder  # noqa: E402


def cpu_ms_per_query(run: object, n: int) -> float:
    started = time.process_time()
    run()  # type: ignore[operator]
    return 1000 * (time.process_time() - started) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--threads", type=int, default=64)
    args = parser.parse_args()
    qs = queries(args.queries)
    model = OnnxMiniLMEmbedder(threads=1)  # the worker's default, SIFT_EMBEDDING_THREADS=1
    model.embed(qs[:16])  # load and warm up
    out: dict[str, float] = {}
    out["alone_cpu_ms"] = cpu_ms_per_query(lambda: [model.embed([q]) for q in qs], len(qs))
    for size in (4, 16, 64):
        out[f"batch_{size}_cpu_ms"] = cpu_ms_per_query(
            lambda size=size: [model.embed(qs[i : i + size]) for i in range(0, len(qs), size)],
            len(qs),
        )
    coalescing = CoalescingEmbedder(model)
    with ThreadPoolExecutor(args.threads) as pool:
        out[f"coalescing_{args.threads}_threads_cpu_ms"] = cpu_ms_per_query(
            lambda: list(pool.map(lambda q: coalescing.embed([q]), qs)), len(qs)
        )
    base = out["alone_cpu_ms"]
    out.update({f"{k.removesuffix('_cpu_ms')}_ratio": v / base for k, v in list(out.items())})
    print(json.dumps({k: round(v, 3) for k, v in out.items()}, indent=2))


if __name__ == "__main__":
    main()

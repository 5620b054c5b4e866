"""Query embedding cost: one query per model call, batched calls, and the coalescing embedder
under concurrent threads, for the shipped graph (fp32 products) and Sift's int8-compute graph,
measured side by side in one run, with the cosine between their vectors.

    python benchmarks/bench_embedding.py [--queries 512] [--threads 64]

Prints CPU milliseconds per query (this process, all threads) and the ratios against one
query per call. On the fp32 graph (``SIFT_EMBEDDING_INT8_COMPUTE=false``) the worker's
searches embed their queries through ``CoalescingEmbedder``; on the int8 graph one per call
(``bench_query_batching.py`` measures batch-independent int8 graphs coalesced).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as cache:
        models = {  # one onnxruntime thread each: the worker's default, SIFT_EMBEDDING_THREADS=1
            "fp32": OnnxMiniLMEmbedder(threads=1),
            "int8": OnnxMiniLMEmbedder(threads=1, int8_cache_dir=Path(cache)),
        }
        vectors = {name: model.embed_array(qs) for name, model in models.items()}  # warm up
        out["cosine_int8_vs_fp32_min"] = float((vectors["int8"] * vectors["fp32"]).sum(1).min())
        for name, model in models.items():
            out[f"{name}_alone_cpu_ms"] = cpu_ms_per_query(
                lambda model=model: [model.embed([q]) for q in qs], len(qs)
            )
            for size in (4, 16, 64):
                out[f"{name}_batch_{size}_cpu_ms"] = cpu_ms_per_query(
                    lambda model=model, size=size: [
                        model.embed(qs[i : i + size]) for i in range(0, len(qs), size)
                    ],
                    len(qs),
                )
            coalescing = CoalescingEmbedder(model)
            with ThreadPoolExecutor(args.threads) as pool:
                out[f"{name}_coalescing_{args.threads}_threads_cpu_ms"] = cpu_ms_per_query(
                    lambda coalescing=coalescing: list(
                        pool.map(lambda q: coalescing.embed([q]), qs)
                    ),
                    len(qs),
                )
    base = out["fp32_alone_cpu_ms"]
    out.update(
        {f"{k.removesuffix('_cpu_ms')}_ratio": v / base for k, v in list(out.items()) if "ms" in k}
    )
    print(json.dumps({k: round(v, 4) for k, v in out.items()}, indent=2))


if __name__ == "__main__":
    main()

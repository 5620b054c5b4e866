"""Document embedding paths on SciFact's abstracts, side by side in one run: CPU per
document, cosine to the fp32 graph, and (with ``--queries``/``--qrels``) the kNN and fused
nDCG@10 each path's vectors give.

    python benchmarks/bench_doc_embedding.py --corpus ../shared/data/scifact/corpus.jsonl \\
        [--queries ../shared/data/scifact/queries.jsonl \\
         --qrels ../shared/data/scifact/qrels/test.tsv]

The paths: the int8-compute graph as Sift makes it (attention fused into one node per
layer), the same graph handed each whole text to tokenize (as before the head cut: the
same ids), the same graph with attention spelled out as the export has it (the r2 graph),
the fused graph with a shorter token cap (192, 128: MiniLM was trained at 128), and the
shipped fp32-product graph. Every path embeds one text per call on one onnxruntime thread
(CPU per document is then what a worker pays per core, whatever the load). The timed
rounds are interleaved, so a burst of load elsewhere hits every path alike; the median is
printed. ``--repeat N`` makes each sampled text N abstracts long (long documents, where
tokenizing the whole text cost most). The nDCG columns index the whole corpus once per
path (in-process, embedded backend) and run the 300 test claims through
:func:`worker.evaluation.harness.evaluate`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.adapters.embedder import (  # noqa: E402
    HEAD_CHARS,
    MAX_TOKENS,
    OnnxMiniLMEmbedder,
    default_model_path,
)
from worker.adapters.int8_graph import int8_compute_model  # noqa: E402
from worker.evaluation.harness import TENANT, evaluate  # noqa: E402
from worker.evaluation.inputs import Collection, read_corpus  # noqa: E402
from worker.runtime.inprocess import build_runtime, embedding_text  # noqa: E402
from worker.settings import load_settings  # noqa: E402


def paths(cache: Path) -> dict[str, OnnxMiniLMEmbedder]:
    fused = int8_compute_model(default_model_path(), cache)
    unfused = int8_compute_model(default_model_path(), cache, fuse_attention=False)

    def one(
        model: Path | None, cap: int = MAX_TOKENS, head: int | None = HEAD_CHARS
    ) -> OnnxMiniLMEmbedder:
        return OnnxMiniLMEmbedder(
            model_path=model,
            threads=1,
            parallel_calls=1,
            batch_size=1,
            max_tokens=cap,
            head_chars=head,
        )

    return {
        "int8, fused attention, 256 (default)": one(fused),
        "int8, fused attention, 256, whole text tokenized": one(fused, head=None),
        "int8, attention unfused (r2), 256": one(unfused),
        "int8, fused attention, 192": one(fused, 192),
        "int8, fused attention, 128": one(fused, 128),
        "fp32 products, 256": one(None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--queries", type=Path)
    parser.add_argument("--qrels", type=Path)
    parser.add_argument("--sample", type=int, default=128, help="texts per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="abstracts per sampled text")
    args = parser.parse_args()
    documents = read_corpus(args.corpus)
    texts = [embedding_text(d.title, d.text) for d in documents]
    step = max(1, len(texts) // args.sample)
    sample = [" ".join(texts[i : i + args.repeat]) for i in range(0, len(texts), step)]
    sample = sample[: args.sample]
    cache = Path.home() / ".cache" / "sift"
    embedders = paths(cache)
    reference = embedders["fp32 products, 256"].embed_array(sample)
    report: dict[str, dict[str, float]] = {}
    for name, embedder in embedders.items():
        cosines = (embedder.embed_array(sample) * reference).sum(axis=1)  # and warm up
        report[name] = {"cosine_to_fp32_min": float(cosines.min())}
        report[name]["cosine_to_fp32_mean"] = float(cosines.mean())
    times: dict[str, list[float]] = {name: [] for name in embedders}
    for _ in range(args.rounds):
        for name, embedder in embedders.items():
            started = time.process_time()
            embedder.embed_array(sample)
            times[name].append(1000 * (time.process_time() - started) / len(sample))
    default = statistics.median(times["int8, fused attention, 256 (default)"])
    for name in embedders:
        report[name]["cpu_ms_per_doc"] = statistics.median(times[name])
        report[name]["cpu_vs_default"] = report[name]["cpu_ms_per_doc"] / default
    if args.queries and args.qrels:
        collection = Collection(args.corpus, args.queries, args.qrels)
        for name, embedder in embedders.items():
            with tempfile.TemporaryDirectory() as data:
                settings = load_settings(data_dir=Path(data), model_cache_dir=cache)
                runtime = build_runtime(settings, embedder=embedder)
                runtime.ingest("eval", TENANT, documents)
                runs = evaluate(runtime, collection)["runs"]
                for run in ("bm25", "knn", "fused"):
                    report[name][f"ndcg@10_{run}"] = runs[run]["nDCG@10"]
            print(name, {k: round(v, 4) for k, v in report[name].items()}, flush=True)
    print(json.dumps(report, indent=2, default=lambda v: round(float(np.float64(v)), 4)))


if __name__ == "__main__":
    main()

"""The pipeline's own CPU per reranked search, today's against a baseline commit, in one run.

    python benchmarks/bench_pipeline_own.py [--baseline b49c850] [--rounds 6] [--searches 3000]

What ``bench_rerank_cpu.py --profile`` calls "the rest of the search" (fusion, the prompt,
the result, the trace, the metrics, the retry layer), without what the ports do: the backend
answers the same 30 documents in each channel from memory, the embedder a fixed vector, the
model a fixed reply, so only :mod:`worker.core.pipeline` and what it calls is measured, with
the worker's Prometheus recorder in multiprocess mode. ``--baseline``'s
``worker/core/pipeline.py`` (``git show``) runs beside today's, on the same ports, in
alternating rounds; each round prints the thread CPU per search of both, and the end the
median of the rounds and of their ratios. Then ``rrf_fuse`` alone, ``--baseline``'s
``worker/core/fusion.py`` beside today's (the pipeline above imports today's fusion); and
today's pipeline with the metrics' children looked up at every call and kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


class Backend:
    """The same 30 documents in both channels (kNN in another order), from memory."""

    name = "embedded"

    def __init__(self) -> None:
        from benchmarks.bench_queue import corpus
        from worker.core.types import ChannelHit, Document

        docs = [Document(d["id"], d["text"], d["title"], "r1", d["metadata"]) for d in corpus()]
        self.bm25 = [ChannelHit(d, 12.0 - i / 4) for i, d in enumerate(docs)]
        self.knn = [ChannelHit(d, 0.9 - i / 100) for i, d in enumerate(reversed(docs))]

    def probe(self, index: str, tenant: str, *, timeout_seconds: float | None = None) -> Any:
        from worker.core.types import IndexProbe

        return IndexProbe(frozenset({"bm25", "knn"}), Embedder.model_id)

    def retrieve(self, query: Any) -> Any:
        from worker.core.types import ChannelResults

        return ChannelResults({"bm25": self.bm25, "knn": self.knn}, {"bm25": 0.0001, "knn": 0.0001})


class Embedder:
    model_id = "stub-embedder"
    dimension = 4

    def embed(self, texts: Any) -> list[list[float]]:
        return [[0.5, 0.5, 0.5, 0.5] for _ in texts]


class Reranker:
    model = "claude-haiku-4-5"
    effort = None

    def rerank(self, prompt: Any, timeout_seconds: float) -> Any:
        from worker.core.types import RerankReply, TokenUsage

        return RerankReply([3, 1, 2, 30, 7, 9, 11, 4, 5, 6], TokenUsage(3000, 40), self.model)


def fusion_alone(commit: str, rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """``rrf_fuse`` of ``commit``'s ``worker/core/fusion.py`` and today's, side by side, on
    the benchmark's 30 + 30 hits and on 120 + 120 (the channel window of 30 candidates)."""
    from benchmarks.baseline import module_at
    from benchmarks.bench_pipeline_cpu import candidates
    from worker.core import fusion as today
    from worker.core.types import ChannelHit

    baseline = module_at(commit, "worker/core/fusion.py", "baseline_fusion")
    backend = Backend()
    docs = [c.document for c in candidates(120)]
    many = [ChannelHit(d, 10.0 - i / 10) for i, d in enumerate(docs)]
    inputs = {
        "30+30 hits": {"bm25": backend.bm25, "knn": backend.knn},
        "120+120 hits": {"bm25": many, "knn": list(reversed(many))},
    }
    out: dict[str, dict[str, float]] = {}
    for name, hits in inputs.items():
        got = [m.rrf_fuse(hits, 30) for m in (baseline, today)]
        assert [(c.document.id, c.rrf_score, c.rrf_rank) for c in got[0]] == [
            (c.document.id, c.rrf_score, c.rrf_rank) for c in got[1]
        ]
        times: dict[str, list[float]] = {"baseline": [], "today": []}
        for round_ in range(rounds):
            sides = [("baseline", baseline), ("today", today)]
            for side, module in sides if round_ % 2 == 0 else sides[::-1]:
                started = time.thread_time()
                for _ in range(calls):
                    module.rrf_fuse(hits, 30)
                times[side].append(1e6 * (time.thread_time() - started) / calls)
        out[name] = {side: round(statistics.median(v), 1) for side, v in times.items()}
        print(f"rrf_fuse, {name}: {out[name]}", file=sys.stderr)
    return out


def label_children(pipeline: Any, specs: list[Any], rounds: int) -> dict[str, float]:
    """Today's pipeline with the metrics' children looked up by ``labels`` at every call (as
    before the metrics' ``child`` kept them: that lookup, plus one function call) and kept,
    side by side (the baseline's pipeline above records through today's metrics)."""
    from worker.observability.metrics import _jobs, _recorder, _recording, _rerank

    users = (_recorder, _rerank, _jobs)  # each calls child() by the name it imported
    kept = _recording.child
    sides = {"labels each call": lambda metric, *values: metric.labels(*values), "kept": kept}
    times: dict[str, list[float]] = {side: [] for side in sides}
    try:
        for round_ in range(rounds):
            order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
            for side in order:
                for module in users:
                    module.child = sides[side]  # type: ignore[attr-defined]
                started = time.thread_time()
                for spec in specs:
                    pipeline.search(spec, "bench")
                times[side].append(1e6 * (time.thread_time() - started) / len(specs))
    finally:
        for module in users:
            module.child = kept  # type: ignore[attr-defined]
    out = {side: round(statistics.median(v), 1) for side, v in times.items()}
    print(f"metrics children: {out}", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--baseline", default="b49c850")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--searches", type=int, default=3000, help="per side and round")
    args = parser.parse_args()
    from worker.observability import metrics

    metrics.setup_multiprocess(Path(tempfile.mkdtemp()) / "metrics")
    from benchmarks.baseline import module_at
    from benchmarks.bench_queue import queries
    from worker.contract import SearchSpec
    from worker.core import pipeline as today
    from worker.runtime.bootstrap import pipeline_config
    from worker.settings import load_settings

    baseline = module_at(args.baseline, "worker/core/pipeline.py", "baseline_pipeline")
    settings = load_settings(
        data_dir=Path(tempfile.mkdtemp()), redis_url=None, rerank_enabled=True,
        generation_model="anthropic:claude-haiku-4-5",
    )  # fmt: skip
    pipelines = {
        side: module.SearchPipeline(
            Backend(),
            Embedder(),
            Reranker(),
            pipeline_config(settings),
            metrics.PrometheusRecorder(),
        )
        for side, module in (("baseline", baseline), ("today", today))
    }
    specs = [SearchSpec(index="bench", query=q) for q in queries(args.searches)]
    # warm up, and check both answer alike, reranked: a pipeline that fell back or answered
    # otherwise did other work than the one it is compared with
    warm = {
        side: [pipeline.search(spec, "bench") for spec in specs[:50]]
        for side, pipeline in pipelines.items()
    }
    assert all(result.rerank.applied for result in warm["today"]), "today's rerank not applied"
    results = [r.model_dump_json() for r in warm["today"]]
    assert results == [r.model_dump_json() for r in warm["baseline"]], "the sides answer otherwise"
    rows: dict[str, list[float]] = {side: [] for side in pipelines}
    for round_ in range(args.rounds):
        order = list(pipelines) if round_ % 2 == 0 else list(pipelines)[::-1]
        for side in order:
            search = pipelines[side].search
            started = time.thread_time()
            for spec in specs:
                search(spec, "bench")
            rows[side].append(1e6 * (time.thread_time() - started) / len(specs))
        print(f"round {round_ + 1}: " + ", ".join(
            f"{side} {rows[side][-1]:.1f} us" for side in pipelines), file=sys.stderr)  # fmt: skip
    ratios = [b / t for b, t in zip(rows["baseline"], rows["today"], strict=True)]
    fusion = fusion_alone(args.baseline, args.rounds, args.searches)
    children = label_children(pipelines["today"], specs, args.rounds)
    out = {
        "baseline": args.baseline,
        "us_per_search_median": {side: round(statistics.median(v), 1) for side, v in rows.items()},
        "ratio_baseline_over_today_median": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "load_average": os.getloadavg(),
        "results_alike": len(results) == 50,  # checked above, or no figure at all
        "fusion_alone_us_per_call_median": fusion,
        "today_us_per_search_labels_each_call_or_kept_median": children,
    }
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

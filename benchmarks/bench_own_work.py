"""Sift's own work per reranked search, in instructions: everything but the embedder and the SDK.

    python benchmarks/bench_own_work.py [--searches 400] [--baseline HEAD~1] [--today COMMIT]

A worker's CPU per search moves with the machine's load by more than the changes to its own
code (the embedding and the SDK are most of it, and every stage runs 1.3-2x slower in a busy
worker than alone). This counts instructions instead, under ``valgrind --tool=callgrind``,
which are the same run after run: one process runs what a worker's item thread runs for a
batch item (the item's job context and in-flight gauge, the pipeline's search with the
Prometheus recorder in multiprocess mode, the embedded backend's probe and retrieval, fusion,
the prompt, the reranker's wrappers and the rate budget, the result; the job store's finish
of the item and start of the next in one round trip, against a real redis-server), with the
query embedding and the model call stubbed out (a fixed vector per query, a fixed reply).
Each tree runs twice, with ``--searches`` and with none, so the start-up (imports, ingest)
cancels out; the difference over ``--searches`` is the instructions per search. It prints
today's side (the working tree, or ``--today``'s commit) and ``--baseline``'s (each commit a
``git archive``) side by side, and their ratio.

``--inner N`` runs the loop itself (used by the outer run under valgrind).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DIMENSION = 64
WARM = 20  # searches before the counted ones: first-use costs (statement caches, metrics files)


class StubEmbedder:
    """A fixed vector per text (from its CRC): no model, the same instructions every run."""

    model_id = "stub-embedder"
    dimension = DIMENSION

    def embed(self, texts: Any) -> list[list[float]]:
        out = []
        for text in texts:
            seed = zlib.crc32(text.encode())
            out.append([((seed >> (i % 24)) % 97) / 97.0 - 0.5 for i in range(DIMENSION)])
        return out


class StubReranker:
    """The model's answer without the SDK: the candidates reversed, a fixed usage."""

    model = "claude-haiku-4-5"
    effort = None

    def rerank(self, prompt: Any, timeout_seconds: float) -> Any:
        from worker.core.types import RerankReply, TokenUsage

        positions = list(range(prompt.candidate_count, 0, -1))[:10]
        return RerankReply(positions, TokenUsage(3000, 40), self.model)


def inner(searches: int) -> None:
    """Set up (outside the count's difference) and run ``searches`` batch items, as a worker."""
    sys.path.insert(0, os.environ["BENCH_TREE"])
    tmp = Path(tempfile.mkdtemp())
    from worker.observability import metrics

    metrics.setup_multiprocess(tmp / "metrics")
    from benchmarks.bench_queue import INDEX, corpus, queries
    from worker.contract import DocumentIn, SearchSpec
    from worker.observability.logcontext import job_context
    from worker.queue.base import count_completed, settle_heap
    from worker.queue.items import CancelMarks
    from worker.queue.jobstore import JobStore
    from worker.queue.tasks.batches import _ModelCheck
    from worker.runtime.inprocess import build_runtime
    from worker.runtime.ratelimit import LimitedReranker, ProviderLimiter
    from worker.settings import load_settings

    settings = load_settings(
        data_dir=tmp / "data",
        redis_url=os.environ["BENCH_REDIS_URL"],
        rerank_enabled=True,
        generation_model="anthropic:claude-haiku-4-5",
    )
    from worker.runtime.bootstrap import build_rate_budget

    reranker = LimitedReranker(
        metrics.InFlightReranker(StubReranker()), ProviderLimiter(settings.rerank_max_in_flight)
    )
    overrides: dict[str, Any] = {"recorder": metrics.PrometheusRecorder(), "reranker": reranker}
    budget = build_rate_budget(settings)
    if budget is not None:
        overrides["rate_budget"] = budget
    runtime = build_runtime(settings, embedder=StubEmbedder(), **overrides)
    runtime.ingest(INDEX, "bench", [DocumentIn.model_validate(x) for x in corpus()])
    store = JobStore.from_url(settings.redis_url)
    # the batch's cancel mark read once: a worker reads it again every 0.1 s for its hundreds
    # of searches in flight, but at valgrind's pace that would be a round trip every other
    # search, and how many depends on the machine's load, not on the code
    marks = CancelMarks(store, max_age=float("inf"))
    total = WARM + searches
    specs = [SearchSpec(index=INDEX, query=q) for q in queries(total + 1)]
    batch = store.create_batch("bench", INDEX, [(f"q{i}", s) for i, s in enumerate(specs)])
    settle_heap()
    begun = store.begin_item(batch.id, "q0")
    for i in range(total):
        assert begun is not None and begun.started
        qid = f"q{i}"
        with job_context(f"{batch.id}/{qid}"), metrics.running_job():
            runtime.pace()
            result = runtime.search(specs[i], "bench", _ModelCheck(store, marks, batch.id, qid))
        assert result.rerank.applied, result.rerank
        transition, begun = store.finish_and_start_item(
            batch.id, qid, result=result, start=(batch.id, f"q{i + 1}")
        )
        count_completed("batch_item", transition.applied, None)


def instructions(tree: Path, redis_url: str, searches: int, db: int) -> int:
    """Instructions of one inner run over ``tree`` (callgrind's count of the whole process)."""
    env = {**os.environ, "BENCH_TREE": str(tree), "BENCH_REDIS_URL": f"{redis_url}/{db}",
           "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}  # fmt: skip
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, str(REPO / "benchmarks" / "bench_own_work.py"),
         "--inner", str(searches)],
        env=env, capture_output=True, text=True, cwd=tree,
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(proc.stderr[-3000:])
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--searches", type=int, default=400)
    parser.add_argument("--baseline", default="HEAD~1", help="the commit to compare with")
    parser.add_argument("--today", default=None, help="a commit (default: the working tree)")
    parser.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner is not None:
        inner(args.inner)
        return
    sys.path.insert(0, str(REPO))
    from benchmarks.bench_rerank_cpu import checkout
    from worker.processes.stack import redis_service, running

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        today = checkout(args.today, tmp / "today") if args.today else REPO
        sides = {"baseline": checkout(args.baseline, tmp / "baseline"), "today": today}
        service, redis_url = redis_service(tmp / "redis")
        per_search: dict[str, float] = {}
        with running(service):
            db = 0
            for side, tree in sides.items():
                counts = []
                for n in (0, args.searches):
                    db += 1
                    counts.append(instructions(tree, redis_url, n, db))
                per_search[side] = (counts[1] - counts[0]) / args.searches
                print(side, f"{per_search[side]:,.0f} instructions per search",
                      f"(runs of 0 and {args.searches}: {counts[0]:,} and {counts[1]:,})",
                      file=sys.stderr, flush=True)  # fmt: skip
    result = {
        "baseline": args.baseline,
        "today": args.today or "the working tree",
        "instructions_per_search": {k: round(v) for k, v in per_search.items()},
        "ratio_baseline_over_today": round(per_search["baseline"] / per_search["today"], 3),
        "load_average": os.getloadavg(),
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

"""The in-process evaluation: per-channel, fused and final quality, and candidate recall.

:func:`evaluate` runs every query of a BEIR-layout collection (:mod:`.inputs`) through the
runtime, run by run (:func:`.scoring.eval_runs`); :func:`.served.score_results` scores what
the API served instead; both end in :func:`.scoring.score_rankings`, so every source is
scored by the same code with ``ir-measures``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from worker.contract import SearchSpec
from worker.errors import SiftError
from worker.evaluation.inputs import Collection, absent_queries, judged_queries, read_qrels
from worker.evaluation.scoring import (
    DEFAULT_WINDOW,
    eval_runs,
    probe_spec,
    score_runs,
    window_of,
)
from worker.evaluation.served import add_usage, fallback_reason
from worker.runtime.inprocess import Runtime

TENANT = "eval"


class EvaluationStopped(SiftError):
    """A search of the in-process evaluation failed, so it stopped there (``error``, whose
    message it keeps). ``usage``: what every model call so far was billed, the failed
    search's own attempts included, for the caller to say before it exits: calls a
    provider billed are paid whether the evaluation ends or not."""

    def __init__(self, error: SiftError, usage: dict[str, float | None]) -> None:
        super().__init__(str(error))
        self.code = error.code
        self.usage = usage


def evaluate(
    runtime: Runtime,
    collection: Collection,
    *,
    index: str = "eval",
    window: int | None = None,
    rerank: bool = False,
    max_queries: int | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Run every query through each run and score it; returns the report as plain data.

    ``progress(run, n)`` hears of each query done (:func:`eval_runs` and
    :func:`judged_queries` give the total ahead). ``window``: the rerank candidate window of
    candidate recall (and of the reranked run); by default the one the index's searches use,
    read from a search's trace (:func:`probe_spec`). A search that fails stops it:
    :class:`EvaluationStopped`, with the usage billed so far."""
    qrels = read_qrels(collection.qrels)
    queries = judged_queries(collection.queries, qrels, max_queries)
    if window is None and queries:
        window = window_of(runtime.search(probe_spec(index, queries[0][1]), TENANT).trace)
    window = window or DEFAULT_WINDOW
    runs = eval_runs(rerank, window)
    rankings: dict[str, dict[str, list[str]]] = {}
    usage_total: dict[str, float | None] = {}
    fallbacks: Counter[str] = Counter()
    for run in runs:
        ranking = rankings[run.name] = {}
        for qid, text in queries:
            spec = SearchSpec(
                index=index,
                query=text,
                mode=run.mode,
                limit=run.limit,
                rerank=run.rerank,
                candidate_limit=run.candidate_limit,
            )
            try:
                result = runtime.search(spec, TENANT)
            except SiftError as error:  # its billed attempts are on it (``job_usage``)
                add_usage(usage_total, error.job_usage.model_dump() if error.job_usage else {})
                raise EvaluationStopped(error, usage_total) from error
            ranking[qid] = [hit.id for hit in result.hits]
            if reason := fallback_reason(result.model_dump(include={"rerank"})):
                fallbacks[reason] += 1
            add_usage(usage_total, result.usage.model_dump())
            if progress is not None:
                progress(run.name, 1)
    report = score_runs(rankings, runs, qrels, queries, window)
    # as the served sources report them: none failed, since a failed search stops the run
    report["failed_by_run"] = dict.fromkeys(report["runs"], 0)
    report["failed"] = 0
    report["errors"] = {}
    report["rerank_fallbacks"] = dict(fallbacks.most_common())
    report["usage"] = usage_total
    report["missing"] = absent_queries(collection.queries, qrels)
    report["missing_from"] = str(collection.queries)
    return report

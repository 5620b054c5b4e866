"""Scoring rankings with ``ir-measures``, whichever source they come from.

Relevance comes from the qrels alone (no LLM judge): a pair counts as relevant when its
score is at least 1 (nDCG's gain is the score, graded), and a query with no relevant pair is
left out. Candidate recall follows the reranking guide (seed 004): end-to-end reports every
query; conditional reports only the queries whose rerank window holds a relevant doc, and it
is given for each channel's ranking too. :func:`fusion_vs_channels` says, query by query,
how often fusion lost to a channel alone. :func:`eval_runs` are the runs an evaluation makes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ir_measures
from ir_measures import RR, R, nDCG

from worker.constants import MAX_LIMIT
from worker.contract import Mode, SearchSpec
from worker.core.query import channel_window, coarse_limit
from worker.settings import Settings

# nDCG takes each pair's score as its gain (graded, as trec_eval and BEIR do); MRR and
# recall count a pair as relevant when its score is 1 or more
JUDGE_POLICY = (
    "qrels (nDCG graded by score; relevant: score >= 1), no LLM judge; "
    "queries without qrels left out"
)
MEASURES = [nDCG @ 10, RR @ 10, R @ 10, R @ 100]
CHANNELS = ("bm25", "knn")
TIE = 1e-9  # per-query nDCG@10 closer than this counts as equal
FINAL_LIMIT = 10  # the reranked run's limit
WINDOW_RUN = "window"  # the run whose hits are the reranker's candidates (no row of its own)
DEFAULT_WINDOW: int = Settings.model_fields["rerank_candidate_limit"].default


@dataclass(frozen=True)
class RunSpec:
    name: str
    mode: Mode
    rerank: bool
    limit: int
    candidate_limit: int | None = None  # the request's own rerank window


def reranked_candidates(window: int) -> int:
    """How many fused candidates the reranked run (limit 10) shows the model at the
    candidate window ``window``: the core's coarse limit, ``max(10, window)``."""
    return coarse_limit(FINAL_LIMIT, window, reranking=True)


def eval_runs(rerank: bool, window: int) -> list[RunSpec]:
    """The runs an evaluation makes, in-process or served: each channel alone and fused at
    depth 100 without a model; the ``window`` run, the candidates a reranked search at
    ``window`` fuses (a search without a model whose limit is that search's coarse limit
    has its channels as deep, ``channel_window(coarse)``, so it fuses the same list; at most
    100, the largest limit); then the reranked run at 10, at that window, when asked for."""
    runs = [
        RunSpec("bm25", "fts", False, 100),
        RunSpec("knn", "vector", False, 100),
        RunSpec("fused", "hybrid", False, 100),
        RunSpec(WINDOW_RUN, "hybrid", False, min(reranked_candidates(window), MAX_LIMIT)),
    ]
    if rerank:
        runs.append(RunSpec("final (reranked)", "hybrid", True, FINAL_LIMIT, window))
    return runs


def window_of(trace: Mapping[str, Any] | None) -> int | None:
    """The candidate window a search's trace says it used (the request's, the index's or
    the deployment's ``SIFT_RERANK_CANDIDATE_LIMIT``), or None without one.

    >>> window_of({"candidate_limit": {"value": 40, "from": "index"}}), window_of(None)
    (40, None)
    """
    value = ((trace or {}).get("candidate_limit") or {}).get("value")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def probe_spec(index: str, query: str) -> SearchSpec:
    """A search of one hit, no model, with its trace: what it says of the candidate window
    (:func:`window_of`) is what the index's searches use when not told another."""
    return SearchSpec(
        index=index, query=query, mode="hybrid", limit=1, rerank=False, include_trace=True
    )


def window_note(window: int) -> str | None:
    """Why the window's candidates are only approximated for a window of ``window``, if so."""
    coarse = reranked_candidates(window)
    if coarse <= MAX_LIMIT:
        return None
    return (
        f"approximated: a search returns at most {MAX_LIMIT} hits, so only the first "
        f"{MAX_LIMIT} of the {coarse} candidates (channels {channel_window(coarse)} deep) count"
    )


def _qrel_list(qrels: dict[str, dict[str, int]], judged: set[str]) -> list[ir_measures.Qrel]:
    return [
        ir_measures.Qrel(qid, doc, rel)
        for qid, docs in qrels.items()
        if qid in judged
        for doc, rel in docs.items()
    ]


def score_runs(
    rankings: dict[str, dict[str, list[str]]],
    runs: list[RunSpec],
    qrels: dict[str, dict[str, int]],
    queries: list[tuple[str, str]],
    window: int,
    failed: Mapping[str, set[str]] | None = None,
) -> dict[str, Any]:
    """:func:`score_rankings` of the :func:`eval_runs` (in-process or served): the window
    run is the candidates the reranker sees (it has no row of its own); the final one is
    the reranked run if asked, else the fused run. ``failed``: by run, the queries whose
    search did not succeed (served runs)."""
    final = "final (reranked)" if "final (reranked)" in rankings else "fused"
    return score_rankings(
        {run.name: rankings[run.name] for run in runs if run.name != WINDOW_RUN},
        qrels,
        [qid for qid, _ in queries],
        window=reranked_candidates(window),
        candidates=rankings[WINDOW_RUN],
        final=rankings[final],
        approximated=window_note(window),
        failed=failed,
    )


def score_rankings(
    runs: dict[str, dict[str, list[str]]],
    qrels: dict[str, dict[str, int]],
    judged: list[str],
    *,
    window: int,
    candidates: dict[str, list[str]],
    final: dict[str, list[str]],
    approximated: str | None = None,
    failed: Mapping[str, set[str]] | None = None,
) -> dict[str, Any]:
    """Score each run's rankings (query id -> document ids, best first) with ir-measures.

    ``candidates`` is the fused ranking whose first ``window`` documents the reranker sees;
    ``final`` the ranking the conditional row scores; ``approximated`` why ``candidates``
    are not quite those (None: they are). A query absent from a run scores 0 (``failed``:
    by run, the queries whose search failed, or whose nDCG@10 is only a lower bound there;
    :func:`fusion_vs_channels` leaves them out).
    ``depth`` is the fewest documents a run ranked for any query: a measure past it (R@100
    of a run 40 deep) counts only what was ranked.
    """
    qrel_list = _qrel_list(qrels, set(judged))
    report: dict[str, Any] = {
        "judge": JUDGE_POLICY,
        "queries": len(judged),
        "runs": {},
        "depth": {},
        "window": window,
    }
    for name, ranking in runs.items():
        report["runs"][name] = _aggregate(qrel_list, _scored(ranking, judged))
        report["depth"][name] = min((len(ranking.get(qid, [])) for qid in judged), default=0)
    # none: rankings of another index or collection than the qrels' (every figure 0)
    report["judged_hits"] = sum(
        doc in qrels[qid]
        for ranking in runs.values()
        for qid in judged
        for doc in ranking.get(qid, ())
    )

    # Candidate recall at the rerank window bounds what any reranker can reach (seed 004).
    recalls = _recalls_at(window, qrel_list, candidates, judged)
    reachable = {qid for qid, recall in recalls.items() if recall > 0}
    report["candidate_recall"] = {
        "window": window,
        "approximated": approximated,
        "end_to_end": _mean(recalls),
        "queries_with_a_relevant_candidate": len(reachable),
        # fewer than ``window`` when the results were cut shorter (a batch of limit 10)
        "candidates_held": min(
            (len(candidates.get(qid, [])[:window]) for qid in judged), default=0
        ),
        "lower_bound": [],  # the figures above a cut short of the window leaves lower bounds
    }
    report["candidate_recall"]["by_ranking"] = {
        name: _mean(_recalls_at(window, qrel_list, runs[name], judged))
        for name in CHANNELS
        if name in runs
    } | {"fused": report["candidate_recall"]["end_to_end"]}
    if all(name in runs for name in CHANNELS):
        report["fusion_vs_channels"] = fusion_vs_channels(runs, qrel_list, judged, failed)
    report["runs"]["final, conditional on the window"] = _aggregate(
        [q for q in qrel_list if q.query_id in reachable],
        _scored(final, [qid for qid in judged if qid in reachable]),
    )
    return report


def _recalls_at(
    window: int, qrels: list[ir_measures.Qrel], ranking: dict[str, list[str]], judged: list[str]
) -> dict[str, float]:
    """Each judged query's R@window (ir-measures): the share of its relevant documents in the
    ranking's first ``window``, 0 for a query the ranking lacks. A query with no relevant
    document has no recall and is left out, as from every measure here."""
    run = _scored(ranking, judged)
    return {m.query_id: m.value for m in ir_measures.iter_calc([R @ window], qrels, run)}


def _mean(values: Mapping[str, float]) -> float:
    return statistics.fmean(values.values()) if values else 0.0


def fusion_vs_channels(
    runs: dict[str, dict[str, list[str]]],
    qrels: list[ir_measures.Qrel],
    judged: list[str],
    failed: Mapping[str, set[str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """For each run that fuses (all but the channels alone), per query by nDCG@10: the
    shares it ``lost``, ``won`` and ``tied`` against the better channel on that query (an
    oracle no fusion reaches often), and against ``best_channel``, the channel better on
    average, with the mean of both (``hurts``: the run is below that channel on average).
    Each on the ``queries`` that run and both channels answered: a query whose search
    failed (``failed``: its id, by run) has no ranking to compare, and its 0 was taken for
    one (a fused run whose index was dropped under it "lost" on every query a channel
    found something). A run that answered none is left out."""
    per_query = {name: _per_query_ndcg(qrels, ranking, judged) for name, ranking in runs.items()}
    failed = failed or {}
    unanswered = set().union(*(failed.get(c, ()) for c in CHANNELS))
    report: dict[str, dict[str, Any]] = {}
    for name in runs:
        kept = [q for q in judged if q not in unanswered and q not in failed.get(name, ())]
        if name in CHANNELS or not kept:
            continue
        oracle = {q: max(per_query[c][q] for c in CHANNELS) for q in kept}
        scores = {n: {q: per_query[n][q] for q in kept} for n in (name, *CHANNELS)}
        mean = {n: statistics.fmean(values.values()) for n, values in scores.items()}
        best = max(CHANNELS, key=lambda c: mean[c])
        report[name] = {
            "vs_better_channel_per_query": _shares(scores[name], oracle),
            "best_channel": best,
            "vs_best_channel": _shares(scores[name], scores[best]),
            "ndcg@10": mean[name],
            "best_channel_ndcg@10": mean[best],
            "hurts": mean[name] < mean[best],
            "queries": len(kept),
        }
    return report


def _shares(run: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """
    >>> _shares({"a": 0.5, "b": 0.2, "c": 0.0, "d": 1.0}, {"a": 0.6, "b": 0.2, "c": 0.0, "d": 0.1})
    {'lost': 0.25, 'won': 0.25, 'tied': 0.5}
    """
    diffs = [run[q] - other[q] for q in run]
    return {
        "lost": sum(d < -TIE for d in diffs) / len(diffs),
        "won": sum(d > TIE for d in diffs) / len(diffs),
        "tied": sum(abs(d) <= TIE for d in diffs) / len(diffs),
    }


def _per_query_ndcg(
    qrels: list[ir_measures.Qrel], ranking: dict[str, list[str]], judged: list[str]
) -> dict[str, float]:
    values = dict.fromkeys(judged, 0.0)  # a query the run did not rank scores 0
    for metric in ir_measures.iter_calc([nDCG @ 10], qrels, _scored(ranking, judged)):
        values[metric.query_id] = float(metric.value)
    return values


def _scored(ranking: dict[str, list[str]], judged: list[str]) -> list[ir_measures.ScoredDoc]:
    """A ranking as ir-measures' run: descending scores, so its order is the ranking's."""
    scored = []
    for qid in judged:
        docs = ranking.get(qid, [])
        scored += [
            ir_measures.ScoredDoc(qid, doc, float(len(docs) - i)) for i, doc in enumerate(docs)
        ]
    return scored


def _aggregate(
    qrels: list[ir_measures.Qrel], run: list[ir_measures.ScoredDoc]
) -> dict[str, float | None]:
    """Each measure's mean over the queries of ``qrels``; None where there is none to average
    (the conditional row when no window holds a relevant document): ir-measures' NaN there
    was written into ``--json`` reports, which no JSON parser but Python's reads."""
    values = ir_measures.calc_aggregate(MEASURES, qrels, run)
    means = {str(measure): float(values[measure]) for measure in MEASURES}
    return {name: value if math.isfinite(value) else None for name, value in means.items()}

"""Scoring what the API served (the lines ``sift batch`` writes) with no search of our own:
each run comes from the ranks the results carry; and reading a served item's usage, failure
and fallback, which the in-process evaluation reads from its results too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from worker.core.cost import add_costs
from worker.core.query import channel_window
from worker.evaluation.scoring import (
    DEFAULT_WINDOW,
    MEASURES,
    reranked_candidates,
    score_rankings,
    window_of,
)

SERVED_RANKINGS = ("final", "fused", "bm25", "knn")  # what a served result's ranks give


def add_usage(total: dict[str, float | None], usage: Mapping[str, Any]) -> None:
    """Add one result's usage to ``total``. A count the result lacks (null) adds 0; a cost
    it does not know (an unpriced model's ``null``) leaves the total's cost unknown too.

    >>> total: dict[str, float | None] = {}
    >>> add_usage(total, {"requests": 1, "cost_usd": 0.5}); add_usage(total, {"requests": 1})
    >>> total
    {'requests': 2, 'cost_usd': 0.5}
    >>> add_usage(total, {"requests": 1, "cost_usd": None}); total
    {'requests': 3, 'cost_usd': None}
    """
    for key, value in usage.items():
        if key == "cost_usd":
            total[key] = add_costs(total.get(key, 0.0), value)
        else:
            total[key] = (total.get(key) or 0) + (value or 0)


def billed_usage(item: Mapping[str, Any]) -> Mapping[str, Any]:
    """What one served item's model calls were billed, where its status puts it: a
    succeeded result's ``usage``, a failed item's ``error.usage`` (the attempts billed
    before it failed), a canceled item's ``usage`` (the calls it sent before the cancel);
    empty when it made none. The batch's own ``usage`` adds the same three.

    >>> billed_usage({"status": "failed", "error": {"type": "x", "usage": {"requests": 3}}})
    {'requests': 3}
    >>> billed_usage({"status": "canceled", "usage": {"requests": 2}})
    {'requests': 2}
    >>> billed_usage({"status": "failed", "error": {"type": "x", "usage": None}})
    {}
    """
    status = item.get("status")
    if status == "succeeded":
        held = item.get("result")
    elif status == "failed":
        held = item.get("error")
    else:
        held = item
    usage = held.get("usage") if isinstance(held, Mapping) else None
    return usage if isinstance(usage, Mapping) else {}


def failure_type(item: Mapping[str, Any]) -> str:
    """Why a served item did not succeed: its error's type, else its status.

    >>> failure_type({"status": "failed", "error": {"type": "index_not_found"}})
    'index_not_found'
    >>> failure_type({"status": "canceled"})
    'canceled'
    """
    error = item.get("error")
    kind = error.get("type") if isinstance(error, dict) else None
    return str(kind or item.get("status") or "unknown")


def fallback_reason(result: Mapping[str, Any] | None) -> str | None:
    """Why a reranked search's hits are the fused order, the model's answer unused (its
    ``rerank.fallback_reason``: ``no_valid_ranks``, ``error:<class>`` under ``fail_open``);
    None when the model ranked them, or no rerank was asked.

    >>> fallback_reason({"rerank": {"applied": False, "fallback_reason": "no_valid_ranks"}})
    'no_valid_ranks'
    >>> fallback_reason({"rerank": {"applied": True}}), fallback_reason(None)
    (None, None)
    """
    rerank = (result or {}).get("rerank") or {}
    return None if rerank.get("applied") else rerank.get("fallback_reason")


def served_rankings(result: Mapping[str, Any] | None) -> dict[str, list[str]]:
    """The rankings one served search result holds, from the ranks its hits carry (and the
    trace's candidates when the request asked for the trace: the whole fused list).

    ``final`` is the hits in order; ``fused``, ``bm25`` and ``knn`` order the documents by
    their RRF or channel rank, and stop at the first rank the result does not hold: a
    document it does not carry sits there, so what follows is not that ranking's next.
    """
    if not result:
        return {name: [] for name in SERVED_RANKINGS}
    hits = result.get("hits") or []
    ranks: dict[str, dict[str, int]] = {}
    for hit in hits:
        held = ranks.setdefault(str(hit["id"]), {})
        held.update({k: v for k, v in (hit.get("ranks") or {}).items() if v is not None})
    for candidate in (result.get("trace") or {}).get("candidates") or []:
        held = ranks.setdefault(str(candidate["id"]), {})
        if (candidate.get("rrf") or {}).get("rank") is not None:
            held["rrf"] = candidate["rrf"]["rank"]
        for channel, info in (candidate.get("channels") or {}).items():
            held[channel] = info["rank"]
    return {
        "final": [str(hit["id"]) for hit in hits],
        "fused": _unbroken(ranks, "rrf"),
        "bm25": _unbroken(ranks, "bm25"),
        "knn": _unbroken(ranks, "knn"),
    }


def _unbroken(ranks: dict[str, dict[str, int]], key: str) -> list[str]:
    ordered = sorted((held[key], doc) for doc, held in ranks.items() if key in held)
    prefix = []
    for position, (rank, doc) in enumerate(ordered, start=1):
        if rank != position:
            break
        prefix.append(doc)
    return prefix


def score_results(
    items: Iterable[Mapping[str, Any]],
    qrels: dict[str, dict[str, int]],
    *,
    window: int | None = None,
) -> dict[str, Any]:
    """Score served results (the lines ``sift batch`` writes: ``query_id``, ``status``,
    ``result``) with no search of our own: each run comes from the ranks the results carry.

    A query with qrels counts; one that did not succeed scores 0 in every run. BM25 and kNN
    rows appear when the results hold that channel's ranks, ``final (reranked)`` when the
    model reranked any of them. ``missing``: the queries with a relevant document in the
    qrels and no line in the results (a file cut short, or a batch of other queries), left
    out. ``errors``: each failure type (the error's ``type``, else the status) and its
    count. Raises ValueError on a query id seen twice.

    ``window`` (by default the one the results' traces name, else the deployment default's
    30): the fused ranking's first ``max(10, window)`` are the reranker's candidates only
    when each trace says its search fused that many (its channels then as deep as a
    reranked search's at that window); else candidate recall is approximated, and says so.
    """
    held: dict[str, dict[str, list[str]]] = {}
    errors: Counter[str] = Counter()
    coarse: set[int | None] = set()  # each succeeded result's fused candidates, if traced
    windows: list[int] = []
    fused_unknown = False  # a reranked result without its trace's candidates
    failed: set[str] = set()
    reranked = False  # a rerank was asked of some result: the model's, or its fallback
    fallbacks: Counter[str] = Counter()
    usage: dict[str, float | None] = {}
    for item in items:
        qid = str(item.get("query_id"))
        if qid in held:
            raise ValueError(f"query_id {qid!r} appears twice")
        if qid not in qrels:
            continue
        result = item.get("result") if item.get("status") == "succeeded" else None
        if result is None:
            failed.add(qid)
            errors[failure_type(item)] += 1
        held[qid] = served_rankings(result)
        add_usage(usage, billed_usage(item))
        if result:
            applied = bool((result.get("rerank") or {}).get("applied"))
            reason = fallback_reason(result)  # the fused order served as the reranked one
            fallbacks.update([reason] if reason else [])
            reranked |= applied or reason is not None
            trace = result.get("trace")
            coarse.add((trace or {}).get("coarse_limit"))
            fused_unknown |= applied and not (trace or {}).get("candidates")
            windows += [w for w in [window_of(trace)] if w is not None]
    window = window or (windows[0] if windows else DEFAULT_WINDOW)
    fused_as_reranked = coarse == {reranked_candidates(window)}
    judged = list(held)
    per_run = {name: {qid: held[qid][name] for qid in judged} for name in SERVED_RANKINGS}
    runs = {name: per_run[name] for name in ("bm25", "knn") if any(per_run[name].values())}
    runs["fused"] = per_run["fused"]  # RRF over the channels the searches' mode ran
    if reranked:
        runs["final (reranked)"] = per_run["final"]
    # a ranking the results hold less than 10 deep (a batch's limit, a reranked search's
    # hits) has only a lower bound for its nDCG@10: a run compared with it there "won"
    # where it may have lost, so such a query is left out of that run's comparisons
    cut: dict[str, set[str]] = {
        name: {q for q in judged if len(runs[name][q]) < 10}
        for name in ("bm25", "knn", "fused")
        if name in runs
    }
    report = score_rankings(
        runs,
        qrels,
        judged,
        window=reranked_candidates(window),
        candidates=per_run["fused"],
        final=per_run["final"],
        approximated=None if fused_as_reranked else _untraced_note(window),
        # every run is of the same searches
        failed={name: failed | cut.get(name, set()) for name in runs},
    )
    report["unknown"] = {}
    if fused_unknown:
        _leave_fused_unknown(report)
    elif not fused_as_reranked:
        _mark_what_a_cut_leaves_unknown(report, per_run["fused"], qrels, judged, failed)
    report["lower_bounds"] = {
        name: [str(m) for m in MEASURES if report["depth"][name] < m["cutoff"]]
        for name in ("bm25", "knn", "fused")
        if name in runs and name not in report["unknown"]
    }
    report["failed"] = len(failed)
    report["errors"] = dict(errors.most_common())
    report["rerank_fallbacks"] = dict(fallbacks.most_common())
    report["failed_by_run"] = dict.fromkeys(runs, len(failed))
    report["missing"] = sum(
        1 for qid, docs in qrels.items() if qid not in held and any(g > 0 for g in docs.values())
    )
    report["usage"] = usage
    return report


def _leave_fused_unknown(report: dict[str, Any]) -> None:
    """Blank what reranked results without their trace cannot tell: the hits hold the fused
    ranks of the documents the model kept only, so the fused ranking (its row), the
    candidates at the window (candidate recall) and the queries whose window holds a
    relevant one (the conditional row) are unknown, not the 0 an empty list scores."""
    unknown = dict.fromkeys((str(m) for m in MEASURES), None)
    report["runs"]["fused"] = dict(unknown)
    report["runs"]["final, conditional on the window"] = dict(unknown)
    recall = report["candidate_recall"]
    recall.update(end_to_end=None, queries_with_a_relevant_candidate=None, approximated=None)
    recall["by_ranking"]["fused"] = None
    (report.get("fusion_vs_channels") or {}).pop("fused", None)
    report["unknown"]["fused"] = (
        "reranked results without their trace hold the fused ranks of the hits the model "
        "kept only: the fused ranking and the window's candidates are unknown (a batch sent "
        "with include_trace holds them)"
    )


def _mark_what_a_cut_leaves_unknown(
    report: dict[str, Any],
    fused: dict[str, list[str]],
    qrels: dict[str, dict[str, int]],
    judged: list[str],
    failed: set[str],
) -> None:
    """What results that stop short of the window for a query (a batch of limit 10, a
    window of 30) cannot tell. One missing a relevant document among its held candidates
    may hold it in the window: its candidate recall, and so the end-to-end one, is a lower
    bound (``lower_bound`` in ``candidate_recall`` names them, with the count of queries
    with a relevant candidate when one holds none). One holding none blanks the conditional
    row: whether its window holds a relevant one is unknown (averaged over the queries
    answered in the candidates held alone, SciFact at limit 10 reads 0.818 over 261 claims,
    against 0.773 over the window's 275)."""
    recall = report["candidate_recall"]
    window = recall["window"]
    # each query cut short of the window: its relevant documents held, of how many
    held = {
        qid: (sum(qrels[qid].get(doc, 0) >= 1 for doc in fused[qid]),
              sum(gain >= 1 for gain in qrels[qid].values()))
        for qid in judged
        if qid not in failed and len(fused[qid]) < window
    }  # fmt: skip
    unknown = [qid for qid, (found, _) in held.items() if not found]
    if any(found < relevant for found, relevant in held.values()):
        recall["lower_bound"].append("end_to_end")
    if unknown:
        recall["lower_bound"].append("queries_with_a_relevant_candidate")
    if not unknown:
        return
    row = "final, conditional on the window"
    report["runs"][row] = dict.fromkeys((str(m) for m in MEASURES), None)
    report["unknown"][row] = (
        f"the results hold only {recall['candidates_held']} fused "
        f"candidate(s) for some query, fewer than the window's {window}, and for "
        f"{len(unknown)} no relevant one among them: which queries have one in the window is "
        f"unknown, and so is the conditional row (a batch of limit {window} holds them)"
    )


def _untraced_note(window: int) -> str:
    coarse = reranked_candidates(window)
    return (
        f"approximated: the results' own fused ranking, not the {coarse} candidates a "
        f"reranked search at window {window} fuses (its channels {channel_window(coarse)} "
        f"deep); a batch with include_trace, of limit {coarse} or reranked at that window, "
        "holds them"
    )

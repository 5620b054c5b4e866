"""Scoring served results: the rankings a result's ranks imply, and what counts as a query."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from worker.cli import app
from worker.evaluation.scoring import score_rankings
from worker.evaluation.served import score_results, served_rankings


def hit(doc: str, final: int, rrf: int, bm25: int | None, knn: int | None) -> dict[str, Any]:
    return {"id": doc, "ranks": {"final": final, "rrf": rrf, "bm25": bm25, "knn": knn}}


def result(*hits: dict[str, Any], trace: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"hits": list(hits), "rerank": {"applied": False}, "usage": {}, "trace": trace}


def test_a_ranking_stops_at_the_first_rank_the_result_does_not_hold() -> None:
    served = served_rankings(
        result(hit("a", 1, 1, 2, 1), hit("b", 2, 2, 1, None), hit("c", 3, 4, 3, 2))
    )
    assert served["final"] == ["a", "b", "c"]
    assert served["fused"] == ["a", "b"]  # rrf 3 is not among the hits: c's 4 is not the next
    assert served["bm25"] == ["b", "a", "c"]
    assert served["knn"] == ["a", "c"]


def test_the_trace_candidates_extend_the_rankings() -> None:
    trace = {
        "candidates": [
            {"id": "x", "rrf": {"rank": 1}, "channels": {"bm25": {"rank": 1}}},
            {"id": "y", "rrf": {"rank": 2}, "channels": {"knn": {"rank": 1}}},
            {"id": "z", "rrf": {"rank": 3}, "channels": {"bm25": {"rank": 2}}},
        ]
    }
    served = served_rankings(result(hit("z", 1, 3, 2, None), trace=trace))  # reranked to z
    assert served["final"] == ["z"]
    assert served["fused"] == ["x", "y", "z"]
    assert served["bm25"] == ["x", "z"] and served["knn"] == ["y"]


def test_a_failed_query_scores_zero_and_unjudged_ones_are_left_out() -> None:
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}}
    items = [
        {"query_id": "q1", "status": "succeeded", "result": result(hit("a", 1, 1, 1, 1))},
        {"query_id": "q2", "status": "failed", "error": {"type": "x", "message": "y"}},
        {"query_id": "q3", "status": "succeeded", "result": result(hit("a", 1, 1, 1, 1))},
    ]
    report = score_results(items, qrels, window=30)
    assert report["queries"] == 2 and report["failed"] == 1
    assert report["runs"]["fused"]["nDCG@10"] == pytest.approx(0.5)
    assert report["candidate_recall"]["queries_with_a_relevant_candidate"] == 1
    assert report["candidate_recall"]["candidates_held"] == 0  # the failed query holds none
    assert "final (reranked)" not in report["runs"]


def test_judged_queries_with_no_line_in_the_results_are_counted_as_missing() -> None:
    """A results file cut short (the first 10 lines of 300) was scored as "10 queries" with
    no word of the judged queries it lacks: ``missing`` counts them (a query whose judgments
    are all 0 is not judged)."""
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}, "q3": {"c": 2}, "q4": {"d": 0}}
    items = [{"query_id": "q1", "status": "succeeded", "result": result(hit("a", 1, 1, 1, 1))}]
    report = score_results(items, qrels, window=30)
    assert report["queries"] == 1 and report["missing"] == 2


def test_a_query_id_twice_is_refused() -> None:
    item = {"query_id": "q1", "status": "succeeded", "result": result(hit("a", 1, 1, 1, 1))}
    with pytest.raises(ValueError, match="q1"):
        score_results([item, item], {"q1": {"a": 1}}, window=30)


def test_fusion_is_compared_with_each_channel_query_by_query() -> None:
    """Three queries, one relevant document each: fused beats both channels on q1, loses to
    BM25 on q2 and ties on q3; candidate recall is given for every ranking."""
    qrels = {"q1": {"r1": 1}, "q2": {"r2": 1}, "q3": {"r3": 1}}
    runs = {
        "bm25": {"q1": ["x", "r1"], "q2": ["r2"], "q3": ["r3"]},
        "knn": {"q1": ["x", "y", "r1"], "q2": ["x", "r2"], "q3": ["x"]},
        "fused": {"q1": ["r1"], "q2": ["x", "r2"], "q3": ["r3"]},
    }
    report = score_rankings(
        runs, qrels, ["q1", "q2", "q3"], window=1, candidates=runs["fused"], final=runs["fused"]
    )
    versus = report["fusion_vs_channels"]["fused"]
    third = pytest.approx(1 / 3)
    assert versus["vs_better_channel_per_query"] == {"lost": third, "won": third, "tied": third}
    assert versus["best_channel"] == "bm25"  # r2 and r3 first, r1 second
    assert versus["vs_best_channel"] == {"lost": third, "won": third, "tied": third}
    assert versus["hurts"] is False  # equal means (1 + 0.63 + 1 both): only below hurts
    assert report["candidate_recall"]["by_ranking"] == {
        "bm25": pytest.approx(2 / 3), "knn": 0.0, "fused": pytest.approx(2 / 3)
    }  # fmt: skip


def test_candidate_recall_is_the_share_of_relevant_documents_in_the_window() -> None:
    """R@window, per query then averaged; a query without a relevant document is left out of
    it (as from every measure: "queries without qrels left out"), not a division by zero."""
    qrels = {"q1": {"r1": 1, "r2": 2, "r3": 1}, "q2": {"r4": 1}, "q3": {}}
    fused = {"q1": ["r1", "x", "r2", "r3"], "q2": ["x", "y", "r4"], "q3": ["r1"]}
    runs = {"bm25": {"q1": ["r3"]}, "knn": {"q2": ["r4"]}, "fused": fused}
    report = score_rankings(
        runs, qrels, ["q1", "q2", "q3"], window=3, candidates=fused, final=fused
    )
    recall = report["candidate_recall"]
    assert recall["end_to_end"] == pytest.approx((2 / 3 + 1) / 2)
    assert recall["queries_with_a_relevant_candidate"] == 2
    assert recall["by_ranking"] == {
        "bm25": pytest.approx(1 / 6), "knn": pytest.approx(1 / 2), "fused": recall["end_to_end"]
    }  # fmt: skip


def test_reranked_results_without_their_trace_leave_the_fused_figures_unknown() -> None:
    """The model kept b (fused 3) and a (fused 5): the fused ranking is not in the results.
    Its row and candidate recall were 0.000 (the fused list read as empty: no rank 1), where
    the truth may be 0.951; they are unknown now, ``None`` (``–`` in the table)."""
    hits = [hit("b", 1, 3, 1, 2), hit("a", 2, 5, 2, 1)]
    reranked = {"hits": hits, "rerank": {"applied": True}, "usage": {}, "trace": None}
    items = [{"query_id": "q1", "status": "succeeded", "result": reranked}]
    report = score_results(items, {"q1": {"a": 1}})
    assert set(report["runs"]["fused"].values()) == {None}
    assert set(report["runs"]["final, conditional on the window"].values()) == {None}
    assert report["candidate_recall"]["end_to_end"] is None
    assert report["candidate_recall"]["by_ranking"]["fused"] is None
    assert "fused" in report["unknown"] and "fused" not in report["fusion_vs_channels"]
    assert report["runs"]["final (reranked)"]["nDCG@10"] == pytest.approx(0.6309, abs=1e-4)
    # the channels' first two are held: measures past them are lower bounds, and say so
    assert report["lower_bounds"]["bm25"] == ["nDCG@10", "RR@10", "R@10", "R@100"]


def test_the_table_shows_unknown_and_lower_bound_figures(tmp_path: Path) -> None:
    hits = [hit("b", 1, 3, 1, 2), hit("a", 2, 5, 2, 1)]
    reranked = {"hits": hits, "rerank": {"applied": True}, "usage": {}, "trace": None}
    line = {"query_id": "q1", "status": "succeeded", "result": reranked}
    (tmp_path / "results.jsonl").write_text(json.dumps(line) + "\n")
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\ta\t1\n")
    args = ["eval", "--results", str(tmp_path / "results.jsonl")]
    result = CliRunner().invoke(
        app, [*args, "--qrels", str(tmp_path / "qrels.tsv")], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if "│" in line}
    assert rows["fused"].count("–") == 4 and "0.000" not in rows["fused"]
    assert rows["bm25"].count("≥") == 4
    said = " ".join(result.output.split())
    assert "–: unknown: reranked results without their trace" in said, said
    assert "candidate recall@30 (end-to-end): –; queries with a relevant candidate" in said
    # the channels' recall at the window, from results holding 2 of their ranks: lower bounds
    assert "candidate recall@30 by ranking: bm25 ≥1.000, knn ≥1.000" in said, said


def test_the_judge_line_says_ndcg_uses_the_graded_scores() -> None:
    """nDCG@10 takes each pair's score as its gain (graded, as trec_eval's, which BEIR
    reports); the heading said the qrels were "binary: score >= 1"."""
    qrels = {"q1": {"a": 2, "b": 1}}
    items = [{"query_id": "q1", "status": "succeeded", "result": result(hit("b", 1, 1, 1, 1))}]
    report = score_results(items, qrels)
    assert "binary" not in report["judge"] and "graded" in report["judge"]
    ideal = 2 + 1 / math.log2(3)  # a (gain 2), then b (gain 1)
    assert report["runs"]["fused"]["nDCG@10"] == pytest.approx(1 / ideal)


def test_the_usage_counts_what_failed_and_canceled_searches_were_billed() -> None:
    """A failed item's billed attempts are on its ``error.usage``, a canceled item's on its
    ``usage`` (docs/queue.md): the report adds them as the batch's own usage does. It added
    the succeeded results' only: a search refused after a billed call was left out."""

    def usage(requests: int, cost: float) -> dict[str, Any]:
        tokens = {"input_tokens": 1000 * requests, "output_tokens": requests}
        return {"requests": requests, **tokens, "cost_usd": cost}

    qrels = {q: {"a": 1} for q in ("q1", "q2", "q3", "q4")}
    items = [
        {"query_id": "q1", "status": "succeeded",
         "result": result(hit("a", 1, 1, 1, 1)) | {"usage": usage(1, 0.25)}},
        {"query_id": "q2", "status": "failed",
         "error": {"type": "rerank_failed", "message": "m", "usage": usage(3, 0.5)}},
        {"query_id": "q3", "status": "canceled", "usage": usage(2, 0.125)},
        {"query_id": "q4", "status": "failed",
         "error": {"type": "index_not_found", "message": "m", "usage": None}},
    ]  # fmt: skip
    report = score_results(items, qrels, window=30)
    assert report["usage"] == usage(6, 0.875)


def test_reranked_results_served_the_fused_order_are_named_not_scored_as_the_models() -> None:
    """A model answer with no valid position (``no_valid_ranks``; under ``fail_open`` a
    failed rerank too) serves the fused order, ``rerank.applied`` false. Such results are
    the final (reranked) row, as served, and the report says how many and why: with every
    result so, the row was missing (the table gave no sign a rerank was asked), and with
    some, their fused order was scored as the model's, with no word of it."""
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}}
    fell_back = {"applied": False, "fallback_reason": "no_valid_ranks"}
    items = [
        {"query_id": "q1", "status": "succeeded",
         "result": result(hit("x", 1, 1, 1, 1), hit("a", 2, 2, 2, 2)) | {"rerank": fell_back}},
        {"query_id": "q2", "status": "succeeded",
         "result": result(hit("b", 1, 1, 1, 1)) | {"rerank": fell_back}},
    ]  # fmt: skip
    report = score_results(items, qrels, window=30)
    assert report["rerank_fallbacks"] == {"no_valid_ranks": 2}
    assert report["runs"]["final (reranked)"] == report["runs"]["fused"]  # the fused order
    items[1]["result"]["rerank"] = {"applied": True, "fallback_reason": None}
    assert score_results(items, qrels, window=30)["rerank_fallbacks"] == {"no_valid_ranks": 1}
    plain = [item | {"result": result(hit("b", 1, 1, 1, 1))} for item in items]
    report = score_results(plain, qrels, window=30)  # no rerank asked: nothing fell back
    assert report["rerank_fallbacks"] == {} and "final (reranked)" not in report["runs"]


def test_results_compare_fusion_with_a_channel_only_where_they_hold_its_first_ten() -> None:
    """A batch's results hold a channel's ranks only as deep as its hits go: past that, the
    channel's nDCG@10 is a lower bound (``≥`` in the table), so a run compared with it
    "won" where it may have lost. q1's two hits hold BM25's and kNN's first rank only; q2's
    ten hold both channels' first ten. Fusion is compared on q2 alone (a tie), where it
    "won" on q1 against both channels: on SciFact, the reranked run of ``sift eval --index``
    lost to the better channel on 91.5 % of the queries, and ``--results`` of its file said
    it lost on none."""
    qrels = {"q1": {"a": 1}, "q2": {"d0": 1}}
    cut = result(hit("x", 1, 1, 1, 1), hit("a", 2, 2, 3, 3))
    deep = result(*(hit(f"d{i}", i + 1, i + 1, i + 1, i + 1) for i in range(10)))
    items = [
        {"query_id": "q1", "status": "succeeded", "result": cut},
        {"query_id": "q2", "status": "succeeded", "result": deep},
    ]
    report = score_results(items, qrels, window=10)
    assert report["lower_bounds"]["bm25"]  # q1's BM25 ranking is cut after its first
    versus = report["fusion_vs_channels"]["fused"]
    assert versus["queries"] == 1
    assert versus["vs_better_channel_per_query"] == {"lost": 0.0, "won": 0.0, "tied": 1.0}
    items.pop()  # no query holds a channel's first ten: nothing to compare
    assert "fused" not in score_results(items, qrels, window=10)["fusion_vs_channels"]


def test_results_of_which_no_hit_is_judged_are_named_not_scored_silently(tmp_path: Path) -> None:
    """Results of another index than the qrels' (a batch of SciFact claims run on a 30-document
    index) scored 0.000 on every row with no word, exit 0: no hit of any run was a document
    the qrels judge. The report counts the judged hits, and the table says so under it."""
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}}
    items = [
        {"query_id": q, "status": "succeeded", "result": result(hit("x", 1, 1, 1, 1))}
        for q in ("q1", "q2")
    ]
    assert score_results(items, qrels, window=30)["judged_hits"] == 0
    items[0]["result"] = result(hit("a", 1, 1, 1, 1))
    assert score_results(items, qrels, window=30)["judged_hits"] == 3  # bm25, knn, fused: a

    items[0]["result"] = result(hit("y", 1, 1, 1, 1))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\ta\t1\nq2\tb\t1\n")
    args = ["eval", "--results", str(tmp_path / "results.jsonl")]
    run = CliRunner().invoke(app, [*args, "--qrels", str(tmp_path / "qrels.tsv")])
    said = " ".join(run.output.split())
    assert "no hit of any run is a document the qrels judge" in said, said


def test_results_cut_before_the_window_leave_the_conditional_row_unknown(tmp_path: Path) -> None:
    """The conditional row averages the queries with a relevant candidate in the window. A
    batch of limit 10 holds each query's first 10 fused candidates, not the window's 30: a
    query whose relevant document is fused 11th to 30th was left out as if none were in the
    window, so the row averaged only the queries answered in the first ten (SciFact, a
    `sift batch` of limit 10: 0.818 over 261 claims, where `sift eval --index` gives 0.773
    over 275). Which queries it holds is unknown then: ``None``, ``–`` in the table. A query
    with a relevant one among those held is in the window anyway, and a failed search holds
    no candidate to tell: neither blanks the row."""
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}, "q3": {"c": 1}}
    first_ten = [hit(f"x{i}", i + 1, i + 1, i + 1, i + 1) for i in range(10)]
    items = [
        {"query_id": "q1", "status": "succeeded", "result": result(hit("a", 1, 1, 1, 1))},
        {"query_id": "q2", "status": "succeeded", "result": result(*first_ten)},  # b: 11th?
        {"query_id": "q3", "status": "failed", "error": {"type": "x", "message": "y"}},
    ]
    report = score_results(items, qrels, window=30)
    assert set(report["runs"]["final, conditional on the window"].values()) == {None}
    assert "final, conditional on the window" in report["unknown"]
    assert report["runs"]["fused"]["nDCG@10"] == pytest.approx(1 / 3)  # the rest as before

    items[1]["result"] = result(hit("b", 1, 1, 1, 1), *first_ten[1:])  # held: in the window
    report = score_results(items, qrels, window=30)
    assert report["runs"]["final, conditional on the window"]["nDCG@10"] == pytest.approx(1.0)
    assert report["unknown"] == {}
    traced = {"coarse_limit": 10, "candidate_limit": {"value": 10, "from": "request"}}
    items[1]["result"] = result(*first_ten, trace=traced)  # the window's 10, all of them
    items[0]["result"] = result(hit("a", 1, 1, 1, 1), trace=traced)
    assert score_results(items, qrels)["runs"]["final, conditional on the window"]["nDCG@10"]

    items[1]["result"] = result(*first_ten)
    del items[0]["result"]["trace"]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\ta\t1\nq2\tb\t1\n")
    args = ["eval", "--results", str(tmp_path / "results.jsonl")]
    run = CliRunner().invoke(
        app, [*args, "--qrels", str(tmp_path / "qrels.tsv")], env={"COLUMNS": "250"}
    )
    (row,) = [line for line in run.output.splitlines() if "│ final, conditional" in line]
    assert row.count("–") == 4 and "1.000" not in row, run.output
    said = " ".join(run.output.split())
    assert "–: unknown: the results hold only" in said, said


def test_candidate_recall_of_results_cut_before_the_window_is_marked_a_lower_bound(
    tmp_path: Path,
) -> None:
    """Two hits of an unreranked search (a batch of limit 2), the window 30: q1 holds its
    relevant a, q2 holds neither of its relevant x and y, which its window may hold. The
    end-to-end recall (0.5) and the queries with a relevant candidate (1 of 2) count only what
    the results hold: lower bounds, marked ``≥`` as the channels' are; q1 alone is exact."""
    lines = [
        {"query_id": "q1", "status": "succeeded",
         "result": result(hit("a", 1, 1, 1, 1), hit("b", 2, 2, 2, 2))},
        {"query_id": "q2", "status": "succeeded",
         "result": result(hit("c", 1, 1, 1, 1), hit("d", 2, 2, 2, 2))},
    ]  # fmt: skip
    qrels = {"q1": {"a": 1}, "q2": {"x": 1, "y": 1}}
    report = score_results(lines, qrels)
    assert report["candidate_recall"]["end_to_end"] == 0.5
    assert report["candidate_recall"]["lower_bound"] == [
        "end_to_end",
        "queries_with_a_relevant_candidate",
    ]
    assert score_results(lines[:1], {"q1": {"a": 1}})["candidate_recall"]["lower_bound"] == []
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "qrels.tsv").write_text(
        "query-id\tcorpus-id\tscore\nq1\ta\t1\nq2\tx\t1\nq2\ty\t1\n"
    )
    args = ["eval", "--results", str(tmp_path / "results.jsonl")]
    said = CliRunner().invoke(
        app, [*args, "--qrels", str(tmp_path / "qrels.tsv")], env={"COLUMNS": "250"}
    )
    assert said.exit_code == 0, said.output
    text = " ".join(said.output.split())
    assert "candidate recall@30 (end-to-end): ≥0.500; queries with a relevant candidate in " \
        "the window: ≥1/2" in text, text  # fmt: skip

"""Candidate recall at the rerank window is measured on the candidates a reranked search at
that window gets: the fused list of channels ``channel_window(coarse)`` deep, through the
real pipeline. It was the first ``window`` of the depth-100 fused run, whose channels are
400 deep: another fused list (on 80 SciFact claims over 300 abstracts, the top-30 sets
differed for 44), and the conditional row could come out below the unconditional one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.fakes import FakeEmbedder
from worker.contract import Channel, SearchSpec
from worker.core.types import ChannelHit, ChannelQuery, ChannelResults, Document, IndexProbe
from worker.evaluation.harness import TENANT, evaluate
from worker.evaluation.inputs import Collection
from worker.evaluation.served import score_results
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.settings import load_settings

DEPTH = 400


def _channels() -> dict[Channel, list[str]]:
    """``r`` first in BM25 and nowhere in kNN; 45 documents carry a BM25 and a kNN rank,
    one of them past 120: with both channels 400 deep they fuse above ``r``, with 120 (a
    window of 30) each keeps one rank only, below ``r``'s."""
    bm25: list[str | None] = [None] * DEPTH
    knn: list[str | None] = [None] * DEPTH
    bm25[0], knn[0] = "r", "f1"
    bm25[1] = "f1"
    for j in range(2, 26):  # BM25 rank j + 1, kNN rank 120 + j
        bm25[j], knn[119 + j] = f"f{j}", f"f{j}"
    for k in range(2, 31):  # kNN rank k, BM25 rank 145 + k
        knn[k - 1], bm25[144 + k] = f"g{k}", f"g{k}"
    return {
        "bm25": [doc or f"b{n}" for n, doc in enumerate(bm25)],
        "knn": [doc or f"k{n}" for n, doc in enumerate(knn)],
    }


class ScriptedBackend:
    """The same two channel rankings for every query, cut at the query's channel window."""

    name = "scripted"

    def __init__(self) -> None:
        self.rankings = _channels()

    def probe(self, index: str, tenant: str, *, timeout_seconds: float | None = None) -> IndexProbe:
        return IndexProbe(frozenset({"bm25", "knn"}), None)

    def retrieve(self, query: ChannelQuery) -> ChannelResults:
        hits: dict[Channel, list[ChannelHit]] = {}
        for channel in query.channels:
            ranked: Sequence[str] = self.rankings[channel][: query.size]
            hits[channel] = [
                ChannelHit(Document(doc, ""), float(DEPTH - i)) for i, doc in enumerate(ranked)
            ]
        return ChannelResults(hits=hits, seconds={})


def _runtime(**settings_: Any) -> Runtime:
    settings = load_settings(redis_url=None, **settings_)
    backend = ScriptedBackend()
    return Runtime(build_pipeline(settings, backend=backend, embedder=FakeEmbedder()))  # type: ignore[arg-type]


def _collection(tmp_path: Path) -> Collection:
    (tmp_path / "queries.jsonl").write_text('{"_id": "q1", "text": "tea"}\n')
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\nq1\tr\t1\n")
    return Collection(tmp_path / "corpus.jsonl", tmp_path / "queries.jsonl", tmp_path / "qrels.tsv")


def test_candidate_recall_is_that_of_the_reranked_searchs_window(tmp_path: Path) -> None:
    runtime = _runtime()

    def fused(limit: int) -> list[str]:
        spec = SearchSpec(index="eval", query="tea", mode="hybrid", limit=limit, rerank=False)
        return [hit.id for hit in runtime.search(spec, TENANT).hits]

    assert "r" not in fused(100)[:30]  # the premise: the depth-100 run's first 30 lack it
    assert fused(30)[:2] == ["f1", "r"]  # what a reranked search at window 30 fuses
    report = evaluate(runtime, _collection(tmp_path), window=30)
    recall = report["candidate_recall"]
    assert recall["window"] == 30
    assert recall["end_to_end"] == 1.0
    assert recall["queries_with_a_relevant_candidate"] == 1


def test_the_window_by_default_is_the_one_the_index_searches_use(tmp_path: Path) -> None:
    """``--window`` left out: the deployment's SIFT_RERANK_CANDIDATE_LIMIT (here 50), as a
    search's trace names it; it was 30 whatever the searches used."""
    report = evaluate(_runtime(rerank_candidate_limit=50), _collection(tmp_path))
    assert report["candidate_recall"]["window"] == 50
    assert report["candidate_recall"]["approximated"] is None


def test_results_without_the_reranked_searchs_fusion_say_recall_is_approximated() -> None:
    hits = [{"id": "r", "ranks": {"final": 1, "rrf": 1, "bm25": 1, "knn": None}}]

    def item(trace: dict[str, Any] | None) -> dict[str, Any]:
        result = {"hits": hits, "rerank": {"applied": False}, "usage": {}, "trace": trace}
        return {"query_id": "q1", "status": "succeeded", "result": result}

    untraced = score_results([item(None)], {"q1": {"r": 1}})
    assert "approximated" in untraced["candidate_recall"]["approximated"]
    trace = {"candidate_limit": {"value": 30, "from": "default"}, "coarse_limit": 30}
    traced = score_results([item(trace)], {"q1": {"r": 1}})
    assert traced["candidate_recall"]["approximated"] is None
    assert traced["candidate_recall"]["window"] == 30


def test_in_process_judged_queries_absent_from_the_queries_file_are_counted(
    tmp_path: Path,
) -> None:
    collection = _collection(tmp_path)
    collection.qrels.write_text("query-id\tcorpus-id\tscore\nq1\tr\t1\nq2\tr\t1\n")
    report = evaluate(_runtime(), collection, window=30)
    assert report["queries"] == 1
    assert report["missing"] == 1 and report["missing_from"] == str(collection.queries)

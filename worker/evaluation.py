"""The evaluation harness: per-channel, fused and final quality, and candidate recall.

It runs in-process over the runtime, reads a BEIR-layout collection, and scores with
``ir-measures``. Relevance comes from the qrels alone (no LLM judge): a pair counts as
relevant when its score is at least 1, and a query with no relevant pair is left out.
Candidate recall follows the reranking guide (seed 004): end-to-end reports every
query; conditional reports only the queries whose rerank window holds a relevant doc.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ir_measures
from ir_measures import RR, R, nDCG

from worker.contract import DocumentIn, Mode, SearchResult, SearchSpec
from worker.runtime import Runtime

JUDGE_POLICY = "qrels (binary: score >= 1), no LLM judge; queries without qrels left out"
MEASURES = [nDCG @ 10, RR @ 10, R @ 10, R @ 100]
TENANT = "eval"


@dataclass(frozen=True)
class Collection:
    corpus: Path
    queries: Path
    qrels: Path


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def read_corpus(path: Path) -> list[DocumentIn]:
    """BEIR (``_id``, ``title``, ``text``) or Sift's own shape (``id``, ...)."""
    docs = []
    for row in read_jsonl(path):
        if "_id" in row:
            row = {"id": str(row["_id"]), "title": row.get("title") or "", "text": row["text"]}
        docs.append(DocumentIn.model_validate(row))
    return docs


def read_qrels(path: Path) -> dict[str, dict[str, int]]:
    qrels: dict[str, dict[str, int]] = {}
    rows = _tsv(path) if path.suffix == ".tsv" else ir_measures.read_trec_qrels(str(path))  # type: ignore[no-untyped-call]
    for qrel in rows:
        if qrel.relevance >= 1:
            qrels.setdefault(qrel.query_id, {})[qrel.doc_id] = qrel.relevance
    return qrels


def _tsv(path: Path) -> Iterator[ir_measures.Qrel]:
    with path.open(encoding="utf-8") as handle:
        for n, line in enumerate(handle):
            parts = line.split()
            if len(parts) != 3 or (n == 0 and not parts[2].lstrip("-").isdigit()):
                continue  # the header
            yield ir_measures.Qrel(parts[0], parts[1], int(parts[2]))


@dataclass(frozen=True)
class RunSpec:
    name: str
    mode: Mode
    rerank: bool
    limit: int


def evaluate(
    runtime: Runtime,
    collection: Collection,
    *,
    index: str = "eval",
    window: int = 30,
    rerank: bool = False,
    max_queries: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Run every query through each run and score it; returns the report as plain data.

    ``progress(run, n, total)`` hears of each query done, with the run's query count."""
    qrels = read_qrels(collection.qrels)
    queries = [
        (str(row["_id"] if "_id" in row else row["id"]), row.get("text") or row["query"])
        for row in read_jsonl(collection.queries)
    ]
    queries = [(qid, text) for qid, text in queries if qid in qrels][:max_queries]
    qrel_list = [
        ir_measures.Qrel(qid, doc, rel)
        for qid, docs in qrels.items()
        for doc, rel in docs.items()
        if any(q == qid for q, _ in queries)
    ]

    runs = [
        RunSpec("bm25", "fts", False, 100),
        RunSpec("knn", "vector", False, 100),
        RunSpec("fused", "hybrid", False, 100),
    ]
    if rerank:
        runs.append(RunSpec("final (reranked)", "hybrid", True, 10))

    report: dict[str, Any] = {
        "judge": JUDGE_POLICY,
        "queries": len(queries),
        "runs": {},
        "window": window,
    }
    windows: dict[str, set[str]] = {}
    usage_total: dict[str, float] = {}
    final: list[ir_measures.ScoredDoc] = []
    for run in runs:
        scored: list[ir_measures.ScoredDoc] = []
        for qid, text in queries:
            result = runtime.search(
                SearchSpec(
                    index=index, query=text, mode=run.mode, limit=run.limit, rerank=run.rerank
                ),
                TENANT,
            )
            scored += _scored(qid, result)
            if run.name == "fused":
                windows[qid] = {hit.id for hit in result.hits[:window]}
            for key, value in result.usage.model_dump().items():
                usage_total[key] = usage_total.get(key, 0) + value
            if progress is not None:
                progress(run.name, 1, len(queries))
        report["runs"][run.name] = _aggregate(qrel_list, scored)
        final = scored  # the last run is the final one: reranked if asked, else fused

    # Candidate recall at the rerank window bounds what any reranker can reach (seed 004).
    recalls = [len(windows[qid] & qrels[qid].keys()) / len(qrels[qid]) for qid, _ in queries]
    reachable = {qid for qid, _ in queries if windows[qid] & qrels[qid].keys()}
    report["candidate_recall"] = {
        "window": window,
        "end_to_end": sum(recalls) / len(recalls) if recalls else 0.0,
        "queries_with_a_relevant_candidate": len(reachable),
    }
    report["runs"]["final, conditional on the window"] = _aggregate(
        [q for q in qrel_list if q.query_id in reachable],
        [s for s in final if s.query_id in reachable],
    )
    report["usage"] = usage_total
    return report


def _scored(qid: str, result: SearchResult) -> list[ir_measures.ScoredDoc]:
    n = len(result.hits)
    return [ir_measures.ScoredDoc(qid, hit.id, float(n - i)) for i, hit in enumerate(result.hits)]


def _aggregate(qrels: list[ir_measures.Qrel], run: list[ir_measures.ScoredDoc]) -> dict[str, float]:
    values = ir_measures.calc_aggregate(MEASURES, qrels, run)
    return {str(measure): float(values[measure]) for measure in MEASURES}

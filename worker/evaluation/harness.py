"""The evaluation harness: per-channel, fused and final quality, and candidate recall.

:func:`evaluate` runs in-process over the runtime on a BEIR-layout collection;
:func:`score_results` scores what the API served (a batch's results) with no search of its
own; both end in :func:`score_rankings`, so every source is scored by the same code with
``ir-measures``. Relevance comes from the qrels alone (no LLM judge): a pair counts as
relevant when its score is at least 1 (nDCG's gain is the score, graded), and a query with
no relevant pair is left out.
Candidate recall follows the reranking guide (seed 004): end-to-end reports every
query; conditional reports only the queries whose rerank window holds a relevant doc,
and it is given for each channel's ranking too. :func:`fusion_vs_channels` says, query by
query, how often fusion lost to a channel alone.
"""

from __future__ import annotations

import io
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ir_measures
from ir_measures import RR, R, nDCG
from pydantic import BaseModel, ConfigDict, ValidationError

from worker.constants import MAX_LIMIT
from worker.contract import DocumentIn, Mode, SearchSpec, from_beir
from worker.core.cost import add_costs
from worker.core.query import channel_window, coarse_limit
from worker.errors import SiftError
from worker.jsonl import field_problem, lines, records
from worker.runtime.inprocess import Runtime
from worker.settings import Settings

# nDCG takes each pair's score as its gain (graded, as trec_eval and BEIR do); MRR and
# recall count a pair as relevant when its score is 1 or more
JUDGE_POLICY = (
    "qrels (nDCG graded by score; relevant: score >= 1), no LLM judge; "
    "queries without qrels left out"
)
MEASURES = [nDCG @ 10, RR @ 10, R @ 10, R @ 100]
TENANT = "eval"
SERVED_RANKINGS = ("final", "fused", "bm25", "knn")  # what a served result's ranks give
CHANNELS = ("bm25", "knn")
TIE = 1e-9  # per-query nDCG@10 closer than this counts as equal
FINAL_LIMIT = 10  # the reranked run's limit
WINDOW_RUN = "window"  # the run whose hits are the reranker's candidates (no row of its own)
DEFAULT_WINDOW: int = Settings.model_fields["rerank_candidate_limit"].default


class EvaluationStopped(SiftError):
    """A search of the in-process evaluation failed, so it stopped there (``error``, whose
    message it keeps). ``usage``: what every model call so far was billed, the failed
    search's own attempts included, for the caller to say before it exits: calls a
    provider billed are paid whether the evaluation ends or not."""

    def __init__(self, error: SiftError, usage: dict[str, float | None]) -> None:
        super().__init__(str(error))
        self.code = error.code
        self.usage = usage


@dataclass(frozen=True)
class Collection:
    corpus: Path
    queries: Path
    qrels: Path


def read_results(path: Path) -> Iterator[dict[str, Any]]:
    """The lines ``sift batch`` writes, each checked for the fields scoring reads; raises
    ValueError ``path:line: field 'x': ...`` at the first bad one, or a query id again."""
    first: dict[str, int] = {}
    for number, item in records(path, _result_line):
        qid = str(item["query_id"])
        if qid in first:
            raise ValueError(
                f"{path}:{number}: field 'query_id': {qid!r} appears twice "
                f"(first at line {first[qid]})"
            )
        first[qid] = number
        yield item


def _result_line(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    try:
        _ResultLine.model_validate(obj)
    except ValidationError as exc:
        raise ValueError(field_problem(exc, "line")) from None
    return obj


class _Lenient(BaseModel):
    """A served shape as scoring reads it: the fields it uses are checked, others kept."""

    model_config = ConfigDict(extra="allow")


class _Rank(_Lenient):
    rank: int


class _Candidate(_Lenient):
    id: str
    rrf: _Lenient | None = None
    channels: dict[str, _Rank] | None = None


class _Hit(_Lenient):
    id: str
    ranks: dict[str, int | None] | None = None


class _Trace(_Lenient):
    candidates: list[_Candidate] | None = None


class _Result(_Lenient):
    hits: list[_Hit] | None = None
    trace: _Trace | None = None
    rerank: dict[str, Any] | None = None
    usage: dict[str, float | None] | None = None


class _ResultLine(_Lenient):
    query_id: str
    status: str
    result: _Result | None = None


def read_corpus(path: Path) -> list[DocumentIn]:
    """BEIR (``_id``, ``title``, ``text``) or Sift's own shape (``id``, ...); raises
    ValueError ``path:line: field 'x': ...`` at the first bad line."""
    return [document for _, document in records(path, _document)]


def _document(obj: Any) -> DocumentIn:
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    if "_id" in obj:
        obj = from_beir(obj) | {"id": str(obj["_id"])}
    try:
        return DocumentIn.model_validate(obj)
    except ValidationError as exc:
        raise ValueError(field_problem(exc)) from None


def read_qrels(path: Path) -> dict[str, dict[str, int]]:
    """The relevant pairs (score at least 1) of a BEIR ``.tsv`` qrels file (``query-id``,
    ``corpus-id``, ``score``, under a header) or of TREC qrels (any other name: query,
    iteration, document, relevance), read by ir-measures. Each line's columns are checked
    first: raises ValueError ``path:line: ...`` at the first bad one, and ``path: ...``
    when no pair is relevant (every measure would be undefined)."""
    tsv = path.suffix == ".tsv"
    qrels: dict[str, dict[str, int]] = {}
    for n, (number, line) in enumerate(lines(path)):
        try:
            qrel = _tsv_row(line, header=n == 0) if tsv else _trec_row(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        if qrel is not None and qrel.relevance >= 1:
            qrels.setdefault(qrel.query_id, {})[qrel.doc_id] = qrel.relevance
    if not qrels:
        raise ValueError(f"{path}: no relevance judgment (a score of 1 or more)")
    return qrels


def _tsv_row(line: str, *, header: bool) -> ir_measures.Qrel | None:
    """One BEIR qrels row; ``None`` for the header (the first row, its score not a number).

    >>> _tsv_row("q1\td1\t2", header=False)
    Qrel(query_id='q1', doc_id='d1', relevance=2, iteration='0')
    >>> _tsv_row("q1 d1", header=False)
    Traceback (most recent call last):
    ValueError: 2 columns: BEIR qrels have 3 (query-id, corpus-id, score)
    """
    parts = line.split()
    if len(parts) != 3:
        raise ValueError(f"{len(parts)} columns: BEIR qrels have 3 (query-id, corpus-id, score)")
    if not _integer(parts[2]):
        if header:
            return None
        raise ValueError(f"field 'score': an integer is required, not {parts[2]!r}")
    return ir_measures.Qrel(parts[0], parts[1], int(parts[2]))


def _trec_row(line: str) -> ir_measures.Qrel:
    """One TREC qrels line, checked, then read by ir-measures' own reader.

    >>> _trec_row("q1 0 d1 1")
    Qrel(query_id='q1', doc_id='d1', relevance=1, iteration='0')
    """
    parts = line.split()
    if len(parts) != 4:
        hint = "; BEIR qrels (query-id, corpus-id, score) need a .tsv name" * (len(parts) == 3)
        raise ValueError(
            f"{len(parts)} columns: TREC qrels have 4 (query, iteration, document, relevance)"
            + hint
        )
    if not _integer(parts[3]):
        raise ValueError(f"field 'relevance': an integer is required, not {parts[3]!r}")
    qrel: ir_measures.Qrel = next(ir_measures.read_trec_qrels(io.StringIO(line)))  # type: ignore[no-untyped-call]
    return qrel


def _integer(text: str) -> bool:
    return text.lstrip("-").isdigit()


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


def judged_queries(
    path: Path, qrels: dict[str, dict[str, int]], max_queries: int | None = None
) -> list[tuple[str, str]]:
    """``(id, text)`` of the queries with at least one relevant pair, in file order; raises
    ValueError ``path:line: field 'x': ...`` at the first bad line, and at an id given again
    (the scores are keyed by id: the second was averaged as one query, counted as two)."""
    return [(qid, text) for qid, text in query_lines(path) if qid in qrels][:max_queries]


def query_lines(path: Path) -> list[tuple[str, str]]:
    """``(id, text)`` of every query of ``path``, checked as :func:`judged_queries` says."""
    first: dict[str, int] = {}
    queries = []
    for number, (field, qid, text) in records(path, _query_line):
        if qid in first:
            raise ValueError(
                f"{path}:{number}: field {field!r}: {qid!r} appears twice "
                f"(first at line {first[qid]})"
            )
        first[qid] = number
        queries.append((qid, text))
    return queries


def absent_queries(path: Path, qrels: Mapping[str, object]) -> int:
    """How many queries of ``qrels`` have no line in the queries file ``path``."""
    return len(set(qrels) - {qid for qid, _ in query_lines(path)})


def _query_line(obj: Any) -> tuple[str, str, str]:
    """:func:`_query`'s ``(id, text)`` after the name of the id's field."""
    field = "_id" if isinstance(obj, dict) and "_id" in obj else "id"
    return (field, *_query(obj))


def _query(obj: Any) -> tuple[str, str]:
    """A BEIR query (``_id``, ``text``) or Sift's (``id``, ``query``) as ``(id, text)``.

    >>> _query({"_id": "q1", "text": "tea"}), _query({"id": "q2", "query": "coffee"})
    (('q1', 'tea'), ('q2', 'coffee'))
    >>> _query({"id": "q3"})
    Traceback (most recent call last):
    ValueError: field 'query': a non-empty string is required
    """
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    id_field, text_field = ("_id", "text") if "_id" in obj else ("id", "query")
    qid, text = obj.get(id_field), obj.get(text_field)
    if isinstance(qid, bool) or not isinstance(qid, str | int) or qid == "":
        raise ValueError(f"field {id_field!r}: a non-empty string is required")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"field {text_field!r}: a non-empty string is required")
    return str(qid), text


def _qrel_list(qrels: dict[str, dict[str, int]], judged: set[str]) -> list[ir_measures.Qrel]:
    return [
        ir_measures.Qrel(qid, doc, rel)
        for qid, docs in qrels.items()
        if qid in judged
        for doc, rel in docs.items()
    ]


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

"""An evaluation's inputs: a BEIR-layout collection (corpus, queries, qrels, in BEIR's or
Sift's own shapes, TREC qrels too) and the results file ``sift batch`` writes, each line
checked for what scoring reads; a bad line raises ValueError ``path:line: field 'x': ...``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ir_measures
from pydantic import BaseModel, ConfigDict, ValidationError

from worker.contract import DocumentIn, from_beir
from worker.jsonl import field_problem, lines, records


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

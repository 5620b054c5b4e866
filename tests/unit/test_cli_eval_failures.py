"""``sift eval`` when searches fail: the error types are named with their counts, as
``sift batch`` names them, the command exits 3 (``sift batch --strict``'s code) after the
table, and no fusion advice is given for a run whose failures explain its gap.

Before: ``sift eval --index nosuch`` printed a table of zeros and "N search(es) did not
succeed; they score 0" with no error type, exit 0; with the model down, ``--rerank`` showed
the final row at 0.000 (every search ``rerank_failed``) and advised "fusion hurts here …
sift eval --tune".
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from worker.cli import _eval_runs, app
from worker.cli._http import Gateway

QUERIES = '{"_id": "1", "text": "tea"}\n{"_id": "2", "text": "coffee"}\n'
QRELS = "query-id\tcorpus-id\tscore\n1\td1\t1\n2\td2\t1\n"


def _hits(qid: str) -> list[dict[str, Any]]:
    ranks = {"final": 1, "rrf": 1, "bm25": 1, "knn": 1}
    return [{"id": f"d{qid}", "ranks": ranks}]


def _gateway(fails: Callable[[dict[str, Any]], str | None]) -> Callable[..., httpx.Response]:
    """A gateway whose index ``s`` exists and whose batches end at once; ``fails(body)``
    gives the error type of every item of a batch submitted with ``body`` (None: each
    succeeds with its relevant doc)."""
    batches: dict[str, dict[str, Any]] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/indexes/s":  # the index exists (sift eval asks first)
            return httpx.Response(200, json={"name": "s"})
        if request.method == "POST":
            body = json.loads(request.content)
            batch_id = f"bat_{len(batches) + 1}"
            batches[batch_id] = body
            return httpx.Response(202, json={"id": batch_id, "status": "queued"})
        batch_id = path.split("/")[3]
        body = batches[batch_id]
        if path.endswith("/results"):
            kind = fails(body)
            results = []
            for query in body["queries"]:
                item: dict[str, Any] = {"query_id": query["id"]}
                if kind is None:
                    result = {"hits": _hits(query["id"]), "rerank": {"applied": body["rerank"]}}
                    item |= {"status": "succeeded", "result": result | {"usage": {}}}
                else:
                    item |= {"status": "failed", "error": {"type": kind, "message": "no"}}
                results.append(item)
            return httpx.Response(200, json={"results": results, "next_page_token": None})
        counts = {"succeeded": 0, "failed": 0, "canceled": 0}
        counts["failed" if fails(body) else "succeeded"] = len(body["queries"])
        return httpx.Response(200, json={"id": batch_id, "status": "succeeded", "counts": counts})

    return answer


def _eval(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    fails: Callable[[dict[str, Any]], str | None],
    *more: str,
    qrels: str = QRELS,
) -> Result:
    transport = httpx.MockTransport(_gateway(fails))

    @contextlib.contextmanager
    def gateway() -> Iterator[Gateway]:
        yield Gateway("http://gw", "key", transport=transport)

    monkeypatch.setattr(_eval_runs, "gateway", gateway)
    (tmp_path / "q.jsonl").write_text(QUERIES)
    (tmp_path / "qrels.tsv").write_text(qrels)
    args = ["eval", "--index", "s", "--queries", str(tmp_path / "q.jsonl")]
    args += ["--qrels", str(tmp_path / "qrels.tsv"), "--window", "30", *more]
    return CliRunner().invoke(app, args, env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_an_evaluation_whose_every_search_failed_names_why_and_exits_3(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result = _eval(monkeypatch, tmp_path, lambda body: "index_not_found")
    said = " ".join(result.output.split())
    assert result.exit_code == 3, said
    assert "8 search(es) did not succeed (index_not_found 8)" in said, said


def test_no_fusion_advice_for_a_reranked_run_whose_searches_failed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result = _eval(
        monkeypatch, tmp_path, lambda body: "rerank_failed" if body["rerank"] else None, "--rerank"
    )
    said = " ".join(result.output.split())
    assert result.exit_code == 3, said
    assert "2 search(es) did not succeed (rerank_failed 2)" in said, said
    assert "fusion hurts" not in said and "--tune" not in said, said


def test_results_whose_every_line_failed_name_why_and_exit_3(tmp_path: Path) -> None:
    lines = [
        {"query_id": qid, "status": "failed", "error": {"type": "index_not_found", "message": ""}}
        for qid in ("1", "2")
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "qrels.tsv").write_text(QRELS)
    args = ["eval", "--results", str(tmp_path / "results.jsonl")]
    args += ["--qrels", str(tmp_path / "qrels.tsv")]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200", "NO_COLOR": "1"})
    said = " ".join(result.output.split())
    assert result.exit_code == 3, said
    assert "2 search(es) did not succeed (index_not_found 2)" in said, said


def test_the_runs_progress_bars_go_to_stderr_and_the_report_to_stdout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``sift eval ... > report.txt`` keeps the table alone: the runs' progress bars were
    drawn on stdout, and their last frames (rich writes them to a file) came before it."""
    result = _eval(monkeypatch, tmp_path, lambda body: None)
    assert result.exit_code == 0, result.output
    assert "fused via s" in result.stderr, result.stderr  # (the table's rules are "━" too)
    assert "via s" not in result.stdout and "MRR@10" in result.stdout, result.stdout
    tuned = _eval(monkeypatch, tmp_path, lambda body: None, "--tune", "--folds", "2")
    assert tuned.exit_code == 0, tuned.output
    assert "tuning: grid points scored" in tuned.stderr, tuned.stderr
    assert "via s" not in tuned.stdout and "tuning:" not in tuned.stdout, tuned.stdout
    assert "chosen on all 2 queries" in tuned.stdout, tuned.stdout
    # a warning, as the errors are: these hits carry no channel scores (it was on stdout)
    assert "no channel scores" in tuned.stderr, tuned.stderr
    assert "no channel scores" not in tuned.stdout, tuned.stdout


def test_judged_queries_absent_from_the_queries_file_are_said(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Query 3 has qrels and no line in the queries file: left out of every figure, and
    said so, as ``--results`` says of a judged query with no result (it said nothing)."""
    result = _eval(monkeypatch, tmp_path, lambda body: None, qrels=QRELS + "3\td3\t1\n")
    said = " ".join(result.output.split())
    assert result.exit_code == 0, said
    assert f"1 judged quer(y/ies) of the qrels are not in {tmp_path / 'q.jsonl'}" in said, said

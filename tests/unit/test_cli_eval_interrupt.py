"""``sift eval --index`` interrupted (Ctrl-C) while its runs' batches run cancels each of them
and says what each cancel did, as ``sift batch`` does.

Before, Ctrl-C exited 130 with nothing said, and the three batches (four with ``--rerank``,
whose model calls are paid) ran on with nobody to read their results.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from worker.cli import _eval_runs, app
from worker.cli._http import Gateway


def invoke_eval(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, interrupt_at: str
) -> tuple[Any, list[tuple[str, str]]]:
    """``sift eval --index`` of two judged queries against a gateway that accepts every
    batch, and is interrupted at the first status read (``GET``) or the second submit; with
    ``second DELETE``, at the first read, then again at the second cancel."""
    sent: list[tuple[str, str]] = []
    posts = iter(range(1, 100))
    deletes = iter(range(1, 100))

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append((request.method, request.url.path))
        if request.method == "POST":
            n = next(posts)
            if interrupt_at == "second POST" and n == 2:
                raise KeyboardInterrupt
            return httpx.Response(202, json={"id": f"bat_{n}", "status": "queued"})
        if request.method == "GET":
            raise KeyboardInterrupt
        if interrupt_at == "second DELETE" and next(deletes) == 2:
            raise KeyboardInterrupt
        counts = {"canceled": 2, "succeeded": 0, "failed": 0}
        return httpx.Response(200, json={"status": "canceled", "counts": counts})

    return run_eval(monkeypatch, tmp_path, answer), sent


def run_eval(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    answer: Callable[[httpx.Request], httpx.Response],
    *more: str,
) -> Any:
    """``sift eval --index`` of two judged queries (and ``more`` options) against a gateway
    where the index exists and that answers each other request with ``answer``;
    ``--window 30``, so no search asks the index's window first."""

    def routed(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/indexes/s":  # the index exists (sift eval asks first)
            return httpx.Response(200, json={"name": "s"})
        return answer(request)

    @contextlib.contextmanager
    def gateway() -> Iterator[Gateway]:
        yield Gateway("http://gw", "key", transport=httpx.MockTransport(routed))

    monkeypatch.setattr(_eval_runs, "gateway", gateway)
    queries = tmp_path / "queries.jsonl"
    queries.write_text('{"_id": "1", "text": "tea"}\n{"_id": "2", "text": "coffee"}\n')
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\n1\td1\t1\n2\td2\t1\n")
    args = ["eval", "--index", "s", "--queries", str(queries), "--qrels", str(qrels)]
    args += ["--window", "30", *more]
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"})


def test_ctrl_c_while_the_runs_wait_cancels_every_batch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result, sent = invoke_eval(monkeypatch, tmp_path, "GET")
    assert result.exit_code == 130, result.output
    deleted = [path for method, path in sent if method == "DELETE"]
    assert deleted == [f"/v1/batches/bat_{n}" for n in (1, 2, 3, 4)], sent
    said = " ".join(result.output.split())
    assert "interrupted: the bm25 run's batch bat_1 canceled: 2 item(s) canceled" in said, said
    assert "fused run's batch bat_3 canceled" in said, said


def test_ctrl_c_while_submitting_cancels_what_was_made_and_says_one_may_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result, sent = invoke_eval(monkeypatch, tmp_path, "second POST")
    assert result.exit_code == 130, result.output
    assert [path for method, path in sent if method == "DELETE"] == ["/v1/batches/bat_1"], sent
    said = " ".join(result.output.split())
    assert "interrupted while submitting: a run's batch may have been accepted" in said, said


def test_ctrl_c_again_while_canceling_says_which_batches_may_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ctrl-C again while the cancels are on their way leaves at once, as ``sift batch`` does,
    naming the batches whose cancel may not have been made. Before, it exited 130 with only
    the first run's cancel said: the second and third batches ran on, unnamed."""
    result, sent = invoke_eval(monkeypatch, tmp_path, "second DELETE")
    assert result.exit_code == 130, result.output
    deleted = [path for method, path in sent if method == "DELETE"]
    assert deleted == ["/v1/batches/bat_1", "/v1/batches/bat_2"], sent  # no third: leave now
    said = " ".join(result.output.split())
    assert "the bm25 run's batch bat_1 canceled" in said, said
    assert (
        "interrupted again: the cancels of bat_2, bat_3, bat_4 may not have been made; they "
        "may still be running (DELETE /v1/batches/{id} cancels each)" in said
    ), said


def test_a_reranked_run_the_deployment_refuses_is_sent_first_so_nothing_else_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A deployment with no generation model refuses ``rerank: true`` (422). The reranked
    run is submitted first, so the refusal comes before any other batch; it was the fourth,
    after three batches (900 searches on SciFact) had started, and canceled then."""
    sent: list[tuple[str, str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        sent.append((request.method, request.url.path, body))
        if request.method == "POST" and body["rerank"]:
            error = {"type": "invalid_request", "message": "rerank: no generation model"}
            return httpx.Response(422, json={"error": {**error, "field": "rerank"}})
        return httpx.Response(202, json={"id": f"bat_{len(sent)}", "status": "queued"})

    result = run_eval(monkeypatch, tmp_path, answer, "--rerank")
    assert result.exit_code == 1, result.output
    assert [(method, path) for method, path, _ in sent] == [("POST", "/v1/batches")], sent
    assert "rerank: no generation model" in " ".join(result.output.split())

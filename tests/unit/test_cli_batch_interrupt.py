"""``sift batch`` interrupted (Ctrl-C) while it waits cancels the batch it submitted, and says
what was canceled.

Before, Ctrl-C exited 130 with nothing said and the batch ran on: every item searched (and
reranked, at the model's price) while no results file would ever be written, since the
command that writes it was gone. A cancel also stops items not yet at their model call.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from worker.cli import app
from worker.cli._http import Gateway
from worker.cli.client import _batch

BATCH = "bat_" + "1" * 32
COUNTS = {"total": 3, "queued": 1, "running": 0, "succeeded": 1, "failed": 0, "canceled": 1}


def served(answers: dict[str, Any], sent: list[tuple[str, str]]) -> Any:
    def answer(request: httpx.Request) -> httpx.Response:
        sent.append((request.method, request.url.path))
        if request.method == "POST":
            if answers.get("post") is KeyboardInterrupt:
                raise KeyboardInterrupt  # Ctrl-C while the batch is being submitted
            return httpx.Response(202, json={"id": BATCH, "status": "queued"})
        if request.method == "GET":
            raise KeyboardInterrupt  # Ctrl-C while the command polls
        reply = answers["delete"]
        if reply[1] is KeyboardInterrupt:
            raise KeyboardInterrupt  # Ctrl-C again while the cancel is on its way
        return httpx.Response(reply[0], json=reply[1])

    return answer


def invoke_batch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, answer: Any, *extra: str
) -> tuple[Any, Path]:
    """``sift batch`` of three queries (and ``extra`` options) against a gateway that
    ``answer`` plays: the result and the ``--out`` path."""

    @contextlib.contextmanager
    def gateway() -> Iterator[Gateway]:
        yield Gateway("http://gw", "key", transport=httpx.MockTransport(answer))

    monkeypatch.setattr(_batch, "gateway", gateway)
    queries = tmp_path / "q.jsonl"
    queries.write_text(
        "".join(json.dumps({"id": f"q{i}", "query": "tea"}) + "\n" for i in range(3))
    )
    out = tmp_path / "out.jsonl"
    args = ["batch", str(queries), "--index", "s", "--out", str(out), *extra]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    return result, out


def run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, delete: tuple[int, Any], post: Any = None
) -> Any:
    sent: list[tuple[str, str]] = []
    answer = served({"delete": delete, "post": post}, sent)
    result, _ = invoke_batch(monkeypatch, tmp_path, answer)
    return result, sent


def test_ctrl_c_cancels_the_batch_and_says_what_was_canceled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    canceled = {"id": BATCH, "status": "running", "counts": COUNTS}
    result, sent = run(monkeypatch, tmp_path, (200, canceled))
    assert result.exit_code == 130, result.output
    assert ("DELETE", f"/v1/batches/{BATCH}") in sent
    assert f"batch {BATCH}: cancel made; 1 item(s) canceled so far, 1 finished" in " ".join(
        result.output.split()
    )
    assert "Traceback" not in result.output


def test_a_cancel_that_canceled_nothing_yet_does_not_call_the_batch_canceled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every item left was held by a worker: the cancel canceled none at once, and those past
    their model call finish, so the batch may end ``succeeded``. It was reported as "batch ...
    canceled: 0 item(s) canceled"."""
    counts = {**COUNTS, "queued": 0, "running": 2, "canceled": 0}
    result, _ = run(
        monkeypatch, tmp_path, (200, {"id": BATCH, "status": "running", "counts": counts})
    )
    assert result.exit_code == 130, result.output
    assert f"batch {BATCH} canceled" not in result.output
    assert f"batch {BATCH}: cancel made; 0 item(s) canceled so far" in result.output


def test_a_cancel_that_completed_the_batch_says_its_final_status(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    counts = {**COUNTS, "queued": 0, "canceled": 2}
    result, _ = run(
        monkeypatch, tmp_path, (200, {"id": BATCH, "status": "canceled", "counts": counts})
    )
    assert result.exit_code == 130, result.output
    assert f"batch {BATCH} canceled: 2 item(s) canceled, 1 finished" in result.output


def test_ctrl_c_after_the_batch_finished_cancels_nothing_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    finished = {"error": {"type": "already_finished", "message": "id: done", "field": "id"}}
    result, sent = run(monkeypatch, tmp_path, (409, finished))
    assert result.exit_code == 130, result.output
    assert ("DELETE", f"/v1/batches/{BATCH}") in sent
    assert f"batch {BATCH} had already finished: nothing canceled" in result.output


def test_a_second_ctrl_c_during_the_cancel_says_the_batch_may_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ctrl-C again while the cancel is on its way (a slow gateway: up to the CLI's 60 s
    timeout) ended the command at its last line, "interrupted: canceling batch ...": nothing
    said that the cancel may not have been made, or how to make it."""
    result, sent = run(monkeypatch, tmp_path, (0, KeyboardInterrupt))
    assert ("DELETE", f"/v1/batches/{BATCH}") in sent
    assert result.exit_code == 130, result.output
    assert "the cancel may not have been made; the batch may still be running" in result.output
    assert f"DELETE /v1/batches/{BATCH} cancels it" in result.output


def test_ctrl_c_while_submitting_says_the_batch_may_run_and_how_to_find_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ctrl-C during the POST (a 100,000-query batch takes seconds to send and store): the
    gateway may have accepted it, and the command has no id to cancel. It exited 130 with
    nothing said while the batch might run on."""
    result, sent = run(monkeypatch, tmp_path, (0, None), post=KeyboardInterrupt)
    assert sent == [("POST", "/v1/batches")]
    assert result.exit_code == 130, result.output
    shown = " ".join(result.output.split())
    assert "interrupted while submitting: the batch may have been accepted" in shown
    assert "`sift batches --limit 1` shows it" in shown


def test_ctrl_c_while_the_results_are_read_says_the_batch_finished_and_where_they_are(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ctrl-C once the batch has finished, while its result pages are read (a page retried
    through a gateway or Redis restart waits up to 120 s, a line on stderr each try): the
    command exited 130 with nothing said, no results file, and no word that the batch had
    finished and its results were still there to read."""
    sent: list[tuple[str, str]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append((request.method, request.url.path))
        if request.method == "POST":
            return httpx.Response(202, json={"id": BATCH, "status": "queued"})
        if request.url.path.endswith("/results"):
            raise KeyboardInterrupt
        done = {**COUNTS, "queued": 0, "succeeded": 2}
        return httpx.Response(200, json={"id": BATCH, "status": "succeeded", "counts": done})

    result, out = invoke_batch(monkeypatch, tmp_path, answer)
    assert result.exit_code == 130, result.output
    assert not any(method == "DELETE" for method, _ in sent)  # nothing left to cancel
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["q.jsonl"]  # no partial
    shown = " ".join(result.output.split())
    assert (
        f"interrupted while writing the results: batch {BATCH} has finished; nothing was "
        f"written to {out}; run the same command again within 24 h to pick it up and "
        "write its results"
    ) in shown, shown


def test_polls_given_up_after_the_retry_window_say_the_batch_may_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The gateway unreachable past the polls' retry window: the command gave up with the
    last error alone ("cannot connect ... Start one with `sift up`"), exit 1, and not a word
    that the batch it submitted runs on, spending, with no results file coming."""
    from worker.cli import _http

    monkeypatch.setattr(_http, "RETRY_SECONDS", 0.5)

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202, json={"id": BATCH, "status": "queued"})
        raise httpx.ConnectError("refused", request=request)

    result, _ = invoke_batch(monkeypatch, tmp_path, answer)
    assert result.exit_code == 1, result.output
    shown = " ".join(result.output.split())
    assert "error: cannot connect to the gateway at http://gw" in shown, shown
    assert f"Start one with `sift up`; batch {BATCH}" in shown, shown  # not "`sift up`.; batch"
    assert (
        f"batch {BATCH} may still be running, with no results file written: run the same "
        f"command again within 24 h to pick it up and write its results "
        f"(DELETE /v1/batches/{BATCH} cancels it)"
    ) in shown, shown


def test_with_new_a_run_given_up_names_its_batch_s_results_not_a_run_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Sent with ``--new`` (a key of its own), the batch is not what the same command run
    again picks up: it sends another, paid again. So the message names the batch's results
    route instead."""
    from worker.cli import _http

    monkeypatch.setattr(_http, "RETRY_SECONDS", 0.5)

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202, json={"id": BATCH, "status": "queued"})
        raise httpx.ConnectError("refused", request=request)

    result, _ = invoke_batch(monkeypatch, tmp_path, answer, "--new")
    assert result.exit_code == 1, result.output
    shown = " ".join(result.output.split())
    assert f"GET /v1/batches/{BATCH}/results pages its results once it has finished" in shown
    assert "run the same command again" not in shown, shown

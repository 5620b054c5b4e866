"""What the CLI prints from the gateway (ids, titles, texts, queries, error messages) is
printed as written: square brackets are not rich markup, ``:name:`` is not an emoji.

Before, a document titled ``[/x]`` made ``sift search`` and ``sift documents get`` end in a
rich ``MarkupError`` traceback, an id ``[red]m-2`` was shown as ``m-2``, and the gateway's
``index: String should match pattern '^[a-z0-9][a-z0-9_.-]*$'`` was printed as ``'^*$'``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner, Result

from worker.cli import app, indexes, listing
from worker.cli._http import Gateway
from worker.cli.client import _batch, _ingest, _search

TITLE = "[/x] closing :thumbs_up:"
DOC_ID = "[red]m-2"
TEXT = "markup [bold]bravo[/bold] and [/] :smile:"
QUERY = "[/q] what :fire:"
PATTERN_ERROR = "index: String should match pattern '^[a-z0-9][a-z0-9_.-]*$'"

HIT = {
    "id": DOC_ID, "revision": "r1", "title": TITLE, "text": TEXT, "metadata": {},
    "ranks": {"final": 1, "rrf": 1, "bm25": 1, "knn": None},
    "scores": {"rrf": 0.03, "bm25": 7.5, "knn": None},
}  # fmt: skip
RESULT = {"hits": [HIT], "rerank": {"applied": False, "fallback_reason": None}, "usage": {}}


def answer(request: httpx.Request) -> httpx.Response:
    path = request.url.path
    if path == "/v1/searches" and request.method == "POST" and b'"refused"' not in request.content:
        return httpx.Response(200, json={"id": "s-1", "status": "succeeded", "result": RESULT})
    if path == "/v1/searches" and request.method == "GET":
        job = {"id": "srch_1", "status": "failed", "index": "s", "mode": "hybrid",
               "query": QUERY, "created_at": None, "finished_at": None,
               "error": {"type": "[/e] odd", "message": "x"}}  # fmt: skip
        return httpx.Response(200, json={"searches": [job], "next_page_token": None})
    if path.startswith("/v1/indexes/s/documents/"):
        doc = {"id": DOC_ID, "text": TEXT, "title": TITLE, "revision": "r1",
               "metadata": {"k": "[/y]"}, "version": 3}  # fmt: skip
        return httpx.Response(200, json=doc)
    body = {"error": {"type": "invalid_request", "message": PATTERN_ERROR, "field": "index"}}
    return httpx.Response(422, json=body)


@pytest.fixture(autouse=True)
def fake_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextlib.contextmanager
    def gateway() -> Iterator[Gateway]:
        yield Gateway("http://gw", "key", transport=httpx.MockTransport(answer))

    for module in (_ingest, _search, _batch, indexes, listing):
        monkeypatch.setattr(module, "gateway", gateway)


def run(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


def shown(result: Result) -> str:
    """The output with the table borders taken out, so a cell is read whole."""
    return " ".join(result.output.replace("│", " ").split())


def no_traceback(result: Result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and "MarkupError" not in result.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("search", "q", "--index", "s"), [DOC_ID, TITLE]),
        (("documents", "get", "m-2", "--index", "s"), [DOC_ID, TITLE, TEXT, '"[/y]"']),
        (("searches",), [QUERY, "[/e] odd"]),
    ],
    ids=["search", "documents-get", "searches"],
)
def test_gateway_text_is_printed_as_written(args: tuple[str, ...], expected: list[str]) -> None:
    result = run(*args)
    no_traceback(result)
    assert result.exit_code == 0, result.output
    for text in expected:
        assert text in shown(result), (text, result.output)


@pytest.mark.parametrize(
    "args",
    [
        ("search", "q", "--index", "refused"),
        ("index", "show", "refused"),
        ("documents", "delete", "a", "--index", "refused"),
    ],
    ids=["search", "index-show", "documents-delete"],
)
def test_an_error_message_keeps_its_brackets(args: tuple[str, ...]) -> None:
    result = run(*args)
    no_traceback(result)
    assert result.exit_code == 1
    assert f"the gateway answered 422: {PATTERN_ERROR}" in result.output


def test_the_markup_of_the_cli_itself_still_renders() -> None:
    """The escaping is of the gateway's text only: the CLI's own styling is not printed as
    brackets."""
    result = run("search", "q", "--index", "refused")
    assert "[bold red]" not in result.output and "error:" in result.output

"""``sift search`` interrupted (Ctrl-C) says what it leaves behind: a search has no cancel, so
one accepted runs on, and the command names it and where its result will be.

Before, Ctrl-C exited 130 with nothing said (typer's handling of KeyboardInterrupt), while
the search ran on, its model call included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from worker.cli import app
from worker.cli._http import Gateway
from worker.cli.client import _search

SEARCH = "srch_" + "2" * 32


def invoke_search(monkeypatch: pytest.MonkeyPatch, interrupt_on: str) -> tuple[Any, list[str]]:
    """``sift search`` against a gateway that accepts the search (202) and is interrupted at
    ``interrupt_on`` (the submit's POST or the poll's GET)."""
    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.method)
        if request.method == interrupt_on:
            raise KeyboardInterrupt
        return httpx.Response(202, json={"id": SEARCH, "status": "queued"})

    @contextlib.contextmanager
    def gateway() -> Iterator[Gateway]:
        yield Gateway("http://gw", "key", transport=httpx.MockTransport(answer))

    monkeypatch.setattr(_search, "gateway", gateway)
    result = CliRunner().invoke(app, ["search", "tea", "--index", "s"], env={"COLUMNS": "200"})
    return result, sent


def test_ctrl_c_while_waiting_names_the_search_that_runs_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result, sent = invoke_search(monkeypatch, "GET")
    assert result.exit_code == 130, result.output
    assert sent == ["POST", "GET"]
    said = " ".join(result.output.split())
    assert f"interrupted: search {SEARCH} runs on; GET /v1/searches/{SEARCH}" in said, said


def test_ctrl_c_while_submitting_says_the_search_may_run(monkeypatch: pytest.MonkeyPatch) -> None:
    result, sent = invoke_search(monkeypatch, "POST")
    assert result.exit_code == 130, result.output
    assert sent == ["POST"]  # no poll
    said = " ".join(result.output.split())
    assert "interrupted while submitting: the search may have been accepted" in said, said
    assert "sift searches --limit 1" in said, said

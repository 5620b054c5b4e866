"""``sift erase ID``: an erase whose answer was lost is sent again (erasing again answers as the
first erase did), and a Ctrl-C while it is sent says its outcome is unknown and how to learn it.
The real gateway's answers are in ``tests/e2e/test_erase.py``."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from tests.fakes import cli_answered_by
from worker.cli import app
from worker.cli import erase as erase_command

SEARCH = "srch_" + "a" * 32
ERASED = {"id": SEARCH, "kind": "search", "erased_at": "2026-12-05T16:00:00+00:00"}


def _using(monkeypatch: pytest.MonkeyPatch, answer: httpx.MockTransport) -> None:
    cli_answered_by(monkeypatch, erase_command, answer)


def test_an_erase_whose_answer_was_lost_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(f"{request.method} {request.url.path}")
        if len(sent) == 1:
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(200, json=ERASED)

    _using(monkeypatch, httpx.MockTransport(answer))
    result = CliRunner().invoke(app, ["erase", SEARCH, "--json"])
    assert result.exit_code == 0, result.output
    assert sent == [f"DELETE /v1/searches/{SEARCH}"] * 2
    assert result.stdout.strip() == '{"id": "' + SEARCH + '", "kind": "search", ' \
        '"erased_at": "2026-12-05T16:00:00+00:00"}'  # fmt: skip


def test_a_ctrl_c_while_erasing_says_the_outcome_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        raise KeyboardInterrupt

    _using(monkeypatch, httpx.MockTransport(answer))
    result = CliRunner().invoke(app, ["erase", SEARCH])
    assert result.exit_code == 130, result.output
    assert f"interrupted: search {SEARCH} may or may not be erased" in result.output
    assert f"sift erase {SEARCH}" in result.output  # how to learn it: again, harmlessly

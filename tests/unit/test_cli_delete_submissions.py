"""``sift documents delete`` sends a delete job's submission again only through a failure that
proves it never reached the gateway (a connection not made in time). The gateway honours no
Idempotency-Key on it: one sent again after an answer lost (a 504, a read timeout) made a
second job, which deleted nothing (``tests/e2e/test_index_cli_deletes.py`` runs that order
against the real gateway)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from worker.cli import app, indexes
from worker.cli._http import Gateway


class _Gateway:
    """Deletes the ids asked (one job per request); the first request fails with ``first``
    (raised before the request reaches it, or after it ran)."""

    def __init__(self, first: type[httpx.TransportError], *, ran: bool) -> None:
        self.docs = {"a", "b", "c"}
        self.first: type[httpx.TransportError] | None = first
        self.ran = ran
        self.deletes = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        failure, self.first = self.first, None
        if failure is not None and not self.ran:
            raise failure("no connection", request=request)
        ids = set(json.loads(request.content)["ids"])
        self.deletes += 1
        job = {"id": f"i{self.deletes}", "status": "succeeded", "deleted": len(ids & self.docs)}
        self.docs -= ids
        if failure is not None:
            raise failure("no answer", request=request)
        return httpx.Response(200, json={**job, "operation": "delete"})


def _using(monkeypatch: pytest.MonkeyPatch, fake: _Gateway) -> None:
    @contextlib.contextmanager
    def gateway(transport: httpx.BaseTransport | None = None) -> Iterator[Gateway]:
        client = Gateway("http://sift.test", "k", transport=httpx.MockTransport(fake))
        try:
            yield client
        finally:
            client.close()

    monkeypatch.setattr(indexes, "gateway", gateway)
    monkeypatch.setattr(time, "sleep", lambda s: None)  # the retry's back-off


def test_a_delete_never_sent_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Gateway(httpx.ConnectTimeout, ran=False)
    _using(monkeypatch, fake)
    result = CliRunner().invoke(app, ["documents", "delete", "--index", "docs", "a", "--json"])
    assert result.exit_code == 0, result.output
    assert fake.deletes == 1 and fake.docs == {"b", "c"}
    assert '"deleted": 1' in result.output, result.output


def test_a_delete_whose_answer_was_lost_is_not_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Gateway(httpx.ReadTimeout, ran=True)
    _using(monkeypatch, fake)
    result = CliRunner().invoke(app, ["documents", "delete", "--index", "docs", "a", "--json"])
    assert result.exit_code == 1, result.output
    assert fake.deletes == 1 and fake.docs == {"b", "c"}
    assert "may have been accepted" in " ".join(result.output.split()), result.output

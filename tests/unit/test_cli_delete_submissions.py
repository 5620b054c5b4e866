"""``sift documents delete`` sends a delete job's submission again only through a failure that
proves the gateway did nothing with it: a connection not made in time, or the gateway's own
``503 job_store_full`` (Redis at its maxmemory refused the job's writes: nothing was stored).
It is sent with no Idempotency-Key: one sent again after an answer lost (a 504, a
read timeout, a ``503 unavailable``) made a second job, which deleted nothing
(``tests/e2e/test_index_cli_deletes.py`` runs those orders against the real gateway)."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from tests.fakes import cli_answered_by
from worker.cli import app, indexes


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


class _FullGateway(_Gateway):
    """Answers the first request ``503`` of ``type_``, having stored nothing, as the gateway
    does when Redis refuses the job's writes (``job_store_full``)."""

    def __init__(self, type_: str) -> None:
        super().__init__(httpx.ConnectError, ran=True)
        self.first = None
        self.type = type_
        self.refused = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.refused:
            self.refused += 1
            error = {"type": self.type, "message": "the job store is full: nothing was stored"}
            return httpx.Response(503, json={"error": error}, headers={"Retry-After": "30"})
        return super().__call__(request)


def _using(monkeypatch: pytest.MonkeyPatch, fake: _Gateway) -> None:
    cli_answered_by(monkeypatch, indexes, httpx.MockTransport(fake))


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


def test_a_delete_the_gateway_refused_storing_nothing_is_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``job_store_full`` says no job was made: the delete is sent again, and runs once."""
    fake = _FullGateway("job_store_full")
    _using(monkeypatch, fake)
    result = CliRunner().invoke(app, ["documents", "delete", "--index", "docs", "a", "--json"])
    assert result.exit_code == 0, result.output
    assert fake.refused == 1 and fake.deletes == 1 and fake.docs == {"b", "c"}
    assert '"deleted": 1' in result.output, result.output


def test_a_delete_answered_unavailable_is_not_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """``unavailable`` (Redis down or too slow) may follow the job's write: not sent again."""
    fake = _FullGateway("unavailable")
    _using(monkeypatch, fake)
    result = CliRunner().invoke(app, ["documents", "delete", "--index", "docs", "a", "--json"])
    assert result.exit_code == 1, result.output
    assert fake.refused == 1 and fake.deletes == 0
    assert "may have been accepted" in " ".join(result.output.split()), result.output

"""``sift documents delete`` sends each delete job's submission with an Idempotency-Key of its
own, and sends it again with that key through any transient failure: a connection not made,
the gateway's ``503 job_store_full`` (nothing was stored), and an answer lost after the job
was made (a 504, a read timeout, a ``503 unavailable``), which the gateway answers with the
job the first request made. It sent none, and after a lost answer gave up saying the delete
"may have been accepted" (``tests/e2e/test_index_cli_deletes.py`` runs those orders against
the real gateway)."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from tests.fakes import cli_answered_by
from worker.cli import app, indexes

# a 503 from Redis stalling after the job's write: the job may have been made
UNAVAILABLE = httpx.Response(
    503, json={"error": {"type": "unavailable", "message": "the job store did not answer"}}
)


class _Gateway:
    """Deletes the ids asked, one job per request, and answers a request whose
    Idempotency-Key made a job with that job, as the gateway does. The first request fails
    with ``first``: raised before the request reaches it (``ran=False``), or after its job
    was made (an exception raised, or a response such as ``UNAVAILABLE`` answered)."""

    def __init__(
        self, first: type[httpx.TransportError] | httpx.Response | None, *, ran: bool
    ) -> None:
        self.docs = {f"d{i}" for i in range(1500)} | {"a", "b", "c"}
        self.first = first
        self.ran = ran
        self.deletes = 0
        self.keys: list[str | None] = []  # each request's Idempotency-Key
        self.jobs: dict[str, dict[str, object]] = {}  # by key

    def __call__(self, request: httpx.Request) -> httpx.Response:
        failure, self.first = self.first, None
        key = request.headers.get("idempotency-key")
        self.keys.append(key)
        if isinstance(failure, type) and not self.ran:
            raise failure("no connection", request=request)
        if key in self.jobs:
            return httpx.Response(200, json=self.jobs[key], headers={"Idempotent-Replayed": "true"})
        ids = set(json.loads(request.content)["ids"])
        self.deletes += 1
        job = {"id": f"i{self.deletes}", "status": "succeeded", "deleted": len(ids & self.docs)}
        self.docs -= ids
        if key is not None:
            self.jobs[key] = {**job, "operation": "delete"}
        if isinstance(failure, type):
            raise failure("no answer", request=request)
        if failure is not None:
            return failure
        return httpx.Response(200, json={**job, "operation": "delete"})


class _FullGateway(_Gateway):
    """Answers the first request ``503 job_store_full``, having stored nothing, as the gateway
    does when Redis refuses the job's writes."""

    def __init__(self) -> None:
        super().__init__(None, ran=True)
        self.refused = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.refused:
            self.refused += 1
            self.keys.append(request.headers.get("idempotency-key"))
            error = {"type": "job_store_full", "message": "the job store is full: nothing stored"}
            return httpx.Response(503, json={"error": error}, headers={"Retry-After": "30"})
        return super().__call__(request)


def _delete(monkeypatch: pytest.MonkeyPatch, fake: _Gateway, *ids: str) -> str:
    """``sift documents delete`` of ``ids`` (``a``: none given) against ``fake``; its
    output, exit 0 asserted."""
    cli_answered_by(monkeypatch, indexes, httpx.MockTransport(fake))
    args = ["documents", "delete", "--index", "docs", *(ids or ("a",)), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


def test_a_delete_never_sent_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Gateway(httpx.ConnectTimeout, ran=False)
    said = _delete(monkeypatch, fake)
    assert fake.deletes == 1 and "a" not in fake.docs
    assert '"deleted": 1' in said, said


@pytest.mark.parametrize(
    "lost", [httpx.ReadTimeout, httpx.RemoteProtocolError, UNAVAILABLE], ids=repr
)
def test_a_delete_whose_answer_was_lost_is_sent_again_and_gets_its_job(
    monkeypatch: pytest.MonkeyPatch, lost: type[httpx.TransportError] | httpx.Response
) -> None:
    """The job was made and ran, its answer lost (a read timeout, a connection closed, a
    ``503 unavailable``): sent again with its key, the gateway answers with that job, and the
    command reports it (it gave up, exit 1, "may have been accepted")."""
    fake = _Gateway(lost, ran=True)
    said = _delete(monkeypatch, fake)
    assert fake.deletes == 1 and "a" not in fake.docs
    assert len(fake.keys) == 2 and fake.keys[0] is not None and fake.keys[0] == fake.keys[1]
    assert '"deleted": 1' in said and '"id": "i1"' in said, said


def test_a_delete_the_gateway_refused_storing_nothing_is_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``job_store_full`` says no job was made: the delete is sent again, and runs once."""
    fake = _FullGateway()
    said = _delete(monkeypatch, fake)
    assert fake.refused == 1 and fake.deletes == 1 and "a" not in fake.docs
    assert fake.keys[0] is not None and fake.keys[0] == fake.keys[1]
    assert '"deleted": 1' in said, said


def test_each_job_of_a_delete_has_its_own_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,500 ids are two jobs, each with its own key: the second sent with the first's key
    would be answered with the first's job (or 422, its body being another)."""
    fake = _Gateway(None, ran=True)
    said = _delete(monkeypatch, fake, *(f"d{i}" for i in range(1500)))
    assert fake.deletes == 2 and fake.docs == {"a", "b", "c"}
    assert len(set(fake.keys)) == 2 and None not in fake.keys, fake.keys
    assert '"deleted": 1500' in said, said

"""``sift ingest`` through a gateway that restarts under it (stopped, then started again on
the same port a few seconds later), run as a user runs it: its own process, the stack's
Redis and worker behind a gateway of its own.

Before, its document POST was sent once: the first request the gateway missed stopped the
command, "cannot connect to the gateway", exit 1, while ``sift batch`` and ``sift eval``
waited for it. An ingest is safe to send again (documents are replaced by id, each write
versioned), so its POST now retries through the restart for the same window as theirs.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api_gateway.schemas import DocumentsRequest
from tests.e2e.conftest import ACME, KEYS, Stack
from tests.e2e.test_batch_cli_gateway_restart import (
    SCALED_SECONDS,
    _DeadClaimHandler,
    _Proxy,
)
from tests.e2e.test_ingest_interrupt import _corpus, _indexed, sift_ingest
from tests.services import free_port, gateway, served
from worker.cli import app
from worker.queue.jobstore import fingerprint

DOWN_SECONDS = 3.0


def test_sift_ingest_retries_its_requests_through_a_gateway_restart(
    stack: Stack, tmp_path: Path
) -> None:
    corpus, ids = _corpus(tmp_path, 300)
    index = "cli-restarted"
    env = {"SIFT_API_KEYS": json.dumps(KEYS), "SIFT_REDIS_URL": stack.redis_url + "/0"}
    port = free_port()
    with ExitStack() as first:
        url = first.enter_context(gateway(tmp_path / "g", env, "first", port=port))
        with sift_ingest(url, corpus, index, "--batch-size", "2") as sift:
            sift.until(lambda: len(_indexed(stack, index)) >= 10, "ten documents indexed")
            first.close()  # the gateway stopped, mid-ingest
            time.sleep(DOWN_SECONDS)
            assert sift.proc.poll() is None, sift.stderr()  # still trying, not given up
            with gateway(tmp_path / "g", env, "second", port=port):
                code = sift.finish(seconds=120)
                err = sift.stderr()
    assert code == 0, err
    assert "trying again" in err, err  # the retries are said, as sift batch says them
    assert ".; trying again" not in err, err  # "...`sift up`.; trying again" read as a typo
    assert _indexed(stack, index) == set(ids)


class _DeadUpsertClaimHandler(_DeadClaimHandler):
    """The first upsert is claimed, and then its gateway dies (:class:`_DeadClaimHandler`)."""

    def submits(self) -> bool:
        return True  # every POST of the test is an upsert

    def fingerprint(self, body: bytes) -> str:
        documents = DocumentsRequest.model_validate_json(body).model_dump(mode="json")
        return fingerprint(f"POST {self.path.split('?')[0]}", documents)


def test_sift_ingest_outwaits_the_claim_of_an_upsert_whose_gateway_died(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upsert whose gateway died between claiming its key and making the job leaves the
    key "in progress" for ``IDEMPOTENCY_PENDING_TTL_SECONDS`` (120 s) from that claim. ``sift
    ingest`` retried for ``RETRY_SECONDS`` (120 s) from its own first send, which came
    earlier: it gave up on the 409 before the key was free, exit 1, nothing indexed. It now
    retries for the same window as ``sift search``, ``sift batch`` and the deletes: the
    marker's life past the retry window."""
    monkeypatch.setattr("worker.cli._http.RETRY_SECONDS", SCALED_SECONDS)
    monkeypatch.setattr("worker.cli._http.IDEMPOTENCY_PENDING_TTL_SECONDS", SCALED_SECONDS)
    corpus, ids = _corpus(tmp_path, 3)
    index = "cli-dead-claim"
    server = _Proxy(stack.live_url)
    server.RequestHandlerClass = _DeadUpsertClaimHandler
    server.redis_url = stack.redis_url + "/0"  # type: ignore[attr-defined]
    with served(server):
        url = f"http://127.0.0.1:{server.server_address[1]}"
        env = {"SIFT_URL": url, "SIFT_API_KEY": ACME["Authorization"].split()[1],
               "COLUMNS": "200", "NO_COLOR": "1"}  # fmt: skip
        result = CliRunner().invoke(app, ["ingest", str(corpus), "--index", index], env=env)
    said = " ".join(result.output.split())
    assert result.exit_code == 0, said
    assert "has not created its job yet; retry after 1 s; trying again" in said, said
    assert len(set(server.batch_posts)) == 1 and len(server.batch_posts) > 2, server.batch_posts
    assert _indexed(stack, index) == set(ids)

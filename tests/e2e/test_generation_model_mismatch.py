"""A rerank accepted by a gateway that has a generation model, run by a worker that has none
(``SIFT_GENERATION_MODEL`` set on the gateways and not yet on the workers, in a rollout, or
lost from one of them), over the real stack.

The gateway checks ``rerank: true`` against its own settings, so the request was valid
when it was accepted: the worker failed it ``invalid_request`` ("rerank: this deployment has
no generation model"), permanent and the client's fault, under either failure policy. It is
the deployment's failure, and the rerank is unavailable as any other that fails for good:
``rerank_failed`` naming ``no_generation_model`` under ``fail_closed`` (the default), the
fused order with ``fallback_reason: "error:no_generation_model"`` under ``fail_open``. The
worker says at its start that it has no model. The model is never called.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ACME, INDEX, finished_batch, split_stack
from tests.fake_anthropic import FakeAnthropic

pytestmark = pytest.mark.integration

REASON = "no_generation_model"
WARNING = "no generation model (SIFT_GENERATION_MODEL): this worker reranks nothing"


@contextmanager
def _mismatched(tmp: Path, **worker: str) -> Iterator[tuple[httpx.Client, Path, FakeAnthropic]]:
    """A gateway with ``SIFT_GENERATION_MODEL`` and a worker without it (``worker``: its
    other settings), the six documents ingested; the client and the worker's log."""
    model = {"SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5"}
    with split_stack(tmp, gateway_env=model, worker_env=worker) as stack:
        yield stack.client, stack.worker_log, stack.model


def _search(client: httpx.Client, **asked: Any) -> dict[str, Any]:
    body = {"index": INDEX, "query": "honey", "limit": 3, "rerank": True, **asked}
    response = client.post("/v1/searches", params={"wait": 30}, json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _warned(log: Path) -> bool:
    deadline = time.monotonic() + 30  # a hang guard: the worker logs it once ready
    while time.monotonic() < deadline:
        if WARNING in log.read_text():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(240)
def test_fail_closed_fails_the_rerank_as_the_deployments_not_the_request(tmp_path: Path) -> None:
    with _mismatched(tmp_path) as (client, log, model):
        searched = _search(client, include_trace=True)
        assert searched["status"] == "failed", searched
        error = searched["error"]
        assert error["type"] == "rerank_failed" and not error["retryable"], error
        assert REASON in error["message"] and "SIFT_GENERATION_MODEL" in error["message"]
        assert error["trace"]["failure"] == REASON and error["trace"]["fallback_reason"] is None

        for lane in ("standard", "economy"):
            queries = [{"id": f"q{i}", "query": "honey"} for i in range(2)]
            body = {"index": INDEX, "rerank": True, "lane": lane, "queries": queries}
            batch, page = finished_batch(client, body, ACME)
            assert batch["counts"]["failed"] == 2, (lane, batch)
            for item in page["results"]:
                assert item["error"]["type"] == "rerank_failed", (lane, item)
                assert REASON in item["error"]["message"], (lane, item)

        fused = _search(client, rerank=False)  # a search asking for no rerank is served
        assert fused["status"] == "succeeded" and len(fused["result"]["hits"]) == 3, fused
        assert model.requests() == []
        assert _warned(log), log.read_text()


@pytest.mark.timeout(240)
def test_fail_open_serves_the_fused_order_naming_the_missing_model(tmp_path: Path) -> None:
    with _mismatched(tmp_path, SIFT_RERANK_FAILURE_POLICY="fail_open") as (client, _, model):
        fused = _search(client, rerank=False)["result"]
        searched = _search(client)
        assert searched["status"] == "succeeded", searched
        rerank = searched["result"]["rerank"]
        assert rerank == {
            "applied": False,
            "policy": rerank["policy"],
            "fallback_reason": f"error:{REASON}",
        }
        assert rerank["policy"] is not None, rerank
        hits = [hit["id"] for hit in searched["result"]["hits"]]
        assert hits == [hit["id"] for hit in fused["hits"]]
        assert model.requests() == []

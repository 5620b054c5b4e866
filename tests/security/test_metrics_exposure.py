"""What ``/metrics`` tells whoever reads it, and who may read the gateway's.

Metrics are the operator's. Their labels come from closed sets, so after real traffic neither
the gateway's nor the worker's ``/metrics`` names a tenant, an index, a query or a job id. The
gateway serves ``/metrics`` on the API's own port, so fleet-wide traffic, backlog and spend are
open to any caller unless ``SIFT_METRICS_TOKEN`` is set: then only that Bearer token reads it,
and a tenant's API key is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import GLOBEX, KEYS, Stack, ingest
from tests.prometheus_support import wait_until
from tests.services import gateway, http_get
from worker.constants import METRIC_JOB_FAILURES

METRICS_TOKEN = "metrics-token-0123456789abcdef"
INDEX = "zq-private-index-7731"
QUERY = "marmalade xylophone quorum 48213"


def index_not_found_failures(stack: Stack) -> float:
    """The live worker's ``sift_job_failures_total{kind="search",error="index_not_found"}``."""
    text = http_get(stack.worker_metrics_url, timeout=10).text
    wanted = {"kind": "search", "error": "index_not_found"}
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == METRIC_JOB_FAILURES and sample.labels == wanted
    )


def test_no_tenant_index_query_or_job_id_reaches_any_metrics(stack: Stack) -> None:
    docs = [{"id": "m1", "text": f"{QUERY} kept in a private index"}]
    ingested = ingest(stack, INDEX, docs, GLOBEX)
    search = stack.live.post(
        "/v1/searches",
        params={"wait": 20},
        json={"index": INDEX, "query": QUERY, "limit": 3},
        headers=GLOBEX,
    )
    assert search.status_code == 200, search.text
    job_id = search.json()["id"]
    failed_before = index_not_found_failures(stack)
    missing = stack.live.post(  # a failed search naming the index in its error
        "/v1/searches", json={"index": "zq-no-such-index-5512", "query": QUERY}, headers=GLOBEX
    )
    assert missing.status_code == 202, missing.text
    path = f"/v1/searches/{missing.json()['id']}"
    failed = wait_until(
        lambda: (job := stack.live.get(path, headers=GLOBEX).json())["status"] == "failed" and job,
        "the search of a missing index to fail",
    )
    assert failed["error"]["type"] == "index_not_found", failed
    # the worker counts the failure as it finishes the job, around when it stores it
    wait_until(lambda: index_not_found_failures(stack) > failed_before, "the failure to be counted")
    texts = {
        "gateway": stack.live.get("/metrics").text,
        "worker": httpx.get(stack.worker_metrics_url, timeout=10).text,
    }
    assert "sift_http_requests_total" in texts["gateway"]
    assert "sift_retrieval_duration_seconds_count" in texts["worker"]
    secrets = [k["tenant"] for k in KEYS] + [INDEX, "zq-no-such-index", QUERY, "marmalade"]
    secrets += [job_id, ingested["id"], KEYS[1]["key"]]
    for where, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"{secret!r} in the {where}'s /metrics"


@pytest.fixture(scope="module")
def guarded(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("guarded-gateway")
    env = {
        "SIFT_API_KEYS": json.dumps(KEYS),
        "SIFT_REDIS_URL": stack.redis_url + "/0",
        "SIFT_DATA_DIR": str(tmp / "data"),
        "SIFT_METRICS_TOKEN": METRICS_TOKEN,
    }
    with gateway(tmp, env, "guarded") as url:
        yield url


def test_with_a_metrics_token_only_that_token_reads_the_gateways_metrics(guarded: str) -> None:
    tenant_key = {"Authorization": f"Bearer {KEYS[0]['key']}"}
    for headers in ({}, tenant_key, {"Authorization": "Bearer wrong-token-0123456789"}):
        refused = httpx.get(f"{guarded}/metrics", headers=headers, timeout=10)
        assert refused.status_code == 401, headers
        assert refused.json()["error"]["field"] == "Authorization"
        assert "sift_" not in refused.text
    allowed = httpx.get(
        f"{guarded}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10
    )
    assert allowed.status_code == 200
    assert 'sift_jobs_in_flight{state="queued"}' in allowed.text
    # two keys, the token among them: one of them was read, the first, so whether the
    # request was let in depended on the headers' order (as for a tenant's key, 401)
    token = ("Authorization", f"Bearer {METRICS_TOKEN}")
    for headers in ([token, *tenant_key.items()], [*tenant_key.items(), token], [token, token]):
        twice = httpx.get(f"{guarded}/metrics", headers=headers, timeout=10)
        assert twice.status_code == 401, headers
        assert twice.json()["error"]["field"] == "Authorization"
        assert "2 times" in twice.json()["error"]["message"]
    # the API itself is unchanged: a tenant's key still works there
    assert httpx.get(f"{guarded}/readyz", timeout=10).status_code == 200

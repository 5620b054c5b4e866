"""The model-fault matrix through the real stack (gateway, worker, fake model over HTTP):
each failure class under both failure policies gives the right job outcome, the right number
of attempts, and the right ``sift_rerank_attempts_total`` counter; the search backend down is
a typed, retried, then clearly reported failure. Timing figures live in
``benchmarks/bench_faults.py``; here only outcomes are asserted.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import fake_anthropic as fa
from tests.reliability.faults import (
    CASES,
    NO_VALID_RANKS,
    POLICIES,
    FaultStack,
    fault_stack,
    run_case,
)
from tests.reliability.support import ACME, INDEX, stack_env, wait_for
from tests.services import celery_worker, free_port, gateway, redis_server
from worker.core.cost import cost_usd, price_for
from worker.core.types import TokenUsage
from worker.settings import DEFAULT_PRICES

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    with fault_stack(Path(tmp_path_factory.mktemp("faults"))) as stack:
        yield stack


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(CASES))
def test_each_failure_class_under_each_policy(faults: FaultStack, name: str, policy: str) -> None:
    case = CASES[name]
    seen = run_case(faults, policy, case.behaviours)
    if case.attempts:
        assert seen.requests == case.attempts
        assert seen.counters == {case.result: case.attempts}
    else:  # the stall: as many attempts as the deadline allows, each one a timeout
        assert seen.requests >= 1
        assert set(seen.counters) == {case.result}
        assert seen.counters[case.result] == seen.requests
    reasons = {case.result} if case.attempts else {case.result, "deadline"}
    if policy == "fail_closed":
        assert seen.status == "failed"
        assert seen.error is not None and seen.error["type"] == "rerank_failed"
        assert any(f"({reason})" in seen.error["message"] for reason in reasons), seen.error
    else:
        assert seen.status == "succeeded", seen.error
        assert seen.rerank is not None and seen.rerank["applied"] is False
        assert seen.rerank["fallback_reason"] in {f"error:{reason}" for reason in reasons}
    print(f"\n{name}/{policy}: {seen.requests} attempts, {seen.seconds * 1000:.0f} ms")


def _tokens_and_cost(metrics_url: str) -> dict[str, float]:
    """The worker's ``sift_rerank_tokens_total`` by type, and its ``sift_rerank_cost_usd_total``."""
    out: dict[str, float] = {"cost_usd": 0.0}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for sample in family.samples:
            if sample.name == "sift_rerank_tokens_total":
                kind = sample.labels["type"]
                out[kind] = out.get(kind, 0.0) + sample.value
            elif sample.name == "sift_rerank_cost_usd_total":
                out["cost_usd"] += sample.value
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_a_billed_malformed_answer_then_5xx_shows_its_usage_once_under_each_policy(
    faults: FaultStack, policy: str
) -> None:
    # the first attempt is answered and billed (not in the schema), the two after it are not:
    # the job (a fallback's result, a failure's error) shows that one call's tokens and
    # dollars and three requests, and the worker's counters rose by exactly as much
    metrics_url = faults.pairs[policy].metrics_url
    before = _tokens_and_cost(metrics_url)
    behaviours = [fa.malformed("not json"), fa.status(500), fa.status(529)]
    seen = run_case(faults, policy, behaviours)
    assert seen.counters == {"malformed": 1, "http_5xx": 2}
    if policy == "fail_closed":
        assert seen.status == "failed" and seen.error is not None, seen
        assert "(http_5xx)" in seen.error["message"], seen.error
    else:
        assert seen.status == "succeeded" and seen.rerank is not None, seen.error
        assert seen.rerank["fallback_reason"] == "error:http_5xx"
    billed = faults.model.usage()
    assert billed["responses"] == 1 and billed["input_tokens"] > 0
    assert seen.usage is not None and seen.usage["requests"] == 3, seen.usage
    after = _tokens_and_cost(metrics_url)
    for kind in ("input", "output", "cache_read", "cache_creation"):
        key = f"{kind}_tokens" if kind in ("input", "output") else f"{kind}_input_tokens"
        assert seen.usage[key] == billed[key] == after[kind] - before.get(kind, 0.0), kind
    priced = cost_usd(
        TokenUsage(
            billed["input_tokens"],
            billed["output_tokens"],
            billed["cache_read_input_tokens"],
            billed["cache_creation_input_tokens"],
        ),
        price_for("claude-haiku-4-5", DEFAULT_PRICES),
    )
    assert priced is not None and priced > 0
    assert seen.usage["cost_usd"] == pytest.approx(priced, rel=1e-9)
    assert after["cost_usd"] - before["cost_usd"] == pytest.approx(priced, rel=1e-9)


@pytest.mark.parametrize("policy", POLICIES)
def test_no_valid_ranks_is_a_fallback_under_both_policies(faults: FaultStack, policy: str) -> None:
    seen = run_case(faults, policy, NO_VALID_RANKS)
    assert seen.status == "succeeded"
    assert seen.rerank == {
        "applied": False,
        "policy": "listwise.v2",
        "fallback_reason": "no_valid_ranks",
    }
    assert seen.requests == 1 and seen.counters == {"ok": 1}


def test_duplicate_and_out_of_range_positions_are_dropped_not_fatal(faults: FaultStack) -> None:
    from tests import fake_anthropic as fa

    seen = run_case(faults, "fail_closed", [fa.positions([3, 3, 99, 1])])
    assert seen.status == "succeeded" and seen.rerank is not None
    assert seen.rerank["applied"] is True and seen.counters == {"ok": 1}


def test_the_search_backend_down_is_typed_retried_then_reported(tmp_path: Path) -> None:
    """Elasticsearch on a closed port: each search retries the backend within its deadline,
    the task retries once more (``SIFT_TASK_MAX_RETRIES=1``), then the job fails with
    ``backend_unavailable``, retryable, and a message that says what was unreachable.

    The deadline leaves the task's retry room on a loaded host: its first run, on a fresh
    worker, loads the embedding model beside the probe (a second idle; under a CI's load,
    2 s were spent before the probe failed, and no retry fitted)."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(
            url + "/0",
            "http://127.0.0.1:9",
            SIFT_RERANK_ENABLED="false",
            SIFT_SEARCH_BACKEND="elasticsearch",
            SIFT_ELASTICSEARCH_URL=f"http://127.0.0.1:{free_port()}",
            SIFT_SEARCH_DEADLINE_SECONDS="20",
            SIFT_TASK_MAX_RETRIES="1",
        )
        with (
            celery_worker(tmp_path / "w", env, "w-es", concurrency=2),
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=60) as client,
        ):
            response = client.post(
                "/v1/searches", params={"wait": 30}, json={"index": INDEX, "query": "tea"},
                headers=ACME,
            )  # fmt: skip
            assert response.status_code == 200, response.text
            job = response.json()
    assert job["status"] == "failed"
    error = job["error"]
    assert error["type"] == "backend_unavailable" and error["retryable"] is True
    assert "elasticsearch" in error["message"].lower() or "connect" in error["message"].lower()
    log = (tmp_path / "w" / "w-es.log").read_text()
    assert "retryable error, retrying" in log  # the task-level retry happened too


@contextmanager
def _silent_server() -> Iterator[str]:
    """An address that takes connections and never answers (a hung Elasticsearch)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for connection in held:
            connection.close()
        listener.close()


def test_a_task_retry_runs_in_what_is_left_of_the_search_deadline(tmp_path: Path) -> None:
    """A backend that hangs: the search's one run spends its whole deadline on the channels
    probe (bounded by what is left of the deadline) and ends ``deadline_exceeded``, the
    backend's timeout its cause. The task must not run it again under a fresh deadline (it
    did, three times at the default ``SIFT_TASK_MAX_RETRIES``): no time is left of the
    search's one deadline, so the job fails after one run."""
    with redis_server(tmp_path / "redis") as url, _silent_server() as hung:
        env = stack_env(
            url + "/0",
            "http://127.0.0.1:9",
            SIFT_RERANK_ENABLED="false",
            SIFT_SEARCH_BACKEND="elasticsearch",
            SIFT_ELASTICSEARCH_URL=hung,
            SIFT_SEARCH_DEADLINE_SECONDS="2",
        )
        with (
            celery_worker(tmp_path / "w", env, "w-hung", concurrency=2),
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=60) as client,
        ):
            response = client.post(
                "/v1/searches", json={"index": INDEX, "query": "tea"}, headers=ACME
            )
            assert response.status_code == 202, response.text
            job_id = response.json()["id"]
            wait_for(
                lambda: (
                    client.get(f"/v1/searches/{job_id}", headers=ACME).json()["status"]
                    in {"succeeded", "failed"}
                ),
                "the search final",
                timeout=120,
            )
            job = client.get(f"/v1/searches/{job_id}", headers=ACME).json()
    assert job["status"] == "failed" and job["error"]["type"] == "deadline_exceeded", job
    assert "during the index probe" in job["error"]["message"], job
    log = (tmp_path / "w" / "w-hung.log").read_text()
    assert log.count(f"search {job_id}: running") == 1, log
    assert "retryable error, retrying" not in log

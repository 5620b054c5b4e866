"""The dashboards and the cost accounting against a real Prometheus scraping the real stack.

Issue 5's acceptance, end to end: a private ``redis-server``, two real ``sift worker``s (two
threads-pool processes each, under its supervisor) and two real gateways under uvicorn, one
pair per rerank failure policy (``fail_open`` on Redis database 0, ``fail_closed`` on
database 1, since the policy is a deployment setting), with
the Anthropic SDK pointed at :class:`tests.fake_anthropic.FakeAnthropic`. A real ``prometheus``
scrapes both gateways (job ``sift-gateway``) and both workers (job ``sift-worker``) every
second, with the rules loaded.

The workload goes over HTTP only: the sample corpus is ingested into each pair, then searches
run one at a time (``?wait=30``), each with the fake scripted so that the script's order maps to
the searches' attempts. Together they provoke every attempt class (ok, timeout, http_5xx,
rate_limited, connection, http_4xx, malformed, refused) and every rerank outcome (applied,
fallback_no_valid_ranks, fallback_error, failed, skipped), in every search mode. A small batch
and a search with webhooks to a local receiver give the delivery results (retry, delivered,
failed).

Then every panel of both dashboards is evaluated through Prometheus's HTTP API, and the totals
are checked against the fake's usage and the jobs' ``usage``. A failed job (``fail_closed``)
carries no ``usage`` in the job store, though its tokens were spent and are in the metrics; the
fake's usage during that search, measured because searches run one at a time, stands in for it.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_anthropic import (
    Behaviour,
    FakeAnthropic,
    drop,
    malformed,
    positions,
    refusal,
    stall,
    status,
)
from tests.keys import ACME, ACME_KEY
from tests.prometheus_support import (
    RULES,
    PanelQuery,
    Prometheus,
    assert_panel_has_data,
    dashboard_queries,
    requires_prometheus,
    run_prometheus,
    wait_until,
)
from tests.services import (
    SHUTDOWN_POLL_SECONDS,
    celery_worker,
    free_port,
    gateway,
    redis_server,
)
from worker.constants import (
    BATCH_QUEUE,
    INGEST_QUEUE,
    POLICY_ID,
    PROMETHEUS_JOB_GATEWAY,
    PROMETHEUS_JOB_WORKER,
    SEARCH_QUEUE,
    WEBHOOK_QUEUE,
)
from worker.core.cost import cost_usd, price_for
from worker.core.types import TokenUsage
from worker.settings import DEFAULT_PRICES

pytestmark = [
    pytest.mark.integration,
    requires_prometheus(),
]

MODEL = "claude-haiku-4-5"
KEY = ACME_KEY
AUTH = ACME
INDEX = "docs"
SAMPLE = Path(__file__).resolve().parents[2] / "worker" / "data" / "sample_corpus.jsonl"
PANEL_QUERIES = dashboard_queries(rate_limits=False)
# What the fake adds to every answer, so every token type has data (thinking is output).
FAKE_CONFIG: dict[str, Any] = {"thinking_tokens": 16, "cache_read_input_tokens": 40,
                               "cache_creation_input_tokens": 24}  # fmt: skip
TOKEN_FIELDS = {
    "input": "input_tokens",
    "output": "output_tokens",
    "cache_read": "cache_read_input_tokens",
    "cache_creation": "cache_creation_input_tokens",
}


@dataclass(frozen=True)
class Step:
    """One search of the workload: what it asks, the fake's script, and what it must provoke."""

    pair: str  # "open" (fail_open) or "closed" (fail_closed)
    query: str
    script: tuple[Behaviour, ...] = ()
    attempts: tuple[str, ...] = ()  # the class of each model call, in order
    outcome: str | None = None  # sift_rerank_outcomes_total's outcome; None: no rerank asked
    search: str = "ok"  # sift_search_duration_seconds's outcome
    mode: str = "hybrid"
    rerank: bool = True
    webhook: str | None = None  # a path on the receiver
    status: str = "succeeded"


STEPS = (
    Step("open", "green tea leaves", (positions([2, 1]),), ("ok",), "applied"),
    Step("open", "black tea oxidation", (positions([0, 99]),), ("ok",),
         "fallback_no_valid_ranks", "fallback"),
    Step("open", "steam railway", (stall(30), positions([1, 2])), ("timeout", "ok"), "applied"),
    Step("open", "bees and flowers", (status(429, retry_after=0.2), positions([1])),
         ("rate_limited", "ok"), "applied"),
    Step("open", "volcanic eruption", (status(500), status(529)), ("http_5xx", "http_5xx"),
         "fallback_error", "fallback"),
    Step("open", "chess champion", (drop(), positions([3, 1])), ("connection", "ok"), "applied"),
    Step("open", "deepest ocean", (status(400),), ("http_4xx",), "fallback_error", "fallback"),
    Step("open", "brewing temperature", (malformed("not json"), positions([1])),
         ("malformed", "ok"), "applied"),
    Step("open", "bees and honey", (refusal("cyber"),), ("refused",), "fallback_error", "fallback"),
    Step("open", "zzqxv wkjhgf", (), (), "skipped", mode="fts"),  # no hit: nothing to rerank
    Step("open", "green tea", (positions([1]),), ("ok",), "applied", mode="vector"),
    Step("open", "steam railway", (positions([1]),), ("ok",), "applied", mode="fts"),
    Step("open", "honey bees", rerank=False, webhook="/gone"),  # a delivery that fails for good
    Step("closed", "black tea", (malformed("oops"), malformed('{"positions": "1"}')),
         ("malformed", "malformed"), "failed", "error", status="failed"),
    Step("closed", "green tea", (positions([2, 1]),), ("ok",), "applied"),
)  # fmt: skip
BATCH_QUERIES = ["green tea", "steam railway"]  # on "closed", no rerank, webhook to /flaky


def _expected() -> dict[str, Any]:
    attempts = Counter(a for step in STEPS for a in step.attempts)
    outcomes = Counter(step.outcome for step in STEPS if step.outcome)
    searches = Counter((step.mode, step.search) for step in STEPS)
    searches["hybrid", "ok"] += len(BATCH_QUERIES)
    # sift_rerank_duration_seconds's outcome: ok when the model answered, else the last class
    rerank_done = Counter(
        "ok" if step.outcome in ("applied", "fallback_no_valid_ranks") else step.attempts[-1]
        for step in STEPS
        if step.attempts
    )
    return {
        "attempts": dict(attempts),
        "outcomes": dict(outcomes),
        "searches": dict(searches),
        "rerank_done": dict(rerank_done),
    }


EXPECTED = _expected()
# Each worker's series at zero from its start, before any search (two workers; attempts,
# tokens, cost and rerank duration in both lanes)
PREREGISTERED = {
    f'count(sift_rerank_attempts_total{{job="{PROMETHEUS_JOB_WORKER}"}} == 0)': 2 * 2 * 9.0,
    f'count(sift_rerank_tokens_total{{job="{PROMETHEUS_JOB_WORKER}"}} == 0)': 2 * 2 * 4.0,
    f'count(sift_rerank_cost_usd_total{{job="{PROMETHEUS_JOB_WORKER}"}} == 0)': 2 * 2 * 1.0,
    f'count(sift_rerank_duration_seconds_count{{job="{PROMETHEUS_JOB_WORKER}"}} == 0)': 2 * 2 * 10,
    f'count(sift_rerank_in_flight{{job="{PROMETHEUS_JOB_WORKER}"}} == 0)': 2 * 1.0,
    'count(sift_retrieval_duration_seconds_count{backend="embedded"} == 0)': 2 * 4.0,
    f'count(sift_rerank_outcomes_total{{job="{PROMETHEUS_JOB_WORKER}"}} == 0)': 2 * 5.0,
}


# --- a webhook receiver ----------------------------------------------------------------------


@dataclass
class Receiver:
    """``/flaky`` answers 503 the first time and 204 after; ``/gone`` always answers 410."""

    url: str
    seen: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, path: str) -> int:
        with self.lock:
            self.seen[path] += 1
            if path == "/flaky":
                return 503 if self.seen[path] == 1 else 204
            return 410


@contextmanager
def webhook_receiver() -> Iterator[Receiver]:
    box: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(box[0].answer(self.path))
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.append(Receiver(f"http://127.0.0.1:{server.server_address[1]}"))
    thread = threading.Thread(
        target=server.serve_forever, args=(SHUTDOWN_POLL_SECONDS,), daemon=True
    )
    thread.start()
    try:
        yield box[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


# --- the stack and the workload ----------------------------------------------------------------


@dataclass
class Pair:
    client: httpx.Client
    worker_metrics: str  # host:port
    gateway: str  # host:port


@dataclass
class Ran:
    """One search as it ran: its job, and the fake's usage during it."""

    step: Step
    job: dict[str, Any]
    fake_usage: dict[str, int]


@dataclass
class Observed:
    prometheus: Prometheus
    fake: FakeAnthropic
    ran: list[Ran]
    batch_results: list[dict[str, Any]]
    receiver: Receiver
    worker_addresses: dict[str, str]
    preregistered: dict[str, float]  # PREREGISTERED's values before the workload


def _usage_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after}


def _env(tmp: Path, redis_url: str, db: int, policy: str, fake: FakeAnthropic, metrics_port: int
         ) -> dict[str, str]:  # fmt: skip
    return {
        "SIFT_API_KEYS": json.dumps([KEY]),
        "SIFT_DATA_DIR": str(tmp / f"data-{policy}"),
        "SIFT_REDIS_URL": f"{redis_url}/{db}",
        "SIFT_RERANK_ENABLED": "false",  # on per request with "rerank": true
        "SIFT_RERANK_FAILURE_POLICY": policy,
        "SIFT_GENERATION_MODEL": f"anthropic:{MODEL}",
        "SIFT_GENERATION_MAX_REQUESTS": "2",
        "SIFT_GENERATION_TIMEOUT_SECONDS": "2",  # a stall is a quick timeout
        "SIFT_SEARCH_DEADLINE_SECONDS": "15",
        "ANTHROPIC_BASE_URL": fake.url,
        "ANTHROPIC_API_KEY": "sk-ant-test",
        "SIFT_WORKER_METRICS_PORT": str(metrics_port),
        "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
        "SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS": "true",
        "SIFT_WEBHOOK_RETRY_SCALE": "0.001",
    }


@contextmanager
def _pair(tmp: Path, name: str, env: dict[str, str]) -> Iterator[Pair]:
    with (
        # two processes under sift worker's supervisor, as a user starts it: its own
        # series (the processes running and expected, their restarts) have a panel too
        celery_worker(tmp / name, env, name, concurrency=4, processes=2),
        gateway(tmp / name, env, f"gateway-{name}") as url,
        httpx.Client(base_url=url, timeout=60, headers=AUTH) as client,
    ):
        yield Pair(client, f"127.0.0.1:{env['SIFT_WORKER_METRICS_PORT']}", url.split("//")[1])


def _ingest(client: httpx.Client) -> None:
    docs = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    response = client.post(
        f"/v1/indexes/{INDEX}/documents", params={"wait": 20}, json={"documents": docs}
    )
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded", response.json()


def _search(pair: Pair, step: Step, receiver: Receiver) -> dict[str, Any]:
    body: dict[str, Any] = {
        "index": INDEX,
        "query": step.query,
        "mode": step.mode,
        "limit": 5,
        "rerank": step.rerank,
        "include_trace": True,
    }
    if step.webhook:
        body["webhook_url"] = receiver.url + step.webhook
    response = pair.client.post("/v1/searches", params={"wait": 30}, json=body)
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    assert job["status"] == step.status, job
    return job


def _batch(pair: Pair, receiver: Receiver) -> list[dict[str, Any]]:
    response = pair.client.post(
        "/v1/batches",
        json={
            "index": INDEX,
            "rerank": False,
            "webhook_url": receiver.url + "/flaky",
            "queries": [{"id": f"b{i}", "query": q} for i, q in enumerate(BATCH_QUERIES)],
        },
    )
    assert response.status_code == 202, response.text
    batch_id = response.json()["id"]
    wait_until(
        lambda: pair.client.get(f"/v1/batches/{batch_id}").json()["finished_at"],
        f"batch {batch_id} to finish",
    )
    page = pair.client.get(f"/v1/batches/{batch_id}/results", params={"page_size": 100}).json()
    results: list[dict[str, Any]] = page["results"]
    assert [r["status"] for r in results] == ["succeeded"] * len(BATCH_QUERIES), results
    return results


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("stack")
    with (
        redis_server(tmp / "redis") as redis_url,
        FakeAnthropic(**FAKE_CONFIG) as fake,
        webhook_receiver() as receiver,
    ):
        envs = {
            "open": _env(tmp, redis_url, 0, "fail_open", fake, free_port()),
            "closed": _env(tmp, redis_url, 1, "fail_closed", fake, free_port()),
        }
        with (
            _pair(tmp, "open", envs["open"]) as open_pair,
            _pair(tmp, "closed", envs["closed"]) as closed_pair,
        ):
            pairs = {"open": open_pair, "closed": closed_pair}
            targets = {
                PROMETHEUS_JOB_GATEWAY: [p.gateway for p in pairs.values()],
                PROMETHEUS_JOB_WORKER: [p.worker_metrics for p in pairs.values()],
            }
            with run_prometheus(tmp / "prometheus", targets, [RULES]) as prometheus:
                for name in targets:  # the zero series are in, so rates have a start
                    prometheus.wait_for_scrapes(name, 3)
                before = {expr: prometheus.values(expr).get("", 0.0) for expr in PREREGISTERED}
                for pair in pairs.values():
                    _ingest(pair.client)
                ran = []
                for step in STEPS:
                    fake.script(step.script)
                    used = fake.usage()
                    job = _search(pairs[step.pair], step, receiver)
                    assert fake.pending() == 0, f"{step}: script not used up"
                    ran.append(Ran(step, job, _usage_delta(used, fake.usage())))
                batch_results = _batch(pairs["closed"], receiver)
                wait_until(
                    lambda: receiver.seen == Counter({"/gone": 1, "/flaky": 2}),
                    f"the webhooks (seen: {receiver.seen})",
                )
                # the end of the workload is in the TSDB: the last counters, then two scrapes
                prometheus.wait_for_value("sum(sift_webhook_deliveries_total)", 3)
                prometheus.wait_for_value(
                    "sum(sift_rerank_attempts_total)", sum(EXPECTED["attempts"].values())
                )
                for name in targets:
                    prometheus.wait_for_more_scrapes(name, 2)
                yield Observed(
                    prometheus,
                    fake,
                    ran,
                    batch_results,
                    receiver,
                    {name: p.worker_metrics for name, p in pairs.items()},
                    before,
                )


# --- the tests ------------------------------------------------------------------------------


def test_the_workload_provokes_every_class_and_outcome() -> None:
    assert set(EXPECTED["attempts"]) == {
        "ok", "timeout", "http_5xx", "rate_limited", "connection", "http_4xx", "malformed",
        "refused",
    }  # fmt: skip
    assert set(EXPECTED["outcomes"]) == {
        "applied", "fallback_no_valid_ranks", "fallback_error", "failed", "skipped",
    }  # fmt: skip


@pytest.mark.parametrize("query", PANEL_QUERIES, ids=str)
def test_every_panel_returns_data(observed: Observed, query: PanelQuery) -> None:
    assert_panel_has_data(observed.prometheus, query)


def test_the_jobs_show_what_the_script_provoked(observed: Observed) -> None:
    for ran in observed.ran:
        step, job = ran.step, ran.job
        if step.status == "failed":
            assert job["error"]["type"] == "rerank_failed", job
            assert f"({step.attempts[-1]})" in job["error"]["message"], job
            continue
        trace = job["result"]["trace"]
        assert [a["outcome"] for a in trace.get("attempts", [])] == list(step.attempts), job
        assert job["result"]["usage"]["requests"] == len(step.attempts)
        rerank = job["result"]["rerank"]
        assert rerank["applied"] is (step.outcome == "applied"), job


def test_each_search_uses_exactly_what_the_fake_handed_out(observed: Observed) -> None:
    """Searches ran one at a time, so the fake's usage during each is that search's usage."""
    for ran in observed.ran:
        if ran.step.status == "succeeded":
            usage = ran.job["result"]["usage"]
            assert {f: usage[f] for f in TOKEN_FIELDS.values()} == {
                f: ran.fake_usage[f] for f in TOKEN_FIELDS.values()
            }, ran.step
        answered = sum(1 for a in ran.step.attempts if a in ("ok", "malformed", "refused"))
        assert ran.fake_usage["responses"] == answered, ran.step


def test_token_totals_equal_the_fakes_usage_and_the_jobs_usage(observed: Observed) -> None:
    tokens = observed.prometheus.values("sum by (type) (sift_rerank_tokens_total)", by="type")
    fake = observed.fake.usage()
    assert all(fake[f] > 0 for f in TOKEN_FIELDS.values()), fake
    assert tokens == {t: float(fake[f]) for t, f in TOKEN_FIELDS.items()}
    # the jobs: each succeeded one's usage, plus the failed one's tokens, which its job record
    # does not carry (only the error), measured at the fake while it alone ran
    succeeded = Counter[str]()
    failed = Counter[str]()
    for ran in observed.ran:
        if ran.step.status == "succeeded":
            succeeded.update({f: ran.job["result"]["usage"][f] for f in TOKEN_FIELDS.values()})
        else:
            failed.update({f: ran.fake_usage[f] for f in TOKEN_FIELDS.values()})
    for result in observed.batch_results:
        succeeded.update({f: result["result"]["usage"][f] for f in TOKEN_FIELDS.values()})
    assert all(failed[f] > 0 for f in ("input_tokens", "output_tokens")), failed
    assert tokens == {t: float(succeeded[f] + failed[f]) for t, f in TOKEN_FIELDS.items()}
    # and per worker: the fail_closed worker spent exactly what its searches took from the fake
    closed = Counter[str]()
    for ran in observed.ran:
        if ran.step.pair == "closed":
            closed.update({f: ran.fake_usage[f] for f in TOKEN_FIELDS.values()})
    address = observed.worker_addresses["closed"]
    on_closed = observed.prometheus.values(
        f'sum by (type) (sift_rerank_tokens_total{{instance="{address}"}})', by="type"
    )
    assert on_closed == {t: float(closed[f]) for t, f in TOKEN_FIELDS.items()}
    lanes = observed.prometheus.values("sum by (lane) (sift_rerank_tokens_total)", by="lane")
    assert lanes["economy"] == 0.0  # every search of this workload ran in the standard lane
    assert lanes["standard"] == sum(float(succeeded[f] + failed[f]) for f in TOKEN_FIELDS.values())


def test_cost_total_equals_the_jobs_cost(observed: Observed) -> None:
    p = observed.prometheus
    cost = p.values("sum(sift_rerank_cost_usd_total)")[""]
    assert cost > 0
    price = price_for(MODEL, DEFAULT_PRICES)
    jobs_cost = sum(
        r.job["result"]["usage"]["cost_usd"] for r in observed.ran if r.step.status == "succeeded"
    )
    failed_cost = sum(
        cost_usd(TokenUsage(**{f: r.fake_usage[f] for f in TOKEN_FIELDS.values()}), price)
        for r in observed.ran
        if r.step.status == "failed"
    )
    assert failed_cost > 0
    assert cost == pytest.approx(jobs_cost + failed_cost, rel=1e-9)
    fake = observed.fake.usage()
    fake_cost = cost_usd(TokenUsage(**{f: fake[f] for f in TOKEN_FIELDS.values()}), price)
    assert cost == pytest.approx(fake_cost, rel=1e-9)
    by_model = p.values("sum by (model) (sift_rerank_cost_usd_total)", by="model")
    assert list(by_model) == [MODEL]


def test_each_attempt_class_is_counted_exactly_as_often_as_provoked(observed: Observed) -> None:
    counted = observed.prometheus.values(
        "sum by (result) (sift_rerank_attempts_total)", by="result"
    )
    assert {k: v for k, v in counted.items() if v} == EXPECTED["attempts"]
    assert len(observed.fake.requests()) == sum(EXPECTED["attempts"].values())


def test_each_outcome_is_counted_exactly_as_often_as_provoked(observed: Observed) -> None:
    p = observed.prometheus
    counted = p.values(
        f'sum by (outcome) (sift_rerank_outcomes_total{{policy="{POLICY_ID}"}})', by="outcome"
    )
    assert {k: v for k, v in counted.items() if v} == EXPECTED["outcomes"]
    searches = p.query("sum by (mode, outcome) (sift_search_duration_seconds_count) > 0")
    got = {(s["metric"]["mode"], s["metric"]["outcome"]): float(s["value"][1]) for s in searches}
    assert got == EXPECTED["searches"]
    done = p.values("sum by (outcome) (sift_rerank_duration_seconds_count) > 0", by="outcome")
    assert done == EXPECTED["rerank_done"]


def test_job_and_webhook_metrics(observed: Observed) -> None:
    p = observed.prometheus
    searches = len(STEPS)
    submitted = p.values("sum by (kind) (sift_jobs_submitted_total) > 0", by="kind")
    assert submitted == {
        "search": searches, "ingest": 2, "batch": 1, "batch_item": len(BATCH_QUERIES),
    }  # fmt: skip
    completed = p.query("sum by (kind, status) (sift_jobs_completed_total) > 0")
    got = {(s["metric"]["kind"], s["metric"]["status"]): float(s["value"][1]) for s in completed}
    failed = sum(1 for step in STEPS if step.status == "failed")
    assert got == {
        ("search", "succeeded"): searches - failed,
        ("search", "failed"): failed,
        ("ingest", "succeeded"): 2,
        ("batch_item", "succeeded"): len(BATCH_QUERIES),
        ("batch", "succeeded"): 1,
    }
    failures = p.query("sum by (kind, error) (sift_job_failures_total) > 0")
    assert [(s["metric"]["kind"], s["metric"]["error"], s["value"][1]) for s in failures] == [
        ("search", "rerank_failed", "1")
    ]
    wait = p.values("sum by (queue) (sift_job_queue_wait_seconds_count) > 0", by="queue")
    deliveries = p.values("sum by (result) (sift_webhook_deliveries_total)", by="result")
    assert deliveries == {"delivered": 1, "retry": 1, "failed": 1}
    # every queue's wait: each search, batch item and ingest once, each webhook attempt once
    assert wait == {
        SEARCH_QUEUE: searches,
        BATCH_QUEUE: len(BATCH_QUERIES),
        INGEST_QUEUE: 2,
        WEBHOOK_QUEUE: sum(deliveries.values()),
    }
    assert p.values("sum(sift_rerank_in_flight)")[""] == 0
    assert p.values('sum(sift_jobs_in_flight{state="running"})')[""] == 0
    assert p.values("sum(sift_queue_backlog)")[""] == 0
    assert p.values(f'sum(up{{job="{PROMETHEUS_JOB_WORKER}"}})')[""] == 2
    assert p.values(f'sum(up{{job="{PROMETHEUS_JOB_GATEWAY}"}})')[""] == 2


def test_workers_show_their_models_and_backends_series_before_the_first_search(
    observed: Observed,
) -> None:
    # so that rate() and increase() count a series' first event too
    assert observed.preregistered == PREREGISTERED


def test_recording_rules_evaluate_on_real_data(observed: Observed) -> None:
    p = observed.prometheus
    for record in (
        "sift:rerank_cost_usd:rate5m",
        "sift:rerank_cost_usd:rate1h",
        "sift:rerank_cost_usd_per_1k_searches:rate1h",
        "sift:rerank_tokens:rate5m",
        "sift:rerank_attempt_error_ratio:rate5m",
        "sift:rerank_fallback_ratio:rate5m",
        "sift:rerank_failure_ratio:rate5m",
    ):
        p.wait_for_value(f"count({record} >= 0) > bool 0", 1)

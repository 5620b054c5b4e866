"""The e2e stack, once per session: our own redis-server, a real Celery worker running the
real runtime (embedded backend, MiniLM embedder, the Anthropic SDK pointed at the fake
Messages API on loopback), and the gateway under uvicorn. Two gateways share the
redis-server:

* ``live``: database 0, served by one worker process (threads pool); private webhook
  receivers allowed, as a local test needs.
* ``idle``: database 1, which no worker consumes, so its jobs stay queued (409 and
  cancel are deterministic there); the SSRF guard is on and the body limit is small.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.keys import ACME, ACME_KEY, GLOBEX_KEY
from tests.keys import GLOBEX as GLOBEX  # the e2e tests import it from here
from tests.reliability.support import forget_rate_budget
from tests.services import celery_worker, free_port, gateway, redis_server

KEYS = [ACME_KEY, GLOBEX_KEY]
ANTHROPIC_API_KEY = "sk-ant-test"
INDEX = "docs"
MODEL = "claude-haiku-4-5"  # the stack's, priced by the built-in table
IDLE_BODY_LIMIT = 65_536
ECONOMY_DEADLINE_SECONDS = 8.0  # resubmission stops this long after an economy batch came in
# (4 s was missed on a loaded CI machine by five 529s waited out at the poll cadence, 3.4 s)
SAMPLE = Path(__file__).resolve().parents[2] / "worker" / "data"


@dataclass
class Stack:
    live: httpx.Client
    idle: httpx.Client
    live_url: str
    idle_url: str
    redis_url: str
    model: FakeAnthropic
    logs: list[Path]  # every process's log file: the worker's and both gateways'
    worker_metrics_url: str = ""  # the live worker's /metrics


@contextlib.contextmanager
def start_stack(
    tmp: Path, *, log_level: str = "INFO", keys: list[dict[str, str]] | None = None
) -> Iterator[Stack]:
    """The e2e stack in ``tmp`` (the module docstring says what runs); every process stopped at
    the end. ``log_level`` is the processes' ``SIFT_LOG_LEVEL``, ``keys`` their API keys."""
    with redis_server(tmp / "redis") as redis_url, FakeAnthropic() as model:
        base = {
            "SIFT_API_KEYS": json.dumps(keys if keys is not None else KEYS),
            "SIFT_DATA_DIR": str(tmp / "data"),
            "SIFT_RERANK_ENABLED": "false",  # on per request with "rerank": true
            "SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5",
            "SIFT_GENERATION_MAX_REQUESTS": "3",
            "ANTHROPIC_BASE_URL": model.url,
            "ANTHROPIC_API_KEY": ANTHROPIC_API_KEY,
            "SIFT_WORKER_METRICS_PORT": "0",
            "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
            "SIFT_WEBHOOK_RETRY_SCALE": "0.001",
            # the economy lane, on a test's time scale: quick polls, small provider batches
            "SIFT_ECONOMY_POLL_SECONDS": "0.2",
            "SIFT_ECONOMY_POLL_MAX_SECONDS": "1",
            "SIFT_ECONOMY_MAX_REQUESTS_PER_BATCH": "4",
            "SIFT_ECONOMY_DEADLINE_SECONDS": str(ECONOMY_DEADLINE_SECONDS),
            "SIFT_LOG_LEVEL": log_level,
        }
        live_env = {
            **base,
            "SIFT_REDIS_URL": redis_url + "/0",
            "SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS": "true",
        }
        idle_env = {
            **base,
            "SIFT_REDIS_URL": redis_url + "/1",
            "SIFT_MAX_BODY_BYTES": str(IDLE_BODY_LIMIT),
        }
        metrics_port = free_port()
        worker_env = {**live_env, "SIFT_WORKER_METRICS_PORT": str(metrics_port)}
        with (
            celery_worker(tmp / "w", worker_env, "w1", concurrency=16),
            gateway(tmp / "g", live_env, "live") as live_url,
            gateway(tmp / "g", idle_env, "idle") as idle_url,
            httpx.Client(base_url=live_url, timeout=30) as live,
            httpx.Client(base_url=idle_url, timeout=30) as idle,
        ):
            logs = [tmp / "w" / "w1.log", tmp / "g" / "live.log", tmp / "g" / "idle.log"]
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            yield Stack(live, idle, live_url, idle_url, redis_url, model, logs, metrics_url)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(tmp_path_factory.mktemp("stack")) as running:
        yield running


@pytest.fixture(autouse=True)
def _rate_budget_forgotten(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the shared stack: a 5xx a test scripted opens the rate budget's
    breaker for every later search (as it should in production), and the next test's search
    would wait out an outage that was only that test's."""
    yield
    if "stack" in request.fixturenames:
        forget_rate_budget(request.getfixturevalue("stack").redis_url + "/0")


@pytest.fixture(scope="session")
def corpus(stack: Stack) -> list[dict[str, object]]:
    """The bundled sample corpus, ingested for tenant acme through the API."""
    docs = [
        json.loads(line)
        for line in (SAMPLE / "sample_corpus.jsonl").read_text().splitlines()
        if line.strip()
    ]
    documents = [
        {
            "id": d["id"],
            "text": d["text"],
            "title": d.get("title", ""),
            "metadata": d.get("metadata", {}),
        }
        for d in docs
    ]
    assert ingest(stack, INDEX, documents)["upserted"] == len(documents)
    return documents


@pytest.fixture(scope="session")
def queries() -> list[str]:
    lines = (SAMPLE / "sample_queries.jsonl").read_text().splitlines()
    return [json.loads(line)["query"] for line in lines if line.strip()]


def ingest(
    stack: Stack, index: str, documents: Sequence[Mapping[str, Any]], who: dict[str, str] = ACME
) -> dict[str, Any]:
    """``documents`` written into ``who``'s ``index`` through the live gateway, waited for
    (``?wait=20``), and succeeded: the ingest job."""
    response = stack.live.post(
        f"/v1/indexes/{index}/documents",
        params={"wait": 20},
        json={"documents": documents},
        headers=who,
    )
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    assert job["status"] == "succeeded", job
    return job


def finished_batch(
    client: httpx.Client, body: dict[str, object], headers: dict[str, str] = ACME
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``body`` submitted as a batch, polled until it has finished: the batch, and its first
    page of results."""
    batch = client.post("/v1/batches", json=body, headers=headers).json()
    deadline = time.monotonic() + 30  # a hang guard, not a speed check
    while not batch["finished_at"]:
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
        batch = client.get(f"/v1/batches/{batch['id']}", headers=headers).json()
    page = client.get(f"/v1/batches/{batch['id']}/results", headers=headers).json()
    return batch, page


def worker_usage(stack: Stack, lane: str) -> dict[str, float]:
    """The live worker's token counters of ``lane`` by type, and its cost counter."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(stack.worker_metrics_url, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("lane") != lane:
                continue
            if sample.name == "sift_rerank_tokens_total":
                kind = sample.labels["type"]
                out[kind] = out.get(kind, 0.0) + sample.value
            elif sample.name == "sift_rerank_cost_usd_total":
                out["cost_usd"] = out.get("cost_usd", 0.0) + sample.value
    return out


#: what :func:`split_stack` ingests: six documents a search of "honey" finds
HONEY = [{"id": f"d{i}", "text": f"honey bees make honey, note {i}"} for i in range(6)]


@dataclass
class SplitStack:
    client: httpx.Client  # the gateway's, sending acme's key
    redis_url: str  # the database the gateway and the worker share
    model: FakeAnthropic
    worker_log: Path


@contextlib.contextmanager
def split_stack(
    tmp: Path, *, gateway_env: dict[str, str], worker_env: dict[str, str]
) -> Iterator[SplitStack]:
    """A Redis of its own, the fake Messages API, and one worker and one gateway on them whose
    settings differ (a rollout that has reached one and not the other, or a value lost from
    one): ``gateway_env`` and ``worker_env`` over what both share, every other setting at its
    default; :data:`HONEY` ingested into :data:`INDEX` for acme. Every process stopped at the
    end."""
    with redis_server(tmp / "redis") as redis_url, FakeAnthropic() as model:
        env = {
            "SIFT_API_KEYS": json.dumps(KEYS),
            "SIFT_DATA_DIR": str(tmp / "data"),
            "SIFT_REDIS_URL": redis_url + "/0",
            "SIFT_WORKER_METRICS_PORT": "0",
            "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
            "ANTHROPIC_BASE_URL": model.url,
            "ANTHROPIC_API_KEY": ANTHROPIC_API_KEY,
        }
        with (
            celery_worker(tmp / "w", {**env, **worker_env}, "w", concurrency=8),
            gateway(tmp / "g", {**env, **gateway_env}) as url,
            httpx.Client(base_url=url, timeout=40, headers=ACME) as client,
        ):
            loaded = client.post(
                f"/v1/indexes/{INDEX}/documents", params={"wait": 30}, json={"documents": HONEY}
            ).json()
            assert loaded["status"] == "succeeded", loaded
            yield SplitStack(client, redis_url + "/0", model, tmp / "w" / "w.log")


@contextlib.contextmanager
def unpriced_stack(
    stack: Stack, tmp: Path, db: int, **extra: str
) -> Iterator[tuple[httpx.Client, str]]:
    """A worker and gateway on database ``db`` of the stack's Redis whose price table lacks
    the model (``SIFT_PRICES`` replaces the built-in one), against the same fake Messages
    API, with five tea documents ingested; ``extra`` settings go to both. Yields the client
    and the worker's log as it was once ready, before any job ran."""
    env = {
        "SIFT_API_KEYS": json.dumps(KEYS),
        "SIFT_DATA_DIR": str(tmp / "data"),
        "SIFT_REDIS_URL": f"{stack.redis_url}/{db}",
        "SIFT_GENERATION_MODEL": f"anthropic:{MODEL}",
        "SIFT_PRICES": json.dumps(
            {
                "claude-sonnet-4-6": {
                    "input": 3,
                    "output": 15,
                    "cache_read": 0.3,
                    "cache_creation": 3.75,
                }
            }
        ),
        "ANTHROPIC_BASE_URL": stack.model.url,
        "ANTHROPIC_API_KEY": ANTHROPIC_API_KEY,
        "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
        "SIFT_WORKER_METRICS_PORT": str(free_port()),
        **extra,
    }
    with (
        celery_worker(tmp / "w", env, "unpriced", concurrency=4),
        gateway(tmp / "g", env, "unpriced") as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        when_ready = (tmp / "w" / "unpriced.log").read_text()
        documents = [{"id": f"tea-{i}", "text": f"green tea leaves, note {i}"} for i in range(5)]
        response = client.post(
            f"/v1/indexes/{INDEX}/documents",
            params={"wait": 20},
            json={"documents": documents},
            headers=ACME,
        )
        assert response.status_code == 200, response.text
        yield client, when_ready

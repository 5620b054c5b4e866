"""What the reliability tests share: keys, the environment of a stack, a webhook receiver,
and small helpers that drive the real gateway over HTTP and read the job store directly.

The processes are the real ones (:mod:`worker.processes.stack` through :mod:`tests.services`): a
redis-server of the test's own, Celery workers on the threads pool, the gateway under
uvicorn, and the fake Messages API on loopback HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.keys import ACME, ACME_KEY
from tests.services import free_port, gateway, redis_server, served
from worker.constants import (
    ALL_QUEUES,
    BATCH_COUNTS_KEY,
    BATCH_ITEMS_KEY,
    BATCH_RESULTS_KEY,
    RATE_BUDGET_KEY,
)

KEYS = [ACME_KEY]
INDEX = "docs"
SAMPLE = Path(__file__).resolve().parents[2] / "worker" / "data"


def stack_env(redis_url: str, model_url: str, **extra: str) -> dict[str, str]:
    """The environment of one gateway or worker: rerank on, the fake model, short retries,
    and a data dir of its own (the default, ``.sift/data`` under the checkout, would be
    shared by every test running at once, and by whatever a developer ingested there)."""
    env = {
        "SIFT_REDIS_URL": redis_url,
        "SIFT_DATA_DIR": tempfile.mkdtemp(prefix="sift-test-data-"),
        "SIFT_API_KEYS": json.dumps(KEYS),
        "SIFT_RERANK_ENABLED": "true",
        "SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5",
        "SIFT_GENERATION_MAX_REQUESTS": "3",
        "ANTHROPIC_BASE_URL": model_url,
        "ANTHROPIC_API_KEY": "sk-ant-test",
        "SIFT_WORKER_METRICS_PORT": "0",
        "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
        "SIFT_WEBHOOK_RETRY_SCALE": "0.001",
        "SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS": "true",
    }
    env.update(extra)
    return env


def forget_rate_budget(redis_url: str) -> None:
    """Forget what the shared rate budget holds (a 5xx's breaker, a 429's pause), for a test
    whose search must meet a provider that was well until then, not the one an earlier
    test's 5xx left the breaker open for."""
    client = redis.Redis.from_url(redis_url)
    try:
        for key in client.scan_iter(RATE_BUDGET_KEY + "*"):
            client.delete(key)
    finally:
        client.close()


def sample_documents() -> list[dict[str, Any]]:
    docs = [
        json.loads(line)
        for line in (SAMPLE / "sample_corpus.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return [{"id": d["id"], "text": d["text"], "title": d.get("title", "")} for d in docs]


def sample_queries() -> list[str]:
    lines = (SAMPLE / "sample_queries.jsonl").read_text().splitlines()
    return [json.loads(line)["query"] for line in lines if line.strip()]


def ingest(client: httpx.Client, headers: dict[str, str] = ACME) -> int:
    """Load the bundled sample corpus into the tenant's (acme's by default) index ``INDEX``;
    answers the documents upserted. The request waits 20 s for the ingest (within a client's
    usual 30 s timeout, which the gateway's answer at the wait's end raced); one still running
    then (a worker still warming up on a loaded machine) is polled until it ends."""
    response = client.post(
        f"/v1/indexes/{INDEX}/documents",
        params={"wait": 20},
        json={"documents": sample_documents()},
        headers=headers,
    )
    assert response.status_code in (200, 202), response.text
    body = response.json()
    if response.status_code == 202:
        path = f"/v1/ingestions/{body['id']}"
        wait_for(
            lambda: client.get(path, headers=headers).json()["finished_at"] is not None,
            "the ingest finished",
            120,
        )
        body = client.get(path, headers=headers).json()
    assert body["status"] == "succeeded", body
    return int(body["upserted"])


def submit_search(client: httpx.Client, query: str, *, webhook_url: str | None = None) -> str:
    """A reranked search of ``query`` on the sample index; its job id."""
    body: dict[str, Any] = {"index": INDEX, "query": query}
    if webhook_url:
        body["webhook_url"] = webhook_url
    response = client.post("/v1/searches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def answered_once(client: httpx.Client, model: FakeAnthropic) -> None:
    """One reranked search answered at once, whatever the model holds, then the model's
    record forgotten (:meth:`FakeAnthropic.reset`) and its holds put back: the deployment
    has had its first answer, as any deployment past its first call has. A test that holds
    the model's answers to have several calls in flight at once needs it: on a deployment
    that never had an answer, the shared rate budget sends the first call alone, to learn
    the provider's limits from it, and the others wait for its answer (docs/queue.md)."""
    held = model.config
    model.configure(hold_until_received=0, hold_unscripted=False)
    body = {"index": INDEX, "query": sample_queries()[0], "rerank": True}  # rerank on a stack
    response = client.post("/v1/searches", json=body, headers=ACME)  # whose default is off
    assert response.status_code == 202, response.text
    path = f"/v1/searches/{response.json()['id']}"
    wait_for(
        lambda: client.get(path, headers=ACME).json()["status"] == "succeeded",
        "the deployment's first answer",
        60,
    )
    model.reset()
    model.configure(
        hold_until_received=held.hold_until_received, hold_unscripted=held.hold_unscripted
    )


def submit_batch(
    client: httpx.Client,
    n: int,
    *,
    webhook_url: str | None = None,
    rerank: bool = True,
    **fields: Any,
) -> str:
    """A batch of ``n`` of the sample queries; ``fields`` go into the request's body as given
    (``lane="economy"``, ``include_trace=True``...)."""
    queries = sample_queries()
    body: dict[str, Any] = {
        "index": INDEX,
        "rerank": rerank,
        "queries": [{"id": f"q{i:05d}", "query": queries[i % len(queries)]} for i in range(n)],
        **fields,
    }
    if webhook_url:
        body["webhook_url"] = webhook_url
    response = client.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def wait_for(check: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    """Poll ``check`` (errors count as not yet) until true, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:g}s (last error: {last})")


def broker_state(redis_url: str) -> dict[str, Any]:
    """What the broker holds now: queue lengths, unacked messages, the restore lock (for a
    failure message)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        state: dict[str, Any] = {q: client.llen(q) for q in ALL_QUEUES}
        state["unacked"] = client.hlen("unacked")
        state["unacked_mutex_ttl"] = client.ttl("unacked_mutex")
        return state
    finally:
        client.close()


def batch_counts(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/batches/{batch_id}", headers=ACME)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def all_results(client: httpx.Client, batch_id: str) -> list[dict[str, Any]]:
    """Every line of a batch's results, following the page tokens."""
    return list(iter_results(client, batch_id))


def iter_results(client: httpx.Client, batch_id: str) -> Iterator[dict[str, Any]]:
    """:func:`all_results` a page at a time (a 100,000-item batch's would not fit in memory
    at once)."""
    token: str | None = None
    while True:
        params: dict[str, Any] = {"page_size": 1000}
        if token:
            params["page_token"] = token
        response = client.get(f"/v1/batches/{batch_id}/results", params=params, headers=ACME)
        response.raise_for_status()
        page = response.json()
        yield from page["results"]
        token = page["next_page_token"]
        if not token:
            return


def assert_batch_exactly_once(
    client: httpx.Client, redis_url: str, batch_id: str, total: int
) -> None:
    """Every item ``succeeded`` with one result; the store's counts moved exactly once each."""
    batch = batch_counts(client, batch_id)
    assert batch["status"] == "succeeded", batch
    counts = batch["counts"]
    results = all_results(client, batch_id)
    errors = Counter(
        f"{r['error']['type']}: {r['error'].get('message', '')[:200]}"
        for r in results
        if r.get("error")
    )
    # a double transition would over-count; a failed item names its error
    assert counts["succeeded"] == total, (counts, errors.most_common(5))
    assert counts["queued"] == counts["running"] == counts["failed"] == counts["canceled"] == 0
    ids = [r["query_id"] for r in results]
    assert len(ids) == total and len(set(ids)) == total  # each query id exactly once
    assert ids == [f"q{i:05d}" for i in range(total)]
    bad = [r for r in results if r["status"] != "succeeded" or "result" not in r]
    assert not bad, bad[:3]
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        items = store.hgetall(BATCH_ITEMS_KEY + batch_id)
        stored = store.hgetall(BATCH_RESULTS_KEY + batch_id)
        raw_counts = store.hgetall(BATCH_COUNTS_KEY + batch_id)
    finally:
        store.close()
    assert set(items.values()) == {"succeeded"} and len(items) == total
    assert len(stored) == total + 1  # one per item, plus the "" placeholder
    assert {k: int(v) for k, v in raw_counts.items()} == {
        "queued": 0, "running": 0, "succeeded": total, "failed": 0, "canceled": 0,
    }  # fmt: skip


@dataclass
class Delivery:
    body: dict[str, Any]
    headers: dict[str, str]
    at: float


@dataclass
class Receiver:
    """A local webhook receiver that records every POST and answers 204."""

    url: str = ""
    deliveries: list[Delivery] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def for_job(self, job_id: str) -> list[Delivery]:
        with self._lock:
            return [d for d in self.deliveries if d.body.get("data", {}).get("id") == job_id]


def webhook_receiver() -> Iterator[Receiver]:
    """A generator fixture body: yields a running :class:`Receiver`, then stops it."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers["content-length"]))
            delivery = Delivery(
                json.loads(raw), {k.lower(): v for k, v in self.headers.items()}, time.time()
            )
            with receiver._lock:
                receiver.deliveries.append(delivery)
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with serve_hook(Handler) as receiver.url:
        yield receiver


class FlakyReceiver:
    """Answers 500 to its first ``failures`` POSTs, then 204; records each body."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.bodies: list[dict[str, object]] = []
        self.lock = threading.Lock()
        self.url = ""

    @contextlib.contextmanager
    def serve(self) -> Iterator[FlakyReceiver]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["content-length"]))
                with receiver.lock:
                    receiver.bodies.append(json.loads(raw))
                    failing = len(receiver.bodies) <= receiver.failures
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        with serve_hook(Handler) as self.url:
            yield self

    def posts(self) -> int:
        with self.lock:
            return len(self.bodies)


@contextlib.contextmanager
def serve_hook(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a free loopback port, in a thread, until the block ends: the
    receiver's ``/hook`` URL."""
    with served(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"


# --- a restartable broker -------------------------------------------------------------

DOWN_SECONDS = 2.0  # how long redis-server stays down: every client sees it gone
# The batch's finish after the restart: a few seconds in these runs. Items a task had not
# stored when the broker went away come back through their message (restored at reconnect,
# or the late ack) or, at worst, the re-drive (every 30 s, for batches idle 120 s): within
# 3x that stall, plus the sweep.
FINISH_TIMEOUT = 3 * 120.0 + 30.0


class Broker:
    """redis-server with AOF ``everysec`` on one port and directory, restartable in place."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.port = directory, free_port()
        self._stack = contextlib.ExitStack()
        self.url = self._start()

    def _start(self) -> str:
        context = redis_server(self.directory, port=self.port, appendonly=True)
        return self._stack.enter_context(context)

    def kill(self, signum: signal.Signals) -> None:
        """Signal redis-server and wait for it to exit."""
        client = redis.Redis.from_url(self.url)
        try:
            pid = int(client.info("server")["process_id"])
        finally:
            client.close()
        os.kill(pid, signum)
        self._stack.close()  # waits for the process (stop() only signals one still running)

    def written(self, client: redis.Redis) -> None:
        """Wait until the AOF file holds every write made so far: a mark written now is in
        it (the file is appended in order). With ``appendfsync everysec`` Redis puts off its
        writes to the file while a slow fsync runs (up to 2 s on a busy disk), and a SIGKILL
        loses what it had not written; what it wrote survives the process."""
        mark = f"sift-aof-mark-{uuid.uuid4().hex}"
        client.set(mark, "1")
        wait_for(
            lambda: any(mark.encode() in aof.read_bytes() for aof in self.directory.rglob("*.aof")),
            "the AOF written up to now",
            30,
        )

    def on_disk(self, needles: list[str]) -> bool:
        """Whether the AOF files hold each of ``needles`` (after :meth:`written`: what a
        restart on them loads)."""
        files = b"".join(aof.read_bytes() for aof in self.directory.rglob("*.aof"))
        return all(needle.encode() in files for needle in needles)

    def start_again(self) -> None:
        """redis-server on the same port and directory: it loads the AOF."""
        assert self._start() == self.url

    def close(self) -> None:
        self._stack.close()


@contextlib.contextmanager
def broker(directory: Path) -> Iterator[Broker]:
    running = Broker(directory)
    try:
        yield running
    finally:
        running.close()


@dataclass
class Stack:
    """Redis, the fake model and a gateway, without a worker (a test starts its own)."""

    redis_url: str
    client: httpx.Client
    env: dict[str, str]
    model: FakeAnthropic | None = None  # gateway_stack's: what it answered (and billed)


@contextlib.contextmanager
def gateway_stack(directory: Path, model_delay: float) -> Iterator[Stack]:
    """A :class:`Stack` in ``directory``, its workers' environment at the defaults (the soft
    shutdown window included), the model answering after ``model_delay`` seconds."""
    with (
        FakeAnthropic(delay=model_delay) as model,
        redis_server(directory / "redis") as base_url,
    ):
        url = base_url + "/0"
        env = stack_env(url, model.url)
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # its default
        with (
            gateway(directory / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            yield Stack(url, client, env, model)

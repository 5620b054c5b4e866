"""The gateway across a Redis restart, at default settings.

A real redis-server with AOF ``everysec`` (as ``sift up`` runs it) is stopped (SIGKILL or
SIGTERM) and started again on the same port and directory under a running gateway (uvicorn).
The first request after Redis is back must succeed: every connection the gateway's pools
held points at the old server, and redis-py 8.1 handed such a connection out as live
(redis/redis-py#4252), so the first ``POST /v1/searches`` used to answer 503.

While Redis is down, each request is a 503 with ``Retry-After``, logged as one line, and the
client's keep-alive connection stays open: it used to be closed after the answer, so the
client's next request on it was reset.

No worker runs: the jobs stay queued, which is all these requests need.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.support import ACME, INDEX, KEYS, wait_for
from tests.services import free_port, gateway, http_get, redis_server
from worker.constants import METRIC_JOBS_IN_FLIGHT, METRIC_QUEUE_BACKLOG, SEARCH_QUEUE
from worker.processes.stack import child_env, gateway_service, running
from worker.settings import Settings

Request = Callable[[httpx.Client, str, str], httpx.Response]

# each kind of request the gateway serves from Redis: reads on its thread-pool store, the
# submissions on its asyncio store (a search) and through the thread pool (a batch)
# each request, and its answer: a read 200, a new job 202 (queued, no worker here)
REQUESTS: list[tuple[str, Request, int]] = [
    ("GET a search", lambda c, s, b: c.get(f"/v1/searches/{s}", headers=ACME), 200),
    ("POST a search", lambda c, s, b: c.post("/v1/searches", json=_search(), headers=ACME), 202),
    ("GET a batch", lambda c, s, b: c.get(f"/v1/batches/{b}", headers=ACME), 200),
    ("GET its results", lambda c, s, b: c.get(f"/v1/batches/{b}/results", headers=ACME), 200),
    ("POST a batch", lambda c, s, b: c.post("/v1/batches", json=_batch(), headers=ACME), 202),
]


def _search() -> dict[str, str]:
    return {"index": INDEX, "query": "green tea"}


def _batch() -> dict[str, object]:
    return {"index": INDEX, "queries": [{"id": "1", "query": "green tea"}]}


class RestartableRedis:
    """A redis-server of the test's own, on one port and directory, with AOF ``everysec``."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.port = directory, free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self._running: contextlib.AbstractContextManager[str] | None = None

    def start(self) -> None:
        """Start it; returns once it answers PING (its AOF loaded)."""
        self._running = redis_server(self.directory, port=self.port, appendonly=True)
        self._running.__enter__()

    def stop(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the server once what it acknowledged is in its AOF, and wait
        until it is gone. (With ``everysec`` Redis may hold writes in its buffer for up to
        2 s while an fsync is slow, and a SIGKILL then loses them; these tests are about
        reconnecting, not about that window.)"""
        client = redis.Redis.from_url(self.url, decode_responses=True)
        try:
            deadline = time.monotonic() + 30
            while int(client.info("persistence")["aof_buffer_length"]) > 0:
                assert time.monotonic() < deadline, "Redis did not write its AOF buffer"
                time.sleep(0.05)
            pid = int(client.info("server")["process_id"])
        finally:
            client.close()
        os.kill(pid, sig)
        assert self._running is not None
        self._running.__exit__(None, None, None)  # waits for the process (SIGKILL after 15 s)
        self._running = None

    def close(self) -> None:
        if self._running is not None:
            self._running.__exit__(None, None, None)


@contextlib.contextmanager
def redis_and_gateway(tmp: Path) -> Iterator[tuple[RestartableRedis, httpx.Client, Path]]:
    """A restartable Redis, the gateway on it at default settings, one keep-alive client,
    and the gateway's log file."""
    server = RestartableRedis(tmp / "redis")
    server.start()
    try:
        env = {"SIFT_REDIS_URL": server.url + "/0", "SIFT_API_KEYS": json.dumps(KEYS)}
        with gateway(tmp / "g", env) as base, httpx.Client(base_url=base, timeout=30) as client:
            yield server, client, tmp / "g" / "gateway.log"
    finally:
        server.close()


def _local_port(response: httpx.Response) -> int:
    """The client's port of the TCP connection the response came on."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_first_request_after_a_redis_restart_succeeds(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """For each kind of request: restart Redis, then that request is the first the gateway
    serves, and it succeeds. No request is answered 503 at any point."""
    with redis_and_gateway(tmp_path) as (server, client, log):
        search = client.post("/v1/searches", json=_search(), headers=ACME)
        batch = client.post("/v1/batches", json=_batch(), headers=ACME)
        assert search.status_code == batch.status_code == 202, (search.text, batch.text)
        search_id, batch_id = search.json()["id"], batch.json()["id"]
        for name, request, status in REQUESTS:
            server.stop(sig)
            server.start()
            response = request(client, search_id, batch_id)
            assert response.status_code == status, f"{name}: {response.text}"
        assert "unavailable" not in log.read_text()


@pytest.mark.timeout(120)
def test_while_redis_is_down_each_request_is_a_503_logged_once_on_a_connection_kept_open(
    tmp_path: Path,
) -> None:
    with redis_and_gateway(tmp_path) as (server, client, log):
        created = client.post("/v1/searches", json=_search(), headers=ACME)
        assert created.status_code == 202, created.text
        search_id = created.json()["id"]
        port = _local_port(created)

        server.stop(signal.SIGKILL)
        down = [
            client.get(f"/v1/searches/{search_id}", headers=ACME),  # the thread-pool store
            client.post("/v1/searches", json=_search(), headers=ACME),  # the asyncio store
            client.get(f"/v1/searches/{search_id}", headers=ACME),
        ]
        for response in down:
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert error["type"] == "unavailable" and "retry" in error["message"], error
            assert "Redis (SIFT_REDIS_URL) could not be reached" in error["message"], error
            assert _local_port(response) == port  # the same keep-alive connection, still open

        server.start()
        back = client.get(f"/v1/searches/{search_id}", headers=ACME)
        assert back.status_code == 200, back.text
        assert _local_port(back) == port

        def logged() -> list[str]:
            return [
                line for line in log.read_text().splitlines() if "job store unavailable" in line
            ]

        wait_for(lambda: len(logged()) >= len(down), "the outage's log lines", 30)
        lines, text = logged(), log.read_text()
        assert len(lines) == len(down), lines
        assert all("ConnectionError" in line for line in lines), lines
        assert "Traceback" not in text and "Exception in ASGI application" not in text


@pytest.mark.timeout(120)
def test_readyz_with_redis_down_is_the_declared_503_naming_the_cause(tmp_path: Path) -> None:
    """``/readyz`` with Redis stopped answers the 503 its OpenAPI document declares (an
    ``ErrorBody``, as its 503 while ``sift gateway`` waits for Redis, and every request's),
    naming the cause and when to ask again. It was ``{"status": "unavailable"}``, which no
    schema in the document allowed for a 503: a client reading ``error.message`` found none."""
    with redis_and_gateway(tmp_path) as (server, client, _):
        doc = client.get("/openapi.json").json()
        ready = client.get("/readyz")
        server.stop(signal.SIGKILL)
        down = client.get("/readyz")
    assert ready.status_code == 200 and _valid(doc, "/readyz", "200", ready.json()), ready.text
    assert down.status_code == 503, down.text
    assert _valid(doc, "/readyz", "503", down.json()), down.text
    assert down.headers["retry-after"] == "1"
    error = down.json()["error"]
    assert error["type"] == "unavailable", error
    assert "Redis (SIFT_REDIS_URL) could not be reached" in error["message"], error


def _valid(doc: dict[str, Any], path: str, status: str, body: object) -> bool:
    """Whether ``body`` is what the OpenAPI ``doc`` declares ``GET path`` answers with
    ``status``."""
    schema = doc["paths"][path]["get"]["responses"][status]["content"]["application/json"]
    resolvable = {**schema["schema"], "components": doc["components"]}
    return jsonschema.Draft202012Validator(resolvable).is_valid(body)


@pytest.mark.timeout(180)
def test_a_stalled_redis_is_a_503_naming_how_long_the_gateway_waits(tmp_path: Path) -> None:
    """Redis accepting connections and never answering (SIGSTOPped), at default settings: a
    search's submit and a read are 503 naming the wait and its setting, so the client can
    tell a stall from a restart. Before: "the job store is unavailable; retry after 1 s",
    after 60 s for the submit (the asyncio store waited a second socket timeout on a new
    connection; tests/reliability/test_redis_outage_clients.py counts them) and 30 s for a
    read, the one place that wait is set being a constant."""
    seconds = Settings.model_fields["gateway_redis_timeout_seconds"].default
    with redis_and_gateway(tmp_path) as (server, client, _):
        created = client.post("/v1/searches", json=_search(), headers=ACME)
        assert created.status_code == 202, created.text
        pid = int(redis.Redis.from_url(server.url).info("server")["process_id"])
        os.kill(pid, signal.SIGSTOP)
        try:
            stalled = [
                client.post("/v1/searches", json=_search(), headers=ACME, timeout=120),
                client.get(f"/v1/searches/{created.json()['id']}", headers=ACME, timeout=120),
            ]
        finally:
            os.kill(pid, signal.SIGCONT)
        for response in stalled:
            assert response.status_code == 503, response.text
            message = response.json()["error"]["message"]
            assert (
                f"Redis did not answer within {seconds:g} s (SIFT_GATEWAY_REDIS_TIMEOUT_SECONDS)"
                in message
            ), message
        back = client.get(f"/v1/searches/{created.json()['id']}", headers=ACME)
        assert back.status_code == 200, back.text


def _gauges(client: httpx.Client) -> dict[tuple[str, str], float]:
    """The gateway's ``sift_jobs_in_flight`` and ``sift_queue_backlog`` samples, by (name,
    label value)."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return {
        (sample.name, sample.labels.get("state") or sample.labels.get("queue", "")): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name in {METRIC_JOBS_IN_FLIGHT, METRIC_QUEUE_BACKLOG}
    }


@pytest.mark.timeout(120)
def test_a_gateway_that_cannot_read_redis_exports_no_stale_queued_count(tmp_path: Path) -> None:
    """Three searches queued (no worker): the gateway's metrics say 3. With Redis down, they
    must not go on saying 3 (another replica's max would show it as now): NaN, unknown, which
    Prometheus's ``max`` over replicas passes over; once Redis is back, the count again."""
    with redis_and_gateway(tmp_path) as (server, client, _):
        for _ in range(3):
            created = client.post("/v1/searches", json=_search(), headers=ACME)
            assert created.status_code == 202, created.text
        queued = (METRIC_JOBS_IN_FLIGHT, "queued")
        backlog = (METRIC_QUEUE_BACKLOG, SEARCH_QUEUE)
        up = _gauges(client)
        assert up[queued] == up[backlog] == 3, up

        server.stop(signal.SIGKILL)
        down = _gauges(client)
        assert math.isnan(down[queued]) and math.isnan(down[backlog]), down

        server.start()
        again = _gauges(client)
        assert again[queued] == again[backlog] == 3, again


@pytest.mark.timeout(120)
def test_a_database_redis_does_not_have_is_a_503_naming_the_url(tmp_path: Path) -> None:
    """``SIFT_REDIS_URL=redis://…/99`` on a Redis of 16 databases: Redis refuses each new
    connection's SELECT ("DB index is out of range"), which no value of the request mends
    and the URL does: a 503 naming SIFT_REDIS_URL, as an unreachable Redis is. It was 500s."""
    server = RestartableRedis(tmp_path / "redis")
    server.start()
    try:
        env = {"SIFT_REDIS_URL": server.url + "/99", "SIFT_API_KEYS": json.dumps(KEYS)}
        service, base = gateway_service(tmp_path / "g", child_env(env, inherit_sift=False))
        up = lambda: http_get(base + "/healthz", timeout=1).status_code == 200  # noqa: E731
        service.ready = up  # never ready: live is enough
        with running(service), httpx.Client(base_url=base, timeout=30) as client:
            ready = client.get("/readyz")
            assert ready.status_code == 503, ready.text
            answers = [
                client.post("/v1/searches", json=_search(), headers=ACME),
                client.get("/v1/searches/srch_0123456789abcdef0123456789abcdef", headers=ACME),
            ]
            for response in answers:
                assert response.status_code == 503, response.text
                message = response.json()["error"]["message"]
                assert "SIFT_REDIS_URL" in message and "database" in message, message
    finally:
        server.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("given", "refusal"),
    [
        (None, "Redis requires a password, and SIFT_REDIS_URL gives none"),
        ("old", "Redis refused the credentials of SIFT_REDIS_URL (invalid username-password"),
    ],
    ids=["no-password", "wrong-password"],
)
def test_a_password_redis_refuses_is_a_503_naming_the_refusal(
    tmp_path: Path, given: str | None, refusal: str
) -> None:
    """Redis answers and refuses the URL's credentials: a ``requirepass`` set on a Redis the
    URL gives no password for (``NOAUTH``), or changed from the one it gives (``WRONGPASS``),
    once the gateway runs (it waits out a refusal at its start). ``/readyz`` says Redis
    refused the gateway, and a request and the log say why: they said it "could not be
    reached", which sent the operator looking for a Redis that was up."""
    server = RestartableRedis(tmp_path / "redis")
    server.start()
    admin = redis.Redis.from_url(server.url)
    try:
        if given is not None:
            admin.config_set("requirepass", given)
            admin.auth(given)
        url = server.url.replace("//", f"//:{given}@") if given else server.url
        env = {"SIFT_REDIS_URL": url + "/0", "SIFT_API_KEYS": json.dumps(KEYS)}
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            admin.config_set("requirepass", "rotated")
            # the gateway's connections, each authenticated at its open: new ones are refused
            admin.client_kill_filter(_type="normal")
            ready = client.get("/readyz")
            asked = client.get("/v1/searches/srch_0123456789abcdef0123456789abcdef", headers=ACME)
        log = (tmp_path / "g" / "gateway.log").read_text()
    finally:
        admin.close()
        server.close()
    for answer in (ready, asked):
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "unavailable"
        assert "could not be reached" not in answer.text, answer.text
    # /readyz, which answers anyone, says Redis refused; a request, and the log, say why
    assert "Redis refused the gateway" in ready.json()["error"]["message"], ready.text
    assert refusal in asked.json()["error"]["message"], asked.text
    assert refusal in log, log


@contextlib.contextmanager
def _gateway_as_acl_user(tmp_path: Path, user: str) -> Iterator[tuple[redis.Redis, httpx.Client]]:
    """A gateway (its log in ``tmp_path / "g"``) on a Redis of its own as the ACL user
    ``user``, let every command until a test changes its rules through the admin connection
    this yields with a client of the gateway."""
    server = RestartableRedis(tmp_path / "redis")
    server.start()
    admin = redis.Redis.from_url(server.url)
    try:
        admin.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all")
        url = server.url.replace("//", f"//{user}:pw@") + "/0"
        env = {"SIFT_REDIS_URL": url, "SIFT_API_KEYS": json.dumps(KEYS)}
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            yield admin, client
    finally:
        admin.close()
        server.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("rules", "refusal"),
    [
        # the scripts both requests run, refused as commands: NOPERM
        (["-evalsha", "-eval"], "NOPERM this user has no permissions to run the 'evalsha'"),
        # the commands in those scripts: Redis 7.0 and 7.1 say so in words of their own
        (["-@read", "-@write"], "the script"),
    ],
    ids=["scripts", "commands-in-scripts"],
)
def test_a_command_redis_acl_refuses_is_a_503_naming_the_acl(
    tmp_path: Path, rules: list[str], refusal: str
) -> None:
    """The URL's ACL user loses commands requests need once the gateway runs (its start
    checks would refuse it first): a search's submit (the asyncio store) and a read (the
    thread-pool store) are the 503 naming the ACL and Redis's refusal, a deployment's
    setting as a refused password is, logged as one line. They were 500s, logged as the
    gateway's bug with a traceback."""
    with _gateway_as_acl_user(tmp_path, "sift") as (admin, client):
        admin.execute_command("ACL", "SETUSER", "sift", *rules)
        answers = [
            client.post("/v1/searches", json=_search(), headers=ACME),
            client.get("/v1/searches/srch_0123456789abcdef0123456789abcdef", headers=ACME),
        ]
    log = (tmp_path / "g" / "gateway.log").read_text()
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["type"] == "unavailable", answer.text
        message = answer.json()["error"]["message"]
        assert "Redis's ACL refuses the user of SIFT_REDIS_URL a command" in message, message
        assert refusal in message, message
    assert "Traceback" not in log, log


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("change", "quoted"),
    [
        (["-ping"], "NOPERM this user has no permissions to run the 'ping' command"),
        (["resetpass", ">rotated"], "invalid username-password pair"),
    ],
    ids=["acl-refuses-ping", "password-rotated"],
)
def test_readyz_tells_no_one_what_redis_said(
    tmp_path: Path, change: list[str], quoted: str
) -> None:
    """``/readyz`` answers anyone, without a key: its 503 says Redis refused the gateway,
    and nothing of Redis's own refusal (the command its ACL refuses, the credentials' fault)
    nor the user; the gateway's log keeps that, naming the setting. It quoted Redis."""
    with _gateway_as_acl_user(tmp_path, "ops-user-7") as (admin, client):
        admin.execute_command("ACL", "SETUSER", "ops-user-7", *change)
        admin.client_kill_filter(_type="normal", skipme=True)  # new connections meet it
        ready = client.get("/readyz")
    log = (tmp_path / "g" / "gateway.log").read_text()
    assert ready.status_code == 503, ready.text
    assert ready.json()["error"]["type"] == "unavailable", ready.text
    message = ready.json()["error"]["message"]
    assert "Redis refused the gateway" in message, message
    for private in (quoted, "NOPERM", "ping", "username-password", "ops-user-7"):
        assert private not in ready.text, ready.text
    assert quoted in log, log  # the operator's log says what Redis said

"""The worker on a TLS Redis (``rediss://``), as a managed Redis serves it: the broker
connection checks the server's certificate as the job store's and the gateway's redis-py
clients do, from the one URL (a certificate its CA did not sign is refused; kombu alone took
any), and a search runs end to end through the real gateway and ``sift worker``.

The redis-server serves TLS only, with a node certificate a private CA (``openssl``, in the
test's tmp dir) signed for 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from celery import Celery

from tests.fake_anthropic import FakeAnthropic
from tests.integration.es_loopback import PrivateCa, private_ca
from tests.reliability.support import (
    ACME,
    DOWN_SECONDS,
    KEYS,
    ingest,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import free_port, gateway
from worker.processes.stack import child_env, redis_service, running, worker_process
from worker.queue.config import celery_config
from worker.settings import load_settings

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> PrivateCa:
    return private_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> PrivateCa:
    return private_ca(tmp_path_factory.mktemp("other-ca"))


def tls_url(port: int, ca: PrivateCa | None) -> str:
    """The URL of :func:`tls_redis`, database 0, trusting ``ca`` (None: the system's roots)."""
    url = f"rediss://127.0.0.1:{port}/0"
    return url if ca is None else f"{url}?ssl_cert_reqs=required&ssl_ca_certs={ca.ca}"


@contextlib.contextmanager
def tls_redis(directory: Path, ca: PrivateCa, port: int) -> Iterator[None]:
    """redis-server (AOF on, in ``directory``) serving TLS only, on ``port``, with ``ca``'s
    node certificate; a restart on the same ``directory`` and ``port`` loads its AOF."""
    service, _ = redis_service(directory, port=port, appendonly=True)
    service.command += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(ca.chain),
                        "--tls-key-file", str(ca.key), "--tls-ca-cert-file", str(ca.ca),
                        "--tls-auth-clients", "no"]  # fmt: skip

    def ping() -> bool:
        client = redis.Redis.from_url(tls_url(port, ca))
        try:
            return bool(client.ping())
        finally:
            client.close()

    service.ready = ping
    with running(service):
        yield


def broker_connects(url: str) -> None:
    """Open the worker's broker connection (its Celery settings for ``url``) once."""
    app = Celery("sift", set_as_current=False)
    app.config_from_object(celery_config(load_settings(redis_url=url)))
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1)
        connection.default_channel.client.ping()


def final(client: httpx.Client, job: str) -> str | None:
    """The search ``job``'s status once final, else None."""
    status = str(client.get(f"/v1/searches/{job}", headers=ACME).json()["status"])
    return None if status in ("queued", "running") else status


def searched(client: httpx.Client) -> str:
    """A new search's final status (a reranked one, through the queue)."""
    job = submit_search(client, "who beat Kasparov")
    wait_for(lambda: final(client, job) is not None, "the search final")
    return str(final(client, job))


@pytest.mark.parametrize("trusted", [None, "other"], ids=["system-roots", "another-ca"])
def test_the_broker_refuses_a_certificate_its_ca_did_not_sign(
    tmp_path: Path, ca: PrivateCa, other_ca: PrivateCa, trusted: str | None
) -> None:
    """``rediss://host:port/0`` (no ``ssl_*`` parameter) trusts the system's roots, as
    redis-py does; kombu alone set ``ssl_cert_reqs=CERT_NONE`` for it and connected."""
    port = free_port()
    with tls_redis(tmp_path / "redis", ca, port):
        url = tls_url(port, other_ca if trusted else None)
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
            broker_connects(url)
        broker_connects(tls_url(port, ca))  # the right CA in the URL: the same server is fine


def test_a_search_runs_on_a_tls_redis(tmp_path: Path, ca: PrivateCa, model: FakeAnthropic) -> None:
    port = free_port()
    with tls_redis(tmp_path / "redis", ca, port):
        env = child_env(stack_env(tls_url(port, ca), model.url), inherit_sift=False)
        with (
            worker_process(tmp_path / "w", env),
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            assert searched(client) == "succeeded"


def test_a_worker_on_a_tls_redis_survives_its_restart(tmp_path: Path, ca: PrivateCa) -> None:
    """Redis stopped (SIGTERM: it writes its AOF) and started again under a ``--processes 1``
    worker while a search's model call is held: the same process consumes on, the held search
    and one sent after the restart succeed. kombu's own transport, which ``rediss://`` had,
    died closing the channel that held the search's message ("Unrecoverable error",
    :mod:`worker.queue.broker`), and its search stayed running."""
    port, log = free_port(), tmp_path / "w" / "worker.log"
    with contextlib.ExitStack() as first_redis, FakeAnthropic(hold_unscripted=True) as model:
        first_redis.enter_context(tls_redis(tmp_path / "redis", ca, port))
        env = child_env(stack_env(tls_url(port, ca), model.url), inherit_sift=False)
        with (
            worker_process(tmp_path / "w", env, processes=1) as worker,
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            held = submit_search(client, "who beat Kasparov")
            wait_for(lambda: model.counts()["received"] == 1, "the model call held")
            first_redis.close()
            time.sleep(DOWN_SECONDS)  # down long enough for the worker's reconnect to meet it
            with tls_redis(tmp_path / "redis", ca, port):
                model.configure(hold_unscripted=False)
                wait_for(lambda: final(client, held) == "succeeded", "the held search succeeded")
                assert searched(client) == "succeeded"  # sent after the restart
                assert "Unrecoverable error" not in log.read_text(errors="replace")
                assert worker.poll() is None


def test_a_certificate_the_gateway_refuses_is_a_503_naming_tls(
    tmp_path: Path, ca: PrivateCa, other_ca: PrivateCa
) -> None:
    """The gateway's Redis comes back (a restart, a failover) with a certificate the URL's CA
    did not sign: each new connection's TLS handshake fails. A request says so, and why
    (``/readyz``, which answers anyone, that Redis refused the gateway): they said Redis
    "could not be reached", which sent the operator looking for a Redis that was up."""
    port = free_port()
    env = {"SIFT_REDIS_URL": tls_url(port, ca), "SIFT_API_KEYS": json.dumps(KEYS)}
    with contextlib.ExitStack() as running_stack:
        first = running_stack.enter_context(contextlib.ExitStack())
        first.enter_context(tls_redis(tmp_path / "redis", ca, port))
        base = running_stack.enter_context(gateway(tmp_path / "g", env))
        first.close()  # Redis stops; it comes back signed by another CA
        running_stack.enter_context(tls_redis(tmp_path / "redis", other_ca, port))
        with httpx.Client(base_url=base, timeout=30) as client:
            ready = client.get("/readyz")
            asked = client.get("/v1/searches/srch_0123456789abcdef0123456789abcdef", headers=ACME)
    for answer in (ready, asked):
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "unavailable"
    # /readyz answers anyone: Redis refused, no more (test_gateway_reconnect.py)
    assert "Redis refused the gateway" in ready.text, ready.text
    assert "CERTIFICATE_VERIFY_FAILED" not in ready.text, ready.text
    message = asked.json()["error"]["message"]
    assert "TLS handshake with Redis (SIFT_REDIS_URL) failed" in message, message
    assert "CERTIFICATE_VERIFY_FAILED" in message, message

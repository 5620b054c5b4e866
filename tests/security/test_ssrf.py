"""The SSRF guard: every non-public webhook target fails at registration and at delivery.

Registration goes through the real gateway with the guard on (the stack's ``idle``
gateway; the in-process gateway for the DNS case, since only this process's resolver can be
faked). Delivery calls :func:`worker.webhooks.delivery.deliver` and :func:`run_delivery` with the
guard on, at a port where a listening socket counts every connection: it must count none,
and no socket in this process may even try to connect. The one boundary faked is
``socket.getaddrinfo`` for names, because this machine has no DNS.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from starlette.testclient import TestClient

from api_gateway.app import create_app
from tests.e2e.conftest import ACME, INDEX, KEYS, Stack
from tests.security.conftest import Receiver, start_receiver, stop_receiver
from tests.unit.test_urlguard import fake_dns
from worker.settings import ApiKey, Settings
from worker.webhooks.delivery import (
    SEARCH_COMPLETED,
    DeliveryOutcome,
    DeliveryTimeouts,
    deliver,
    message_id,
    payload,
    run_delivery,
)

SECRET = KEYS[0]["webhook_secret"]
FAST = DeliveryTimeouts(connect=2.0, read=2.0)
# A name this machine cannot resolve; the faked resolver answers it with the address given.
PRIVATE_NAMES = {
    "hooks.internal.example": ["10.20.30.40"],
    "rebind.example": ["93.184.216.34", "192.168.7.7"],  # one private answer among public
    "loopback.example": ["127.0.0.1"],  # where the listener is
    "mapped.example": ["::ffff:127.0.0.1"],
    "metadata.example": ["169.254.169.254"],
}

# (url template, what the refusal says); {port} is the listener's port.
MATRIX = [
    ("http://127.0.0.1:{port}/hook", "loopback"),
    ("http://localhost:{port}/hook", "loopback"),  # a real name, resolved by /etc/hosts
    ("http://[::1]:{port}/hook", "loopback"),
    ("http://10.0.0.1:{port}/hook", "private"),
    ("http://10.255.255.254:{port}/hook", "private"),
    ("http://172.16.0.1:{port}/hook", "private"),
    ("http://172.31.255.255:{port}/hook", "private"),
    ("http://192.168.0.1:{port}/hook", "private"),
    ("http://169.254.169.254:{port}/latest/meta-data/", "metadata"),
    ("http://169.254.10.10:{port}/hook", "link-local"),
    ("http://[fd00:ec2::254]:{port}/", "metadata"),
    ("http://[fe80::1]:{port}/hook", "link-local"),
    ("http://[::ffff:127.0.0.1]:{port}/hook", "loopback"),
    ("http://[::ffff:10.0.0.1]:{port}/hook", "private"),
    ("http://[::ffff:169.254.169.254]:{port}/hook", "metadata"),
    ("http://2130706433:{port}/hook", "loopback"),  # 127.0.0.1 in decimal
    ("http://0x7f000001:{port}/hook", "loopback"),  # in hex
    ("http://0.0.0.0:{port}/hook", "unspecified"),
]
DNS_MATRIX = [
    ("https://hooks.internal.example/hook", "10.20.30.40 is a private"),
    ("https://rebind.example/hook", "192.168.7.7 is a private"),
    ("http://loopback.example:{port}/hook", "127.0.0.1 is a loopback"),
    ("http://mapped.example:{port}/hook", "loopback"),
    ("http://metadata.example:{port}/", "metadata"),
]


@pytest.fixture(scope="module")
def listener() -> Iterator[Receiver]:
    """One listening socket for the whole matrix: it must never see a connection."""
    started = start_receiver()
    try:
        yield started
    finally:
        stop_receiver(started)


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every address a socket of this process tries to connect to, while the test runs."""
    attempts: list[Any] = []
    real_connect = socket.socket.connect

    def spy(self: socket.socket, address: Any) -> None:
        attempts.append(address)
        real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", spy)
    return attempts


@pytest.fixture
def private_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns(PRIVATE_NAMES))


def _ids(matrix: list[tuple[str, str]]) -> list[str]:
    return [url.split("//")[1].split("/")[0].replace(":{port}", "") for url, _ in matrix]


def _assert_refused_by_gateway(response: Any, why: str) -> None:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "webhook_url"
    assert error["message"].startswith("webhook_url: ")
    assert why in error["message"]


# --- registration ---------------------------------------------------------------------------


@pytest.mark.parametrize(("template", "why"), MATRIX, ids=_ids(MATRIX))
def test_registration_is_refused_by_the_gateway(
    stack: Stack, listener: Receiver, template: str, why: str
) -> None:
    url = template.format(port=listener.port)
    search = stack.idle.post(
        "/v1/searches", json={"index": INDEX, "query": "q", "webhook_url": url}, headers=ACME
    )
    _assert_refused_by_gateway(search, why)
    batch = stack.idle.post(
        "/v1/batches",
        json={"index": INDEX, "queries": [{"id": "1", "query": "q"}], "webhook_url": url},
        headers=ACME,
    )
    _assert_refused_by_gateway(batch, why)
    assert listener.connections == 0


@pytest.fixture(scope="module")
def inprocess_gateway(stack: Stack) -> Iterator[TestClient]:
    """The gateway app in this process (so its resolver can be faked), guard on, on its own
    Redis database of the stack's redis-server."""
    settings = Settings(
        redis_url=stack.redis_url + "/3",
        api_keys=[ApiKey(**KEYS[0])],
        webhook_allow_private_networks=False,
    )
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize(("template", "why"), DNS_MATRIX, ids=_ids(DNS_MATRIX))
def test_registration_of_a_name_resolving_to_a_private_address_is_refused(
    inprocess_gateway: TestClient, listener: Receiver, private_dns: None, template: str, why: str
) -> None:
    url = template.format(port=listener.port)
    response = inprocess_gateway.post(
        "/v1/searches", json={"index": INDEX, "query": "q", "webhook_url": url}, headers=ACME
    )
    _assert_refused_by_gateway(response, why)
    assert listener.connections == 0


def test_registration_accepts_a_public_address_and_contacts_nothing(
    inprocess_gateway: TestClient, connects: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registration only resolves and checks; it never connects to the URL (which is also
    why a redirect cannot be judged there: the delivery refuses to follow one)."""
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({"hooks.example": ["93.184.216.34"]}))
    response = inprocess_gateway.post(
        "/v1/searches",
        json={"index": INDEX, "query": "q", "webhook_url": "https://hooks.example/sift"},
        headers=ACME,
    )
    assert response.status_code == 202, response.text
    assert not [a for a in connects if isinstance(a, tuple) and a[0] == "93.184.216.34"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/searches", {"index": INDEX, "query": "q"}),
        ("/v1/batches", {"index": INDEX, "queries": [{"id": "a", "query": "q"}]}),
    ],
)
def test_a_resend_by_its_idempotency_key_replays_the_job_whatever_its_url_resolves_to_now(
    inprocess_gateway: TestClient, monkeypatch: pytest.MonkeyPatch, route: str, body: Any
) -> None:
    """A resend with the first request's Idempotency-Key gets that job: the URL was checked
    when the job was made. It was checked again first, so once the host resolved to a private
    address (or not at all, or its lookup timed out), the resend was a 422 naming
    ``webhook_url`` (or a 503) while the job it had made ran: the client took it as never made."""
    body = {**body, "webhook_url": "https://hooks.example/sift"}
    headers = {**ACME, "Idempotency-Key": f"resend-{route}"}
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({"hooks.example": ["93.184.216.34"]}))
    first = inprocess_gateway.post(route, json=body, headers=headers)
    assert first.status_code == 202, first.text
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({"hooks.example": ["10.0.0.7"]}))
    again = inprocess_gateway.post(route, json=body, headers=headers)
    assert again.status_code == 202, again.text
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    fresh = inprocess_gateway.post(route, json=body, headers=ACME)  # a new job: checked
    _assert_refused_by_gateway(fresh, "10.0.0.7")


def test_registration_whose_name_lookup_hangs_is_a_503_at_the_connect_timeout(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """getaddrinfo takes no timeout, and the gateway's lookup of a URL being registered had
    no bound: a resolver that never answered held the request (and a thread of the pool the
    gateway's store calls share) for as long as it took; here, the 20 s the fake resolver
    hangs, then a 202. Now the request waits for it at most
    ``SIFT_WEBHOOK_CONNECT_TIMEOUT_SECONDS`` and answers 503 naming the field and the
    setting, nothing stored, while the lookup still hangs."""
    answered = threading.Event()
    real = socket.getaddrinfo

    def hanging(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "hangs.example":  # its DNS server never answers (20 s, a hang guard)
            answered.wait(20.0)
            answered.set()
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    redis.Redis.from_url(stack.redis_url + "/4").flushdb()  # this test's own database
    settings = Settings(
        redis_url=stack.redis_url + "/4",
        api_keys=[ApiKey(**KEYS[0])],
        webhook_connect_timeout_seconds=0.5,
    )
    body = {"index": INDEX, "query": "q", "webhook_url": "https://hangs.example/sift"}
    with TestClient(create_app(settings)) as client:
        try:
            response = client.post("/v1/searches", json=body, headers=ACME)
            assert not answered.is_set()  # it did not wait for the lookup
            listed = client.get("/v1/searches", headers=ACME)
        finally:
            answered.set()
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["field"] == "webhook_url"
    assert error["message"].startswith("webhook_url: the name lookup of the host 'hangs.example'")
    assert "SIFT_WEBHOOK_CONNECT_TIMEOUT_SECONDS" in error["message"]
    assert response.headers["retry-after"] == "1"
    assert listed.status_code == 200 and listed.json()["searches"] == [], listed.text


def test_a_lookup_refused_for_want_of_a_thread_counts_no_other_tenants_lookups(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's lookup threads are shared out among tenants, so their admission is
    shared capacity (docs/security.md); the refusal's message is the caller's alone. It
    counted every tenant's lookups waiting on the resolver: one more of globex's showed in
    acme's answer."""
    answered = threading.Event()
    real = socket.getaddrinfo

    def hanging(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host.endswith(".hangs.example"):
            answered.wait(20.0)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    redis.Redis.from_url(stack.redis_url + "/4").flushdb()  # this test's own database
    settings = Settings(redis_url=stack.redis_url + "/4", api_keys=[ApiKey(**k) for k in KEYS])
    body = {"index": INDEX, "query": "q", "webhook_url": "https://acme.hangs.example/sift"}
    messages = []
    with TestClient(create_app(settings)) as client:
        lookups = client.app.state.lookups  # type: ignore[attr-defined]
        try:
            for n in range(24):  # as many as one tenant may hold
                lookups.submit(f"a{n}.hangs.example", 443, "acme")
            for globex in (0, 1):  # globex's lookups waiting: none, then one
                if globex:
                    lookups.submit("g.hangs.example", 443, "globex")
                response = client.post("/v1/searches", json=body, headers=ACME)
                assert response.status_code == 503, response.text
                messages.append(response.json()["error"]["message"])
        finally:
            answered.set()
    assert "no lookup thread free for this tenant" in messages[0]
    assert messages[0] == messages[1]


def test_registration_whose_name_lookup_fails_for_now_is_a_503_not_a_bad_url(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resolver whose servers did not answer gives up with ``EAI_AGAIN``: nothing is known
    of the host, so the request may be sent again (503, ``Retry-After``), where a host that
    does not exist is the caller's error (422). Before, both were 422 "does not resolve",
    telling the caller its URL was wrong; the worker already retried an ``EAI_AGAIN``."""
    real = socket.getaddrinfo

    def flaky(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "flaky-dns.example":
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if host == "no-such-host.example":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", flaky)
    redis.Redis.from_url(stack.redis_url + "/5").flushdb()  # this test's own database
    settings = Settings(redis_url=stack.redis_url + "/5", api_keys=[ApiKey(**KEYS[0])])
    with TestClient(create_app(settings)) as client:
        answers = {
            host: client.post(
                "/v1/searches",
                json={"index": INDEX, "query": "q", "webhook_url": f"https://{host}/sift"},
                headers=ACME,
            )
            for host in ("flaky-dns.example", "no-such-host.example")
        }
        listed = client.get("/v1/searches", headers=ACME)
    flaky_answer, missing = answers["flaky-dns.example"], answers["no-such-host.example"]
    assert flaky_answer.status_code == 503, flaky_answer.text
    error = flaky_answer.json()["error"]
    assert error["field"] == "webhook_url"
    assert "temporary failure in name resolution" in error["message"]
    assert "retry-after" in flaky_answer.headers
    assert missing.status_code == 422, missing.text
    assert "does not resolve" in missing.json()["error"]["message"]
    assert listed.status_code == 200 and listed.json()["searches"] == [], listed.text


def test_a_stopped_gateway_lets_its_lookup_threads_go(
    stack: Stack, wait_for: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's webhook-URL lookup threads end with its lifespan; they outlived it (idle,
    one per lookup ever in flight at once), for as long as the app object lived."""

    def lookup_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("sift-gateway-dns")}

    others = lookup_threads()  # another app's, alive in this process (a fixture's)
    redis.Redis.from_url(stack.redis_url + "/6").flushdb()  # this test's own database
    settings = Settings(redis_url=stack.redis_url + "/6", api_keys=[ApiKey(**KEYS[0])])
    with TestClient(create_app(settings)) as client:
        monkeypatch.setattr(socket, "getaddrinfo", fake_dns({"hooks.example": ["93.184.216.34"]}))
        body = {"index": INDEX, "query": "q", "webhook_url": "https://hooks.example/sift"}
        answered = client.post("/v1/searches", json=body, headers=ACME)
        assert answered.status_code == 202, answered.text
        ours = lookup_threads() - others
        assert ours
    wait_for(lambda: not any(t.is_alive() for t in ours), "the lookup threads to end")


# --- delivery -------------------------------------------------------------------------------


def _deliver(url: str) -> Any:
    body = payload(SEARCH_COMPLETED, "srch_ssrf", "succeeded")
    return deliver(url, body, message_id("srch_ssrf"), SECRET, allow_private=False, timeout=FAST)


def _run_delivery(url: str) -> Any:
    return run_delivery(
        url=url,
        event_type=SEARCH_COMPLETED,
        job_id="srch_ssrf",
        status="succeeded",
        occurred_at=datetime.now(UTC),
        attempt=1,
        secrets=[SECRET],
        settings=Settings(webhook_allow_private_networks=False),
    )


def _assert_refused_at_delivery(
    url: str, why: str, listener: Receiver, connects: list[Any]
) -> None:
    result = _deliver(url)
    assert result.outcome is DeliveryOutcome.FAILED
    assert result.reason.startswith("refused: webhook_url:") and why in result.reason
    decision = _run_delivery(url)
    assert decision.result.outcome is DeliveryOutcome.FAILED
    assert decision.final and decision.retry_in is None  # refused for good, never retried
    assert connects == []  # no socket of this process even tried
    assert listener.connections == 0


@pytest.mark.parametrize(("template", "why"), MATRIX, ids=_ids(MATRIX))
def test_delivery_is_refused_without_a_connection(
    listener: Receiver, connects: list[Any], template: str, why: str
) -> None:
    _assert_refused_at_delivery(template.format(port=listener.port), why, listener, connects)


@pytest.mark.parametrize(("template", "why"), DNS_MATRIX, ids=_ids(DNS_MATRIX))
def test_delivery_to_a_name_resolving_to_a_private_address_is_refused(
    listener: Receiver, connects: list[Any], private_dns: None, template: str, why: str
) -> None:
    _assert_refused_at_delivery(template.format(port=listener.port), why, listener, connects)


def test_the_listener_would_have_seen_an_allowed_delivery(
    connects: list[Any], private_dns: None
) -> None:
    """The control: with the guard lifted, the same name reaches a listener like the one
    above, so its zero connections mean the guard stopped them."""
    receiver = start_receiver()
    try:
        url = f"http://loopback.example:{receiver.port}/hook"
        body = payload(SEARCH_COMPLETED, "srch_ok", "succeeded")
        result = deliver(url, body, message_id("srch_ok"), SECRET, allow_private=True)
        assert result.outcome is DeliveryOutcome.DELIVERED
        assert receiver.connections == 1 and len(receiver.requests) == 1
        assert receiver.requests[0].headers["host"] == f"loopback.example:{receiver.port}"
        assert connects == [("127.0.0.1", receiver.port)]
    finally:
        stop_receiver(receiver)


def test_a_name_that_turns_private_between_registration_and_delivery_is_refused(
    monkeypatch: pytest.MonkeyPatch, listener: Receiver, connects: list[Any]
) -> None:
    """DNS rebinding: public when registered, loopback when sent. The delivery re-resolves."""
    answers = {"flip.example": ["93.184.216.34"]}
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns(answers))
    from worker.webhooks.urlguard import check_webhook_url

    url = f"http://flip.example:{listener.port}/hook"
    assert check_webhook_url(url, allow_private=False)  # registration passes
    answers["flip.example"] = ["127.0.0.1"]
    _assert_refused_at_delivery(url, "127.0.0.1 is a loopback", listener, connects)


# --- redirects ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "location",
    ["http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:{target}/stolen"],
)
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_never_followed(
    receiver: Receiver, connects: list[Any], location: str, status: int
) -> None:
    """No public receiver exists offline, so the first hop is a local receiver with the guard
    lifted; it answers a redirect to the metadata address or to a second listener."""
    target = start_receiver()
    try:
        receiver.status = status
        receiver.headers = {"location": location.format(target=target.port)}
        settings = Settings(webhook_allow_private_networks=True)
        decision = run_delivery(
            url=receiver.url,
            event_type=SEARCH_COMPLETED,
            job_id="srch_redirect",
            status="succeeded",
            occurred_at=datetime.now(UTC),
            attempt=1,
            secrets=[SECRET],
            settings=settings,
        )
        assert decision.result.outcome is DeliveryOutcome.FAILED
        assert decision.result.reason == f"redirect {status} not followed"
        assert decision.final  # a redirect is a failure, not retried
        assert len(receiver.requests) == 1 and receiver.requests[0].path == "/hook"
        assert target.connections == 0 and target.requests == []
        assert connects == [("127.0.0.1", receiver.port)]  # nothing after the first hop
    finally:
        stop_receiver(target)


def test_the_worker_does_not_follow_a_redirect_end_to_end(
    stack: Stack, receiver: Receiver, wait_for: Callable[..., None]
) -> None:
    """Through the real worker (the live stack lifts the address rule for local receivers):
    the receiver answers 302 to a second listener, which never hears from Sift."""
    target = start_receiver()
    try:
        receiver.status = 302
        receiver.headers = {"location": target.url}
        job = stack.live.post(
            "/v1/searches",
            params={"wait": 20},
            json={"index": INDEX, "query": "redirect", "webhook_url": receiver.url},
            headers=ACME,
        ).json()
        wait_for(lambda: len(receiver.requests) >= 1, "the webhook")
        first = receiver.requests[0]
        assert json.loads(first.body)["data"]["id"] == job["id"]
        # a later search's webhook goes to the same receiver: once it arrived, the worker
        # has long finished the first delivery, and still nothing reached the target
        receiver.status = 204
        stack.live.post(
            "/v1/searches",
            json={"index": INDEX, "query": "marker", "webhook_url": receiver.url},
            headers=ACME,
        )
        wait_for(lambda: len(receiver.requests) >= 2, "the second webhook")
        assert len(receiver.requests) == 2  # the redirected one was not retried either
        assert target.connections == 0 and target.requests == []
    finally:
        stop_receiver(target)

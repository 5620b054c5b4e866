"""Webhook delivery against a real loopback receiver, verified with the standardwebhooks library."""

from __future__ import annotations

import json
import math
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from tests.integration.slow_receivers import silent_handshake, slow_receiver
from tests.unit.test_urlguard import fake_dns
from worker.settings import ApiKey, Settings
from worker.webhooks.delivery import (
    BATCH_COMPLETED,
    MAX_ATTEMPTS,
    RETRY_SCHEDULE_SECONDS,
    SEARCH_COMPLETED,
    DeliveryOutcome,
    DeliveryTimeouts,
    deliver,
    message_id,
    next_delay,
    payload,
    run_delivery,
    sign,
)

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OLD_SECRET = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A stdlib HTTP server on 127.0.0.1 that records requests and answers a scripted status."""

    server: ThreadingHTTPServer
    received: list[Received] = field(default_factory=list)
    status: int = 204
    extra_headers: dict[str, str] = field(default_factory=dict)
    # set: each request is answered only once this is set (30 s at most: a hang guard)
    hold: threading.Event | None = None
    # the receiver's clock, this many seconds off the test's: its answers' Date header
    clock_offset: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    box: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            me = box["r"]
            if me.hold is not None:
                me.hold.wait(30)
            length = int(self.headers.get("content-length", "0"))
            body = self.rfile.read(length)
            me.received.append(Received(self.path, dict(self.headers.items()), body))
            self.send_response(me.status)
            for name, value in me.extra_headers.items():
                self.send_header(name, value)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # where a redirect would lead; must never be hit
            box["r"].received.append(Received(self.path, dict(self.headers.items()), b""))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def date_time_string(self, timestamp: float | None = None) -> str:
            return formatdate(time.time() + box["r"].clock_offset, usegmt=True)

        def log_message(self, format: str, *args: object) -> None:
            pass

    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box["r"] = Receiver(server)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield box["r"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


FAST = DeliveryTimeouts(connect=2.0, read=2.0)


def test_a_delivery_verifies_with_the_standardwebhooks_library(receiver: Receiver) -> None:
    body = payload(SEARCH_COMPLETED, "job-1", "succeeded")
    result = deliver(
        receiver.url, body, message_id("job-1"), SECRET, allow_private=True, timeout=FAST
    )
    assert result.outcome is DeliveryOutcome.DELIVERED
    assert result.status_code == 204
    [got] = receiver.received
    assert got.path == "/hook"
    assert got.body == body
    assert got.headers["webhook-id"] == "msg_job-1"
    assert {k.lower(): v for k, v in got.headers.items()}["host"] == receiver.url.split("/")[2]
    event = Webhook(SECRET).verify(got.body, got.headers)
    assert event["type"] == "search.completed"
    assert event["data"] == {"id": "job-1", "status": "succeeded"}
    assert set(event) == {"type", "timestamp", "data"}
    with pytest.raises(WebhookVerificationError):
        Webhook(OLD_SECRET).verify(got.body, got.headers)


def test_during_a_rotation_both_signatures_are_sent_and_each_secret_verifies(
    receiver: Receiver,
) -> None:
    key = ApiKey(
        key="k" * 16, tenant="acme", webhook_secret=SECRET, webhook_secret_previous=OLD_SECRET
    )
    body = payload(BATCH_COMPLETED, "batch-9", "succeeded")
    result = deliver(
        receiver.url, body, message_id("batch-9"), key.webhook_secrets(), allow_private=True
    )
    assert result.outcome is DeliveryOutcome.DELIVERED
    [got] = receiver.received
    signatures = got.headers["webhook-signature"].split(" ")
    assert len(signatures) == 2 and all(s.startswith("v1,") for s in signatures)
    for secret in (SECRET, OLD_SECRET):
        assert Webhook(secret).verify(got.body, got.headers)["type"] == "batch.completed"


def test_sign_is_the_librarys_signature() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    headers = sign(SECRET, "msg_x", when, b'{"a":1}')
    assert headers["webhook-timestamp"] == str(int(when.timestamp()))
    assert headers["webhook-signature"] == Webhook(SECRET).sign("msg_x", when, '{"a":1}')


def test_a_redirect_is_a_failure_and_is_not_followed(receiver: Receiver) -> None:
    receiver.status = 302
    receiver.extra_headers = {"location": receiver.url.replace("/hook", "/elsewhere")}
    body = payload(SEARCH_COMPLETED, "job-2", "succeeded")
    result = deliver(receiver.url, body, message_id("job-2"), SECRET, allow_private=True)
    assert result.outcome is DeliveryOutcome.FAILED
    assert result.status_code == 302
    assert [r.path for r in receiver.received] == ["/hook"]  # /elsewhere never requested


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, DeliveryOutcome.DELIVERED),
        (202, DeliveryOutcome.DELIVERED),
        (500, DeliveryOutcome.RETRY),
        (503, DeliveryOutcome.RETRY),
        (429, DeliveryOutcome.RETRY),
        # RFC 9110 (15.5.9): the server timed out waiting for the request; the client may
        # send it again (a proxy in front of a receiver answers it): not a refusal
        (408, DeliveryOutcome.RETRY),
        # any other 4xx may be the receiver's passing state (a deploy's 404, a secret being
        # rotated's 401): tried again on the schedule, as Svix's, whose schedule this is
        (400, DeliveryOutcome.RETRY),
        (401, DeliveryOutcome.RETRY),
        (404, DeliveryOutcome.RETRY),
        # but 410 Gone: the receiver says the URL is gone for good
        (410, DeliveryOutcome.FAILED),
    ],
)
def test_the_answer_is_classified(
    receiver: Receiver, status: int, outcome: DeliveryOutcome
) -> None:
    receiver.status = status
    body = payload(SEARCH_COMPLETED, "job-3", "failed")
    result = deliver(receiver.url, body, message_id("job-3"), SECRET, allow_private=True)
    assert (result.outcome, result.status_code) == (outcome, status)


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize("form", ["seconds", "date"])
def test_a_receiver_s_retry_after_is_read_in_either_form(
    receiver: Receiver, status: int, form: str
) -> None:
    """RFC 9110 (10.2.3) lets a ``Retry-After`` be delay-seconds or an HTTP-date; a date was
    taken for none, and the retry schedule alone applied."""
    receiver.status = status
    ahead = int(time.time()) + 600  # a whole second: an HTTP-date has no fraction
    receiver.extra_headers = {
        "Retry-After": formatdate(ahead, usegmt=True) if form == "date" else "600"
    }
    body = payload(SEARCH_COMPLETED, "job-ra", "succeeded")
    before = time.time()
    result = deliver(receiver.url, body, message_id("job-ra"), SECRET, allow_private=True)
    after = time.time()
    assert result.outcome is DeliveryOutcome.RETRY
    assert result.retry_after is not None, result
    if form == "seconds":
        assert result.retry_after == 600
    else:  # the date less the answer's Date, a whole second between these two readings
        assert ahead - after - 1e-3 <= result.retry_after <= ahead - int(before) + 1e-3, result


@pytest.mark.parametrize("offset", [-300, 300])
def test_a_receiver_s_retry_after_date_is_read_against_its_own_clock(
    receiver: Receiver, offset: int
) -> None:
    """A receiver whose clock is 5 minutes off the worker's asks for 90 s as an HTTP-date on
    its clock, 90 s after its answer's ``Date``: the wait is 90 s. Before, the date was read
    against the worker's clock: 5 minutes behind, the retry came at once (at the schedule's
    wait), the receiver still down; 5 minutes ahead, it waited 390 s."""
    receiver.status = 503
    receiver.clock_offset = offset
    answered = int(time.time()) + offset
    receiver.extra_headers = {"Retry-After": formatdate(answered + 90, usegmt=True)}
    body = payload(SEARCH_COMPLETED, "job-ra-off", "succeeded")
    result = deliver(receiver.url, body, message_id("job-ra-off"), SECRET, allow_private=True)
    assert result.outcome is DeliveryOutcome.RETRY
    # the Date's whole second may have turned since ``answered``: 90 s from it, or 89
    assert result.retry_after in (89.0, 90.0), result


def test_a_receiver_s_retry_after_of_a_year_past_any_clock_leaves_the_schedule(
    receiver: Receiver,
) -> None:
    """A date whose year no clock holds (a receiver's bug, or a hostile one) is no
    ``Retry-After``: the schedule's wait applies. Its parse raised ``OverflowError`` out of
    the attempt, so the task failed with no retry scheduled, the webhook left owed."""
    receiver.status = 503
    receiver.extra_headers = {"Retry-After": "Wed, 21 Oct 99999999999999999999 07:28:00 GMT"}
    decision = run_delivery(
        url=receiver.url,
        event_type=SEARCH_COMPLETED,
        job_id="job-ra-far",
        status="succeeded",
        occurred_at=datetime.now(UTC),
        attempt=1,
        secrets=[SECRET],
        settings=Settings(webhook_allow_private_networks=True, webhook_retry_scale=0.001),
    )
    assert decision.result.outcome is DeliveryOutcome.RETRY
    assert decision.result.retry_after is None
    assert decision.retry_in is not None and 0.004 <= decision.retry_in <= 0.006


def test_a_name_is_pinned_to_the_checked_address_and_keeps_its_host_header(
    receiver: Receiver,
) -> None:
    port = receiver.server.server_address[1]
    body = payload(SEARCH_COMPLETED, "job-10", "succeeded")
    url = f"http://localhost:{port}/hook?tenant=a"
    result = deliver(url, body, message_id("job-10"), SECRET, allow_private=True, timeout=FAST)
    assert result.outcome is DeliveryOutcome.DELIVERED
    [got] = receiver.received
    assert got.path == "/hook?tenant=a"
    assert {k.lower(): v for k, v in got.headers.items()}["host"] == f"localhost:{port}"
    Webhook(SECRET).verify(got.body, got.headers)


def test_a_name_with_non_ascii_letters_is_delivered_with_its_ascii_host_header(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An internationalised host name (``bücher.example``) resolves (getaddrinfo encodes it,
    IDNA) and so passes the guard at registration; its delivery sends the ``Host`` header in
    the same ASCII form (``xn--bcher-kva.example``), as an HTTP client would. It sent the
    name as it was written, which httpx could not encode: every attempt raised
    (UnicodeEncodeError) out of the delivery, so the webhook was never sent nor settled."""
    port = receiver.server.server_address[1]
    monkeypatch.setattr(socket, "getaddrinfo", fake_dns({"bücher.example": ["127.0.0.1"]}))
    body = payload(SEARCH_COMPLETED, "job-16", "succeeded")
    url = f"http://Bücher.example:{port}/hook"
    result = deliver(url, body, message_id("job-16"), SECRET, allow_private=True, timeout=FAST)
    assert result.outcome is DeliveryOutcome.DELIVERED, result.reason
    [got] = receiver.received
    assert {k.lower(): v for k, v in got.headers.items()}["host"] == f"xn--bcher-kva.example:{port}"
    Webhook(SECRET).verify(got.body, got.headers)


def test_a_url_with_a_delete_character_is_refused_not_raised(receiver: Receiver) -> None:
    """A URL holding DEL (0x7f), as an older release accepted at registration, is a refused
    delivery (``failed``, settled): httpx refuses such a URL with an error that is no
    network error, and it was raised out of every attempt, the webhook never settled."""
    body = payload(SEARCH_COMPLETED, "job-17", "succeeded")
    url = receiver.url + "\x7f"
    result = deliver(url, body, message_id("job-17"), SECRET, allow_private=True, timeout=FAST)
    assert result.outcome is DeliveryOutcome.FAILED
    assert "control characters" in result.reason
    assert receiver.received == []


def test_a_slow_receiver_times_out_and_is_retryable(receiver: Receiver) -> None:
    """The receiver answers nothing until the test lets it, after the delivery returned: the
    delivery gave up on its own read timeout, the one it asked httpx for."""
    receiver.hold = threading.Event()
    asked: list[dict[str, float]] = []
    body = payload(SEARCH_COMPLETED, "job-11", "succeeded")
    timeouts = DeliveryTimeouts(connect=1.0, read=0.2)
    with httpx.Client(
        event_hooks={"request": [lambda request: asked.append(request.extensions["timeout"])]}
    ) as client:
        try:
            result = deliver(
                receiver.url, body, message_id("job-11"), SECRET, allow_private=True,
                timeout=timeouts, client=client,
            )  # fmt: skip
        finally:
            receiver.hold.set()
    assert result.outcome is DeliveryOutcome.RETRY
    assert result.reason.startswith("timeout")
    assert asked == [{"connect": 1.0, "read": 0.2, "write": 0.2, "pool": 1.0}]


def test_a_receiver_trickling_its_headers_is_cut_at_the_total_cap() -> None:
    """httpx's timeouts are per read: a receiver sending its status line and headers a byte
    every 0.1 s never trips a 10 s read timeout. The delivery's wall-clock cap (1 s here,
    from settings) shuts the connection; the attempt is a timeout, retried on the schedule.
    Before the cap, the delivery waited as long as the receiver dripped (200 bytes here; as
    long as it liked in the wild), and its end was no timeout."""
    settings = Settings(
        webhook_allow_private_networks=True,
        webhook_read_timeout_seconds=10.0,
        webhook_total_timeout_seconds=1.0,
    )
    with slow_receiver(drip=0.1, max_bytes=200) as receiver:
        decision = run_delivery(
            url=receiver.url,
            event_type=SEARCH_COMPLETED,
            job_id="job-12",
            status="succeeded",
            occurred_at=datetime.now(UTC),
            attempt=1,
            secrets=[SECRET],
            settings=settings,
        )
        assert receiver.cut.wait(30)  # the receiver saw its connection shut mid-drip
        assert not receiver.ran_out.is_set()
    assert decision.result.outcome is DeliveryOutcome.RETRY
    assert decision.result.reason == "timeout: the 1 s cap"
    assert decision.result.status_code is None
    assert decision.retry_in is not None and not decision.final


def test_a_receiver_silent_in_the_tls_handshake_is_cut_at_the_total_cap() -> None:
    """A TLS handshake has no socket the cap can shut (the wrap detaches the plain one): its
    connect timeout is cut to what the cap leaves, so a receiver that accepts and never
    answers the hello holds the delivery about the 1 s cap, not the 10 s connect timeout.
    Before, the handshake ran the whole connect timeout."""
    settings = Settings(
        webhook_allow_private_networks=True,
        webhook_connect_timeout_seconds=10.0,
        webhook_total_timeout_seconds=1.0,
    )
    with silent_handshake() as receiver:
        started = time.monotonic()
        decision = run_delivery(
            url=receiver.url,
            event_type=SEARCH_COMPLETED,
            job_id="job-13",
            status="succeeded",
            occurred_at=datetime.now(UTC),
            attempt=1,
            secrets=[SECRET],
            settings=settings,
        )
        took = time.monotonic() - started
        assert receiver.closed.wait(30)  # the client gave up and closed its connection
    assert decision.result.outcome is DeliveryOutcome.RETRY
    assert decision.result.reason.startswith("timeout")
    assert took < settings.webhook_connect_timeout_seconds  # the cap, not the connect timeout
    assert decision.retry_in is not None


@pytest.mark.parametrize(
    ("error", "outcome", "reason"),
    [
        (socket.EAI_AGAIN, DeliveryOutcome.RETRY, "dns: temporary failure in name resolution"),
        (
            socket.EAI_NONAME,
            DeliveryOutcome.FAILED,
            "refused: webhook_url: the host 'gone.example' does not",
        ),
    ],
)
def test_a_lookup_the_resolver_gave_up_on_for_now_is_retried(
    monkeypatch: pytest.MonkeyPatch, error: int, outcome: DeliveryOutcome, reason: str
) -> None:
    """A resolver whose servers did not answer gives up with ``EAI_AGAIN``, a temporary
    failure: that attempt is retried on the schedule, as a connect that failed is. It was a
    refusal, never retried, the webhook ``failed`` for a moment's DNS trouble. A host that
    does not exist (``EAI_NONAME``) is still refused, as at registration."""

    def lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(error, "from the resolver")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    body = payload(SEARCH_COMPLETED, "job-14", "succeeded")
    url = "https://gone.example/hook"
    result = deliver(url, body, message_id("job-14"), SECRET, allow_private=False, timeout=FAST)
    assert result.outcome is outcome
    assert result.reason.startswith(reason)


def test_every_delivery_has_a_finite_total_cap_by_default() -> None:
    """The cap exists without any setting, and settings cannot lift it."""
    assert math.isfinite(DeliveryTimeouts().total) and DeliveryTimeouts().total > 0
    assert Settings().webhook_total_timeout_seconds == DeliveryTimeouts().total
    for bad in ("inf", "nan", "0", "-1"):
        with pytest.raises(ValueError, match="webhook_total_timeout_seconds"):
            Settings(webhook_total_timeout_seconds=bad)


def test_connection_refused_is_retryable(receiver: Receiver) -> None:
    url = receiver.url
    receiver.server.server_close()  # nothing listens on the port now
    body = payload(SEARCH_COMPLETED, "job-4", "succeeded")
    result = deliver(url, body, message_id("job-4"), SECRET, allow_private=True, timeout=FAST)
    assert result.outcome is DeliveryOutcome.RETRY
    assert result.status_code is None


def test_the_same_job_has_the_same_webhook_id_and_body_on_every_retry(receiver: Receiver) -> None:
    receiver.status = 500
    settings = Settings(webhook_allow_private_networks=True, webhook_retry_scale=0.001)
    occurred = datetime.now(UTC).isoformat()
    decisions = [
        run_delivery(
            url=receiver.url,
            event_type=SEARCH_COMPLETED,
            job_id="job-5",
            status="succeeded",
            occurred_at=occurred,
            attempt=attempt,
            secrets=[SECRET],
            settings=settings,
        )
        for attempt in (1, 2)
    ]
    first, second = receiver.received
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == "msg_job-5"
    assert first.body == second.body
    assert all(d.result.outcome is DeliveryOutcome.RETRY for d in decisions)
    assert decisions[0].retry_in is not None and 0.004 <= decisions[0].retry_in <= 0.006
    assert decisions[1].retry_in is not None and 0.24 <= decisions[1].retry_in <= 0.36
    for got in (first, second):
        Webhook(SECRET).verify(got.body, got.headers)


def test_run_delivery_gives_up_when_the_schedule_is_spent(receiver: Receiver) -> None:
    receiver.status = 503
    settings = Settings(webhook_allow_private_networks=True, webhook_retry_scale=0.0)
    decision = run_delivery(
        url=receiver.url,
        event_type=BATCH_COMPLETED,
        job_id="b-1",
        status="succeeded",
        occurred_at=datetime.now(UTC),
        attempt=MAX_ATTEMPTS,
        secrets=[SECRET],
        settings=settings,
    )
    assert decision.final and decision.gave_up and decision.retry_in is None


def test_run_delivery_stops_at_a_permanent_failure(receiver: Receiver) -> None:
    receiver.status = 410
    decision = run_delivery(
        url=receiver.url,
        event_type=SEARCH_COMPLETED,
        job_id="job-6",
        status="succeeded",
        occurred_at=datetime.now(UTC),
        attempt=1,
        secrets=[SECRET],
        settings=Settings(webhook_allow_private_networks=True),
    )
    assert decision.result.outcome is DeliveryOutcome.FAILED
    assert decision.final and not decision.gave_up


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/hook",
        "http://localhost:{port}/hook",
        "http://2130706433:{port}/hook",
        "http://[::ffff:127.0.0.1]:{port}/hook",
    ],
)
def test_a_loopback_url_is_refused_at_send_time(receiver: Receiver, url: str) -> None:
    target = url.format(port=receiver.server.server_address[1])
    body = payload(SEARCH_COMPLETED, "job-7", "succeeded")
    result = deliver(target, body, message_id("job-7"), SECRET, allow_private=False)
    assert result.outcome is DeliveryOutcome.FAILED
    assert result.reason.startswith("refused: webhook_url:")
    assert receiver.received == []  # nothing was sent


def test_run_delivery_applies_the_guard_from_settings(receiver: Receiver) -> None:
    decision = run_delivery(
        url=receiver.url,
        event_type=SEARCH_COMPLETED,
        job_id="job-8",
        status="succeeded",
        occurred_at=datetime.now(UTC),
        attempt=1,
        secrets=[SECRET],
        settings=Settings(webhook_allow_private_networks=False),
    )
    assert decision.result.outcome is DeliveryOutcome.FAILED and decision.final
    assert receiver.received == []


def test_the_retry_schedule_grows_with_bounded_jitter_and_ends() -> None:
    rng = random.Random(7)
    for attempt in range(1, MAX_ATTEMPTS):
        base = RETRY_SCHEDULE_SECONDS[attempt]
        samples = [next_delay(attempt, rng=rng) for _ in range(50)]
        assert all(s is not None and 0.8 * base <= s <= 1.2 * base for s in samples)
        if base:
            assert len(set(samples)) > 1  # jittered, not fixed
    assert list(RETRY_SCHEDULE_SECONDS) == sorted(RETRY_SCHEDULE_SECONDS)
    assert RETRY_SCHEDULE_SECONDS[1:4] == (5, 300, 1800)
    assert next_delay(MAX_ATTEMPTS) is None
    assert next_delay(MAX_ATTEMPTS + 3) is None
    scaled = next_delay(3, scale=0.001, rng=rng)
    assert scaled is not None and 0.8 * 1.8 <= scaled <= 1.2 * 1.8


def test_the_payload_is_thin_json() -> None:
    when = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    body = json.loads(payload(SEARCH_COMPLETED, "j", "canceled", occurred_at=when))
    assert body == {
        "type": "search.completed",
        "timestamp": "2026-05-01T12:00:00Z",
        "data": {"id": "j", "status": "canceled"},
    }
    with pytest.raises(ValueError):
        payload("search.started", "j", "running")

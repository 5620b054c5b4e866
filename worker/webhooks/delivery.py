"""Standard Webhooks delivery: the payload, signing, one guarded POST, and the retry schedule.

The Celery task ``sift.webhook`` (queue ``sift.webhooks``) calls
:func:`run_delivery` once per attempt and acts on the decision::

    attempt = event.get("attempt", 1)
    decision = run_delivery(
        url=url, event_type=SEARCH_COMPLETED, job_id=job_id, status="succeeded",
        occurred_at=occurred_at, attempt=attempt,
        secrets=api_key.webhook_secrets(), settings=settings,
    )
    if decision.retry_in is not None:  # the next attempt's message, due retry_in from now
        raise self.retry(args=[{**event, "attempt": attempt + 1, "due_at": ...}], ...)

The attempt number rides in the event, not in Celery's retry count: a wait longer than half
the broker's visibility timeout is made in hops, each a Celery retry of its own
(:func:`worker.queue.webhook_task.webhook`).

The body carries the job's final figures, and its end as the timestamp, read from its record
(final once the job's final move sent the message) at the first attempt and carried by the
event from then on (:func:`worker.queue.webhook_task.webhook`).

Delivery is at least once. The ``webhook-id`` is ``msg_<job id>`` on every
attempt and the body is the same bytes on every attempt (its timestamp is the
event's, passed in); only the ``webhook-timestamp`` header is fresh, so a
receiver's five-minute tolerance holds for a retry hours later. A message the broker lost
is sent again by the re-drive once overdue (:mod:`worker.queue.redrive`), with the same
``webhook-id``.

Nothing here logs a secret, a signature or a body.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from standardwebhooks.webhooks import Webhook

from worker import clock
from worker.constants import WEBHOOK_EVENT_BATCH_COMPLETED, WEBHOOK_EVENT_SEARCH_COMPLETED
from worker.core.budget import answer_date, retry_after_seconds
from worker.errors import InvalidRequest
from worker.webhooks import urlguard
from worker.webhooks.shares import TenantSlots
from worker.webhooks.urlguard import (
    IPAddress,
    LookupsBusy,
    LookupThreads,
    check_webhook_url,
    failed_for_now,
)

if TYPE_CHECKING:
    from worker.settings import Settings

log = logging.getLogger(__name__)

SEARCH_COMPLETED = WEBHOOK_EVENT_SEARCH_COMPLETED
BATCH_COMPLETED = WEBHOOK_EVENT_BATCH_COMPLETED
EVENT_TYPES = (SEARCH_COMPLETED, BATCH_COMPLETED)

USER_AGENT = "Sift-Webhooks/1"

# Seconds to wait before attempt n+1 after attempt n failed (n = 1..8), like Svix's:
# immediately, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h. Eight attempts, then give up.
RETRY_SCHEDULE_SECONDS: tuple[float, ...] = (0, 5, 300, 1800, 7200, 18000, 36000, 36000)
MAX_ATTEMPTS = len(RETRY_SCHEDULE_SECONDS)
JITTER = 0.2  # each delay is scaled by a uniform factor in [1 - JITTER, 1 + JITTER]
MAX_RETRY_AFTER_SECONDS = 36000.0  # a receiver's Retry-After is honoured up to this


# The one answer that ends a webhook at once: 410 Gone, the receiver saying its URL is gone
# for good. Any other 4xx is tried again on the schedule, as Svix's (whose schedule this is):
# a receiver mid-deploy answers 404 for a while, one whose secret is being rotated 401, and a
# webhook refused for good at the first such answer was lost though the receiver came back.
GONE = 410


class DeliveryOutcome(StrEnum):
    """The class of one delivery attempt; also the ``result`` label of the metric."""

    DELIVERED = "delivered"  # 2xx
    RETRY = "retry"  # 4xx but 410, 5xx, timeout, connection error: try again later
    FAILED = "failed"  # 410 Gone, a redirect, an SSRF refusal: never retried


@dataclass(frozen=True)
class DeliveryResult:
    """What one attempt did. ``reason`` is short and safe to log (no body, no secret)."""

    outcome: DeliveryOutcome
    reason: str
    status_code: int | None = None
    retry_after: float | None = None
    duration_seconds: float = 0.0


@dataclass(frozen=True)
class DeliveryTimeouts:
    """Connect and read are separate: a slow receiver must not hold a worker for long.

    ``connect`` and ``read`` are httpx's, per connect and per read; ``total`` caps the whole
    delivery by the wall clock (:class:`_Deadline`), the host's name lookup included, since
    a receiver sending a byte each read timeout (or a DNS server never answering) would
    otherwise hold its thread for as long as it liked."""

    connect: float = 5.0
    read: float = 15.0
    total: float = 30.0

    def as_httpx(self, left: float | None = None) -> httpx.Timeout:
        """httpx's timeouts, the connect one (which also bounds a TLS handshake) cut to
        ``left``, the seconds the cap leaves: a handshake has no socket the cap can shut.

        >>> DeliveryTimeouts(connect=5, read=15).as_httpx(2.5).connect
        2.5
        >>> DeliveryTimeouts(connect=5, read=15).as_httpx(40).connect
        5
        """
        connect = self.connect if left is None else min(self.connect, left)
        return httpx.Timeout(self.read, connect=connect, write=self.read, pool=connect)


# Threads looking up webhook hosts at once in a process; a lookup that hangs keeps its thread
# until the system resolver gives up, and one that finds none free is refused at once, a
# retried attempt (LookupThreads). Apart from the model calls' lookups
# (worker/adapters/attempt_deadline.py), so a tenant's host whose DNS hangs never holds those up.
LOOKUP_THREADS = urlguard.LOOKUP_THREADS


def _lookup_pool() -> LookupThreads:
    return LookupThreads(LOOKUP_THREADS, "sift-webhook-dns")


_LOOKUPS = _lookup_pool()


def _new_lookup_pool() -> None:
    """A forked child gets a pool of its own: its parent's threads did not come along."""
    global _LOOKUPS
    _LOOKUPS = _lookup_pool()


os.register_at_fork(after_in_child=_new_lookup_pool)


class _Unresolved(Exception):
    """The host's name lookup did not answer in time, or failed for now (the resolver gave
    up), or found no thread free: the attempt is retried, not refused. Not an ``OSError``,
    so the guard lets it by."""


class _Deadline:
    """Shuts a delivery's connection down at its wall-clock cap, and gives up on its name
    lookup there.

    httpx's timeouts are per operation, so a blocked read is interrupted here from a timer
    thread: httpcore's ``trace`` extension hands over each connection's socket as it is
    made (plain or TLS), and ``shutdown`` wakes the read blocked on it, which then fails.
    A TLS handshake (its plain socket is detached by the wrap) has no socket to shut: the
    connect timeout is cut to :meth:`left` instead. getaddrinfo takes no timeout at all: the
    guard's lookup runs on a thread of its own, waited on no longer than :meth:`left`
    (:meth:`lookup`), one of ``tenant``'s share of the threads."""

    def __init__(self, seconds: float, tenant: str = "") -> None:
        self.reached = False
        self._seconds = seconds
        self._tenant = tenant
        self._ends = time.monotonic() + max(seconds, 0.0)
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._timer = threading.Timer(max(seconds, 0.0), self._cut)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def left(self) -> float:
        """Seconds until the cap (0 once reached)."""
        return max(self._ends - time.monotonic(), 0.0)

    def lookup(self, host: str, port: int, **kwargs: Any) -> list[tuple[Any, ...]]:
        """``socket.getaddrinfo`` for the guard, given up on at the cap; a lookup the
        resolver gave up on for now (``EAI_AGAIN``: its servers did not answer) is retried
        too, and so is one that finds no lookup thread free (the others wait on lookups the
        resolver has not answered): refused at once, not queued behind them. Each raises
        :class:`_Unresolved`."""
        try:
            found = _LOOKUPS.submit(host, port, self._tenant, **kwargs)
        except LookupsBusy as exc:
            log.warning("webhook lookup of %s for tenant %s: %s", host, self._tenant, exc)
            raise _Unresolved(str(exc)) from None
        try:
            return found.result(timeout=self.left())
        except FutureTimeout:
            raise _Unresolved(f"timeout: the name lookup, at the {self._seconds:g} s cap") from None
        except socket.gaierror as exc:
            if not failed_for_now(exc):
                raise  # no such host, say: the guard refuses it
            raise _Unresolved("dns: temporary failure in name resolution") from exc

    def trace(self, name: str, info: Mapping[str, Any]) -> None:
        """httpcore's ``trace`` callback: keeps the socket of the connection just made."""
        if not name.endswith((".connect_tcp.complete", ".start_tls.complete")):
            return
        stream = info.get("return_value")
        sock = None if stream is None else stream.get_extra_info("socket")
        with self._lock:
            self._socket = sock
            if self.reached:
                _shut(sock)

    def _cut(self) -> None:
        with self._lock:
            self.reached = True
            _shut(self._socket)


def _shut(sock: socket.socket | None) -> None:
    """Shut ``sock`` both ways (the base class's, so a TLS socket's state is left alone for
    the thread reading it); a socket already closed is fine."""
    if sock is None:
        return
    with suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


@functools.cache
def delivery_slots(limit: int, per_tenant: int | None = None) -> TenantSlots:
    """This process's delivery slots (``SIFT_WEBHOOK_DELIVERIES_PER_PROCESS``, of which
    ``SIFT_WEBHOOK_DELIVERIES_PER_TENANT`` one tenant's, a quarter kept for tenants sending
    nothing else), shared out by the rule the name lookups' threads follow too."""
    return TenantSlots(limit, per_tenant)


@dataclass(frozen=True)
class DeliveryDecision:
    """What the task does next: ``retry_in`` seconds is set only when another attempt is due."""

    result: DeliveryResult
    attempt: int
    retry_in: float | None

    @property
    def final(self) -> bool:
        return self.retry_in is None

    @property
    def gave_up(self) -> bool:
        """True when a retryable failure ran out of attempts."""
        return self.result.outcome is DeliveryOutcome.RETRY and self.retry_in is None


def message_id(job_id: str) -> str:
    """The ``webhook-id`` of a job's event: stable across every retry."""
    return f"msg_{job_id}"


def payload(
    event_type: str,
    job_id: str,
    status: str,
    *,
    occurred_at: datetime | None = None,
    figures: Mapping[str, Any] | None = None,
) -> bytes:
    """The body ``{"type","timestamp","data":{"id","status",...figures}}``.

    ``figures`` are the job's final figures from its record
    (:func:`worker.queue.jobstore.webhook_figures`: a batch's counts, usage and rerank
    outcomes, a search's usage and error type; its ``status`` wins); never a result, which
    is at the job's URL."""
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown webhook event type {event_type!r}")
    when = (occurred_at or datetime.fromtimestamp(clock.now(), UTC)).astimezone(UTC)
    body = {
        "type": event_type,
        "timestamp": when.isoformat().replace("+00:00", "Z"),
        "data": {"id": job_id, "status": status, **(figures or {})},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def sign(
    secrets: str | Sequence[str], msg_id: str, timestamp: datetime | int, body: bytes
) -> dict[str, str]:
    """The three Standard Webhooks headers for ``body``.

    With several secrets (a rotation: current first, then previous) the
    ``webhook-signature`` header carries one ``v1,<base64>`` per secret,
    space-separated, so a receiver holding either secret verifies it.
    """
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    if not keys:
        raise ValueError("at least one webhook secret is needed")
    if isinstance(timestamp, int):
        when = datetime.fromtimestamp(timestamp, UTC)
    else:
        when = timestamp.astimezone(UTC)
    data = body.decode()
    signatures = [Webhook(key).sign(msg_id=msg_id, timestamp=when, data=data) for key in keys]
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(when.timestamp())),
        "webhook-signature": " ".join(signatures),
    }


def next_delay(
    attempt: int, *, scale: float = 1.0, rng: random.Random | None = None
) -> float | None:
    """Seconds to wait after failed attempt ``attempt`` (1-based); None once the schedule is spent.

    The schedule's delay is multiplied by ``scale`` (``SIFT_WEBHOOK_RETRY_SCALE``;
    tests use a tiny one) and by a jitter factor in ``[0.8, 1.2]``.
    """
    if attempt < 1:
        raise ValueError("attempt is 1-based")
    if attempt >= MAX_ATTEMPTS:
        return None
    base = RETRY_SCHEDULE_SECONDS[attempt] * scale
    jitter = (rng or random).uniform(1.0 - JITTER, 1.0 + JITTER)
    return base * jitter


def _retry_after(response: httpx.Response) -> float | None:
    """The receiver's ``Retry-After`` in seconds, in either RFC form, up to the cap. A date
    is on the receiver's clock: read against its answer's ``Date`` (the shared clock without
    one), not this worker's, which may be minutes off it."""
    now = answer_date(response.headers.get("date")) or datetime.fromtimestamp(clock.now(), UTC)
    seconds = retry_after_seconds(response.headers.get("retry-after"), now)
    return None if seconds is None else min(seconds, MAX_RETRY_AFTER_SECONDS)


def _pinned(url: str, address: IPAddress) -> tuple[str, str, str]:
    """``url`` with its host swapped for ``address``, plus the ``Host`` header and TLS name.

    An internationalised host name goes in the ``Host`` header in its ASCII (IDNA) form, the
    name getaddrinfo looked up and the TLS layer sends: a header is ASCII, and httpx refused
    the name as written (every attempt raised, the webhook never sent nor settled).

    >>> _pinned("http://Bücher.example:8080/h", ipaddress.ip_address("93.184.216.34"))[:2]
    ('http://93.184.216.34:8080/h', 'xn--bcher-kva.example:8080')
    """
    parts = urlsplit(url)
    userinfo, _, host_port = parts.netloc.rpartition("@")
    if not host_port.isascii():
        host = (parts.hostname or "").encode("idna").decode("ascii")
        host_port = host if parts.port is None else f"{host}:{parts.port}"
    literal = f"[{address}]" if isinstance(address, ipaddress.IPv6Address) else str(address)
    netloc = literal if parts.port is None else f"{literal}:{parts.port}"
    if userinfo:
        netloc = f"{userinfo}@{netloc}"
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    return pinned, host_port, parts.hostname or host_port


def _classify(response: httpx.Response) -> DeliveryResult:
    code = response.status_code
    if 200 <= code < 300:
        return DeliveryResult(DeliveryOutcome.DELIVERED, f"http {code}", code)
    if 300 <= code < 400:
        return DeliveryResult(DeliveryOutcome.FAILED, f"redirect {code} not followed", code)
    if code == GONE:
        return DeliveryResult(DeliveryOutcome.FAILED, f"http {code}", code)
    return DeliveryResult(DeliveryOutcome.RETRY, f"http {code}", code, _retry_after(response))


def deliver(
    url: str,
    body: bytes,
    msg_id: str,
    secrets: str | Sequence[str],
    *,
    allow_private: bool,
    timeout: DeliveryTimeouts | None = None,
    client: httpx.Client | None = None,
    tenant: str = "",
) -> DeliveryResult:
    """POST one signed delivery to ``url`` and classify what happened. Never raises for the network.

    The whole delivery ends by ``timeout.total``, its clock started before the guard's name
    lookup: a lookup still unanswered then is given up on, a connection still open then is
    shut, a connect or TLS handshake may last only what the cap leaves, and the attempt is a
    timeout (retried). A lookup the resolver gave up on for now is retried too, and so is
    one that finds no thread free (``tenant``'s lookups have their share of this process's
    :data:`LOOKUP_THREADS`); a host that does not exist is refused, as at registration.

    The SSRF guard runs again here, re-resolving the host, and the request is
    sent to one of exactly the addresses it checked (the ``Host`` header and TLS
    server name stay the original host), so DNS cannot swap in a private
    address between the check and the connect. Redirects are not followed.
    """
    started = time.monotonic()
    timeouts = timeout or DeliveryTimeouts()
    with _Deadline(timeouts.total, tenant) as deadline:
        try:
            addresses = check_webhook_url(url, allow_private=allow_private, lookup=deadline.lookup)
        except InvalidRequest as exc:
            log.warning("webhook %s refused by the SSRF guard", msg_id)
            return DeliveryResult(DeliveryOutcome.FAILED, f"refused: {exc.message}")
        except _Unresolved as exc:
            result = DeliveryResult(DeliveryOutcome.RETRY, str(exc))
        else:
            result = _post(client, url, addresses, body, msg_id, secrets, timeouts, deadline)
    result = DeliveryResult(
        result.outcome,
        result.reason,
        result.status_code,
        result.retry_after,
        time.monotonic() - started,
    )
    log.info(
        "webhook %s to %s: %s (%s)",
        msg_id,
        urlsplit(url).hostname,
        result.outcome.value,
        result.reason,
    )
    return result


def _post(
    client: httpx.Client | None,
    url: str,
    addresses: list[IPAddress],
    body: bytes,
    msg_id: str,
    secrets: str | Sequence[str],
    timeouts: DeliveryTimeouts,
    deadline: _Deadline,
) -> DeliveryResult:
    """:func:`_send` on ``client``, or on a client of its own (on the process's TLS context,
    :func:`_tls`), closed after."""
    http = client or httpx.Client(
        timeout=timeouts.as_httpx(), follow_redirects=False, verify=_tls()
    )
    try:
        return _send(http, url, addresses, body, msg_id, secrets, timeouts, deadline)
    finally:
        if client is None:
            http.close()


@functools.cache
def _tls() -> ssl.SSLContext:
    """The TLS context every delivery's own client verifies with, made once per process:
    httpx's default (the CA bundle, or ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` when set). A
    client given none makes its own, reading the bundle: about 20 ms of CPU per delivery,
    more than the rest of it."""
    return httpx.create_ssl_context()


def _send(
    http: httpx.Client,
    url: str,
    addresses: list[IPAddress],
    body: bytes,
    msg_id: str,
    secrets: str | Sequence[str],
    timeouts: DeliveryTimeouts,
    deadline: _Deadline,
) -> DeliveryResult:
    capped = DeliveryResult(DeliveryOutcome.RETRY, f"timeout: the {timeouts.total:g} s cap")
    # on the shared clock: the receiver checks the timestamp against its own, and this
    # host's may be minutes off (a 6 minute skew had every webhook refused)
    headers = sign(secrets, msg_id, datetime.fromtimestamp(clock.now(), UTC), body)
    headers["content-type"] = "application/json"
    headers["user-agent"] = USER_AGENT
    last = DeliveryResult(DeliveryOutcome.RETRY, "connection failed")
    for address in addresses:
        left = deadline.left()
        if deadline.reached or left <= 0:
            return capped
        pinned_url, headers["host"], server_name = _pinned(url, address)
        try:
            with http.stream(
                "POST",
                pinned_url,
                content=body,
                headers=headers,
                timeout=timeouts.as_httpx(left),
                follow_redirects=False,
                extensions={"sni_hostname": server_name, "trace": deadline.trace},
            ) as response:
                return _classify(response)  # the body is never read
        except httpx.TransportError as exc:
            if deadline.reached or deadline.left() <= 0:  # the cap shut the connection (or
                return capped  # its cut connect timeout ran out), whatever httpx made of it
            if isinstance(exc, httpx.ConnectError):
                # Nothing was sent: the next checked address may answer.
                last = DeliveryResult(
                    DeliveryOutcome.RETRY, f"connection error: {type(exc).__name__}"
                )
                continue
            if isinstance(exc, httpx.TimeoutException):
                return DeliveryResult(DeliveryOutcome.RETRY, f"timeout: {type(exc).__name__}")
            return DeliveryResult(DeliveryOutcome.RETRY, f"transport error: {type(exc).__name__}")
    return last


def run_delivery(
    *,
    url: str,
    event_type: str,
    job_id: str,
    status: str,
    occurred_at: datetime | str,
    attempt: int,
    secrets: Sequence[str],
    settings: Settings,
    figures: Mapping[str, Any] | None = None,
    client: httpx.Client | None = None,
    rng: random.Random | None = None,
    tenant: str = "",
) -> DeliveryDecision:
    """One attempt of the ``sift.webhook`` task: build, sign, send, and decide what comes next.

    ``attempt`` is 1-based (the event's ``attempt``; a first message has none: 1).
    ``occurred_at`` is when the job finished (a datetime or its ISO string, as a
    JSON task argument carries it); it is the payload's timestamp. ``figures``: the job's
    final figures (:func:`payload`), which the event carries from its first attempt on, so
    every attempt sends the same bytes. ``retry_in`` is the countdown for the next
    attempt, or None when this attempt was final: delivered, failed for good, or
    the schedule is spent (``gave_up``). A 4xx's or 5xx's ``Retry-After`` lengthens the
    wait, never shortens it. ``tenant``: whose webhook (its share of the lookup threads).
    """
    when = datetime.fromisoformat(occurred_at) if isinstance(occurred_at, str) else occurred_at
    body = payload(event_type, job_id, status, occurred_at=when, figures=figures)
    result = deliver(
        url,
        body,
        message_id(job_id),
        secrets,
        allow_private=settings.webhook_allow_private_networks,
        timeout=DeliveryTimeouts(
            connect=settings.webhook_connect_timeout_seconds,
            read=settings.webhook_read_timeout_seconds,
            total=settings.webhook_total_timeout_seconds,
        ),
        client=client,
        tenant=tenant,
    )
    return decide(result, job_id=job_id, attempt=attempt, settings=settings, rng=rng)


def decide(
    result: DeliveryResult,
    *,
    job_id: str,
    attempt: int,
    settings: Settings,
    rng: random.Random | None = None,
) -> DeliveryDecision:
    """What comes after attempt ``attempt`` of ``job_id``'s webhook ended as ``result``: a
    retry on the schedule (a 4xx's or 5xx's ``Retry-After`` lengthens the wait, never shortens it),
    or nothing (delivered, failed for good, or the schedule spent)."""
    retry_in: float | None = None
    if result.outcome is DeliveryOutcome.RETRY:
        retry_in = next_delay(attempt, scale=settings.webhook_retry_scale, rng=rng)
        if retry_in is not None and result.retry_after is not None:
            retry_in = max(retry_in, result.retry_after * settings.webhook_retry_scale)
        if retry_in is None:
            log.warning("webhook %s gave up after %d attempts", message_id(job_id), attempt)
    return DeliveryDecision(result=result, attempt=attempt, retry_in=retry_in)

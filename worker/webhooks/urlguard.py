"""The SSRF guard: a webhook URL must be http(s) and resolve only to public addresses.

Stdlib only, because the gateway imports it to check a URL when a hook is
registered, and the webhook sender checks it again (re-resolving) at send time::

    addresses = check_webhook_url("https://hooks.example.com/sift", allow_private=False)

Every address the host resolves to must be public; one private answer among
public ones refuses the URL (a DNS-rebinding host often answers both). Numeric
host forms (``2130706433``, ``0x7f.1``, ``0177.0.0.1``) are normalised by
``getaddrinfo`` and checked like any other address. IPv6 addresses that embed
an IPv4 address (mapped, compatible, 6to4, NAT64, Teredo) are checked on the
embedded address too.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from worker.errors import InvalidRequest
from worker.webhooks.shares import TenantSlots

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# socket.getaddrinfo's shape: the sender passes one bounded by its delivery's cap
Lookup = Callable[..., list[tuple[Any, ...]]]

FIELD = "webhook_url"
# the setting that lifts the address rule, named in a refusal so a developer running a local
# receiver knows what to set (worker/settings.py: webhook_allow_private_networks)
ALLOW_PRIVATE_SETTING = "SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS"
# the setting that bounds the gateway's lookup of a URL's host at registration, named in its 503
LOOKUP_TIMEOUT_SETTING = "SIFT_WEBHOOK_CONNECT_TIMEOUT_SECONDS"
# threads looking up webhook hosts at once in one process (the gateway's, a worker's)
LOOKUP_THREADS = 32
ALLOWED_SCHEMES = ("http", "https")
DEFAULT_PORTS = {"http": 80, "https": 443}

# Cloud instance-metadata endpoints, refused by name so the message says so.
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    {
        ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack, ...
        ipaddress.ip_address("fd00:ec2::254"),  # AWS IMDS over IPv6
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
        ipaddress.ip_address("168.63.129.16"),  # Azure wire server
    }
)
CGNAT = ipaddress.ip_network("100.64.0.0/10")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries, if it is one of the embedding forms."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in IPV4_COMPATIBLE and int(ip) > 1:  # ::a.b.c.d, deprecated; :: and ::1 excluded
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_metadata(ip: IPAddress) -> bool:
    """Whether ``ip`` is a cloud metadata address, itself or embedded in an IPv6 address
    (``::ffff:169.254.169.254``, ``64:ff9b::a9fe:a9fe``, 6to4...): a refusal of one never
    hints at the setting that lifts the address rule, in any spelling."""
    if ip in METADATA_ADDRESSES:
        return True
    embedded = _embedded_ipv4(ip) if isinstance(ip, ipaddress.IPv6Address) else None
    return embedded is not None and embedded in METADATA_ADDRESSES


def refusal_reason(ip: IPAddress) -> str | None:
    """Why ``ip`` is not a public address a webhook may reach, or None when it is."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            inner = refusal_reason(embedded)
            if inner is not None:
                return f"{ip} embeds {embedded}, {inner}"
        if ip in NAT64_LOCAL:
            return f"{ip} is a local-use NAT64 address"
    if ip in METADATA_ADDRESSES:
        return f"{ip} is a cloud metadata address"
    if ip.is_unspecified:
        return f"{ip} is the unspecified address"
    if ip.is_loopback:
        return f"{ip} is a loopback address"
    if ip.is_link_local:
        return f"{ip} is a link-local address"
    if ip.is_multicast:
        return f"{ip} is a multicast address"
    if isinstance(ip, ipaddress.IPv4Address) and ip in CGNAT:
        return f"{ip} is a carrier-grade NAT (shared) address"
    if ip.is_reserved:
        return f"{ip} is a reserved address"
    if ip.is_private:
        return f"{ip} is a private address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return f"{ip} is a site-local address"
    if not ip.is_global:
        return f"{ip} is not a globally routable address"
    return None


def _parse_address(text: str) -> IPAddress:
    return ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone id


def resolve(host: str, port: int, lookup: Lookup | None = None) -> list[IPAddress]:
    """Every address ``host`` resolves to, in resolver order, without duplicates; looked up
    with ``lookup`` (default ``socket.getaddrinfo``, which takes no timeout)."""
    try:
        infos = (lookup or socket.getaddrinfo)(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError) as exc:
        raise InvalidRequest(FIELD, f"the host {host!r} does not resolve") from exc
    addresses: list[IPAddress] = []
    for info in infos:
        try:
            address = _parse_address(str(info[4][0]))
        except ValueError:
            continue
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise InvalidRequest(FIELD, f"the host {host!r} resolves to no IP address")
    return addresses


def split_webhook_url(url: str) -> tuple[str, str, int]:
    """Check the URL's form and return ``(scheme, host, port)``; no resolution."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest(FIELD, "the URL is empty")
    # DEL (0x7f) too: httpx refuses a URL holding any ASCII control character, with an error
    # no delivery classifies, so such a URL was accepted and its every delivery raised
    if any(ch.isspace() or (ch.isascii() and not ch.isprintable()) for ch in url):
        raise InvalidRequest(FIELD, "the URL contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidRequest(FIELD, f"the URL is malformed ({exc})") from exc
    scheme = parts.scheme.lower()
    if scheme not in ALLOWED_SCHEMES:
        shown = scheme or "none"
        raise InvalidRequest(FIELD, f"the scheme must be http or https, not {shown}")
    host = parts.hostname
    if not host:
        raise InvalidRequest(FIELD, "the URL has no host")
    if port == 0:  # nothing listens there: each attempt failed to connect, retried for a day
        raise InvalidRequest(FIELD, "the port must be 1 to 65535, not 0")
    return scheme, host, port if port is not None else DEFAULT_PORTS[scheme]


def check_webhook_url(
    url: str, *, allow_private: bool, lookup: Lookup | None = None
) -> list[IPAddress]:
    """Refuse a webhook URL that is not http(s) or that resolves to a non-public address.

    Returns the addresses the host resolved to, so a sender can connect to one
    of exactly those (pinning them closes the DNS-rebinding window). Raises
    ``InvalidRequest("webhook_url", reason)``. ``allow_private`` (the
    ``SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS`` setting, for local tests only)
    lifts the address rule but never the scheme or host rules. ``lookup``: see :func:`resolve`
    (the sender's gives up at its delivery's cap).
    """
    _, host, port = split_webhook_url(url)
    addresses = resolve(host, port, lookup)
    if not allow_private:
        _refuse_non_public(host, addresses)
    return addresses


def _refuse_non_public(host: str, addresses: list[IPAddress]) -> None:
    """Raise the refusal of ``host`` if any of its ``addresses`` is not public. It names the
    setting that lifts the rule for a local receiver, never when a metadata address is among
    them, embedded or not: the setting would let the URL reach it."""
    refused = [(a, reason) for a in addresses if (reason := refusal_reason(a)) is not None]
    if not refused:
        return
    metadata = [(a, reason) for a, reason in refused if is_metadata(a)]
    reason = (metadata or refused)[0][1]
    message = f"the host {host!r} resolves to a non-public address: {reason}"
    if not metadata:
        message += (
            f"; for local development only, {ALLOW_PRIVATE_SETTING}=true on the "
            "gateway and the workers allows it"
        )
    raise InvalidRequest(FIELD, message)


def failed_for_now(error: BaseException | None) -> bool:
    """Whether a name lookup's ``error`` is the resolver giving up for now (``EAI_AGAIN``: its
    servers did not answer): nothing is known of the host yet, and a later lookup may find it
    (a host that does not exist is ``EAI_NONAME``)."""
    return isinstance(error, socket.gaierror) and error.errno == socket.EAI_AGAIN


class LookupsBusy(Exception):
    """No lookup thread is free for this tenant: the others wait on lookups the resolver has
    not answered. Refused at once, never queued behind them."""


class LookupThreads:
    """Threads for ``socket.getaddrinfo``, which takes no timeout, so that its caller waits
    only as long as it likes (``submit(...).result(timeout=...)``)::

        lookups = LookupThreads(32, "sift-webhook-dns")
        infos = lookups.submit("hooks.example.com", 443, "acme").result(timeout=5)

    A lookup holds its thread until the resolver answers, given up on or not. At most
    ``limit`` do, shared out among tenants by :class:`TenantSlots`' rule (a quarter kept for
    tenants with none in the resolver); a lookup the rule gives no thread is refused at once
    (:class:`LookupsBusy`). Queued, it waited behind lookups that may never end, and once a
    resolver that never answers held every thread, every tenant's lookup waited out its
    caller's whole time and was then reported as a lookup that took too long."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit = limit
        self._slots = TenantSlots(limit)
        self._pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix=name)

    def submit(
        self, host: str, port: int, tenant: str = "", **kwargs: Any
    ) -> Future[list[tuple[Any, ...]]]:
        """``socket.getaddrinfo(host, port, **kwargs)`` on a thread of its own, or
        :class:`LookupsBusy` at once when the rule leaves ``tenant`` none."""
        if not self._slots.acquire(tenant):
            raise LookupsBusy(
                f"dns: no name lookup thread free for this tenant ({self._slots.held()} of "
                f"{self.limit} wait on the resolver); not looked up"
            )

        def lookup() -> list[tuple[Any, ...]]:
            try:
                return socket.getaddrinfo(host, port, **kwargs)
            finally:
                self._slots.release(tenant)

        return self._pool.submit(lookup)

    def close(self) -> None:
        """Let the threads go once their lookups end; no lookup is taken after this."""
        self._pool.shutdown(wait=False, cancel_futures=True)

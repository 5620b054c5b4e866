"""The SSRF guard at registration: refuse webhook URLs that point into private networks.

It calls :func:`worker.urlguard.check_webhook_url` when that module exists and
falls back to a minimal local check until it lands (delete the fallback then).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from worker.errors import InvalidRequest

FIELD = "webhook_url"


def check_webhook_url(url: str, allow_private: bool) -> None:
    """Raise InvalidRequest("webhook_url", ...) unless ``url`` is a public http(s) URL."""
    try:
        from worker.urlguard import check_webhook_url as guard  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        _fallback(url, allow_private)
    else:
        guard(url, allow_private)


def _fallback(url: str, allow_private: bool) -> None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidRequest(FIELD, f"is not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise InvalidRequest(FIELD, "must be an http or https URL")
    if not parts.hostname:
        raise InvalidRequest(FIELD, "has no host")
    if parts.username or parts.password:
        raise InvalidRequest(FIELD, "must not carry credentials")
    if allow_private:
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, port or 443, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise InvalidRequest(FIELD, f"host {parts.hostname!r} does not resolve") from exc
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if not address.is_global or address.is_multicast:
            raise InvalidRequest(
                FIELD, f"resolves to a non-public address ({address}); refused")

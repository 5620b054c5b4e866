"""An attempt's deadline over its whole HTTP exchange: the host's lookup, the connection, the
request and every read of the answer's body.

The SDK's timeout (httpx's) bounds each socket operation alone, so a body that trickles in, a
piece now and then, kept an attempt of 1 s going for as long as the provider sent, and a name
lookup (which takes no timeout) as long as the resolver took. httpx has no total timeout
(encode/httpx#1450) and takes no network backend, so :func:`bound_by_deadline` gives the
connection pools of an SDK client a :class:`DeadlineBackend`: every operation's timeout is
cut to what is left of the attempt (:data:`attempt_deadline`, set by the caller around one
call), and a new connection looks its host up in a thread waited on no longer than that.

    http_client = anthropic.DefaultHttpxClient(limits=limits)
    bound_by_deadline(http_client)
    token = attempt_deadline.set(time.monotonic() + timeout_seconds)
    try:
        client.messages.with_raw_response.create(...)   # the body is read in here
    finally:
        attempt_deadline.reset(token)
"""

from __future__ import annotations

import contextvars
import ipaddress
import logging
import os
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import httpcore2

if TYPE_CHECKING:
    from collections.abc import Iterable

    from httpcore2._types import SOCKET_OPTION

logger = logging.getLogger(__name__)


# the monotonic instant by which the attempt this thread is making must be over (None
# outside an attempt: the connections then keep httpx's own timeouts alone)
attempt_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "sift_attempt_deadline", default=None
)


def _left(timeout: float | None, expired: type[httpcore2.TimeoutException]) -> float | None:
    """``timeout`` for one socket operation, cut to what is left of the attempt's deadline;
    ``expired`` (the operation's httpcore timeout, which the SDK maps to APITimeoutError)
    when nothing is left."""
    deadline = attempt_deadline.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the attempt's timeout ran out")
    return left if timeout is None else min(timeout, left)


class Unsent(httpcore2.ConnectTimeout):
    """The attempt's deadline was over before the first byte of its request was written: a
    ConnectTimeout, as the SDK's caller reads one (:func:`_never_connected
    <worker.adapters.anthropic._never_connected>`), since the provider saw nothing."""


class DeadlineStream(httpcore2.NetworkStream):
    """A connection whose every read and write waits at most until the attempt's deadline.

    A request's writes come before its answer's reads, so a write with no write since the
    last read is its first: one whose deadline is over raises :class:`Unsent`, not a
    WriteTimeout (a request that may have gone out), since the provider saw nothing of it: a
    kept-alive connection reached by a late thread with its deadline spent."""

    def __init__(self, inner: httpcore2.NetworkStream) -> None:
        self._inner = inner
        self._writing = False  # a byte of the current request written

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._writing = False
        return self._inner.read(max_bytes, _left(timeout, httpcore2.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        left = _left(timeout, httpcore2.WriteTimeout if self._writing else Unsent)
        self._writing = True
        self._inner.write(buffer, left)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore2.NetworkStream:
        timeout = _left(timeout, httpcore2.ConnectTimeout)
        return DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class DeadlineBackend(httpcore2.NetworkBackend):
    """httpcore's network backend, its connections made :class:`DeadlineStream`."""

    def __init__(self, inner: httpcore2.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SOCKET_OPTION] | None = None,
    ) -> httpcore2.NetworkStream:
        error: httpcore2.ConnectError | None = None
        for address in _addresses(host, port):  # each in turn, as socket.create_connection
            try:
                stream = self._inner.connect_tcp(
                    address,
                    port,
                    _left(timeout, httpcore2.ConnectTimeout),
                    local_address,
                    socket_options,
                )
            except httpcore2.ConnectError as exc:
                error = exc
                continue
            return DeadlineStream(stream)
        assert error is not None  # _addresses answers one at least
        raise error

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SOCKET_OPTION] | None = None,
    ) -> httpcore2.NetworkStream:
        timeout = _left(timeout, httpcore2.ConnectTimeout)
        return DeadlineStream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


# threads looking up the hosts of new connections at once; a hung lookup keeps its thread
RESOLVER_THREADS = 32


def _resolver_pool() -> ThreadPoolExecutor:
    """The threads that look up hosts for new connections: getaddrinfo takes no timeout, so
    an attempt waits for its answer here only as long as the attempt has left."""
    return ThreadPoolExecutor(max_workers=RESOLVER_THREADS, thread_name_prefix="sift-resolve")


_RESOLVER = _resolver_pool()


def _new_resolver() -> None:
    """A forked child gets a pool of its own: its parent's threads did not come along, and
    the copy of the parent's pool could believe it has idle ones and never start any."""
    global _RESOLVER
    _RESOLVER = _resolver_pool()


os.register_at_fork(after_in_child=_new_resolver)


def _addresses(host: str, port: int) -> list[str]:
    """``host``'s addresses, looked up within what is left of the attempt (an IP address is
    its own). A lookup that does not answer in time is a ConnectTimeout; one that fails, a
    ConnectError."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return [host]
    if attempt_deadline.get() is None:
        return [host]  # not an attempt: the connection looks it up itself
    wait = _left(None, httpcore2.ConnectTimeout)
    lookup = _RESOLVER.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        found = lookup.result(timeout=wait)
    except FutureTimeout:
        # still queued behind hung lookups: drop it, or it would run later for nobody and
        # hold up the lookups of the attempts still waiting
        lookup.cancel()
        raise httpcore2.ConnectTimeout(f"{host} did not resolve in the attempt's time") from None
    except OSError as exc:
        raise httpcore2.ConnectError(f"{host} did not resolve: {exc}") from exc
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    if not addresses:
        raise httpcore2.ConnectError(f"{host} resolved to no address")
    return addresses


def addresses_within(seconds: float, host: str, port: int = 443) -> list[str]:
    """``host``'s addresses as an attempt of ``seconds`` looks them up (for tests)."""
    token = attempt_deadline.set(time.monotonic() + seconds)
    try:
        return _addresses(host, port)
    finally:
        attempt_deadline.reset(token)


def bound_by_deadline(http_client: Any) -> None:
    """Give every connection pool of ``http_client`` (its transport, and a proxy's from the
    environment) the :class:`DeadlineBackend`. httpx takes no network backend, so this
    reaches into its transports (``_transport``, ``_mounts``, ``_pool``). Should a release
    of httpx change those, the attempts keep httpx's per-operation timeouts alone (as before
    the clamp) and an error is logged: the tests of the clamp fail then, but reranking
    still works."""
    transports = [getattr(http_client, "_transport", None)]
    transports += list(getattr(http_client, "_mounts", {}).values())
    for transport in transports:
        if transport is None:
            continue
        pool: Any = getattr(transport, "_pool", None)
        if not hasattr(pool, "_network_backend"):
            logger.error(
                "the model calls' connections of %s cannot be bounded by the attempt's "
                "deadline: a body that trickles in can outlast it",
                type(transport).__name__,
            )
            continue
        if not isinstance(pool._network_backend, DeadlineBackend):
            pool._network_backend = DeadlineBackend(pool._network_backend)

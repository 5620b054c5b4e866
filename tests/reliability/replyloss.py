"""A TCP proxy in front of redis-server that loses one reply: the command reached Redis and
ran, then the connection broke before its answer came back (a Redis restart or a network
blip in that instant).

redis-py answers a broken connection by sending the command again on a new one, so the
second run of a status change must answer what the first did. The proxy makes that instant
happen on demand: armed with some byte strings, the next command that carries all of them
goes through to Redis, and the reply to it is thrown away and both ends are closed. Every
other byte passes untouched, so a worker or a gateway can run its whole stack through it
(the broker's connections too).

    with ReplyLoss(redis_port) as proxy:
        env = stack_env(proxy.url + "/0", model.url)
        proxy.arm(b"\\r\\nsucceeded\\r\\n", SEARCH_KEY.encode())
        ...
        assert proxy.fired.wait(30)

Armed with ``outage=`` seconds, the proxy plays a Redis restart at that command instead:
the command never reaches Redis, every connection breaks, and new ones are refused for that
long. Armed with ``down_after=`` seconds, the command runs and its reply is lost, and then
Redis seems down that long (the restart came just after the command ran).

Armed with ``before=`` a function, the proxy calls it just before the marked command goes
up, and loses nothing: ``direct.flushdb`` plays a Redis that came back empty just before it.

``sent_again`` counts the commands carrying the markers that came after the lost reply: the
command sent again (redis-py's retry on a new connection), which a test asserts came, or it
proves nothing about the second run.

A reply that is a ``NOSCRIPT`` error (the script not yet loaded: nothing ran) passes, and
the proxy stays armed for the next command that carries the bytes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from tests.services import free_port


class ReplyLoss:
    """The proxy (see the module doc); ``fired`` is set once it has lost a reply."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.fired = threading.Event()
        self.lost = b""  # the command whose reply was lost (for a failure message)
        self.sent_again = 0  # commands carrying the markers since its reply was lost
        self._fired_markers: tuple[bytes, ...] = ()
        self._target = target_port
        self._markers: tuple[bytes, ...] | None = None
        self._outage = 0.0  # with the markers: how long Redis then seems down
        self._down_after = 0.0  # with the markers: how long Redis seems down after the reply
        self._down_until = 0.0  # time.monotonic() until which no connection is served
        self._before: Callable[[], object] | None = None  # with the markers: run, lose nothing
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._open: list[socket.socket] = []
        self._closed = False

    def arm(
        self,
        *markers: bytes,
        outage: float = 0.0,
        down_after: float = 0.0,
        before: Callable[[], object] | None = None,
    ) -> None:
        """Lose the reply to the next command carrying every one of ``markers``. With
        ``outage`` seconds, Redis goes down at that command instead: it is not sent, every
        connection is broken, and new ones are closed at once for that long (a restart).
        With ``down_after`` seconds, the command runs, its reply is lost, and then Redis is
        down so long. With ``before``, it is called just before the command is sent, and
        nothing is lost."""
        with self._lock:
            self._markers, self._outage, self._down_after = markers, outage, down_after
            self._before = before
            self.fired.clear()
            self.sent_again, self._fired_markers = 0, ()

    def __enter__(self) -> ReplyLoss:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            for sock in self._open:
                _close(sock)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if time.monotonic() < self._down_until:  # "down": refused
                _close(client)
                continue
            upstream = socket.create_connection(("127.0.0.1", self._target))
            for sock in (client, upstream):  # each relayed chunk goes at once, as Redis's do:
                # with Nagle's algorithm on, a chunk sent while the one before was not yet
                # acknowledged waited for the peer's delayed ACK (about 40 ms)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._open += [client, upstream]
            link = _Link(client, upstream)
            threading.Thread(target=self._up, args=(link,), daemon=True).start()
            threading.Thread(target=self._down, args=(link,), daemon=True).start()

    def _claim(self, seen: bytes) -> tuple[bytes, ...] | None:
        """The armed markers, disarmed, when ``seen`` carries them all."""
        with self._lock:
            markers = self._markers
            if markers is None or not all(m in seen for m in markers):
                return None
            self._markers = None
            return markers

    def _up(self, link: _Link) -> None:
        """Client to Redis: every byte, noting a marked command before it goes up (so its
        reply cannot come back first)."""
        try:
            while data := link.client.recv(65536):
                if self._fired_markers and all(m in data for m in self._fired_markers):
                    self.sent_again += 1
                # a script call's keys and first arguments come in its first read
                markers = self._claim(data)
                if markers is not None and self._outage > 0:
                    self._go_down(data)
                    return
                if markers is not None and self._before is not None:
                    self._before()
                    self.fired.set()
                    markers = None
                if markers is not None:
                    link.doomed, self.lost = markers, data
                link.upstream.sendall(data)
        except OSError:
            pass
        link.close()

    def _go_down(self, data: bytes, seconds: float | None = None) -> None:
        """Redis "restarts" at ``data`` (not sent, unless ``seconds`` says how long it is
        down after it ran): every connection breaks."""
        with self._lock:
            self._down_until = time.monotonic() + (self._outage if seconds is None else seconds)
            self.lost = data
            opened, self._open = self._open, []
        self.fired.set()
        for sock in opened:
            _close(sock)

    def _down(self, link: _Link) -> None:
        """Redis to client: every byte, until the reply to a marked command, which is lost."""
        try:
            while data := link.upstream.recv(65536):
                markers = link.doomed
                if markers is not None:
                    link.doomed = None
                    if b"NOSCRIPT" in data:  # nothing ran: pass it on, stay armed
                        self.arm(*markers, down_after=self._down_after)
                    else:
                        if self._down_after > 0:
                            self._go_down(self.lost, self._down_after)
                        self._fired_markers = markers
                        self.fired.set()
                        break  # the reply is lost with the connection
                link.client.sendall(data)
        except OSError:
            pass
        link.close()


@dataclass
class _Link:
    """One client connection and its own connection to Redis."""

    client: socket.socket
    upstream: socket.socket
    doomed: tuple[bytes, ...] | None = None  # the markers of a command whose reply is lost

    def close(self) -> None:
        _close(self.client)
        _close(self.upstream)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()

"""Webhook receivers on loopback that answer slowly, as plain sockets (no HTTP library's
timeouts in the way): one drips its status line and headers a byte at a time, one answers
nothing until the test lets it, and one never answers a TLS client's hello."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# What the trickling receiver drips: a status line, then a header that never ends.
TRICKLE = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000


class _LoopbackServer:
    """A listening socket on loopback, each connection served by :meth:`_serve` on its own
    thread; ``close`` shuts the listener and every connection."""

    scheme = "http"

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._server.getsockname()[1]}/hook"

    def close(self) -> None:
        self._server.close()
        for conn in self._conns:
            conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError


class SlowReceiver(_LoopbackServer):
    """Reads each request whole, then either drips :data:`TRICKLE` a byte every ``drip``
    seconds (``drip`` > 0; it stops by itself after ``max_bytes`` bytes and closes), or, with
    ``drip`` 0, holds the request unanswered until :attr:`release` is set, then answers 204.

    ``cut`` is set when the client shut a connection while it dripped; ``ran_out`` when it
    dripped ``max_bytes`` without that. ``held`` counts requests read and not yet answered."""

    def __init__(self, drip: float = 0.0, max_bytes: int = 200) -> None:
        self.drip = drip
        self.max_bytes = max_bytes
        self.release = threading.Event()
        self.cut = threading.Event()
        self.ran_out = threading.Event()
        self.held = 0
        self.requests = 0
        self._lock = threading.Lock()
        super().__init__()

    def close(self) -> None:
        self.release.set()
        super().close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            _read_request(conn)
        except OSError:
            return
        with self._lock:
            self.requests += 1
            self.held += 1
        try:
            if self.drip > 0:
                self._trickle(conn)
            else:
                self.release.wait(60)  # a hang guard
                conn.sendall(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")
        except OSError:
            pass
        finally:
            with self._lock:
                self.held -= 1
            conn.close()

    def _trickle(self, conn: socket.socket) -> None:
        for byte in TRICKLE[: self.max_bytes]:
            try:
                conn.sendall(bytes([byte]))
            except OSError:  # the client shut its connection
                self.cut.set()
                return
            if self.release.wait(self.drip):
                return
        self.ran_out.set()


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the headers ended")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the body ended")
        body += chunk


@contextmanager
def slow_receiver(drip: float = 0.0, max_bytes: int = 200) -> Iterator[SlowReceiver]:
    receiver = SlowReceiver(drip, max_bytes)
    try:
        yield receiver
    finally:
        receiver.close()


class SilentHandshake(_LoopbackServer):
    """Accepts connections and never answers a thing, so a TLS client's handshake waits on
    it; ``closed`` is set once a client closed its connection (read to its end)."""

    scheme = "https"

    def __init__(self) -> None:
        self.closed = threading.Event()
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while conn.recv(65536):  # the client's hello, then nothing until it closes
                pass
        except OSError:
            return
        self.closed.set()


@contextmanager
def silent_handshake() -> Iterator[SilentHandshake]:
    receiver = SilentHandshake()
    try:
        yield receiver
    finally:
        receiver.close()

"""The security suite's stack and a recording webhook receiver.

The stack is the e2e stack (tests/e2e/conftest.py), started once for this directory with
every process at ``SIFT_LOG_LEVEL=DEBUG`` (so the log test reads the most verbose logs the
processes write, after everything the other modules sent through them), with globex in
the middle of a webhook secret rotation (``webhook_secret_previous`` set), and with five
more tenants whose names hold separators (``sep``, ``sep.x``, ``sep_x``, ``sep-x``,
``sep--x``: test_shared_names.py).
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.e2e.conftest import KEYS, Stack, start_stack

GLOBEX_PREVIOUS_SECRET = "whsec_b2xkLWdsb2JleC1zZWNyZXQtOTg3NjU0MzIxMA=="
# Tenants whose names, joined to an index name by a separator they hold, spell another
# tenant's (test_shared_names.py): "sep" + "." + "x.i" is "sep.x" + "." + "i".
SEPARATORS = (".", "_", "-", "--")
SEPARATOR_TENANTS = ("sep", *(f"sep{s}x" for s in SEPARATORS))
SECURITY_KEYS = [
    KEYS[0],
    {**KEYS[1], "webhook_secret_previous": GLOBEX_PREVIOUS_SECRET},
    *(
        {
            "key": f"separator-tenant-key-{n}-7f3a9c",
            "tenant": tenant,
            "webhook_secret": "whsec_"
            + base64.b64encode(f"sep-secret-{n}-e41b7d".encode()).decode(),
        }
        for n, tenant in enumerate(SEPARATOR_TENANTS)
    ),
]


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("security-stack")
    with start_stack(tmp, log_level="DEBUG", keys=SECURITY_KEYS) as running:
        yield running


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 that counts every TCP connection it accepts, records every
    request, and answers ``status`` (with ``headers``)."""

    server: ThreadingHTTPServer
    connections: int = 0
    requests: list[Request] = field(default_factory=list)
    status: int = 204
    headers: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"


def start_receiver() -> Receiver:
    """A started :class:`Receiver`; stop it with :func:`stop_receiver`."""
    box: dict[str, Receiver] = {}

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def verify_request(self, request: Any, client_address: Any) -> bool:
            with box["r"].lock:
                box["r"].connections += 1
            return True

    class Handler(BaseHTTPRequestHandler):
        def _record(self) -> None:
            me = box["r"]
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            with me.lock:
                me.requests.append(Request(self.command, self.path, headers, body))
            self.send_response(me.status)
            for name, value in me.headers.items():
                self.send_header(name, value)
            self.send_header("content-length", "0")
            self.end_headers()

        do_POST = do_GET = do_PUT = _record

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = Server(("127.0.0.1", 0), Handler)
    box["r"] = Receiver(server)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    box["r"].thread = thread
    return box["r"]


def stop_receiver(receiver: Receiver) -> None:
    receiver.server.shutdown()
    receiver.server.server_close()
    if receiver.thread is not None:
        receiver.thread.join(timeout=5)


@pytest.fixture
def wait_for() -> Callable[..., None]:
    """``wait_for(check, what)``: poll ``check`` until it is true; fail after ``timeout``."""

    def wait(check: Callable[[], object], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not seen within {timeout} s")
            time.sleep(0.02)

    return wait


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    started = start_receiver()
    try:
        yield started
    finally:
        stop_receiver(started)

"""Ctrl-C (SIGINT) while ``sift ingest`` or ``sift batch`` still reads its input file, run as a
user runs it (its own process): it says it was interrupted and that nothing was sent, and
exits 130, having sent nothing.

Before, it exited 130 with nothing said (typer's handling of KeyboardInterrupt): the user
could not tell an interrupt from a crash, nor whether any document or batch had gone.
The input is a FIFO the test holds open, so the command is reading it when the signal comes.
The "gateway" answers only ``sift ingest``'s check of it, made before the file is read.
"""

from __future__ import annotations

import errno
import http.server
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services import served


class _Gateway(http.server.ThreadingHTTPServer):
    """Answers ``GET /v1/ingestions`` (``sift ingest``'s check) and keeps every request."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.heard: list[tuple[str, str]] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Gateway

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        self.server.heard.append((self.command, self.path.split("?")[0]))
        ok = self.command == "GET" and self.path.startswith("/v1/ingestions?")
        body = b'{"ingestions": [], "next_page_token": null}' if ok else b"{}"
        self.send_response(200 if ok else 500)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


def _restore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background job's child inherits it ignored


def _open_writer(fifo: Path, proc: subprocess.Popen[str], seconds: float = 60) -> int:
    """The FIFO's write end, once the command has opened it to read."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO:
                raise
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the command never opened its input"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("command", "line", "said"),
    [
        (["ingest"], {"_id": "d1", "title": "t", "text": "pangolins"}, "nothing was sent"),
        (
            ["batch", "--out", "{tmp}/results.jsonl"],
            {"_id": "q1", "text": "pangolins"},
            "nothing was sent, no batch made",
        ),
    ],
)
def test_ctrl_c_while_reading_the_input_says_nothing_was_sent(
    tmp_path: Path, command: list[str], line: dict[str, str], said: str
) -> None:
    fifo = tmp_path / "input.jsonl"
    os.mkfifo(fifo)
    with served(_Gateway()) as gateway:  # must hear no more than ingest's check
        port = gateway.server_address[1]
        env = {
            "SIFT_URL": f"http://127.0.0.1:{port}",
            "SIFT_API_KEY": "acme-key-0001",
            "COLUMNS": "200",
            "HOME": os.environ.get("HOME", "/tmp"),
        }
        args = [a.replace("{tmp}", str(tmp_path)) for a in command[1:]]
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", command[0], str(fifo), "--index", "i", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_restore_sigint,
        )
        writer = _open_writer(fifo, proc)
        try:
            os.write(writer, (json.dumps(line) + "\n").encode())  # the rest of the file "to come"
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            os.close(writer)
    checked = [("GET", "/v1/ingestions")] if command[0] == "ingest" else []
    assert gateway.heard == checked, gateway.heard  # nothing sent
    err = " ".join(err.split())
    assert proc.returncode == 130, (out, err)
    assert f"interrupted while reading {fifo}: {said}" in err, (out, err)

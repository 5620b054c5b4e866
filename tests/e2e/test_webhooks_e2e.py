"""A signed webhook reaches a local receiver and verifies with the standardwebhooks library."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from standardwebhooks.webhooks import Webhook

from tests.e2e.conftest import ACME, INDEX, KEYS, Stack

Received = tuple[bytes, dict[str, str]]


@pytest.fixture
def receiver() -> Iterator[tuple[str, queue.Queue[Received]]]:
    inbox: queue.Queue[Received] = queue.Queue()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            inbox.put((body, {k.lower(): v for k, v in self.headers.items()}))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", inbox
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_search_and_batch_webhooks_are_signed(
    stack: Stack, corpus: object, receiver: tuple[str, queue.Queue[Received]]
) -> None:
    url, inbox = receiver
    search = stack.live.post(
        "/v1/searches", json={"index": INDEX, "query": "tea", "webhook_url": url}, headers=ACME
    ).json()
    batch = stack.live.post(
        "/v1/batches",
        json={
            "index": INDEX,
            "webhook_url": url,
            "queries": [{"id": str(i), "query": "bees"} for i in range(30)],
        },
        headers=ACME,
    ).json()
    verifier = Webhook(KEYS[0]["webhook_secret"])
    seen = {}
    for _ in range(2):
        body, headers = inbox.get(timeout=30)
        payload = verifier.verify(body, headers)
        assert headers["webhook-id"] == f"msg_{payload['data']['id']}"
        seen[payload["type"]] = payload
    assert seen["search.completed"]["data"] == {"id": search["id"], "status": "succeeded"}
    assert seen["batch.completed"]["data"] == {"id": batch["id"], "status": "succeeded"}
    assert set(json.loads(body)) == {"type", "timestamp", "data"}
    with pytest.raises(queue.Empty):  # each event once: no copy in another queue
        inbox.get(timeout=1.0)

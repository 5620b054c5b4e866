"""A gateway told to stop at once (a second Ctrl-C or SIGTERM during its graceful stop, which
uvicorn answers by cancelling the requests it still serves) while a request is in flight.

``sift gateway`` on a real redis-server, no worker: a search sent with ``?wait=30`` is made
(queued in Redis) and then held by its wait. A SIGTERM starts the graceful stop, which waits
for that request; a SIGINT then forces it. uvicorn's own answer, a plain-text ``500``
``Internal Server Error``, is not the gateway's error body and says the request failed in
the server, where the search was made and runs once a worker comes (a client sending it
again without a key makes a second). The client is answered the ``503`` ``unavailable``
every other answer of unknown outcome gets, in the error body, with ``Retry-After``.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
import pytest
import redis

from tests.reliability.support import ACME, INDEX, KEYS, wait_for
from tests.services import redis_server
from worker.constants import ERROR_UNAVAILABLE, SEARCH_KEY
from worker.processes.stack import child_env, gateway_service, running

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_a_request_cut_by_a_forced_stop_is_a_503_of_unknown_outcome(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as url:
        env = child_env({"SIFT_REDIS_URL": url + "/0", "SIFT_API_KEYS": json.dumps(KEYS)},
                        inherit_sift=False)  # fmt: skip
        service, base = gateway_service(tmp_path / "g", env)
        assert service.log is not None
        log = service.log
        with running(service):
            proc = service.proc
            assert proc is not None
            answers: list[httpx.Response] = []
            sent = threading.Thread(
                target=lambda: answers.append(
                    httpx.post(
                        f"{base}/v1/searches",
                        params={"wait": 30},
                        headers=ACME,
                        json={"index": INDEX, "query": "green tea"},
                        timeout=60,
                    )
                )
            )
            sent.start()
            store = redis.Redis.from_url(url + "/0")
            wait_for(lambda: bool(store.keys(SEARCH_KEY + "*")), "the search made, in its wait")
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "Waiting for connections to close" in log.read_text(),
                     "the graceful stop, waiting for the request")  # fmt: skip
            proc.send_signal(signal.SIGINT)
            sent.join(60)
            proc.wait(30)
        (answer,) = answers
        assert answer.status_code == 503, (answer.status_code, answer.text)
        assert answer.json()["error"]["type"] == ERROR_UNAVAILABLE
        assert "unknown" in answer.json()["error"]["message"]
        assert answer.headers["retry-after"] == "1"

"""An index read or settings change no worker answers: a ``503`` saying which it was.

Through the gateway app on a real Redis with no worker, its waits cut to a fraction of a
second (10 s, and 3 s more for a change, by default). A settings change was answered "no
worker answered the index read within 10 s" after 13 s.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from api_gateway import indexes
from api_gateway.app import create_app
from worker.constants import INDEX_READ_TASK, SEARCH_QUEUE
from worker.queue.jobstore import JobStore
from worker.settings import ApiKey, Settings

KEY = "key-acme-0123456789"
ACME = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def client(
    redis_url: str, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TestClient]:
    monkeypatch.setattr(indexes, "INDEX_READ_TIMEOUT_SECONDS", 0.2)
    monkeypatch.setattr(indexes, "INDEX_CHANGE_GRACE_SECONDS", 0.3)
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LKLYYb"
    key = ApiKey(key=KEY, tenant="acme", webhook_secret=secret)
    settings = Settings(redis_url=redis_url, api_keys=[key])
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize(
    ("method", "body", "said"),
    [
        ("GET", None, "no worker answered the index read within 0.2 s; retry"),
        (
            "PATCH",
            {"candidate_limit": 40},
            "no worker answered the index settings change within 0.5 s (none started by"
            " 0.2 s makes it); retry",
        ),
    ],
)
def test_an_unanswered_index_request_says_which_it_was(
    client: TestClient, method: str, body: dict[str, int] | None, said: str
) -> None:
    answer = client.request(method, "/v1/indexes/docs", json=body, headers=ACME)
    assert answer.status_code == 503, answer.text
    assert answer.json() == {"error": {"type": "backend_unavailable", "message": said}}
    assert answer.headers["Retry-After"] == "1"  # as the job store's own 503 says when


def _redis_seconds(store: JobStore) -> float:
    seconds, micros = store.redis.time()
    return float(seconds) + micros / 1_000_000


@pytest.mark.parametrize("skew", [-100.0, 100.0])
def test_a_change_s_start_by_is_on_redis_s_clock_not_the_gateway_s(
    client: TestClient, store: JobStore, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    """A change's ``start_by`` is compared with a worker's clock, on another host: set from
    the gateway's own (``time.time()``), a gateway a few seconds ahead of the worker had a
    change applied after its 503 said none was made, and one behind had every change
    dropped. It is Redis's clock (``TIME``), which the worker reads too: the same whatever
    the gateway's clock says (here shifted by ``skew`` seconds)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew)
    before = _redis_seconds(store)
    answer = client.patch("/v1/indexes/docs", json={"candidate_limit": 40}, headers=ACME)
    after = _redis_seconds(store)
    assert answer.status_code == 503, answer.text  # no worker: the message waits in the queue
    (raw,) = store.redis.lrange(SEARCH_QUEUE, 0, -1)
    message = json.loads(raw)
    assert message["headers"]["task"] == INDEX_READ_TASK
    args = json.loads(base64.b64decode(message["body"]))[0]
    start_by = args[-1]
    wait = indexes.INDEX_READ_TIMEOUT_SECONDS
    assert before + wait <= start_by <= after + wait, (before, start_by, after)

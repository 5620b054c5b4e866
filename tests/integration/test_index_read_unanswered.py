"""An index read or settings change no worker answers: a ``503`` saying which it was.

Through the gateway app on a real Redis with no worker, its waits cut to a fraction of a
second (10 s, and 3 s more for a change, by default). A settings change was answered "no
worker answered the index read within 10 s" after 13 s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from api_gateway import indexes
from api_gateway.app import create_app
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

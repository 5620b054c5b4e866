"""Fixtures the integration modules share: a real redis-server per module, a clean store, the
gateway app on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from api_gateway.app import create_app
from tests.integration.gateway_app import gateway_settings
from tests.services import redis_server
from worker.queue.jobstore import JobStore


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of the module's own; its database 0."""
    with redis_server(Path(tmp_path_factory.mktemp("redis"))) as url:
        yield url + "/0"


@pytest.fixture
def store(redis_url: str) -> Iterator[JobStore]:
    """A job store on an emptied database."""
    store = JobStore.from_url(redis_url)
    store.redis.flushdb()
    yield store
    store.close()


@pytest.fixture
def client(redis_url: str, store: JobStore) -> Iterator[TestClient]:
    """The gateway app on the emptied database ``store`` gives (acme's key:
    :mod:`tests.integration.gateway_app`)."""
    with TestClient(create_app(gateway_settings(redis_url))) as client:
        yield client


@pytest.fixture
def round_trips(store: JobStore) -> list[int]:
    """How many script calls each of the store's transition round trips carried, as sent."""
    sent: list[int] = []
    evalsha_all = store._evalsha_all

    def counting(calls: list[Any]) -> list[Any]:
        sent.append(len(calls))
        return evalsha_all(calls)

    store._evalsha_all = counting  # type: ignore[method-assign]
    return sent

"""The Elasticsearch adapter against a stateful ES stand-in (:mod:`tests.integration.es_stateful`):
the shared lifecycle contract, and the races and name clashes of the per-tenant layout, asserted
by what a tenant reads afterwards, not by the requests sent."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from elasticsearch import ApiError, Elasticsearch

from tests.integration.backend_contract import LifecycleContract
from tests.integration.es_loopback import FakeElasticsearchServer, running
from tests.integration.es_stateful import StatefulElasticsearch, stateful_server
from worker.adapters.elasticsearch import ElasticsearchBackend
from worker.settings import load_settings

pytestmark = pytest.mark.integration


@pytest.fixture
def fake() -> Iterator[tuple[FakeElasticsearchServer, StatefulElasticsearch]]:
    server, state = stateful_server()
    for started in running(server):
        yield started, state


def backend_on(server: FakeElasticsearchServer, **settings: Any) -> ElasticsearchBackend:
    """A worker process's backend (each call: another process, with its own memo)."""
    return ElasticsearchBackend.from_settings(
        load_settings(
            search_backend="elasticsearch",
            elasticsearch_url=server.url,
            elasticsearch_vector_dims=64,
            **settings,
        )
    )


class TestStatefulElasticsearchContract(LifecycleContract):
    @pytest.fixture
    def index(self) -> str:
        return "contract"

    @pytest.fixture
    def backend(
        self, fake: tuple[FakeElasticsearchServer, StatefulElasticsearch]
    ) -> ElasticsearchBackend:
        return backend_on(fake[0])


# --- the stand-in answers as ES does --------------------------------------------------------


def client(server: FakeElasticsearchServer) -> Elasticsearch:
    return Elasticsearch(server.url, max_retries=0)


def error_of(call: Any) -> tuple[int, str]:
    with pytest.raises(ApiError) as caught:
        call()
    return caught.value.meta.status, caught.value.body["error"]["type"]


def test_the_stand_in_refuses_as_es_does(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    es = client(fake[0])
    es.indices.create(index="a~1", aliases={"a": {}})
    assert error_of(lambda: es.indices.create(index="a~1")) == (
        400,
        "resource_already_exists_exception",
    )
    assert error_of(lambda: es.indices.create(index="a")) == (400, "invalid_index_name_exception")
    assert error_of(lambda: es.indices.delete(index="a")) == (400, "illegal_argument_exception")
    assert es.options(ignore_status=404).indices.get_alias(name="b*").body == {}
    missing = es.options(ignore_status=404).indices.get_alias(name="b")
    assert missing.meta.status == 404 and missing.body["error"] == "alias [b] missing"
    assert es.indices.get_alias(name="a").body == {"a~1": {"aliases": {"a": {}}}}
    es.index(index="a", id="x", document={"n": 1}, version=5, version_type="external")
    assert error_of(
        lambda: es.index(index="a", id="x", document={}, version=5, version_type="external")
    ) == (409, "version_conflict_engine_exception")
    answer = es.bulk(
        operations=[{"index": {"_index": "a~1", "_id": "y"}}, {"n": 2}], require_alias=True
    ).body
    item = answer["items"][0]["index"]
    assert answer["errors"] and item["status"] == 404
    assert item["error"]["type"] == "index_not_found_exception"
    assert item["error"]["reason"].endswith("[a~1] is not an alias")
    assert es.get(index="a", id="x").body["_version"] == 5

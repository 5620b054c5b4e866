"""The shared backend contract against a real Elasticsearch 9 cluster.

Runs only when ``SIFT_TEST_ELASTICSEARCH_URL`` is set, for instance with ``deploy/``'s
cluster: ``SIFT_TEST_ELASTICSEARCH_URL=http://elastic:$ELASTIC_PASSWORD@localhost:9200``.
Each test writes to a fresh index and deletes it afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from tests.fakes import FakeEmbedder
from tests.integration.backend_contract import LifecycleContract
from worker.adapters.elasticsearch import ElasticsearchBackend
from worker.settings import load_settings

pytestmark = pytest.mark.integration

URL = os.environ.get("SIFT_TEST_ELASTICSEARCH_URL")


@pytest.fixture
def index() -> str:
    return f"contract-{uuid.uuid4().hex[:10]}"


@pytest.mark.skipif(
    not URL,
    reason="no live cluster: set SIFT_TEST_ELASTICSEARCH_URL (deploy/README.md shows how)",
)
class TestElasticsearchContract(LifecycleContract):
    @pytest.fixture
    def backend(self, index: str) -> Iterator[ElasticsearchBackend]:
        settings = load_settings(
            search_backend="elasticsearch",
            elasticsearch_url=URL,
            elasticsearch_index_prefix="sifttest-",
            elasticsearch_vector_dims=FakeEmbedder.dimension,
            elasticsearch_replicas=0,
            elasticsearch_refresh="wait_for",
        )
        backend = ElasticsearchBackend.from_settings(settings)
        yield backend
        backend._client.options(ignore_status=404).indices.delete(
            index=f"{backend.alias(index)}-*", expand_wildcards="all"
        )

"""The shared backend contract against a real Elasticsearch 9 cluster.

Runs only when ``SIFT_TEST_ELASTICSEARCH_URL`` is set, for instance with ``deploy/``'s
cluster: ``SIFT_TEST_ELASTICSEARCH_URL=http://elastic:$ELASTIC_PASSWORD@localhost:9200``.
Each test writes to a fresh index name and deletes every tenant's index of it afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fakes import FakeEmbedder
from tests.integration.backend_contract import LifecycleContract
from tests.integration.test_elasticsearch_stateful import (
    documents_under_their_own_ids_read_as_searched,
    finished_items_keep_what_the_search_finds,
    metadata_another_tool_wrote_shows_as_held,
    writes_by_id_replace_what_another_tool_wrote,
)
from tests.services import purge, purged
from worker.adapters.elasticsearch import ElasticsearchBackend
from worker.core.types import ChannelQuery, Document, HardFilters
from worker.settings import load_settings

pytestmark = pytest.mark.integration

URL = os.environ.get("SIFT_TEST_ELASTICSEARCH_URL")
PREFIX = "sifttest-"


@pytest.fixture
def index() -> str:
    return f"contract-{uuid.uuid4().hex[:10]}"


def live_backend(**settings: Any) -> ElasticsearchBackend:
    loaded = load_settings(
        search_backend="elasticsearch",
        elasticsearch_url=URL,
        elasticsearch_index_prefix=PREFIX,
        elasticsearch_vector_dims=FakeEmbedder.dimension,
        elasticsearch_replicas=0,
        elasticsearch_refresh="wait_for",
        **settings,
    )
    return ElasticsearchBackend.from_settings(loaded)


def delete_every_tenants(backend: ElasticsearchBackend, index: str) -> None:
    """Every tenant's concrete indexes of ``index`` (and of names it begins), by name: ES
    refuses a wildcard delete (``action.destructive_requires_name``)."""
    es = backend._client
    found = es.indices.get(index=f"{PREFIX}*--{index}*", expand_wildcards="all").body
    if found:
        es.options(ignore_status=404).indices.delete(index=",".join(found))


def on_the_cluster(check: Callable[[ElasticsearchBackend, str], None], index: str) -> None:
    """``check`` (a test shared with the stand-in's suite) on a live backend, every tenant's
    indexes of ``index`` deleted after it."""
    backend = live_backend()
    try:
        check(backend, index)
    finally:
        delete_every_tenants(backend, index)


skip_without_a_cluster = pytest.mark.skipif(
    not URL,
    reason="no live cluster: set SIFT_TEST_ELASTICSEARCH_URL (deploy/README.md shows how)",
)


@skip_without_a_cluster
class TestElasticsearchContract(LifecycleContract):
    @pytest.fixture
    def backend(self, index: str) -> Iterator[ElasticsearchBackend]:
        backend = live_backend()
        yield backend
        delete_every_tenants(backend, index)

    @pytest.fixture
    def another(self) -> ElasticsearchBackend:
        return live_backend()


def bm25_hits(backend: ElasticsearchBackend, index: str, tenant: str) -> list[tuple[str, float]]:
    query = ChannelQuery(index, HardFilters(tenant), ("bm25",), 10, "alpha beta", None, 10.0)
    return [(hit.document.id, hit.score) for hit in backend.retrieve(query).hits["bm25"]]


@skip_without_a_cluster
def test_another_tenants_documents_change_neither_bm25_scores_nor_ranking(index: str) -> None:
    """BM25's statistics (IDF, average length) are the tenant's own index's: another tenant
    writing the query's terms into the same Sift name leaves the caller's scores exactly as
    they were (in one shared index, 60 more documents with "alpha" lower its IDF)."""
    backend = live_backend()
    try:
        mine = [Document("x", "alpha alpha gamma"), Document("y", "beta delta epsilon")]
        mine += [Document(f"f{i}", f"filler words number {i}") for i in range(6)]
        backend.upsert(index, "acme", mine, None)
        before = bm25_hits(backend, index, "acme")
        assert [doc_id for doc_id, _ in before] == ["x", "y"]  # two alphas beat one beta

        theirs = [Document(f"t{i}", f"alpha {'padding ' * (i % 7)}") for i in range(60)]
        backend.upsert(index, "globex", theirs, None)
        assert bm25_hits(backend, index, "acme") == before
        assert len(bm25_hits(backend, index, "globex")) == 10
        assert backend.alias(index, "acme") != backend.alias(index, "globex")
        assert [i.name for i in backend.indexes("acme") if i.name == index] == [index]
        # globex's drop deletes its physical index; acme's scores still stand
        assert backend.delete_index(index, "globex") == len(theirs)
        assert not backend._client.indices.exists_alias(name=backend.alias(index, "globex"))
        assert bm25_hits(backend, index, "acme") == before
    finally:
        delete_every_tenants(backend, index)


@skip_without_a_cluster
def test_the_analyzer_setting_maps_the_indexes_made_after_it(index: str) -> None:
    """SIFT_ELASTICSEARCH_ANALYZER goes into the template: an index made with ``french``
    maps both text fields with it, and BM25 matches as it analyzes (its elision filter makes
    ``l'église`` the word ``église``, which ``english`` keeps whole); an index made before,
    at the default, keeps ``english``, and so does its next write from the french setting."""
    english = live_backend()
    french = live_backend(elasticsearch_analyzer="french")
    try:
        doc = [Document("x", "l'église du village", title="Une visite")]
        english.upsert(index, "acme", doc, None)
        french.upsert(index, "globex", doc, None)
        french.upsert(index, "acme", [Document("y", "l'église", title="")], None)
        for backend, tenant, analyzer in (
            (english, "acme", "english"),
            (french, "globex", "french"),
        ):
            found = backend._client.indices.get_mapping(index=backend.alias(index, tenant)).body
            (mapping,) = found.values()
            properties = mapping["mappings"]["properties"]
            assert properties["text"]["analyzer"] == analyzer
            assert properties["title"]["analyzer"] == analyzer
        query = ChannelQuery(index, HardFilters("globex"), ("bm25",), 10, "église", None, 10.0)
        assert [hit.document.id for hit in french.retrieve(query).hits["bm25"]] == ["x"]
    finally:
        delete_every_tenants(english, index)


@skip_without_a_cluster
def test_a_purge_deletes_the_tenants_index_and_only_its_documents_from_a_shared_one(
    index: str, redis_url: str
) -> None:
    """``sift tenant purge acme`` on the cluster: acme's own index of ``index`` is deleted
    whole, and so is ``<index>-faq``, whose documents acme deleted by id (not listed, still
    an index); from ``<index>-shared``, an alias of acme's an operator pointed at globex's
    index, only acme's documents go (``_delete_by_query``), globex's index and documents
    stay; acme lists no index after it, no index of acme's key is left, and a second run
    drops nothing."""
    backend = live_backend()
    es = backend._client
    shared, emptied = f"{index}-shared", f"{index}-faq"
    try:
        mine = [Document(f"a{i}", f"alpha {i}") for i in range(3)]
        theirs = [Document(f"g{i}", f"gamma {i}") for i in range(4)]
        backend.upsert(index, "acme", mine, None)
        backend.upsert(index, "globex", theirs, None)
        (globex_index,) = es.indices.get_alias(name=backend.alias(index, "globex")).body
        pointed = {"add": {"index": globex_index, "alias": backend.alias(shared, "acme")}}
        es.indices.update_aliases(actions=[pointed])
        backend.upsert(shared, "acme", mine[:2], None)
        backend.upsert(emptied, "acme", mine[:1], None)
        assert backend.delete_documents(emptied, "acme", ["a0"]) == 1
        assert [(i.name, i.documents) for i in backend.indexes("acme")] == [
            (index, 3),
            (shared, 2),
        ]
        env = {
            "SIFT_REDIS_URL": redis_url,
            "SIFT_SEARCH_BACKEND": "elasticsearch",
            "SIFT_ELASTICSEARCH_URL": str(URL),
            "SIFT_ELASTICSEARCH_INDEX_PREFIX": PREFIX,
            "SIFT_ELASTICSEARCH_VECTOR_DIMS": str(FakeEmbedder.dimension),
            "SIFT_ELASTICSEARCH_REPLICAS": "0",
        }
        ran = purge(env, "acme")
        assert ran.returncode == 0, ran.stdout + ran.stderr
        removed = purged(ran.stdout)
        assert (removed["indexes dropped"], removed["documents dropped"]) == (3, 5), ran.stdout

        assert backend.indexes("acme") == []
        stem = backend.tenant_stem("acme")  # the pattern finds globex's by acme's alias too
        left = es.indices.get(index=f"{stem}*", expand_wildcards="all").body
        assert [name for name in left if name.startswith(stem)] == []
        assert not es.indices.exists_alias(name=backend.alias(index, "acme"))
        assert not es.indices.exists_alias(name=backend.alias(emptied, "acme"))
        assert es.indices.exists(index=globex_index)
        assert backend.index_info(index, "globex").documents == len(theirs)
        es.indices.refresh(index=globex_index)
        assert es.count(index=globex_index).body["count"] == len(theirs)
        again = purge(env, "acme")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "tenant 'acme': nothing of it was found" in again.stdout, again.stdout
    finally:
        delete_every_tenants(backend, index)


@skip_without_a_cluster
def test_an_economy_item_keeps_a_document_without_tokens_its_search_finds(index: str) -> None:
    """:func:`finished_items_keep_what_the_search_finds` on the cluster: its ``flattened``
    field and its typed tokens, not the stand-in's."""
    on_the_cluster(finished_items_keep_what_the_search_finds, index)


@skip_without_a_cluster
def test_a_document_another_tool_wrote_under_its_own_id_reads_as_it_is_searched(
    index: str,
) -> None:
    """:func:`documents_under_their_own_ids_read_as_searched` on the cluster."""
    on_the_cluster(documents_under_their_own_ids_read_as_searched, index)


@skip_without_a_cluster
def test_metadata_another_tool_wrote_shows_as_held_in_hits_reads_and_listings(
    index: str,
) -> None:
    """:func:`metadata_another_tool_wrote_shows_as_held` on the cluster: its ``flattened``
    field, not the stand-in's."""
    on_the_cluster(metadata_another_tool_wrote_shows_as_held, index)


@skip_without_a_cluster
def test_writes_by_id_replace_and_take_down_what_another_tool_wrote_under_its_own_id(
    index: str,
) -> None:
    """:func:`writes_by_id_replace_what_another_tool_wrote` on the cluster."""
    on_the_cluster(writes_by_id_replace_what_another_tool_wrote, index)

"""The Elasticsearch adapter against a stateful ES stand-in (:mod:`tests.integration.es_stateful`):
the shared lifecycle contract, and the races and name clashes of the per-tenant layout, asserted
by what a tenant reads afterwards, not by the requests sent."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from elasticsearch import ApiError, ConflictError, Elasticsearch
from elasticsearch.exceptions import GeneralAvailabilityWarning

from api_gateway.indexes import ListedDocumentOut, StoredDocumentOut
from tests.integration.backend_contract import EMBEDDER, LifecycleContract, vectors_of
from tests.integration.es_loopback import (
    Answer,
    FakeElasticsearchServer,
    Recorded,
    bulk_response,
    error_body,
    require_alias_refused,
    running,
)
from tests.integration.es_stateful import StatefulElasticsearch, stateful_server
from tests.services import purge, purged
from worker.adapters.elasticsearch import (
    ElasticsearchBackend,
    FieldNames,
    IndexSettings,
    _listing,
    index_template,
)
from worker.adapters.elasticsearch._layout import document_es_id, tenant_key
from worker.contract import DocumentIn, FilterValue, SearchSpec
from worker.core.pipeline import PipelineConfig, Prepared, RerankRun, SearchPipeline
from worker.core.types import Candidate, Document
from worker.errors import (
    BackendRequestError,
    BackendUnavailable,
    ConfigError,
    IndexLimitReached,
    IndexNotFound,
)
from worker.queue import lifecycle
from worker.queue.config import ingest_redelivery_window
from worker.queue.economy.finish import as_stored_now
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

    @pytest.fixture
    def another(
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
    es.indices.put_mapping(index="a", properties={"k": {"type": "keyword"}})  # via the alias
    es.indices.put_mapping(index="a", properties={"k": {"type": "keyword"}})  # again: a no-op
    assert error_of(
        lambda: es.indices.put_mapping(index="a", properties={"k": {"type": "text"}})
    ) == (400, "illegal_argument_exception")


def test_the_stand_in_refuses_an_id_over_512_bytes_as_es_does(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """ES validates every item's ``_id`` length (UTF-8 bytes) before running any: one too
    long fails the whole bulk, 400, and nothing of it is written."""
    es = client(fake[0])
    es.indices.create(index="a~1", aliases={"a": {}})
    fits, over = "é" * 256, "é" * 256 + "x"  # 512 and 513 bytes, 256 and 257 characters
    with pytest.raises(ApiError) as caught:
        es.bulk(
            operations=[
                {"index": {"_index": "a", "_id": fits}},
                {"n": 1},
                {"delete": {"_index": "a", "_id": over}},
            ]
        )
    assert caught.value.meta.status == 400
    assert caught.value.body["error"]["type"] == "action_request_validation_exception"
    assert caught.value.body["error"]["reason"] == (
        f"Validation Failed: 1: id [{over}] is too long, must be no longer than 512 bytes "
        "but was: 513;"
    )
    assert not fake[1].indexes["a~1"].docs
    assert error_of(lambda: es.index(index="a", id=over, document={})) == (
        400,
        "action_request_validation_exception",
    )
    assert (
        es.bulk(operations=[{"index": {"_index": "a", "_id": fits}}, {"n": 1}]).body["items"][0][
            "index"
        ]["status"]
        == 201
    )
    assert es.options(ignore_status=404).get(index="a", id=over).body["found"] is False


# --- the lifecycle's races and name clashes -------------------------------------------------

DOC = Document("vitd", "Vitamin D deficiency raises the risk of bone fractures.", "Vitamin D")
CALC = Document("calc", "Calcium supplements and bone density in older adults.", "Calcium")


def write(backend: ElasticsearchBackend, doc: Document, version: int | None) -> int:
    return backend.upsert("docs", "acme", [doc], vectors_of([doc]), version=version)


def indexes_named(state: StatefulElasticsearch, alias: str) -> list[str]:
    """Every concrete index of ``alias`` (pointed at by it, or kept by a reindex)."""
    with state.lock:
        return sorted(n for n in state.indexes if n.startswith(alias) and n != alias)


def test_a_drop_after_a_reindex_that_kept_the_old_index_deletes_both_and_the_name_works_again(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    server, state = fake
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    assert write(backend, DOC, version=1) == 1
    backend.reindex("docs", "acme")  # the old index is kept for a rollback
    assert len(indexes_named(state, alias)) == 2
    assert backend.delete_index("docs", "acme", version=2) == 1
    assert indexes_named(state, alias) == []  # the dropped documents are gone, kept ones too
    # this process, and one that never saw the index
    assert write(backend, CALC, version=3) == 1
    assert write(backend_on(server), DOC, version=4) == 1
    assert backend.index_info("docs", "acme").documents == 2
    assert backend.document("docs", "acme", "vitd").version == 4


def assert_names_no_concrete_index(message: str, alias: str) -> None:
    """``message`` (a tenant's error) names none of the deployment's index names: neither
    the alias, a concrete index of it, the prefix before the tenant's key, nor the key."""
    assert alias not in message and tenant_key("acme") not in message, message
    assert "sift-" not in message, message


def test_a_leftover_concrete_index_without_its_alias_is_a_lasting_error_a_drop_clears(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A concrete index of the alias's first name exists but the alias does not (a drop cut
    short): the write is refused, not retryably (no retry clears it), naming the tenant's
    index and the remedy, and nothing is written. The tenant's error named the concrete
    index and its alias (the deployment's prefix, the tenant's key): the worker's log
    does now, for the operator. The remedy works: a drop, though the alias is gone,
    deletes the leftover, and the name takes writes again."""
    server, state = fake
    backend = backend_on(server)
    write(backend, CALC, version=1)
    (first,) = indexes_named(state, backend.alias("docs", "acme"))
    with state.lock:
        state.aliases.clear()  # the alias went, its index did not
    with (
        caplog.at_level("WARNING", logger="worker.adapters.elasticsearch._writes"),
        pytest.raises(BackendRequestError) as caught,
    ):
        write(backend_on(server), DOC, version=2)
    assert not caught.value.retryable
    assert "drop index 'docs' again" in str(caught.value)
    assert_names_no_concrete_index(str(caught.value), backend.alias("docs", "acme"))
    assert any(first in r.getMessage() for r in caplog.records), caplog.records  # the log does
    assert state.live_ids(first) == {"acme:calc"}
    assert backend.delete_index("docs", "acme", version=3) == 0
    assert indexes_named(state, backend.alias("docs", "acme")) == []
    assert write(backend_on(server), DOC, version=4) == 1
    assert backend.document("docs", "acme", "vitd") is not None
    assert backend.document("docs", "acme", "calc") is None


def test_require_alias_refusing_every_attempt_is_bounded_and_retryable(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    server, _state = fake
    backend = backend_on(server)
    write(backend, CALC, version=1)
    refused = bulk_response(require_alias_refused("index", backend.alias("docs", "acme"), "x"))
    server.on("PUT", "/_bulk", Answer(200, refused))
    with pytest.raises(BackendUnavailable) as caught:
        write(backend, DOC, version=2)
    assert caught.value.retryable
    assert 2 <= len(server.sent("PUT", "/_bulk")) - 1 <= 5
    assert "index 'docs'" in str(caught.value)
    assert_names_no_concrete_index(str(caught.value), backend.alias("docs", "acme"))


@pytest.mark.parametrize("doc_id", ["vitd", "𝔡" * 512])  # the longest: a hashed _id
def test_a_stale_upsert_landing_in_an_index_a_newer_writer_made_again_is_taken_back(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch], doc_id: str
) -> None:
    """W1 (version 10, accepted before drop 12) passes its floor check on worker 1; drop 12
    runs on worker 2; W2 (version 13) on worker 3 makes the index again; then W1's bulk
    finds the alias and writes. W1 reads the floor again, takes its document back, and says
    it wrote nothing; W2's document stays."""
    server, state = fake
    w1, dropper, w3 = backend_on(server), backend_on(server), backend_on(server)
    assert write(w1, CALC, version=5) == 1  # worker 1 knows the index
    fired: list[int] = []

    def between(request: Recorded) -> None:
        if not fired and '"version":10' in request.body.decode().replace(" ", ""):
            fired.append(1)
            assert dropper.delete_index("docs", "acme", version=12) == 1
            assert write(w3, CALC, version=13) == 1

    server.on("PUT", "/_bulk", between)
    assert write(w1, replace(DOC, id=doc_id), version=10) == 0
    assert fired
    assert w1.document("docs", "acme", doc_id) is None
    assert w1.document("docs", "acme", "calc") is not None
    assert w1.index_info("docs", "acme").documents == 1
    (concrete,) = indexes_named(state, w1.alias("docs", "acme"))
    with state.lock:  # the take-back's delete, at the drop's version, hit W1's _id
        docs = state.indexes[concrete].docs
        assert [d.version for d in docs.values() if d.source is None] == [12]
        assert set(docs) == {"acme:calc", *(i for i, d in docs.items() if d.source is None)}


@pytest.mark.parametrize("first", ["docs", "docs-000001"])
def test_a_name_like_another_names_concrete_index_is_its_own(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch], first: str
) -> None:
    """``docs-000001`` (or a reindex's timestamped name) is a valid Sift name: it never is
    the concrete index of ``docs``, in either order of first writes."""
    server, _state = fake
    backend = backend_on(server)
    docs = {"docs": DOC, "docs-000001": CALC}
    for name in (first, *(set(docs) - {first})):
        assert backend.upsert(name, "acme", [docs[name]], vectors_of([docs[name]]), version=1) == 1
    backend.reindex("docs", "acme", delete_old=True)
    stamp = backend._concrete(backend.alias("docs", "acme"))[0].rsplit("~", 1)[-1]
    assert backend.upsert(f"docs-{stamp}", "acme", [CALC], None, version=1) == 1
    for name, doc in docs.items():
        assert backend.index_info(name, "acme").documents == 1
        assert backend.document(name, "acme", doc.id) is not None
    assert backend.delete_index("docs-000001", "acme", version=2) == 1
    assert backend.index_info("docs", "acme").documents == 1
    assert backend.document("docs", "acme", "vitd") is not None
    assert sorted(i.name for i in backend.indexes("acme")) == ["docs", f"docs-{stamp}"]


# --- the shared layout of earlier releases: what is Sift's, and its migration ------------------


def old_mapping() -> dict[str, Any]:
    """The mapping the shared layout's template gave (no ``_meta`` marker then)."""
    template = index_template("sift-", FieldNames(), IndexSettings(dims=64))
    mappings: dict[str, Any] = template["template"]["mappings"]
    return {k: v for k, v in mappings.items() if k != "_meta"}


def make_index(
    server: FakeElasticsearchServer,
    alias: str,
    concrete: str,
    docs: dict[str, dict[str, Any]],
    mappings: dict[str, Any] | None = None,
) -> None:
    es = client(server)
    es.indices.create(index=concrete, aliases={alias: {}}, mappings=mappings or {})
    for n, (doc_id, source) in enumerate(sorted(docs.items())):
        es.index(index=alias, id=doc_id, document=source, version=7 + n, version_type="external")


def shared_doc(tenant: str, doc_id: str, text: str) -> dict[str, Any]:
    vector = vectors_of([Document(doc_id, text)])[0]
    return {
        "doc_id": doc_id,
        "text": text,
        "title": "",
        "tenant": tenant,
        "revision": "1",
        "metadata": {},
        "vector": vector,
    }


def test_only_sifts_own_shared_indexes_are_the_shared_layout(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """A sibling deployment's per-tenant aliases (prefix ``sift-staging-`` beside ``sift-``),
    an operator's rollover alias under the prefix, and one with Sift's name shape but not
    its mapping are none of it; Sift's own old index is."""
    server, state = fake
    staging = backend_on(server, elasticsearch_index_prefix="sift-staging-")
    assert write(staging, DOC, version=1) == 1
    make_index(server, "sift-audit", "sift-audit-000001", {"e1": {"event": "login"}})
    make_index(server, "sift-faq", "sift-faq-000001", {"f1": {"tenant": "acme", "text": "x"}})
    prod = backend_on(server)
    assert prod.shared_layout() == {}
    prod.check()
    assert prod.migrate_shared(delete_old=True) == {}
    make_index(
        server,
        "sift-docs",
        "sift-docs-000001",
        {"acme:vitd": shared_doc("acme", "vitd", DOC.text)},
        old_mapping(),
    )
    assert prod.shared_layout() == {"sift-docs": ["sift-docs-000001"]}
    with pytest.raises(ConfigError, match=r"\(sift-docs\)"):
        prod.check()
    with state.lock:
        assert {"sift-audit", "sift-faq"} <= set(state.aliases)


def test_with_an_empty_prefix_an_operators_rollover_alias_is_left_alone(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    server, state = fake
    make_index(server, "logs-app", "logs-app-000001", {"l1": {"message": "GET /"}})
    bare = backend_on(server, elasticsearch_index_prefix="")
    assert bare.shared_layout() == {}
    bare.check()
    assert bare.migrate_shared(delete_old=True) == {}
    assert state.concrete("logs-app") == ["logs-app-000001"]
    assert state.live_ids("logs-app") == {"l1"}


def test_a_shared_index_holding_no_tenants_documents_is_neither_refused_nor_touched(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    server, state = fake
    make_index(server, "sift-empty", "sift-empty-000001", {}, old_mapping())
    backend = backend_on(server)
    assert backend.shared_layout() == {"sift-empty": ["sift-empty-000001"]}
    backend.check()  # nothing in it would vanish
    assert backend.migrate_shared(delete_old=True) == {"empty": {}}
    assert state.concrete("sift-empty") == ["sift-empty-000001"]


def test_the_migration_dry_run_then_run_then_run_again(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    server, state = fake
    docs = {
        "acme:vitd": shared_doc("acme", "vitd", DOC.text),
        "acme:calc": shared_doc("acme", "calc", CALC.text),
        "beta:vitd": shared_doc("beta", "vitd", "beta secret"),
    }
    make_index(server, "sift-docs", "sift-docs-000001", docs, old_mapping())
    backend = backend_on(server)
    assert backend.migrate_shared(dry_run=True) == {"docs": {"acme": 2, "beta": 1}}
    assert state.concrete("sift-docs") == ["sift-docs-000001"]
    assert backend.indexes("acme") == []  # nothing written
    assert backend.migrate_shared() == {"docs": {"acme": 2, "beta": 1}}
    backend.check()
    assert backend.index_info("docs", "acme").documents == 2
    assert backend.document("docs", "beta", "vitd").text == "beta secret"
    assert backend.document("docs", "acme", "calc").version == docs_version("acme:calc", docs)
    assert backend.migrate_shared() == {}  # the old alias is gone: nothing twice
    assert "sift-docs-000001" in state.indexes  # kept for a rollback


def test_every_alias_of_the_tenant_counts_toward_its_limit_and_the_migration_is_not_held(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """On Elasticsearch the limit counts the tenant's aliases: each holds a shard, the empty
    one a delete into a new name made too (not listed), so past the limit a delete into a
    new name is refused as an upsert is, and dropping the empty name frees its place. The
    migration of the shared layout copies what a tenant already held, past any limit."""
    server, _state = fake
    docs = {f"acme:d{i}": shared_doc("acme", f"d{i}", DOC.text) for i in range(2)}
    # made before any index of Sift's (and its template)
    make_index(server, "sift-docs", "sift-docs-000001", docs, old_mapping())
    backend = backend_on(server, max_indexes_per_tenant=2)
    backend.upsert("sci", "acme", [DOC], vectors_of([DOC]), version=1)
    assert backend.delete_documents("bio", "acme", ["x"], version=2) == 0  # an empty index
    assert [i.name for i in backend.indexes("acme")] == ["sci"]
    for write in (
        lambda: backend.upsert("med", "acme", [DOC], vectors_of([DOC]), version=3),
        lambda: backend.delete_documents("med", "acme", ["x"], version=3),
    ):
        with pytest.raises(IndexLimitReached, match="holds 2 indexes") as refused:
            write()
        assert refused.value.unlisted == ["bio"]  # the empty one, named: drop it
        assert "so are not listed: 'bio'" in refused.value.message
    other = backend_on(server, max_indexes_per_tenant=2)  # another process: it asks ES
    with pytest.raises(IndexLimitReached):
        other.upsert("med", "acme", [DOC], vectors_of([DOC]), version=4)
    backend.delete_index("bio", "acme", version=5)
    assert other.upsert("med", "acme", [DOC], vectors_of([DOC]), version=6) == 1
    assert [i.name for i in other.indexes("acme")] == ["med", "sci"]
    assert backend.migrate_shared() == {"docs": {"acme": 2}}
    assert backend.index_info("docs", "acme").documents == 2


def docs_version(doc_id: str, docs: dict[str, Any]) -> int:
    return 7 + sorted(docs).index(doc_id)


def test_a_copy_still_running_is_waited_on_not_started_twice_and_es_errors_are_sifts(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    server, _state = fake
    docs = {"acme:vitd": shared_doc("acme", "vitd", DOC.text)}
    make_index(server, "sift-docs", "sift-docs-000001", docs, old_mapping())
    backend = backend_on(server)
    dest = backend.alias("docs", "acme")
    running = {
        "nodes": {
            "n1": {
                "tasks": {
                    "n1:42": {
                        "action": "indices:data/write/reindex",
                        "description": f"reindex from [sift-docs] to [{dest}]",
                    }
                }
            }
        }
    }
    server.on("GET", "/_tasks", Answer(200, running), times=1)
    # a run again waits on that copy (here: it ends failed) instead of starting another
    ended = {"completed": False, "task": running["nodes"]["n1"]["tasks"]["n1:42"]}
    server.on(
        "GET",
        "/_tasks/n1%3A42",
        Answer(
            200,
            {
                **ended,
                "completed": True,
                "error": {
                    "type": "search_phase_execution_exception",
                    "reason": "n1:42 lost a shard",
                },
            },
        ),
        times=1,
    )
    server.on("GET", "/_tasks/n1%3A42", Answer(200, ended), times=1)
    with pytest.raises(BackendRequestError, match="n1:42 lost a shard"):
        backend.migrate_shared()
    assert not server.sent("POST", "/_reindex")
    assert len(server.sent("GET", "/_tasks/n1%3A42")) == 2
    server.on("POST", "/_reindex", Answer(503, error_body("unavailable", "busy", 503)), times=1)
    with pytest.raises(BackendUnavailable, match="503"):
        backend.migrate_shared()
    assert backend.migrate_shared() == {"docs": {"acme": 1}}


def test_a_delete_by_ids_counts_what_it_deleted_before_a_drop_cut_it_short(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """One document per bulk chunk: the first chunk deletes ``calc``, then another worker
    drops the index, so the second chunk is refused and the call makes the index again and
    sends both once more (neither is there). ``calc`` existed: 1, not the last attempt's 0."""
    server, _state = fake
    backend = backend_on(server, elasticsearch_bulk_chunk_size=1)
    backend.upsert("docs", "acme", [CALC, DOC], vectors_of([CALC, DOC]))
    dropper = backend_on(server)
    chunks: list[int] = []

    def between(request: Recorded) -> None:
        chunks.append(1)
        if len(chunks) == 2:  # the second chunk of the delete
            dropper.delete_index("docs", "acme")

    server.on("PUT", "/_bulk", between)
    assert backend.delete_documents("docs", "acme", ["calc", "vitd"]) == 1
    assert backend.document("docs", "acme", "vitd") is None


# --- deletes as ES 9 runs them: require_alias does not hold them ------------------------------


def test_the_stand_in_runs_deletes_as_es_does(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """``require_alias`` does not apply to a delete; an external-versioned delete on a
    missing index makes it (a bare index of that name), an unversioned one answers 404; and
    ``_resolve/index`` answers GET only."""
    server, state = fake
    es = client(server)
    versioned = {"delete": {"_index": "gone", "_id": "x", "version": 3, "version_type": "external"}}
    plain = {"delete": {"_index": "never", "_id": "x"}}
    items = es.bulk(operations=[plain, versioned], require_alias=True).body["items"]
    assert items[0]["delete"]["status"] == 404
    assert items[0]["delete"]["error"]["type"] == "index_not_found_exception"
    assert items[1]["delete"] == {**items[1]["delete"], "_index": "gone", "result": "not_found"}
    with state.lock:
        assert sorted(state.indexes) == ["gone"] and not state.aliases
    assert es.perform_request("GET", "/_resolve/index/g*").body["indices"][0]["name"] == "gone"
    with pytest.raises(ApiError) as caught:
        es.indices.resolve_index(name="g*")  # the 9.5 client sends POST
    assert caught.value.meta.status == 405


def test_a_delete_by_ids_racing_a_drop_leaves_no_bare_index_and_the_name_works(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """Delete v2 passes its checks; drop v3 runs before its bulk; the bulk's external
    versioned delete makes a bare index of the alias's name (ES does). The delete clears it
    and, being below the floor on its next attempt, stops: no index is left, and later
    writes and drops of the name work."""
    server, state = fake
    backend, dropper = backend_on(server), backend_on(server)
    alias = backend.alias("docs", "acme")
    write(backend, CALC, version=1)
    fired: list[int] = []

    def between(request: Recorded) -> None:
        if not fired and b'"delete"' in request.body:
            fired.append(1)
            assert dropper.delete_index("docs", "acme", version=3) == 1

    server.on("PUT", "/_bulk", between)
    assert backend.delete_documents("docs", "acme", ["calc"], version=2) == 0
    assert fired
    server.off("PUT", "/_bulk")
    with state.lock:
        assert alias not in state.indexes and indexes_named(state, alias) == []
    assert write(backend, DOC, version=4) == 1
    assert write(backend_on(server), CALC, version=5) == 1
    assert backend.delete_index("docs", "acme", version=6) == 2
    assert write(backend_on(server), DOC, version=7) == 1


def test_a_take_back_racing_the_drop_itself_makes_no_bare_index(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """W1 (v10) writes; drop 12 deletes the index just before W1's take-back reads the
    floor. The take-back finds the alias gone and sends no delete (one would make a bare
    index); a later write (v13) makes the index as usual."""
    server, state = fake
    w1, dropper = backend_on(server), backend_on(server)
    alias = w1.alias("docs", "acme")
    write(w1, CALC, version=5)
    reads: list[int] = []

    def between(request: Recorded) -> None:
        reads.append(1)
        if len(reads) == 2:  # the take-back's floor read (the first: the floor check)
            assert dropper.delete_index("docs", "acme", version=12) == 2

    server.on("GET", f"/sift-sift-floors/_doc/{alias}", between)
    assert write(w1, DOC, version=10) == 0
    server.off("GET", f"/sift-sift-floors/_doc/{alias}")
    with state.lock:
        assert alias not in state.indexes and not state.aliases
    assert write(backend_on(server), DOC, version=13) == 1
    assert w1.document("docs", "acme", "vitd") is not None


@pytest.mark.parametrize("holds", [False, True])
def test_a_bare_index_named_like_the_alias_is_cleared_or_named(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
    holds: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A concrete index of the alias's own name (an earlier release's delete made it): a
    write deletes it if it holds no document and goes on; one holding documents is named
    in a lasting error, and a drop deletes it (it holds only this tenant's)."""
    server, state = fake
    es = client(server)
    backend = backend_on(server)
    backend.ensure_template()
    alias = backend.alias("docs", "acme")
    delete = {
        "delete": {"_index": alias, "_id": "acme:x", "version": 2, "version_type": "external"}
    }
    es.bulk(operations=[delete])
    if holds:
        es.index(index=alias, id="acme:calc", document=backend.source("acme", CALC, None))
        with (
            caplog.at_level("WARNING", logger="worker.adapters.elasticsearch._writes"),
            pytest.raises(BackendRequestError) as caught,
        ):
            write(backend, DOC, version=3)
        assert not caught.value.retryable
        assert "index 'docs'" in str(caught.value)
        assert_names_no_concrete_index(str(caught.value), alias)
        assert any(repr(alias) in r.getMessage() for r in caplog.records), caplog.records
        assert backend.delete_index("docs", "acme", version=4) == 1
    assert write(backend_on(server), DOC, version=5) == 1
    with state.lock:
        assert alias not in state.indexes and state.concrete(alias) == [f"{alias}~000001"]


def test_a_retry_after_a_take_back_cut_short_completes_it(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """W1 (v10) passes its floor check; drop 12 runs and W3 (v13) makes the index again
    before W1's bulk, which writes ``vitd``; the take-back's deletes answer 503 (retryable).
    The job's retry finds W1 below the floor and sends the deletes again: ``vitd`` (accepted
    before the drop) goes, W3's ``calc`` stays."""
    server, _state = fake
    w1, dropper, w3 = backend_on(server), backend_on(server), backend_on(server)
    write(w1, CALC, version=5)
    fired: list[int] = []

    def between(request: Recorded) -> Answer | None:
        body = request.body.decode().replace(" ", "")
        if not fired and '"version":10' in body:
            fired.append(1)
            dropper.delete_index("docs", "acme", version=12)
            write(w3, CALC, version=13)
        if '"delete"' in body:
            return Answer(503, error_body("unavailable_shards_exception", "busy", 503))
        return None

    server.on("PUT", "/_bulk", between)
    with pytest.raises(BackendUnavailable) as caught:
        write(w1, DOC, version=10)
    assert caught.value.retryable and fired
    server.off("PUT", "/_bulk")
    assert w1.document("docs", "acme", "vitd") is not None  # the cut-short take-back's
    assert write(w1, DOC, version=10) == 0
    assert w1.document("docs", "acme", "vitd") is None
    assert w1.document("docs", "acme", "calc") is not None


def test_a_drop_cut_short_between_its_deletes_completes_when_run_again(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """After a reindex that kept ``~000001``, a drop's first DELETE answers 503. Run again,
    the drop deletes both indexes, the dropped document is nowhere, and the name works."""
    server, state = fake
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    write(backend, DOC, version=1)
    backend.reindex("docs", "acme")
    assert len(indexes_named(state, alias)) == 2
    busy = Answer(503, error_body("process_cluster_event_timeout_exception", "busy", 503))
    server.on("DELETE", f"/{alias}~000001", busy, times=1)
    with pytest.raises(BackendUnavailable):
        backend.delete_index("docs", "acme", version=2)
    assert backend.delete_index("docs", "acme", version=2) == 1
    assert indexes_named(state, alias) == []
    assert write(backend_on(server), CALC, version=3) == 1
    assert backend.delete_index("docs", "acme", version=4) == 1
    assert indexes_named(state, alias) == []


def test_a_drop_whose_alias_is_gone_still_deletes_the_kept_index(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """A drop cut short under an earlier release deleted the live index and not the kept
    one: a drop of the name, though the alias is gone, deletes it."""
    server, state = fake
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    write(backend, DOC, version=1)
    backend.reindex("docs", "acme")
    (live,) = state.concrete(alias)
    client(server).indices.delete(index=live)
    assert indexes_named(state, alias) == [f"{alias}~000001"]
    assert backend.delete_index("docs", "acme", version=2) == 0
    assert indexes_named(state, alias) == []
    assert write(backend_on(server), CALC, version=3) == 1


def test_a_drop_never_deletes_an_index_a_newer_writer_makes_while_it_runs(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """After ``reindex --delete-old``, drop 2 deletes the live index; W2 (v3, accepted after
    the drop) makes ``~000001`` again right then. The drop found its names before deleting
    any, so W2's index and document stay."""
    server, state = fake
    backend, w2 = backend_on(server), backend_on(server)
    alias = backend.alias("docs", "acme")
    write(backend, DOC, version=1)
    backend.reindex("docs", "acme", delete_old=True)
    (live,) = state.concrete(alias)
    after: list[int] = []

    def deleted_then_written(request: Recorded) -> Answer:
        with state.lock:
            state.delete_indexes(live, ignore_unavailable=False)
        after.append(write(w2, CALC, version=3))
        return Answer(200, {"acknowledged": True})

    server.on("DELETE", f"/{live}", deleted_then_written, times=1)
    assert backend.delete_index("docs", "acme", version=2) == 1
    assert after == [1]
    assert state.concrete(alias) == [f"{alias}~000001"]
    assert backend.document("docs", "acme", "calc") is not None
    assert backend.document("docs", "acme", "vitd") is None


FAILURES = {
    "rejected": (429, "es_rejected_execution_exception", BackendUnavailable),
    "refused": (400, "document_parsing_exception", BackendRequestError),
}


@pytest.mark.parametrize("ending", ["canceled", "timeout", *FAILURES])
def test_a_cancelled_or_unfinished_copy_moves_no_alias(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
    ending: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reindex whose copy task reports ``canceled`` (no failures), failures (retryably if
    each is a passing one, a 429), or is not done within the bound, fails: the alias stays
    on the old index and the old index is not deleted."""
    server, state = fake
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    write(backend, DOC, version=1)
    before = state.concrete(alias)

    real = state.get_tasks

    def report(parts: list[str], q: Any) -> tuple[int, Any]:
        status, task = real(parts, q)
        if parts and ending == "canceled":
            task = {**task, "response": {**task["response"], "canceled": "by user request"}}
        elif parts and ending in FAILURES:
            status, kind, _error = FAILURES[ending]
            cause = {"type": kind, "reason": "one item"}
            failure = {"index": "x", "id": "acme:vitd", "status": status, "cause": cause}
            task = {**task, "response": {**task["response"], "failures": [failure]}}
        elif parts:
            task = {**task, "completed": False}
        return status, task

    monkeypatch.setattr(state, "get_tasks", report)
    if ending == "timeout":
        backend.copy_max_seconds = 0  # the bound spent at the first read
    error, match = {
        "canceled": (BackendRequestError, "by user request"),
        "timeout": (BackendUnavailable, "not done"),
        # a passing failure by its status alone: ES's reason may name a node by its address
        **{
            name: (e, f"answered {status} " if e is BackendUnavailable else kind)
            for name, (status, kind, e) in FAILURES.items()
        },
    }[ending]
    with pytest.raises(error, match=match):
        backend.reindex("docs", "acme", delete_old=True)
    assert state.concrete(alias) == before
    assert backend.document("docs", "acme", "vitd") is not None


def test_the_migration_clears_a_bare_index_and_names_a_leftover_for_good(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """A tenant's alias name taken by an empty bare index (a delete made it) is cleared and
    the copy goes on; another's first concrete name without its alias stops the migration
    with a lasting error naming it, and a drop of that name lets the run complete."""
    server, state = fake
    docs = {
        "acme:vitd": shared_doc("acme", "vitd", DOC.text),
        "beta:vitd": shared_doc("beta", "vitd", "beta secret"),
    }
    make_index(server, "sift-docs", "sift-docs-000001", docs, old_mapping())
    backend = backend_on(server)
    es = client(server)
    acme, beta = backend.alias("docs", "acme"), backend.alias("docs", "beta")
    delete = {"_index": acme, "_id": "acme:x", "version": 2, "version_type": "external"}
    es.bulk(operations=[{"delete": delete}])
    es.indices.create(index=f"{beta}~000001")
    with pytest.raises(BackendRequestError, match=re.escape(f"{beta}~000001")) as caught:
        backend.migrate_shared()
    assert not caught.value.retryable
    assert state.concrete("sift-docs") == ["sift-docs-000001"]  # the alias stays
    assert backend.delete_index("docs", "beta", version=3) == 0
    # acme's copy was made by the first run: the second copies it not twice
    assert backend.migrate_shared() == {"docs": {"acme": 0, "beta": 1}}
    with state.lock:
        assert acme not in state.indexes
    assert backend.document("docs", "acme", "vitd") is not None
    assert backend.document("docs", "beta", "vitd").text == "beta secret"


def test_an_index_of_the_previous_release_keeps_answering_filters_and_takes_typed_terms(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """An index made before the metadata-terms field (its mapping ``dynamic: strict``
    without it) and its documents (no tokens): filters still find them, compared as text
    as before; the first write of this release adds the field to the mapping, and what it
    writes compares as JSON values; a document written again through Sift does too."""
    server, state = fake
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    template = index_template("sift-", replace(FieldNames(), metadata_terms=""), IndexSettings(64))
    before = template["template"]["mappings"]
    assert "metadata_terms" not in before["properties"]
    old = {**shared_doc("acme", "old", "alpha old"), "metadata": {"year": 5}}
    make_index(server, alias, f"{alias}~000001", {"acme:old": old}, before)

    def found(**filters: Any) -> set[str]:
        hits = (
            TestStatefulElasticsearchContract()
            .search(backend, "docs", "acme", "alpha", size=10, **filters)
            .hits
        )
        assert {h.document.id for h in hits["bm25"]} == {h.document.id for h in hits["knn"]}
        return {h.document.id for h in hits["bm25"]}

    assert found(year=5) == {"old"}
    assert found(year="5") == {"old"}  # as text, as the previous release compared it
    new = Document("new", "alpha new", "", "1", {"year": 5.0})
    assert backend.upsert("docs", "acme", [new], vectors_of([new]), version=1) == 1
    (concrete,) = state.concrete(alias)
    assert state.indexes[concrete].mappings["properties"]["metadata_terms"] == {"type": "keyword"}
    assert found(year=5) == {"old", "new"}
    assert found(year="5") == {"old"}
    assert found(year=5.5) == set()
    again = Document("old", "alpha old", "", "1", {"year": 5})
    assert backend.upsert("docs", "acme", [again], vectors_of([again]), version=20) == 1
    assert found(year="5") == set()
    assert found(year=5) == {"old", "new"}


def test_a_reindex_run_again_after_giving_up_waits_on_the_running_copy_and_uses_it(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reindex that gave up waiting for its copy (the task runs on) moved no alias; run
    again, it finds that copy running (``GET _tasks``), waits on it and moves the alias to
    its index: one copy, one new index, not a second of each."""
    server, state = fake
    monkeypatch.setattr("worker.adapters.elasticsearch._reindex.COPY_POLL_SECONDS", 0.01)
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    write(backend, DOC, version=1)
    write(backend, CALC, version=2)
    (first,) = state.concrete(alias)
    state.copy_running_reads = 3
    backend.copy_max_seconds = 0
    with pytest.raises(BackendUnavailable, match="runs on"):
        backend.reindex("docs", "acme")
    assert state.concrete(alias) == [first]
    (copying,) = [n for n in indexes_named(state, alias) if n != first]

    again = backend_on(server)  # another run: its own process
    assert again.reindex("docs", "acme", delete_old=True) == copying
    assert len(server.sent("POST", "/_reindex")) == 1
    assert state.concrete(alias) == [copying]
    assert indexes_named(state, alias) == [copying]  # no second copy's index
    assert state.live_ids(alias) == {"acme:vitd", "acme:calc"}
    assert again.document("docs", "acme", "calc") is not None
    # a copy from another alias, or into the live index, is not taken for this one's
    state.copy_running_reads = 0
    assert again.reindex("docs", "acme") not in (first, copying)
    assert len(server.sent("POST", "/_reindex")) == 2


def test_a_node_that_does_not_answer_the_task_list_is_no_proof_that_no_copy_runs(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    server, state = fake
    backend = backend_on(server)
    write(backend, DOC, version=1)
    failed = {"nodes": {}, "node_failures": [{"type": "failed_node_exception", "reason": "n2"}]}
    server.on("GET", "/_tasks", Answer(200, failed), times=1)
    with pytest.raises(BackendUnavailable, match="did not answer"):
        backend.reindex("docs", "acme")
    assert not server.sent("POST", "/_reindex")
    assert len(state.concrete(backend.alias("docs", "acme"))) == 1


def test_a_write_retried_after_some_items_were_rejected_reports_every_document_it_wrote(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """A bulk write whose one item ES rejected (429, its queue full) fails retryably, the
    rest written; the retry writes that one, finds the others holding its own version (a
    409), and reports all three written, as the same write on the embedded backend (all or
    nothing) reports after its retry."""
    server, state = fake
    backend = backend_on(server)
    docs = [Document(i, f"alpha {i}") for i in ("a", "b", "c")]
    assert backend.upsert("docs", "acme", docs[:1], None, version=1) == 1  # the index exists

    def reject_b(request: Recorded) -> Answer:
        lines = request.ndjson()
        pairs = list(zip(lines[0::2], lines[1::2], strict=True))
        kept = [line for pair in pairs if pair[0]["index"]["_id"] != "acme:b" for line in pair]
        with state.lock:
            answer = state.bulk(kept, {k: v[-1] for k, v in request.query.items()})
        error = {"type": "es_rejected_execution_exception", "reason": "bulk queue full"}
        rejected = {"index": {"_id": "acme:b", "status": 429, "error": error}}
        answer["items"].insert(1, rejected)
        return Answer(200, {**answer, "errors": True})

    server.on("PUT", "/_bulk", reject_b, times=1)
    with pytest.raises(BackendUnavailable, match=r"b \(429 es_rejected_execution_exception"):
        backend.upsert("docs", "acme", docs, None, version=5)
    assert state.live_ids(backend.alias("docs", "acme")) == {"acme:a", "acme:c"}
    assert backend.upsert("docs", "acme", docs, None, version=5) == 3
    assert backend.index_info("docs", "acme").documents == 3
    # a newer write of "a" since: the retry of version 5 does not count it
    assert backend.upsert("docs", "acme", docs[:1], None, version=7) == 1
    assert backend.upsert("docs", "acme", docs, None, version=5) == 2


def previous_release_template() -> dict[str, Any]:
    """The index template a worker of the release before metadata terms puts."""
    fields = replace(FieldNames(), metadata_terms="")
    return index_template("sift-", fields, IndexSettings(64))


def filtered(backend: ElasticsearchBackend, tenant: str, **filters: Any) -> set[str]:
    hits = (
        TestStatefulElasticsearchContract()
        .search(backend, "docs", tenant, "alpha", size=10, **filters)
        .hits
    )
    return {h.document.id for h in hits["bm25"]}


def test_an_index_made_from_a_template_a_previous_release_put_since_takes_the_fields(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """A worker puts its template once; a worker of the previous release (a rolling upgrade)
    may put its own since, so an index this worker makes later can lack the metadata-terms
    field under ``dynamic: strict``. Its first write there still adds the field: the
    write is not refused (``strict_dynamic_mapping_exception``, for good, while the
    process lives), and filters compare its documents as JSON values."""
    server, state = fake
    backend = backend_on(server)
    write(backend, DOC, version=1)  # this worker's template is put, acme's index made
    state.templates["sift-sift"] = previous_release_template()
    doc = Document("new", "alpha new", "", "1", {"year": 5})
    assert backend.upsert("docs", "beta", [doc], vectors_of([doc]), version=2) == 1
    (concrete,) = state.concrete(backend.alias("docs", "beta"))
    assert state.indexes[concrete].mappings["properties"]["metadata_terms"] == {"type": "keyword"}
    assert filtered(backend, "beta", year=5.0) == {"new"}
    assert filtered(backend, "beta", year="5") == set()


def test_a_reindex_that_waits_on_a_previous_releases_copy_gives_its_index_the_fields(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reindex of the previous release gave up waiting on its copy, into an index made
    from that release's template (no metadata-terms field, ``dynamic: strict``). Run again
    on this release, it waits on that copy and moves the alias there: a worker that wrote
    through the alias before (and so remembers its mapping as done) keeps writing."""
    server, state = fake
    monkeypatch.setattr("worker.adapters.elasticsearch._reindex.COPY_POLL_SECONDS", 0.01)
    previous = backend_on(server, elasticsearch_metadata_terms_field="")
    first = Document("a", "alpha a", "", "1", {"year": 5})
    assert previous.upsert("docs", "acme", [first], vectors_of([first]), version=1) == 1
    alias = previous.alias("docs", "acme")
    state.copy_running_reads = 3
    previous.copy_max_seconds = 0
    with pytest.raises(BackendUnavailable, match="runs on"):
        previous.reindex("docs", "acme")
    (copying,) = [n for n in indexes_named(state, alias) if n not in state.concrete(alias)]
    assert "metadata_terms" not in state.indexes[copying].mappings["properties"]
    writer = backend_on(server)  # upgraded: its write (the same again) maps the live index
    assert writer.upsert("docs", "acme", [first], vectors_of([first]), version=1) == 1

    assert backend_on(server).reindex("docs", "acme") == copying
    later = Document("b", "alpha b", "", "1", {"year": 5.0})
    assert writer.upsert("docs", "acme", [later], vectors_of([later]), version=2) == 1
    assert filtered(writer, "acme", year=5) == {"a", "b"}


def test_a_search_finding_nothing_asks_again_only_what_a_remembered_probe_may_have_missed(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """A search that finds nothing checks whether the tenant still holds a document only
    when the pipeline's probe may have answered from this process's memo (a tenant with
    vectors, remembered for a while), and with one small search: a tenant without vectors
    was just probed from ES within the same search. The memo stays while documents do."""
    server, _state = fake
    backend = backend_on(server)
    pipeline = SearchPipeline(backend, EMBEDDER, config=PipelineConfig())
    words = Document("w", "alpha words", "", "1", {"year": 5})
    assert backend.upsert("docs", "beta", [words], None, version=1) == 1
    server.requests.clear()
    spec = SearchSpec(index="docs", query="alpha", mode="fts", filters={"year": 6}, rerank=False)
    assert pipeline.search(spec, "beta").hits == []
    beta = backend.alias("docs", "beta")
    assert [r.path for r in server.requests] == [f"/{beta}/_msearch"] * 2  # probe, search

    vectors = Document("v", "alpha vectors", "", "1", {"year": 5})
    assert backend.upsert("docs", "acme", [vectors], vectors_of([vectors]), version=2) == 1
    acme = backend.alias("docs", "acme")
    hybrid = SearchSpec(index="docs", query="alpha", filters={"year": 6}, rerank=False)
    server.requests.clear()
    assert pipeline.search(hybrid, "acme").hits == []  # the probe answered from the memo
    assert [r.path for r in server.requests] == [f"/{acme}/_msearch", f"/{acme}/_search"]
    server.requests.clear()
    assert [
        h.id for h in pipeline.search(hybrid.model_copy(update={"filters": {}}), "acme").hits
    ] == ["v"]
    assert [r.path for r in server.requests] == [f"/{acme}/_msearch"]  # the memo stayed
    # another worker deletes acme's last document: the memo answers the probe, the search
    # finds nothing, and the check reads the index as missing, as the embedded backend does
    assert backend_on(server).delete_documents("docs", "acme", ["v"], version=3) == 1
    with pytest.raises(IndexNotFound):
        pipeline.search(hybrid.model_copy(update={"filters": {}}), "acme")
    assert backend.channels("docs", "acme") == frozenset()


def test_a_number_filter_matches_a_document_without_tokens_however_it_was_written(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """Documents of the previous release (no tokens) hold each value as the text it was
    written with, ``5`` or ``5.0``; one written since holds a typed token. A number filter
    finds both kinds, whichever way either was spelled (``5`` is ``5.0``): the text it
    compares an untyped document on is every spelling of the number, not one."""
    server, _state = fake
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    before = previous_release_template()["template"]["mappings"]
    old = {
        "acme:int": {**shared_doc("acme", "int", "alpha int"), "metadata": {"n": 5}},
        "acme:float": {**shared_doc("acme", "float", "alpha float"), "metadata": {"n": 5.0}},
        "acme:big": {**shared_doc("acme", "big", "alpha big"), "metadata": {"n": 1e16}},
        "acme:zero": {**shared_doc("acme", "zero", "alpha zero"), "metadata": {"n": -0.0}},
    }
    make_index(server, alias, f"{alias}~000001", old, before)
    new = [
        Document("newint", "alpha newint", "", "1", {"n": 5}),
        Document("newfloat", "alpha newfloat", "", "1", {"n": 5.0}),
    ]
    assert backend.upsert("docs", "acme", new, vectors_of(new), version=20) == 2
    five = {"int", "float", "newint", "newfloat"}
    assert filtered(backend, "acme", n=5) == five
    assert filtered(backend, "acme", n=5.0) == five
    assert filtered(backend, "acme", n=10**16) == {"big"}
    assert filtered(backend, "acme", n=0) == {"zero"}
    assert filtered(backend, "acme", n=5.5) == set()


def finished_items_keep_what_the_search_finds(backend: ElasticsearchBackend, index: str) -> None:
    """An economy item finished on its candidates as stored now keeps those a search with
    its filters finds now, and drops the others as filtered out, whether a document holds
    typed tokens (written by Sift) or not (written by an earlier release, or by another
    tool into the index): one without is found by its metadata as text (``"5"`` is ``5``,
    a list holds each value, ``{"o": {"k": ...}}`` is ``o.k``), and the item keeps it too.
    (Shared with the live suite.)"""
    typed = Document("typed", "alpha typed", "", "1", {"year": 5, "on": True})
    assert backend.upsert(index, "acme", [typed], vectors_of([typed]), version=1) == 1
    outside = {
        "str5": {"year": "5", "on": "true"},
        "lists": {"year": [5, 2021], "tags": ["a", "b"], "o": {"k": "x"}},
        "float5": {"year": 5.0, "on": True},
    }
    for doc_id, metadata in outside.items():
        source = {**shared_doc("acme", doc_id, f"alpha {doc_id}"), "metadata": metadata}
        backend._client.index(
            index=backend.alias(index, "acme"),
            id=document_es_id("acme", doc_id),
            document=source,
            refresh="wait_for",
        )
    ids = ["typed", *outside]
    cases: list[tuple[dict[str, FilterValue], set[str]]] = [
        ({"year": 5}, {"typed", "str5", "lists", "float5"}),
        ({"year": "5"}, {"str5", "lists"}),  # float5 is held as "5.0"
        ({"on": True}, {"typed", "str5", "float5"}),
        ({"on": "true"}, {"str5", "float5"}),
        ({"tags": "a", "o.k": "x"}, {"lists"}),
        ({"year": 2021.0}, {"lists"}),
        ({"year": 5.5}, set()),
    ]
    for filters, expected in cases:
        hits = (
            TestStatefulElasticsearchContract()
            .search(backend, index, "acme", "alpha", size=10, **filters)
            .hits
        )
        for channel in ("bm25", "knn"):
            assert {h.document.id for h in hits[channel]} == expected, (filters, channel)
        candidates = [Candidate(Document(i, "alpha"), n, 0.1, {}, {}) for n, i in enumerate(ids)]
        item = Prepared(SearchSpec(index=index, query="alpha", filters=filters), candidates, {})
        [held] = as_stored_now(backend, "acme", [item])
        assert isinstance(held, Prepared), held
        assert set(ids) - held.gone == expected, (filters, sorted(held.gone))
        assert held.filtered_out == set(ids) - expected, filters


def test_an_economy_item_keeps_a_document_without_tokens_its_search_finds(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """:func:`finished_items_keep_what_the_search_finds` on the stand-in."""
    finished_items_keep_what_the_search_finds(backend_on(fake[0]), "docs")


def documents_under_their_own_ids_read_as_searched(
    backend: ElasticsearchBackend, index: str
) -> None:
    """An index that already exists (deploy/README.md §4: a tenant's alias over it) holds
    documents under the ``_id`` its own tool gave them, not Sift's ``<tenant>:<id>``. A
    search finds one by its id field (or, without one, by its ``_id``) and the listing
    lists it; a read of it by that id, and an economy item's finish, read the same
    document: another tenant's stays unread, and one never written is none.
    (Shared with the live suite.)"""
    first = Document("sift-1", "alpha written by sift")
    assert backend.upsert(index, "acme", [first], vectors_of([first]), version=1) == 1
    theirs = {
        "cat-1": {**shared_doc("acme", "cat-1", "alpha catalogue one"), "metadata": {"y": 1}},
        "cat-2": shared_doc("beta", "cat-2", "alpha catalogue two"),
        "raw-3": {k: v for k, v in shared_doc("acme", "_", "alpha raw").items() if k != "doc_id"},
        # an _id with a colon, no id field: its id is the whole _id, not what follows ":"
        "ns:raw-4": {k: v for k, v in shared_doc("acme", "_", "alpha ns").items() if k != "doc_id"},
    }
    for es_id, source in theirs.items():
        backend._client.index(
            index=backend.alias(index, "acme"), id=es_id, document=source, refresh="wait_for"
        )
    hits = TestStatefulElasticsearchContract().search(backend, index, "acme", "alpha").hits
    assert {h.document.id for h in hits["bm25"]} == {"sift-1", "cat-1", "raw-3", "ns:raw-4"}
    got = backend.document(index, "acme", "ns:raw-4")
    assert got is not None and got.text == "alpha ns", got
    assert backend.delete_documents(index, "acme", ["ns:raw-4"], version=3) == 1
    hits = TestStatefulElasticsearchContract().search(backend, index, "acme", "alpha").hits
    assert {h.document.id for h in hits["bm25"]} == {"sift-1", "cat-1", "raw-3"}
    listed = backend.documents(index, "acme", None, 10) or []
    assert [d.id for d in listed] == ["cat-1", "sift-1"]
    got = backend.document(index, "acme", "cat-1")
    assert got is not None and (got.text, got.metadata) == ("alpha catalogue one", {"y": 1})
    assert backend.document(index, "acme", "cat-2") is None  # beta's
    asked = ["sift-1", "cat-1", "cat-2", "raw-3", "never"]
    stored = backend.stored_documents(index, "acme", asked)
    assert sorted(stored) == ["cat-1", "raw-3", "sift-1"], stored
    assert stored["raw-3"].text == "alpha raw"
    candidates = [Candidate(Document(i, "alpha"), n, 0.1, {}, {}) for n, i in enumerate(stored)]
    item = Prepared(SearchSpec(index=index, query="alpha"), candidates, {})
    [held] = as_stored_now(backend, "acme", [item])
    assert isinstance(held, Prepared) and not held.gone, held
    assert backend.delete_documents(index, "acme", ["sift-1"], version=2) == 1
    assert "sift-1" not in backend.stored_documents(index, "acme", ["sift-1", "cat-1"])


def test_a_document_another_tool_wrote_under_its_own_id_reads_as_it_is_searched(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """:func:`documents_under_their_own_ids_read_as_searched` on the stand-in."""
    documents_under_their_own_ids_read_as_searched(backend_on(fake[0]), "docs")


def metadata_another_tool_wrote_shows_as_held(backend: ElasticsearchBackend, index: str) -> None:
    """A document another tool wrote into an index that already exists (deploy/README.md
    §4) may hold lists, objects and nulls in its metadata, which the ``flattened`` field
    takes: a search's hit, an economy item finished on its candidates as stored now, a read
    of it and a listing show that metadata as the index holds it (the gateway's response
    types take it), next to a document Sift wrote. (Shared with the live suite.)"""
    mine = Document("sift-1", "alpha mine", metadata={"year": 5})
    assert backend.upsert(index, "acme", [mine], vectors_of([mine]), version=1) == 1
    held: dict[str, Any] = {"tags": ["a", "b"], "o": {"k": 1, "l": [True, None]}, "none": None}
    source = {**shared_doc("acme", "cat-1", "alpha catalogue"), "metadata": held}
    backend._client.index(
        index=backend.alias(index, "acme"), id="cat-1", document=source, refresh="wait_for"
    )
    shown = {"sift-1": {"year": 5}, "cat-1": held}
    config = PipelineConfig(failure_policy="fail_open")  # the finish below has no model
    pipeline = SearchPipeline(backend, EMBEDDER, config=config)
    for filters in ({}, {"tags": "a"}):
        spec = SearchSpec(index=index, query="alpha", rerank=False, filters=filters)
        result = pipeline.search(spec, "acme")
        assert {h.id: h.metadata for h in result.hits} == {
            i: m for i, m in shown.items() if i == "cat-1" or not filters
        }, filters
    ids = ["sift-1", "cat-1"]
    candidates = [Candidate(Document(i, "alpha"), n, 0.1, {}, {}) for n, i in enumerate(ids, 1)]
    item = Prepared(SearchSpec(index=index, query="alpha"), candidates, {"candidate_max_chars": 9})
    [now] = as_stored_now(backend, "acme", [item])
    assert isinstance(now, Prepared) and not now.gone, now
    finished = pipeline.finish_without_model(now, RerankRun())
    assert {h.id: h.metadata for h in finished.hits} == shown
    got = lifecycle._document(backend, "acme", index, "cat-1")
    assert StoredDocumentOut.model_validate(got).metadata == held
    page = lifecycle._documents(backend, "acme", index, json.dumps({"after": None, "limit": 9}))
    listed = [ListedDocumentOut.model_validate(d) for d in page["documents"]]
    assert {d.id: d.metadata for d in listed} == shown


def test_metadata_another_tool_wrote_shows_as_held_in_hits_reads_and_listings(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """:func:`metadata_another_tool_wrote_shows_as_held` on the stand-in."""
    metadata_another_tool_wrote_shows_as_held(backend_on(fake[0]), "docs")


def writes_by_id_replace_what_another_tool_wrote(backend: ElasticsearchBackend, index: str) -> None:
    """An index that already exists, aliased for the tenant (deploy/README.md §4), holds
    documents under its own tool's ``_id``s. An upsert of such an id replaces that document
    (a search, a read and the listing show the new one, once); a delete by id, of one id or
    several, takes it down and counts it; a delete's version still wins over an older
    upsert of the id run after it; another tenant's document of the same id stays, and a
    drop takes what the tool wrote too. (Shared with the live suite.)"""
    alias = backend.alias(index, "acme")
    concrete = f"{alias}-theirs"  # the operator's own index, not one Sift made
    template = index_template(backend.prefix, backend.fields, backend.index_settings)
    mappings = {k: v for k, v in template["template"]["mappings"].items() if k != "_meta"}
    es = backend._client
    es.indices.create(index=concrete, aliases={alias: {}}, mappings=mappings)
    theirs = {
        "cat-1": shared_doc("acme", "cat-1", "alpha cat old"),
        "cat-2": shared_doc("acme", "cat-2", "alpha cat two"),
        "cat-4": shared_doc("acme", "cat-4", "alpha cat four"),
        "raw-3": {k: v for k, v in shared_doc("acme", "_", "alpha raw").items() if k != "doc_id"},
        "beta-cat-1": shared_doc("beta", "cat-1", "alpha beta's cat"),
    }
    for es_id, source in theirs.items():
        es.index(index=alias, id=es_id, document=source, refresh="wait_for")

    def searched() -> dict[str, str]:
        hits = TestStatefulElasticsearchContract().search(backend, index, "acme", "alpha cat raw")
        found = [(h.document.id, h.document.text) for h in hits.hits["bm25"]]
        assert len(found) == len(dict(found)), found  # no id twice
        return dict(found)

    new = Document("cat-1", "alpha cat new")
    assert backend.upsert(index, "acme", [new], vectors_of([new]), version=2) == 1
    assert searched() == {
        "cat-1": "alpha cat new",
        "cat-2": "alpha cat two",
        "cat-4": "alpha cat four",
        "raw-3": "alpha raw",
    }
    got = backend.document(index, "acme", "cat-1")
    assert got is not None and got.text == "alpha cat new"
    listed = backend.documents(index, "acme", None, 10) or []
    assert [d.id for d in listed] == ["cat-1", "cat-2", "cat-4"]
    assert backend.delete_documents(index, "acme", ["cat-2"], version=3) == 1
    assert backend.delete_documents(index, "acme", ["raw-3", "cat-1", "never"], version=4) == 2
    assert searched() == {"cat-4": "alpha cat four"}
    assert backend.stored_documents(index, "acme", ["cat-1", "cat-2", "raw-3"]) == {}
    older = Document("cat-2", "alpha cat two again")  # accepted before the delete, run after
    assert backend.upsert(index, "acme", [older], vectors_of([older]), version=2) == 0
    assert backend.document(index, "acme", "cat-2") is None
    assert es.get(index=concrete, id="beta-cat-1")["_source"]["tenant"] == "beta"
    assert backend.delete_index(index, "acme", version=5) == 1
    assert backend.document(index, "acme", "cat-4") is None
    assert es.get(index=concrete, id="beta-cat-1")["_source"]["tenant"] == "beta"


def test_writes_by_id_replace_and_take_down_what_another_tool_wrote_under_its_own_id(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """:func:`writes_by_id_replace_what_another_tool_wrote` on the stand-in."""
    writes_by_id_replace_what_another_tool_wrote(backend_on(fake[0]), "docs")


def test_a_write_by_id_in_an_index_a_reindex_copied_from_another_tools_replaces_its_id(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """A reindex of an alias over an index another tool wrote copies each document under
    its ``_id``: the index Sift made (named as Sift names its indexes) holds the tool's
    ``_id``s too, and an upsert and a delete by id there replace and take down the tool's
    document as in the tool's own index."""
    server, state = fake
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    make_index(server, alias, "catalogue", {"cat-1": shared_doc("acme", "cat-1", "alpha old")})
    new = backend.reindex("docs", "acme", delete_old=True)
    assert state.concrete(alias) == [new] and state.live_ids(new) == {"cat-1"}
    fresh = Document("cat-1", "alpha new")
    assert backend.upsert("docs", "acme", [fresh], vectors_of([fresh]), version=2) == 1
    assert state.live_ids(new) == {document_es_id("acme", "cat-1")}
    assert backend.delete_documents("docs", "acme", ["cat-1"], version=3) == 1
    assert state.live_ids(new) == set()


def test_the_stand_in_lists_running_tasks_as_es_does(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """``GET _tasks``: the running tasks whose action matches ``actions``, each with its
    description only when ``detailed`` is true (what finds a copy to wait on)."""
    server, state = fake
    es = client(server)
    es.indices.create(index="a~1", aliases={"a": {}})
    state.copy_running_reads = 1
    task = es.reindex(source={"index": "a"}, dest={"index": "b"}, wait_for_completion=False)
    with warnings.catch_warnings():  # the client calls the task list a technical preview
        warnings.simplefilter("ignore", GeneralAvailabilityWarning)
        detailed = es.tasks.list(actions="*reindex", detailed=True).body
        plain = es.tasks.list(actions="*reindex").body
        other = es.tasks.list(actions="*search", detailed=True).body
    listed = detailed["nodes"]["fakenode"]["tasks"][task["task"]]
    assert listed["description"] == "reindex from [a] to [b]"
    assert "description" not in plain["nodes"]["fakenode"]["tasks"][task["task"]]
    assert other == {"nodes": {}}


def test_an_index_made_again_by_a_previous_release_worker_is_mapped_again_on_the_retry(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """This worker mapped acme's fields (once per alias); a worker of the previous release
    (a rolling upgrade) dropped acme's index and made it again from its own template,
    without the metadata-terms field. This worker's next write is refused by ``dynamic:
    strict`` for that field: a retryable failure that lets the memo go, so the job's retry
    maps the field and writes, instead of failing for good while the process lives."""
    server, _state = fake
    backend = backend_on(server)
    first = Document("a", "alpha a", "", "1", {"year": 5})
    assert backend.upsert("docs", "acme", [first], vectors_of([first]), version=1) == 1
    previous = backend_on(server, elasticsearch_metadata_terms_field="")
    previous.delete_index("docs", "acme", version=2)
    old = Document("o", "alpha o", "", "1", {"year": 5})
    assert previous.upsert("docs", "acme", [old], vectors_of([old]), version=3) == 1
    later = Document("b", "alpha b", "", "1", {"year": 5.0})
    with pytest.raises(BackendUnavailable, match="metadata_terms"):
        backend.upsert("docs", "acme", [later], vectors_of([later]), version=4)
    assert backend.upsert("docs", "acme", [later], vectors_of([later]), version=4) == 1
    assert filtered(backend, "acme", year=5) == {"o", "b"}
    assert filtered(backend, "acme", year="5") == {"o"}  # the old one, compared as text


def redelivery_window() -> float:
    """The longest an ingest task, taken before a later delete ran, can still write at the
    defaults (:func:`ingest_redelivery_window`)."""
    return ingest_redelivery_window(load_settings(redis_url="redis://localhost"))


def test_the_stand_in_forgets_a_tombstone_after_gc_deletes_as_es_does(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """ES's default ``index.gc_deletes`` is 60 s: after that, an external-versioned write
    older than the delete is applied (the stand-in's clock moved on, no waiting)."""
    server, state = fake
    es = client(server)
    es.indices.create(index="plain")
    es.index(index="plain", id="x", document={}, version=5, version_type="external")
    delete = {"_index": "plain", "_id": "x", "version": 7, "version_type": "external"}
    assert es.bulk(operations=[{"delete": delete}])["items"][0]["delete"]["result"] == "deleted"
    with pytest.raises(ConflictError):
        es.index(index="plain", id="x", document={}, version=6, version_type="external")
    with state.lock:
        state.now += 61
    assert (
        es.index(index="plain", id="x", document={}, version=6, version_type="external")["result"]
        == "created"
    )


def test_a_delete_wins_over_an_older_ingest_redelivered_at_the_end_of_the_window(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """An ingest accepted before a delete of the same id, whose worker was killed after it
    took the message (the delete ran meanwhile), redelivered as late as the defaults allow:
    the delete's tombstone still refuses it (Sift's index template sets ``gc_deletes`` past
    that window), so the document stays deleted and the ingest reports nothing written."""
    server, state = fake
    backend = backend_on(server)
    assert write(backend, CALC, version=10) == 1
    assert backend.delete_documents("docs", "acme", ["calc"], version=12) == 1
    with state.lock:
        state.now += redelivery_window()
    assert write(backend_on(server), CALC, version=11) == 0
    assert backend.document("docs", "acme", "calc") is None


def test_a_delete_or_drop_run_again_reports_0_on_elasticsearch(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """What deploy/README.md §6 says of a delete or drop whose worker died after ES applied
    it: the rerun changes nothing and reports 0 (a tombstone does not say whether a
    document existed; the drop finds the alias gone), unlike the embedded backend."""
    server, _state = fake
    backend = backend_on(server)
    assert write(backend, CALC, version=10) == 1
    assert write(backend, DOC, version=11) == 1
    assert backend.delete_documents("docs", "acme", ["calc"], version=12) == 1
    assert backend_on(server).delete_documents("docs", "acme", ["calc"], version=12) == 0
    assert backend.document("docs", "acme", "calc") is None
    assert backend.delete_index("docs", "acme", version=13) == 1
    assert backend_on(server).delete_index("docs", "acme", version=13) == 0
    assert backend.index_info("docs", "acme") is None


def test_a_documents_page_of_long_texts_leaves_the_texts_in_elasticsearch(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """A listing shows 200 characters of each text, and its search fetched every text
    whole to cut it in the worker: this page of 20 texts of 100,000 characters came back
    as 2 MB. Now Elasticsearch cuts the preview and counts the length (script fields), and
    the page's answer holds 200 characters of each text, whatever the texts' length."""
    server, state = fake
    answered: list[int] = []

    def measured(request: Recorded) -> Answer | None:
        answer = state(request)
        if answer is not None and request.path.endswith("/_search") and b'"sort"' in request.body:
            answered.append(len(json.dumps(answer.body)))
        return answer

    server.fallback = measured
    backend = backend_on(server)
    docs = [Document(f"d{n:02}", f"{n} " + "long text " * 10_000, "T", "1", {}) for n in range(20)]
    assert backend.upsert("docs", "acme", docs, vectors_of(docs)) == 20
    listed = backend.documents("docs", "acme", None, 100)
    assert [(d.text_preview, d.text_length) for d in listed or []] == [
        (d.text[:200], len(d.text)) for d in docs
    ]
    (size,) = answered
    assert size < 20 * 1_000, size  # a preview, an id, a title, a version and a few keys each


def test_a_document_whose_text_is_null_reads_as_empty_listed_or_got(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """A document of an operator's index may hold ``"text": null``. The listing's scripts
    read it as empty (preview ``""``, length 0), and ``GET`` of the same document said
    ``"None"`` (Python's ``str`` of the null): the two reads of one document disagreed,
    and neither text was ever written."""
    server, _ = fake
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    mappings = index_template("sift-", FieldNames(), IndexSettings(64))["template"]["mappings"]
    held = {**shared_doc("acme", "n", "x"), "text": None}
    make_index(server, alias, f"{alias}~000001", {"acme:n": held}, mappings)
    (listed,) = backend.documents("docs", "acme", None, 10) or []
    assert (listed.text_preview, listed.text_length) == ("", 0)
    got = backend.document("docs", "acme", "n")
    assert got is not None and got.text == ""


def _a_shared_drop_outlasting_its_budget(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
    monkeypatch: pytest.MonkeyPatch,
    acme_ids: list[str],
    version: int,
) -> str:
    """acme's alias over an index it shares with beta (acme's ``acme_ids``, beta's ``vitd``),
    and acme's drop at ``version`` whose ``_delete_by_query`` task outlasted the drop's
    budget (the drop failed retryably; the task runs on). Answers the alias."""
    server, state = fake
    monkeypatch.setattr(
        "worker.adapters.elasticsearch._drops.DROP_POLL_SECONDS", 0.01, raising=False
    )
    backend = backend_on(server)
    alias = backend.alias("docs", "acme")
    texts = {"vitd": DOC.text, "calc": CALC.text}
    docs = {f"acme:{id_}": shared_doc("acme", id_, texts[id_]) for id_ in acme_ids}
    docs["beta:vitd"] = shared_doc("beta", "vitd", "beta's own")
    make_index(server, alias, "shared-000001", docs, old_mapping())
    state.delete_running_reads = 5
    backend.drop_max_seconds = 0
    with pytest.raises(BackendUnavailable, match="runs on"):
        backend.delete_index("docs", "acme", version=version)
    return alias


def test_a_drop_from_a_shared_index_outlasting_its_budget_is_waited_on_by_its_retry(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """acme's alias over an index beta's documents share: its drop deletes only acme's,
    as a ``_delete_by_query`` task. One not done within the drop's budget fails the drop
    retryably; the retry, another process, waits on that task before it starts its own
    (not two racing), counts what both deleted, and beta's document stays."""
    server, state = fake
    alias = _a_shared_drop_outlasting_its_budget(fake, monkeypatch, ["vitd", "calc"], 20)

    state.delete_running_reads = 0
    assert backend_on(server).delete_index("docs", "acme", version=20) == 2
    assert len(server.sent("POST", f"/{alias}/_delete_by_query")) == 2  # the first, then its own
    assert state.live_ids("shared-000001") == {"beta:vitd"}
    assert state.concrete(alias) == ["shared-000001"]  # the shared index is never deleted


def test_a_drop_that_waits_on_an_older_drops_delete_still_takes_what_that_one_left(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """acme's alias over an index beta's documents share. Drop 12's delete task outlasts
    its budget and runs on; acme's ``calc`` is written at 14 meanwhile (accepted after drop
    12, so that task leaves it). Drop 20 finds the task still running on the alias and
    waits on it, then runs its own: ``calc``, written before drop 20, goes too."""
    server, state = fake
    _a_shared_drop_outlasting_its_budget(fake, monkeypatch, ["vitd"], 12)
    assert write(backend_on(server), CALC, 14) == 1

    state.delete_running_reads = 0
    assert backend_on(server).delete_index("docs", "acme", version=20) == 2
    assert state.live_ids("shared-000001") == {"beta:vitd"}


def test_a_reindex_of_an_alias_over_a_shared_index_copies_and_deletes_only_the_tenants(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """acme's and beta's aliases over one index an operator shares (deploy/README.md §4).
    Rebuilding acme's copies acme's documents only, and ``delete_old`` keeps the shared index,
    which beta's alias and documents live on (it copied all three documents and deleted the
    shared index, beta's alias with it). ``reindex_all`` (tenants unknown: each alias's own,
    by its key) does the same for beta's alias."""
    server, state = fake
    backend = backend_on(server)
    acme, beta = backend.alias("docs", "acme"), backend.alias("docs", "beta")
    docs = {
        "acme:vitd": shared_doc("acme", "vitd", DOC.text),
        "acme:calc": shared_doc("acme", "calc", CALC.text),
        "beta:vitd": shared_doc("beta", "vitd", "beta's own"),
    }
    make_index(server, acme, "shared-000001", docs, old_mapping())
    client(server).indices.update_aliases(
        actions=[{"add": {"index": "shared-000001", "alias": beta}}]
    )

    new = backend.reindex("docs", "acme", delete_old=True)
    assert state.live_ids(new) == {"acme:vitd", "acme:calc"}
    assert state.concrete(acme) == [new]
    assert state.concrete(beta) == ["shared-000001"]
    assert state.live_ids("shared-000001") == set(docs)

    rebuilt = dict(zip([acme, beta], backend.reindex_all("docs", delete_old=True), strict=True))
    assert state.live_ids(rebuilt[acme]) == {"acme:vitd", "acme:calc"}
    assert state.live_ids(rebuilt[beta]) == {"beta:vitd"}
    assert new not in state.indexes  # held acme's documents only: deleted
    assert state.live_ids("shared-000001") == set(docs)  # acme's still there: kept


def test_a_page_as_big_as_the_aggregation_still_says_more_follow(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker reads a page and one more, to say whether more follow; the count holds
    ``MAX_LISTED_INDEXES`` (here 2, for 1,000) indexes a search. A page of that size, or
    empty indexes among the names, must not end the list early: the next names are counted
    by another search. (It answered ``more: false`` with index c left.)"""
    from tests.integration.backend_contract import CORPUS
    from worker.queue.lifecycle import _indexes

    monkeypatch.setattr("worker.adapters.elasticsearch._listing.MAX_LISTED_INDEXES", 2)
    backend = backend_on(fake[0])
    for name in "abcde":
        assert backend.upsert(name, "acme", CORPUS[:1], vectors_of(CORPUS[:1])) == 1
    assert backend.delete_documents("b", "acme", [CORPUS[0].id], version=99) == 1  # b: empty

    def page(after: str | None, limit: int) -> tuple[list[str], bool]:
        read = _indexes(backend, None, "acme", json.dumps({"after": after, "limit": limit}))
        return [i["name"] for i in read["indexes"]], read["more"]

    assert page(None, 2) == (["a", "c"], True)  # b empty: the second search found c, and d
    assert page("c", 2) == (["d", "e"], False)
    assert page(None, 4) == (["a", "c", "d", "e"], False)


def test_two_processes_making_the_same_new_name_at_the_limits_edge_both_write(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch],
) -> None:
    """Two worker processes write into one new name of a tenant one below its limit: the
    second's ``HEAD _alias`` finds it missing, the first makes it before the second counts.
    The alias the second counts is the very one it writes into, no new one: both writes
    land, the tenant holds the limit's worth, none refused ``index_limit_reached``."""
    server, _state = fake
    first, second = (backend_on(server, max_indexes_per_tenant=2) for _ in range(2))
    first.upsert("sci", "acme", [DOC], vectors_of([DOC]), version=1)
    asked = second._alias_exists

    def head_then_the_other_creates(alias: str, what: str, index: str) -> bool:
        found = asked(alias, what, index)
        if not found and index == "med":  # the first process makes it meanwhile
            first.upsert("med", "acme", [DOC], vectors_of([DOC]), version=2)
        return found

    second._alias_exists = head_then_the_other_creates  # type: ignore[method-assign]
    other = Document(id="d2", text="another document", title="")
    assert second.upsert("med", "acme", [other], vectors_of([other]), version=3) == 1
    assert [(i.name, i.documents) for i in second.indexes("acme")] == [("med", 2), ("sci", 1)]


def _few(prefix: str, n: int) -> list[Document]:
    return [Document(id=f"{prefix}{i}", text=f"text {prefix} {i}") for i in range(n)]


def test_an_index_limit_refusal_names_no_index_that_holds_documents(fake: Any) -> None:
    """A reindex keeps the old concrete index for a rollback: counted among the tenant's
    indexes by ``_index``, it took one of the aggregation's buckets, so a live index with
    fewer documents had none and was named as holding none ("drop one")."""
    server, _ = fake
    backend = backend_on(server, max_indexes_per_tenant=2)
    backend.upsert("a", "acme", _few("a", 5), None, version=1)
    backend.upsert("b", "acme", _few("b", 1), None, version=2)
    backend.reindex("a", "acme")  # keeps the old "a" (5 documents)
    assert backend.index_info("b", "acme").documents == 1
    with pytest.raises(IndexLimitReached) as refused:
        backend.upsert("c", "acme", _few("c", 1), None, version=3)
    assert refused.value.unlisted == []


def _purge_env(redis_url: str, server: FakeElasticsearchServer) -> dict[str, str]:
    """``sift tenant purge``'s environment against this fake cluster."""
    return {
        "SIFT_REDIS_URL": redis_url,
        "SIFT_SEARCH_BACKEND": "elasticsearch",
        "SIFT_ELASTICSEARCH_URL": server.url,
        "SIFT_ELASTICSEARCH_VECTOR_DIMS": "64",
    }


def test_the_listing_counts_each_live_index_whatever_a_reindex_kept(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unfiltered, the listing's count by ``_index`` let kept concrete indexes take the
    aggregation's buckets (1,000; 3 here), and a small live index was left out."""
    server, _ = fake
    monkeypatch.setattr(_listing, "MAX_LISTED_INDEXES", 3)
    backend = backend_on(server)
    backend.upsert("a", "acme", _few("a", 5), None, version=1)
    backend.upsert("b", "acme", _few("b", 5), None, version=2)
    backend.upsert("c", "acme", _few("c", 1), None, version=3)
    backend.reindex("a", "acme")
    assert [i.name for i in backend.indexes("acme")] == ["a", "b", "c"]


def test_a_purge_drops_the_tenants_indexes_that_hold_no_document_too(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch], redis_url: str, store: Any
) -> None:
    """Acme's "faq" emptied by deletes by id, and "bio" made by a delete by id into a new
    name, are not listed (an index exists while it holds a document), yet each is an index
    of acme's key in the cluster: its shard, its deleted documents' data until its segments
    merge, and a place among the indexes a tenant given the name again may hold. The purge
    drops them with "docs"; globex's index of the same name, and the alias of acme's an
    operator pointed at globex's index (nothing of acme's in it), stay; a second run drops
    nothing. Before, the purge dropped the listed "docs" alone."""
    server, state = fake
    backend = backend_on(server)
    docs = [Document(f"d{i}", f"alpha {i}") for i in range(3)]
    backend.upsert("docs", "acme", docs, vectors_of(docs))
    backend.upsert("faq", "acme", docs[:2], vectors_of(docs[:2]))
    backend.delete_documents("faq", "acme", ["d0", "d1"], version=10)
    backend.delete_documents("bio", "acme", ["x"], version=11)
    backend.upsert("docs", "globex", docs, vectors_of(docs))
    (theirs,) = client(server).indices.get_alias(name=backend.alias("docs", "globex")).body
    pointed = {"add": {"index": theirs, "alias": backend.alias("ops", "acme")}}
    client(server).indices.update_aliases(actions=[pointed])
    stem = backend.tenant_stem("acme")
    assert [i.name for i in backend.indexes("acme")] == ["docs"]
    assert sorted(backend._aliases(f"{stem}*").values()) == [
        [backend.alias(name, "acme")] for name in ("bio", "docs", "faq", "ops")
    ]
    env = _purge_env(redis_url, server)

    ran = purge(env, "acme")

    assert ran.returncode == 0, ran.stdout + ran.stderr
    removed = purged(ran.stdout)
    assert (removed["indexes dropped"], removed["documents dropped"]) == (3, 3), ran.stdout
    assert backend._aliases(f"{stem}*") == {theirs: [backend.alias("ops", "acme")]}
    assert not [name for name in state.indexes if name.startswith(stem)]
    assert backend.index_info("docs", "globex").documents == len(docs)
    again = purge(env, "acme")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "tenant 'acme': nothing of it was found" in again.stdout, again.stdout


def test_a_purge_closes_the_new_index_an_unfinished_ingest_names(
    fake: tuple[FakeElasticsearchServer, StatefulElasticsearch], redis_url: str, store: Any
) -> None:
    """Acme's ingest into "fresh", a name it never had a document in, is running when the
    purge comes: the purge raises the floor of "fresh" too (no alias to delete), so the
    worker's write, reaching the backend after the purge at the version it was accepted
    at, lands nothing and makes no index. Before, only the indexes found in the cluster were
    dropped: "fresh" had no floor, and every document was written after the purge."""
    server, state = fake
    backend = backend_on(server)
    docs = _few("s", 3)
    job = store.create_ingest("acme", "fresh", [DocumentIn(id=d.id, text=d.text) for d in docs])
    assert store.start_ingest(job.id)
    env = _purge_env(redis_url, server)

    ran = purge(env, "acme")

    assert ran.returncode == 0, ran.stdout + ran.stderr
    # the worker running it writes now, at the version the ingest was accepted at
    assert backend.upsert("fresh", "acme", docs, vectors_of(docs), version=job.version) == 0
    assert backend.indexes("acme") == []
    stem = backend.tenant_stem("acme")
    assert not [name for name in state.indexes if name.startswith(stem)]
    removed = purged(ran.stdout)
    assert removed["ingests canceled"] == 1, ran.stdout
    closed = removed["indexes only its unfinished writes named, closed to them"]
    assert (removed["indexes dropped"], closed) == (0, 1), ran.stdout
    again = purge(env, "acme")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "tenant 'acme': nothing of it was found" in again.stdout, again.stdout

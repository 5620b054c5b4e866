"""The Elasticsearch adapter against a loopback ES 9 stand-in: the exact requests, the parsing,
the fused result through the pipeline, and the error mapping (no client-side retries).
"""

from __future__ import annotations

import hashlib
import inspect
import re
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest
from prometheus_client import REGISTRY

from tests.fakes import FakeEmbedder
from tests.integration.es_loopback import (
    Answer,
    FakeElasticsearchServer,
    Recorded,
    alias_missing,
    aliases,
    bulk_item,
    bulk_response,
    delete_by_query_response,
    delete_by_query_task,
    drop_counts,
    error_body,
    floor_found,
    floor_written,
    get_found,
    get_missing,
    hit,
    index_missing,
    is_probe,
    is_search,
    models_agg,
    msearch_response,
    probe_response,
    probes,
    probes_of_a_missing_index,
    reindex_response,
    require_alias_refused,
    resolved,
    running,
    search_response,
    tasks_list,
    tenants_composite,
    terms_by_index_response,
    version_conflict,
)
from tests.integration.es_stateful import stateful_server
from tests.services import purge, purged
from worker.adapters import elasticsearch
from worker.adapters.elasticsearch import (
    ElasticsearchBackend,
    FieldNames,
    IndexSettings,
    _search,
    index_template,
    num_candidates,
    tenant_key,
)
from worker.adapters.elasticsearch._listing import LENGTH_SCRIPT, PREVIEW_SCRIPT
from worker.constants import MAX_BM25_WORDS, MAX_FILTER_KEYS, MAX_QUERY_CHARS
from worker.contract import Channel, FilterValue, SearchSpec
from worker.core.pipeline import PipelineConfig, SearchPipeline
from worker.core.types import ChannelQuery, Document, HardFilters, IndexProbe
from worker.errors import (
    BackendAccessRefused,
    BackendRequestError,
    BackendUnavailable,
    ConfigError,
    DeadlineExceeded,
    EmbeddingModelMismatch,
    IndexLimitReached,
    IndexNotFound,
    InvalidRequest,
)
from worker.observability.metrics import PrometheusRecorder, snapshot
from worker.runtime.bootstrap import pipeline_config
from worker.settings import load_settings
from worker.write_versions import next_write_version

pytestmark = pytest.mark.integration

ACME = f"sift-{tenant_key('acme')}--docs"  # acme's own alias of Sift index "docs"
BETA = f"sift-{tenant_key('beta')}--docs"
CONCRETE = f"{ACME}~000001"
MSEARCH = f"/{ACME}/_msearch"  # acme's probes and searches alike
FLOORS = "sift-sift-floors"
FLOOR = f"/{FLOORS}/_doc/{ACME}"  # acme's drop floor for "docs"
#: The newest delete by id on acme's alias (the client sends the ``#`` of its id as %23).
DELETES = f"/{FLOORS}/_doc/{ACME}%23deletes"
#: Before a new index of the tenant's is made, its aliases are counted
#: (SIFT_MAX_INDEXES_PER_TENANT): ``GET _alias/<prefix><key>--*``.
ACME_ALIASES = f"/_alias/sift-{tenant_key('acme')}--*"
BETA_ALIASES = f"/_alias/sift-{tenant_key('beta')}--*"
RESOLVE = f"/_resolve/index/{ACME}*"  # a drop's one look for acme's concrete indexes
SOURCE = ["doc_id", "text", "title", "revision", "metadata", "tenant"]
VECTOR = [0.6, 0.8, 0.0]


@pytest.fixture
def server() -> Iterator[FakeElasticsearchServer]:
    yield from running(FakeElasticsearchServer())


def backend_for(server: FakeElasticsearchServer | str, **settings: Any) -> ElasticsearchBackend:
    url = server if isinstance(server, str) else server.url
    return ElasticsearchBackend.from_settings(
        load_settings(search_backend="elasticsearch", elasticsearch_url=url, **settings)
    )


def query(
    channels: tuple[Channel, ...] = ("bm25", "knn"),
    size: int = 120,
    tenant: str = "acme",
    timeout: float | None = 2.0,
    **fields: FilterValue,
) -> ChannelQuery:
    return ChannelQuery(
        index="docs",
        filters=HardFilters(tenant, fields),
        channels=channels,
        size=size,
        text="vitamin d fractures",
        vector=VECTOR if "knn" in channels else None,
        timeout_seconds=timeout,
    )


def bulk_ok(request: Recorded) -> Answer:
    lines = request.ndjson()
    items = [
        {
            "index": {
                "_index": CONCRETE,
                "_id": action["index"]["_id"],
                "_version": 1,
                "result": "created",
                "_shards": {"total": 2, "successful": 1, "failed": 0},
                "_seq_no": n,
                "_primary_term": 1,
                "status": 201,
            }
        }
        for n, action in enumerate(lines[0::2])
    ]
    return Answer(200, {"errors": False, "took": 7, "items": items})


def on_existing_index(server: FakeElasticsearchServer, alias: str = ACME) -> None:
    """The tenant's index exists (``HEAD _alias`` 200), made by another process or an earlier
    release: a write's first ``PUT _mapping`` adds the fields the template gained since."""
    server.on("HEAD", f"/_alias/{alias}", Answer(200))
    server.on("PUT", f"/{alias}/_mapping", Answer(200, {"acknowledged": True}))
    on_other_ids(server, alias)


def on_other_ids(server: FakeElasticsearchServer, alias: str = ACME, deleted: int = 0) -> None:
    """After a write by id, the ``_delete_by_query`` of the tenant's documents of its ids
    under ``_id``s other than Sift's (an index Sift wrote holds none: 0 deleted)."""
    server.on("POST", f"/{alias}/_delete_by_query", Answer(200, delete_by_query_response(deleted)))


def on_probes(server: FakeElasticsearchServer, answer: Answer, times: int | None = None) -> None:
    """Answer acme's channel probes (``POST /<acme's alias>/_msearch``) with ``answer``."""
    server.on("POST", MSEARCH, answer, times, when=is_probe)


def on_searches(server: FakeElasticsearchServer, answer: Answer, times: int | None = None) -> None:
    """Answer acme's channel searches (the same path as its probes) with ``answer``."""
    server.on("POST", MSEARCH, answer, times, when=is_search)


def probes_sent(server: FakeElasticsearchServer) -> list[Recorded]:
    return [r for r in server.sent("POST", MSEARCH) if is_probe(r)]


def searches_sent(server: FakeElasticsearchServer) -> list[Recorded]:
    return [r for r in server.sent("POST", MSEARCH) if is_search(r)]


def no_post_filter(body: Any) -> None:
    assert "post_filter" not in str(body)


# --- the write path -------------------------------------------------------------------


EXPECTED_TEMPLATE = {
    "index_patterns": ["sift-*"],
    "priority": 105,  # 100 + len("sift-")
    "template": {
        "settings": {
            "number_of_shards": 1,
            "number_of_replicas": 1,
            "index.gc_deletes": "27000s",
        },
        "mappings": {
            "dynamic": "strict",
            "_meta": {"sift": {"layout": "per-tenant", "prefix": "sift-"}},
            "properties": {
                "doc_id": {"type": "keyword"},
                "text": {"type": "text", "analyzer": "english"},
                "title": {"type": "text", "analyzer": "english"},
                "vector": {
                    "type": "dense_vector",
                    "dims": 384,
                    "index": True,
                    "similarity": "cosine",
                    "index_options": {"type": "int8_hnsw"},
                },
                "tenant": {"type": "keyword"},
                "revision": {"type": "keyword"},
                "metadata": {"type": "flattened"},
                "embedding_model": {"type": "keyword"},
                "metadata_terms": {"type": "keyword"},
                "write_version": {"type": "long"},
            },
        },
    },
    "_meta": {"managed_by": "sift"},
}


def test_first_upsert_puts_the_template_creates_index_and_alias_then_bulk_writes(
    server: FakeElasticsearchServer,
) -> None:
    server.on("HEAD", f"/_alias/{ACME}", Answer(404))
    server.on("GET", ACME_ALIASES, Answer(200, {}))  # a wildcard matching nothing
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on(
        "PUT",
        f"/{CONCRETE}",
        Answer(200, {"acknowledged": True, "shards_acknowledged": True, "index": CONCRETE}),
    )
    server.on("PUT", f"/{ACME}/_mapping", Answer(200, {"acknowledged": True}))
    server.on("PUT", "/_bulk", bulk_ok)
    on_other_ids(server)
    backend = backend_for(server)
    docs = [
        Document("d1", "Vitamin D and fractures", "Vit D", "r7", {"year": 2020, "lang": "en"}),
        Document("d2", "Statins lower LDL", "", "r1", {}),
    ]
    assert backend.upsert("docs", "acme", docs, [VECTOR, [0.0, 1.0, 0.0]]) == 2

    assert [(r.method, r.path) for r in server.requests] == [
        ("HEAD", f"/_alias/{ACME}"),
        ("GET", ACME_ALIASES),  # acme holds none: under its limit of indexes
        ("PUT", "/_index_template/sift-sift"),
        ("PUT", f"/{CONCRETE}"),
        ("PUT", f"/{ACME}/_mapping"),
        ("PUT", "/_bulk"),
        ("POST", f"/{ACME}/_delete_by_query"),  # the ids under other _ids: none here
    ]
    assert server.requests[2].json() == EXPECTED_TEMPLATE
    assert server.requests[3].json() == {"aliases": {ACME: {}}}
    # the index just made may come from a template an earlier release's worker put since
    # this one's: the fields writes carry are mapped on it all the same
    assert server.requests[4].json() == {
        "properties": {
            "embedding_model": {"type": "keyword"},
            "metadata_terms": {"type": "keyword"},
            "write_version": {"type": "long"},
        }
    }
    bulk = server.requests[5]
    # require_alias: a write whose alias another worker dropped is refused, not auto-created
    assert bulk.query == {"refresh": ["wait_for"], "require_alias": ["true"]}
    assert bulk.headers["content-type"] == (
        "application/vnd.elasticsearch+x-ndjson; compatible-with=9"
    )
    assert bulk.ndjson() == [
        {"index": {"_id": "acme:d1", "_index": ACME}},
        {
            "doc_id": "d1",
            "text": "Vitamin D and fractures",
            "title": "Vit D",
            "tenant": "acme",
            "revision": "r7",
            "metadata": {"year": 2020, "lang": "en"},
            "metadata_terms": ["lang=s:en", "year=n:2020"],
            "vector": VECTOR,
        },
        {"index": {"_id": "acme:d2", "_index": ACME}},
        {
            "doc_id": "d2",
            "text": "Statins lower LDL",
            "title": "",
            "tenant": "acme",
            "revision": "r1",
            "metadata": {},
            "metadata_terms": [],
            "vector": [0.0, 1.0, 0.0],
        },
    ]

    # then acme's documents of those ids under other _ids (an index that already exists,
    # aliased for acme, holds its own tool's _ids), by the id field or an _id without it
    other_ids = server.requests[6]
    assert other_ids.query == {"conflicts": ["proceed"]}
    untagged = {
        "bool": {
            "filter": [{"ids": {"values": ["d1", "d2"]}}],
            "must_not": [{"exists": {"field": "doc_id"}}],
        }
    }
    assert other_ids.json() == {
        "query": {
            "bool": {
                "filter": [{"term": {"tenant": "acme"}}],
                "should": [{"terms": {"doc_id": ["d1", "d2"]}}, untagged],
                "minimum_should_match": 1,
                "must_not": [{"ids": {"values": ["acme:d1", "acme:d2"]}}],
            }
        }
    }

    # acme's index is known now: its next upsert goes straight to _bulk
    assert backend.upsert("docs", "acme", [Document("d3", "again", revision="r")], None) == 1
    assert [(r.method, r.path) for r in server.requests[7:]] == [
        ("PUT", "/_bulk"),
        ("POST", f"/{ACME}/_delete_by_query"),
    ]
    assert server.requests[7].ndjson()[0] == {"index": {"_id": "acme:d3", "_index": ACME}}


def test_the_analyzer_setting_goes_into_the_template_of_text_and_title(
    server: FakeElasticsearchServer,
) -> None:
    """SIFT_ELASTICSEARCH_ANALYZER maps both text fields of the indexes made from the template
    (with no prefix, of each index created: it carries its mapping itself); nothing else
    changes, and no write maps it on an index made before (``_mapping`` adds fields only)."""
    server.on("HEAD", f"/_alias/{ACME}", Answer(404))
    server.on("GET", ACME_ALIASES, Answer(200, {}))
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on("PUT", f"/{CONCRETE}", Answer(200, {"acknowledged": True, "index": CONCRETE}))
    server.on("PUT", f"/{ACME}/_mapping", Answer(200, {"acknowledged": True}))
    server.on("PUT", "/_bulk", bulk_ok)
    on_other_ids(server)
    backend = backend_for(server, elasticsearch_analyzer="french")
    assert backend.upsert("docs", "acme", [Document("d1", "l'église", revision="r")], None) == 1

    template = server.requests[2].json()
    properties = template["template"]["mappings"]["properties"]
    assert properties["text"] == {"type": "text", "analyzer": "french"}
    assert properties["title"] == {"type": "text", "analyzer": "french"}
    expected = EXPECTED_TEMPLATE["template"]["mappings"]["properties"]
    assert {k: v for k, v in properties.items() if k not in ("text", "title")} == {
        k: v for k, v in expected.items() if k not in ("text", "title")
    }
    assert "text" not in server.requests[4].json()["properties"]
    bare = backend_for(server, elasticsearch_analyzer="standard", elasticsearch_index_prefix="")
    created = bare._explicit_body()["mappings"]["properties"]
    assert created["text"]["analyzer"] == created["title"]["analyzer"] == "standard"


def test_a_tenant_at_its_limit_of_indexes_makes_none_and_is_told_its_empty_ones(
    server: FakeElasticsearchServer,
) -> None:
    """At SIFT_MAX_INDEXES_PER_TENANT, acme's aliases counted, a new name is not made: one
    tenant-filtered ``size: 0`` count by ``_index`` finds which of its indexes hold none of
    its documents (so are not listed), for the refusal to name, and nothing else is sent."""
    sci, bio = (f"sift-{tenant_key('acme')}--{name}" for name in ("sci", "bio"))
    server.on("HEAD", f"/_alias/{ACME}", Answer(404))
    held = aliases((f"{sci}~000001", sci), (f"{bio}~000001", bio))
    server.on("GET", ACME_ALIASES, Answer(200, held))
    counted = {
        "took": 2,
        "timed_out": False,
        "_shards": {"total": 2, "successful": 2, "skipped": 0, "failed": 0},
        "hits": {"total": {"value": 3, "relation": "eq"}, "max_score": None, "hits": []},
        "aggregations": {
            "indexes": {
                "doc_count_error_upper_bound": 0,
                "sum_other_doc_count": 0,
                "buckets": [{"key": f"{sci}~000001", "doc_count": 3}],
            }
        },
    }
    server.on("POST", f"{ACME_ALIASES.removeprefix('/_alias')}/_search", Answer(200, counted))
    backend = backend_for(server, max_indexes_per_tenant=2)
    with pytest.raises(IndexLimitReached) as refused:
        backend.upsert("docs", "acme", [Document("d1", "x")], None)
    assert refused.value.held == 2 and refused.value.unlisted == ["bio"]
    assert [(r.method, r.path) for r in server.requests] == [
        ("HEAD", f"/_alias/{ACME}"),
        ("GET", ACME_ALIASES),
        ("POST", f"{ACME_ALIASES.removeprefix('/_alias')}/_search"),
    ]
    # on the aliases' own indexes only: one a reindex kept would take a bucket
    assert server.requests[2].json() == {
        "size": 0,
        "query": {
            "bool": {
                "filter": [
                    {"term": {"tenant": "acme"}},
                    {"terms": {"_index": [f"{bio}~000001", f"{sci}~000001"]}},
                ]
            }
        },
        "aggs": {"indexes": {"terms": {"field": "_index", "size": 2}}},
    }
    assert server.requests[2].query == {
        "ignore_unavailable": ["true"],
        "allow_no_indices": ["true"],
    }


def test_two_tenants_writing_one_name_each_get_their_own_physical_index(
    server: FakeElasticsearchServer,
) -> None:
    """Beta's first write into "docs", which acme already holds, makes beta's own index:
    the same requests as a first write into a name nobody has (no timing tells them apart),
    and no byte of it reaches acme's index."""
    on_existing_index(server)
    server.on("HEAD", f"/_alias/{BETA}", Answer(404))
    server.on("GET", BETA_ALIASES, Answer(200, {}))  # beta's own count: acme's not in it
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on("PUT", f"/{BETA}~000001", Answer(200, {"acknowledged": True, "index": BETA}))
    server.on("PUT", f"/{BETA}/_mapping", Answer(200, {"acknowledged": True}))
    server.on("PUT", "/_bulk", bulk_ok)
    on_other_ids(server, BETA)
    backend = backend_for(server)
    assert backend.upsert("docs", "acme", [Document("d1", "acme's text")], None) == 1
    server.requests.clear()
    assert backend.upsert("docs", "beta", [Document("d1", "other tenant", revision="")], None) == 1
    assert [(r.method, r.path) for r in server.requests] == [
        ("HEAD", f"/_alias/{BETA}"),
        ("GET", BETA_ALIASES),
        ("PUT", "/_index_template/sift-sift"),  # once per process: acme's index existed
        ("PUT", f"/{BETA}~000001"),
        ("PUT", f"/{BETA}/_mapping"),
        ("PUT", "/_bulk"),
        ("POST", f"/{BETA}/_delete_by_query"),
    ]
    assert server.requests[3].json() == {"aliases": {BETA: {}}}
    action, source = server.requests[5].ndjson()
    assert action == {"index": {"_id": "beta:d1", "_index": BETA}}
    assert "vector" not in source and source["tenant"] == "beta"
    assert len(source["revision"]) == 16  # derived from the content when none came
    assert ACME != BETA and ACME not in str([r.path for r in server.requests])
    assert ACME.encode() not in b"".join(r.body for r in server.requests)


@pytest.mark.parametrize(
    "tenant", ["Acme Corp", "org:42/team?x", "ÜNÏCODE*<>|,#", "-_+lead", "a" * 300, ".."]
)
def test_a_tenant_id_es_refuses_in_a_name_still_makes_a_valid_index_name(
    server: FakeElasticsearchServer, tenant: str
) -> None:
    """Tenant ids are free text: the name holds a fixed-length hex key of it, so capitals,
    ``:``, ``/``, ``*``, spaces, Unicode or a leading ``-`` never reach ES, and the longest
    Sift name under the longest prefix still fits ES's 255 bytes with a reindex's stamp."""
    longest = "n" * 128
    backend = backend_for(server, elasticsearch_index_prefix="p" * 64)
    alias = backend.alias(longest, tenant)
    assert alias == f"{'p' * 64}{tenant_key(tenant)}--{longest}"
    assert len(f"{alias}-20261201t205337123456".encode()) <= 255
    assert re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", alias)
    for forbidden in '\\/*?"<>|,# :':
        assert forbidden not in backend_for(server).alias("docs", tenant)
    with pytest.raises(ConfigError, match=r"SIFT_ELASTICSEARCH_INDEX_PREFIX.* 64"):
        load_settings(elasticsearch_index_prefix="p" * 65)
    assert server.requests == []


def test_an_index_created_by_a_racing_worker_is_fine(server: FakeElasticsearchServer) -> None:
    server.on("HEAD", f"/_alias/{ACME}", Answer(200))  # the racing worker made both
    server.on("HEAD", f"/_alias/{ACME}", Answer(404), times=1)
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on(
        "PUT",
        f"/{CONCRETE}",
        Answer(400, error_body("resource_already_exists_exception", "index exists")),
    )
    server.on("PUT", f"/{ACME}/_mapping", Answer(200, {"acknowledged": True}))
    server.on("PUT", "/_bulk", bulk_ok)
    on_other_ids(server)
    assert backend_for(server).upsert("docs", "acme", [Document("d1", "x")], None) == 1
    # the racing worker's index may be of an earlier template: the new fields are added
    assert server.sent("PUT", f"/{ACME}/_mapping")


def test_bulk_item_errors_name_the_documents(server: FakeElasticsearchServer) -> None:
    on_existing_index(server)

    def partly(request: Recorded) -> Answer:
        failed = {
            "index": {
                "_index": CONCRETE,
                "_id": "acme:bad",
                "status": 400,
                "error": {
                    "type": "document_parsing_exception",
                    "reason": "[1:20] failed to parse field [vector]",
                },
            }
        }
        answer = bulk_ok(request)
        answer.body["errors"] = True
        answer.body["items"][1] = failed
        return answer

    server.on("PUT", "/_bulk", partly)
    docs = [Document("good", "x"), Document("bad", "y")]
    with pytest.raises(BackendRequestError, match=r"bad \(400 document_parsing_exception"):
        backend_for(server).upsert("docs", "acme", docs, None)


def test_a_bulk_item_refusing_sifts_credentials_is_a_config_error_without_es_reason(
    server: FakeElasticsearchServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A bulk write whose items ES refused for Sift's role (403) named each document with
    ES's reason (the service user, its roles, the concrete index): now its cause's type."""
    on_existing_index(server)
    kind, reason = ACCESS_REFUSED[403]

    def refused(request: Recorded) -> Answer:
        answer = bulk_ok(request)
        answer.body["errors"] = True
        answer.body["items"][1] = {
            "index": {"_index": CONCRETE, "_id": "acme:bad", "status": 403,
                      "error": {"type": kind, "reason": reason}},
        }  # fmt: skip
        return answer

    server.on("PUT", "/_bulk", refused)
    docs = [Document("good", "x"), Document("bad", "y")]
    with pytest.raises(BackendAccessRefused) as caught:
        backend_for(server).upsert("docs", "acme", docs, None)
    message = str(caught.value)
    assert "bad (403 security_exception)" in message and "SIFT_ELASTICSEARCH_API_KEY" in message
    for secret in ("sift_svc", "sift_reader", tenant_key("acme")):
        assert secret not in message, message
    assert reason in caplog.text


def test_bulk_rejections_are_retryable(server: FakeElasticsearchServer) -> None:
    on_existing_index(server)

    def rejected(request: Recorded) -> Answer:
        answer = bulk_ok(request)
        answer.body["errors"] = True
        answer.body["items"][0] = {
            "index": {
                "_id": "acme:d1",
                "status": 429,
                "error": {"type": "es_rejected_execution_exception", "reason": "queue full"},
            }
        }
        return answer

    server.on("PUT", "/_bulk", rejected)
    with pytest.raises(BackendUnavailable, match="d1"):
        backend_for(server).upsert("docs", "acme", [Document("d1", "x")], None)
    assert len(server.sent("PUT", "/_bulk")) == 1  # the helper did not retry by itself


TASK = "oTUltX4IQMOUUVeiohTt8A:12345"


def on_copies(server: FakeElasticsearchServer, created: int) -> None:
    """A copy as a task: no reindex running yet, ``_reindex`` answers its task, which is done
    at the first read (``GET _tasks/<id>``: ``completed`` and the reindex report)."""
    server.on("GET", "/_tasks", Answer(200, {"nodes": {}}))
    server.on("POST", "/_reindex", Answer(200, {"task": TASK}))
    done = {"completed": True, "task": {"node": "oTUltX4IQMOUUVeiohTt8A", "id": 12345}}
    server.on(
        "GET",
        f"/_tasks/{TASK.replace(':', '%3A')}",
        Answer(200, {**done, "response": reindex_response(created)}),
    )


def test_reindex_builds_a_new_index_and_swaps_the_alias_atomically(
    server: FakeElasticsearchServer,
) -> None:
    """Acme's index only: a new concrete index under acme's alias, ``_reindex`` keeping each
    document's version (``version_type: external``), then one atomic alias swap."""
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on("GET", f"/_alias/{ACME}", Answer(200, aliases((CONCRETE, ACME))))
    on_copies(server, 2)
    backend = backend_for(server, elasticsearch_vector_quantization="hnsw")
    # Any PUT or POST of /<acme's alias>~2... is the new index.
    original = server._answer

    def answer(request: Recorded) -> Answer:
        if request.method in ("PUT", "POST") and request.path.startswith(f"/{ACME}~2"):
            return Answer(200, {"acknowledged": True, "_shards": {"total": 1}})
        return original(request)

    server._answer = answer  # type: ignore[method-assign]
    server.on("POST", "/_aliases", Answer(200, {"acknowledged": True}))
    new = backend.reindex("docs", "acme")

    assert new.startswith(f"{ACME}~2")
    steps = [(r.method, r.path) for r in server.requests]
    assert steps == [
        ("GET", f"/_alias/{ACME}"),
        ("GET", "/_tasks"),  # no copy from acme's alias running (an earlier run's)
        ("PUT", "/_index_template/sift-sift"),
        ("PUT", f"/{new}"),
        ("POST", "/_reindex"),
        ("GET", f"/_tasks/{TASK.replace(':', '%3A')}"),  # polled until done
        ("POST", f"/{new}/_refresh"),
        ("PUT", f"/{new}/_mapping"),  # fields an earlier release's template may lack
        ("POST", "/_aliases"),
    ]
    template = server.requests[2].json()
    assert template["template"]["mappings"]["properties"]["vector"]["index_options"] == {
        "type": "hnsw"
    }
    assert server.requests[4].json() == {
        "dest": {"index": new, "version_type": "external"},
        # acme's documents only: an operator's alias may be over an index tenants share
        "source": {"index": ACME, "query": {"bool": {"filter": [{"term": {"tenant": "acme"}}]}}},
        "conflicts": "proceed",  # a newer version already there stays
    }
    assert server.requests[4].query == {"wait_for_completion": ["false"]}
    assert server.requests[1].query == {"actions": ["*reindex"], "detailed": ["true"]}
    assert server.requests[7].json() == {
        "properties": {
            "embedding_model": {"type": "keyword"},
            "metadata_terms": {"type": "keyword"},
            "write_version": {"type": "long"},
        }
    }
    assert server.requests[8].json() == {
        "actions": [
            {"remove": {"index": CONCRETE, "alias": ACME}},
            {"add": {"index": new, "alias": ACME}},
        ]
    }
    # a tenant with no such index: IndexNotFound, nothing made
    server.on("GET", f"/_alias/{BETA}", Answer(404, alias_missing(BETA)))
    with pytest.raises(IndexNotFound):
        backend.reindex("docs", "beta")
    assert server.requests[-1].path == f"/_alias/{BETA}"


def test_the_task_api_is_read_without_the_clients_preview_warning(
    server: FakeElasticsearchServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET _tasks`` and ``GET _tasks/<id>`` (polled every second while a copy or a
    tenant's delete runs) go out as the client's own requests would, without its preview
    decorator: that walked ``inspect.stack()`` (reading the source of every frame, about
    0.4 s of CPU a call in a worker's deep stack) to place a warning Sift then hid inside
    ``warnings.catch_warnings()``, which swaps the process's filters under its other threads."""
    on_copies(server, 2)
    backend = backend_for(server)

    def no_stack_walk(*args: object, **kwargs: object) -> None:
        raise AssertionError("inspect.stack() walked")

    monkeypatch.setattr(inspect, "stack", no_stack_walk)
    filters = list(warnings.filters)
    assert backend._running_tasks("*reindex") == {}
    assert backend._task(TASK)["completed"] is True
    assert warnings.filters == filters
    assert [(r.method, r.path, r.query) for r in server.requests] == [
        ("GET", "/_tasks", {"actions": ["*reindex"], "detailed": ["true"]}),
        ("GET", f"/_tasks/{TASK.replace(':', '%3A')}", {}),
    ]
    assert all(r.headers.get("accept", "").startswith("application/") for r in server.requests)


def test_reindex_all_rebuilds_every_tenants_index_of_the_name_and_no_other(
    server: FakeElasticsearchServer,
) -> None:
    """An operator knows a name, not its tenants: every ``<prefix><key>--docs`` alias is
    rebuilt, and acme's ``foo--docs`` (which the pattern also matches) is not."""
    other = f"sift-{tenant_key('acme')}--foo--docs"
    found = aliases((CONCRETE, ACME), (f"{BETA}~000001", BETA), (f"{other}~000001", other))
    server.on("GET", "/_alias/sift-*--docs", Answer(200, found))
    for alias, tenant in ((ACME, "acme"), (BETA, "beta")):
        server.on("GET", f"/_alias/{alias}", Answer(200, aliases((f"{alias}~000001", alias))))
        counts = {tenant: 2}
        server.on("POST", f"/{alias}/_search", lambda r, c=counts: tenants_composite(r, c))
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    on_copies(server, 1)
    server.on("POST", "/_aliases", Answer(200, {"acknowledged": True}))
    original = server._answer

    def answer(request: Recorded) -> Answer:
        if request.method in ("PUT", "POST") and "--docs~2" in request.path:
            return Answer(200, {"acknowledged": True, "_shards": {"total": 1}})
        return original(request)

    server._answer = answer  # type: ignore[method-assign]
    rebuilt = backend_for(server).reindex_all("docs")
    assert [name.rsplit("~", 1)[0] for name in rebuilt] == sorted([ACME, BETA])
    swaps = [r.json()["actions"][-1]["add"]["alias"] for r in server.sent("POST", "/_aliases")]
    assert swaps == sorted([ACME, BETA])
    # each alias's tenants found by a composite aggregation, and only theirs copied
    copied = [r.json()["source"]["query"] for r in server.sent("POST", "/_reindex")]
    assert copied == [
        {"bool": {"filter": [{"term": {"tenant": tenant}}]}}
        for _, tenant in sorted([(ACME, "acme"), (BETA, "beta")])
    ]
    assert other not in str([r.path for r in server.requests[1:]])


# --- the read path: exact msearch bodies -----------------------------------------------------


def bm25_body(size: int, filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "size": size,
        "query": {
            "bool": {
                "must": {
                    "multi_match": {
                        "query": "vitamin d fractures",
                        "fields": ["title", "text"],
                        "type": "best_fields",
                        "operator": "or",
                    }
                },
                "filter": filters,
            }
        },
        "_source": SOURCE,
        "track_total_hits": False,
    }


def knn_body(size: int, candidates: int, filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "size": size,
        "knn": {
            "field": "vector",
            "query_vector": VECTOR,
            "k": size,
            "num_candidates": candidates,
            "filter": filters,
        },
        "_source": SOURCE,
        "track_total_hits": False,
    }


PATHS: list[tuple[tuple[Channel, ...], dict[str, FilterValue]]] = [
    (("bm25",), {}),
    (("knn",), {}),
    (("bm25", "knn"), {}),
    (("bm25",), {"lang": "en", "year": 2020}),
    (("knn",), {"lang": "en", "year": 2020}),
    (("bm25", "knn"), {"lang": "en", "year": 2020, "open": True}),
]


def metadata_filter(
    token: str, as_text: dict[str, str | list[str]], terms: str = "metadata_terms"
) -> dict[str, Any]:
    """One metadata filter: the typed token, or, on a document holding none (written before
    the tokens existed, or not by Sift), the ``flattened`` field's text (a list: each
    spelling of a number)."""
    ((_field, text),) = as_text.items()
    return {
        "bool": {
            "should": [
                {"term": {terms: token}},
                {
                    "bool": {
                        "filter": [{"terms" if isinstance(text, list) else "term": as_text}],
                        "must_not": [{"exists": {"field": terms}}],
                    }
                },
            ],
            "minimum_should_match": 1,
        }
    }


@pytest.mark.parametrize(("channels", "fields"), PATHS)
def test_every_search_path_filters_by_tenant_inside_each_channel(
    server: FakeElasticsearchServer,
    channels: tuple[Channel, ...],
    fields: dict[str, FilterValue],
) -> None:
    on_searches(
        server,
        Answer(200, msearch_response(*[search_response([]) for _ in channels])),
    )
    results = backend_for(server).retrieve(query(channels, **fields))
    assert set(results.hits) == set(channels)

    (sent,) = server.requests  # nothing found, no memo in the way: nothing asked again
    assert sent.path == MSEARCH  # acme's own index, in the URL; none in the header lines
    assert sent.headers["content-type"] == (
        "application/vnd.elasticsearch+x-ndjson; compatible-with=9"
    )
    tokens = {"lang": "lang=s:en", "year": "year=n:2020", "open": "open=b:true"}
    # a number is compared as text (on a document without tokens) in each JSON spelling
    texts: dict[str, str | list[str]] = {"lang": "en", "year": ["2020", "2020.0"], "open": "true"}
    filters: list[dict[str, Any]] = [{"term": {"tenant": "acme"}}]
    filters += [metadata_filter(tokens[k], {f"metadata.{k}": texts[k]}) for k in sorted(fields)]
    expected: list[Any] = []
    for channel in channels:
        expected.append({})
        expected.append(
            bm25_body(120, filters) if channel == "bm25" else knn_body(120, 200, filters)
        )
    assert sent.ndjson() == expected
    for body in sent.ndjson()[1::2]:
        no_post_filter(body)
        inside = body["knn"]["filter"] if "knn" in body else body["query"]["bool"]["filter"]
        assert inside[0] == {"term": {"tenant": "acme"}}


@pytest.mark.parametrize(
    ("size", "setting", "expected"),
    [(120, 200, 200), (500, 200, 500), (50, 10_000, 10_000), (32, 32, 32)],
)
def test_num_candidates_is_at_least_k_and_at_most_10000(
    server: FakeElasticsearchServer, size: int, setting: int, expected: int
) -> None:
    on_searches(server, Answer(200, msearch_response(search_response([]))))
    backend_for(server, elasticsearch_num_candidates=setting).retrieve(query(("knn",), size=size))
    body = server.requests[0].ndjson()[1]
    assert body["knn"]["k"] == size and body["knn"]["num_candidates"] == expected
    assert num_candidates(size, setting) == expected


def test_more_than_10000_candidates_is_refused_before_any_request(
    server: FakeElasticsearchServer,
) -> None:
    with pytest.raises(InvalidRequest, match="size"):
        backend_for(server).retrieve(query(("knn",), size=10_001))
    with pytest.raises(InvalidRequest, match=r"filters\.bad key"):
        backend_for(server).retrieve(query(("bm25",), **{"bad key": 1}))
    assert server.requests == []


def test_existing_index_field_names_are_used_everywhere(server: FakeElasticsearchServer) -> None:
    """An existing index's field names; with no prefix acme's alias is ``<key>--docs`` (an
    operator points it at the existing index: deploy/README.md §4)."""
    server.on(
        "POST",
        f"/{tenant_key('acme')}--docs/_msearch",
        Answer(200, msearch_response(search_response([]), search_response([]))),
    )
    backend = backend_for(
        server,
        elasticsearch_index_prefix="",
        elasticsearch_text_field="body",
        elasticsearch_title_field="",
        elasticsearch_vector_field="emb",
        elasticsearch_tenant_field="org_id",
        elasticsearch_metadata_field="attrs",
        elasticsearch_id_field="sku",
        elasticsearch_revision_field="etag",
    )
    backend.retrieve(query(lang="en"))
    header, bm25, _, knn = server.requests[0].ndjson()
    assert header == {}
    filters = [{"term": {"org_id": "acme"}}, metadata_filter("lang=s:en", {"attrs.lang": "en"})]
    assert bm25["query"]["bool"]["filter"] == filters
    assert bm25["query"]["bool"]["must"]["multi_match"]["fields"] == ["body"]
    assert knn["knn"]["field"] == "emb" and knn["knn"]["filter"] == filters
    assert knn["_source"] == ["sku", "body", "etag", "attrs", "org_id"]


def test_native_rrf_uses_the_retriever_with_filters_in_both_children(
    server: FakeElasticsearchServer,
) -> None:
    fused = search_response([hit(CONCRETE, "acme", "a", 0.0325)])
    server.on("POST", f"/{ACME}/_search", Answer(200, fused))
    hits = backend_for(server).retrieve_native(query(lang="en"))
    assert [h.document.id for h in hits] == ["a"] and hits[0].score == pytest.approx(0.0325)
    body = server.requests[0].json()
    filters = [{"term": {"tenant": "acme"}}, metadata_filter("lang=s:en", {"metadata.lang": "en"})]
    assert body == {
        "size": 120,
        "retriever": {
            "rrf": {
                "retrievers": [
                    {"standard": {"query": bm25_body(120, filters)["query"]}},
                    {"knn": knn_body(120, 200, filters)["knn"]},
                ],
                "rank_window_size": 120,
                "rank_constant": 60,
            }
        },
        "_source": SOURCE,
        "track_total_hits": False,
    }


# --- parsing and the fused result -------------------------------------------------------------

BM25_HITS = [
    hit(CONCRETE, "acme", "a", 7.5, title="A", metadata={"lang": "en"}),
    hit(CONCRETE, "acme", "b", 5.0, revision="r2"),
    hit(CONCRETE, "acme", "c", 2.25),
]
KNN_HITS = [  # ES reports cosine as (1 + cos) / 2
    hit(CONCRETE, "acme", "c", 0.95),
    hit(CONCRETE, "acme", "a", 0.9),
    hit(CONCRETE, "acme", "d", 0.75),
]


def test_responses_parse_into_channel_hits_best_first(server: FakeElasticsearchServer) -> None:
    on_searches(
        server,
        Answer(200, msearch_response(search_response(BM25_HITS, 4), search_response(KNN_HITS, 9))),
    )
    results = backend_for(server).retrieve(query())
    assert [(h.document.id, h.score) for h in results.hits["bm25"]] == [
        ("a", 7.5),
        ("b", 5.0),
        ("c", 2.25),
    ]
    assert [h.document.id for h in results.hits["knn"]] == ["c", "a", "d"]
    assert [h.score for h in results.hits["knn"]] == pytest.approx([0.9, 0.8, 0.5])
    first = results.hits["bm25"][0].document
    assert first == Document("a", "text of a", "A", "1", {"lang": "en"})
    assert results.hits["bm25"][1].document.revision == "r2"
    assert results.seconds == {"bm25": 0.004, "knn": 0.009}


def mapping(with_vector: bool = True) -> dict[str, Any]:
    properties: dict[str, Any] = {"text": {"type": "text"}, "tenant": {"type": "keyword"}}
    if with_vector:
        properties["vector"] = {"type": "dense_vector", "dims": 384, "similarity": "cosine"}
    return {CONCRETE: {"mappings": {"properties": properties}}}


def test_pipeline_fuses_the_channels_with_sift_rrf_and_keeps_each_rank(
    server: FakeElasticsearchServer,
) -> None:
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    on_searches(
        server,
        Answer(200, msearch_response(search_response(BM25_HITS), search_response(KNN_HITS))),
    )
    pipeline = SearchPipeline(backend_for(server), FakeEmbedder(), config=PipelineConfig())
    result = pipeline.search(
        SearchSpec(index="docs", query="  vitamin   d fractures ", limit=3, filters={"lang": "en"}),
        tenant="acme",
    )
    # a: 1/61 + 1/62; c: 1/63 + 1/61; b: 1/62; d: 1/63
    assert [h.id for h in result.hits] == ["a", "c", "b"]
    a, c, b = result.hits
    assert (a.ranks.bm25, a.ranks.knn, a.ranks.rrf, a.ranks.final) == (1, 2, 1, 1)
    assert (c.ranks.bm25, c.ranks.knn, c.ranks.rrf) == (3, 1, 2)
    assert (b.ranks.bm25, b.ranks.knn) == (2, None)
    assert a.scores.rrf == pytest.approx(1 / 61 + 1 / 62)
    assert a.scores.knn == pytest.approx(0.8) and a.scores.bm25 == pytest.approx(7.5)

    assert [(r.method, r.path) for r in server.requests] == [
        ("POST", MSEARCH),
        ("GET", f"/{ACME}/_mapping"),
        ("POST", MSEARCH),
    ]
    assert server.requests[0].ndjson() == PROBES_OF_ACME
    _, bm25, _, knn = server.requests[2].ndjson()
    filters = [{"term": {"tenant": "acme"}}, metadata_filter("lang=s:en", {"metadata.lang": "en"})]
    assert bm25["query"]["bool"]["filter"] == filters and knn["knn"]["filter"] == filters
    assert bm25["size"] == knn["knn"]["k"] == 32  # max(4 * 3, 32)
    assert knn["knn"]["query_vector"] == pytest.approx(
        FakeEmbedder().embed(["vitamin d fractures"])[0]
    )


def test_a_long_cjk_query_sends_no_more_leaf_clauses_than_any_node_allows(
    server: FakeElasticsearchServer,
) -> None:
    """ES's standard tokenizer makes each ideograph a token, and ``multi_match`` over title
    and text one leaf clause per token and field: 2,000 distinct ideographs were 4,000
    leaves, past the ``max(1024, heap_MB * 64 / search_threads)`` a small node with many
    cores allows (``too_many_clauses``). The BM25 query holds the first ``MAX_BM25_WORDS``;
    with the most filters a search takes, its leaves stay under 1,024."""
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    on_searches(server, Answer(200, msearch_response(search_response(BM25_HITS))))
    ideographs = "".join(chr(0x4E00 + n) for n in range(MAX_QUERY_CHARS))
    filters: dict[str, FilterValue] = {f"k{n}": n for n in range(MAX_FILTER_KEYS)}
    pipeline = SearchPipeline(backend_for(server), FakeEmbedder(), config=PipelineConfig())
    pipeline.search(
        SearchSpec(index="docs", query=ideographs, mode="fts", filters=filters), tenant="acme"
    )
    _, bm25 = server.requests[-1].ndjson()
    assert bm25["query"]["bool"]["must"]["multi_match"]["query"] == ideographs[:MAX_BM25_WORDS]
    assert leaf_clauses(bm25["query"]) < 1024


def leaf_clauses(query: dict[str, Any]) -> int:
    """The leaf queries Lucene counts against the clause limit in an ES query of Sift's
    shapes: a ``multi_match`` one per ideograph (a token each) and field, any other leaf
    (``term``, ``terms``, ``exists``) one."""
    if "bool" in query:
        clauses = query["bool"]
        return sum(
            leaf_clauses(part)
            for occur in ("must", "should", "filter", "must_not")
            for part in (
                [clauses[occur]] if isinstance(clauses.get(occur), dict) else clauses.get(occur, [])
            )
        )
    if "multi_match" in query:
        return len(query["multi_match"]["query"]) * len(query["multi_match"]["fields"])
    return 1


def test_a_min_similarity_floor_reads_cosine_not_es_scores(server: FakeElasticsearchServer) -> None:
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    on_searches(server, Answer(200, msearch_response(search_response(KNN_HITS))))
    pipeline = SearchPipeline(
        backend_for(server), FakeEmbedder(), config=PipelineConfig(vector_min_similarity=0.6)
    )
    result = pipeline.search(SearchSpec(index="docs", query="q", mode="vector"), tenant="acme")
    assert [h.id for h in result.hits] == ["c", "a"]  # d's cosine is 0.5


PROBES_OF_ACME = [
    {},
    {
        "size": 0,
        "terminate_after": 1,
        "track_total_hits": True,
        "query": {"bool": {"filter": [{"term": {"tenant": "acme"}}]}},
    },
    {},
    {
        "size": 1,
        "_source": ["embedding_model"],
        "terminate_after": 1,
        "track_total_hits": True,
        "query": {
            "bool": {"filter": [{"term": {"tenant": "acme"}}, {"exists": {"field": "vector"}}]}
        },
    },
]


def test_channels_are_the_tenants_documents_and_vectors(server: FakeElasticsearchServer) -> None:
    """Two tenant-filtered probes in one ``_msearch``; the mapping only once vectors are found."""
    backend = backend_for(server)
    on_probes(server, Answer(200, probes_of_a_missing_index(ACME)))
    assert backend.channels("docs", "acme") == frozenset()
    on_probes(server, Answer(200, probes(documents=False, vectors=False)))
    assert backend.channels("docs", "acme") == frozenset()  # emptied by deletes by id
    on_probes(server, Answer(200, probes(documents=True, vectors=False)))
    assert backend.channels("docs", "acme") == {"bm25"}
    assert [r.path for r in server.requests] == [MSEARCH] * 3  # no mapping read
    for request in server.requests:
        assert request.ndjson() == PROBES_OF_ACME
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping(with_vector=False)))
    assert backend.channels("docs", "acme") == {"bm25"}  # a vector field that is no dense_vector
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    assert backend.channels("docs", "acme") == {"bm25", "knn"}
    before = len(server.requests)
    assert backend.channels("docs", "acme") == {"bm25", "knn"}  # remembered for a while
    assert len(server.requests) == before
    server.on("POST", f"/{BETA}/_msearch", Answer(200, probes_of_a_missing_index(BETA)))
    assert backend.channels("docs", "beta") == frozenset()  # acme's answer is not beta's
    assert server.requests[-1].path == f"/{BETA}/_msearch"  # beta's own index is asked
    beta = server.requests[-1].ndjson()
    assert beta[1]["query"]["bool"]["filter"] == [{"term": {"tenant": "beta"}}]


def test_a_search_finding_nothing_in_an_index_emptied_elsewhere_is_index_not_found(
    server: FakeElasticsearchServer,
) -> None:
    """This worker remembers acme's vectors (its probe answer, for a while); another worker
    deleted acme's last documents by id. The search finds nothing, so whether acme still
    holds a document is asked (the probe's first search, bypassing the memo): none is
    left, so the index reads as missing, as on the embedded backend, not as an index with
    no match. One with documents left answers its empty hits and keeps the memo; a tenant
    the memo does not hold was probed from ES within the search: nothing is asked again."""
    backend = backend_for(server)
    on_probes(server, Answer(200, probes(documents=True, vectors=True, model="m-1")))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    assert backend.channels("docs", "acme") == {"bm25", "knn"}
    on_probes(server, Answer(200, probes(documents=False, vectors=False)))
    assert backend.channels("docs", "acme") == {"bm25", "knn"}  # the memo answers
    on_searches(server, Answer(200, msearch_response(search_response([]), search_response([]))))
    server.on("POST", f"/{ACME}/_search", Answer(200, probe_response(0)), times=1)
    with pytest.raises(IndexNotFound):
        backend.retrieve(query())
    (held,) = server.sent("POST", f"/{ACME}/_search")
    assert held.json() == {
        "size": 0,
        "terminate_after": 1,
        "track_total_hits": True,
        "query": {"bool": {"filter": [{"term": {"tenant": "acme"}}]}},
    }
    assert backend.channels("docs", "acme") == frozenset()  # the memo is let go

    on_probes(server, Answer(200, probes(documents=True, vectors=True, model="m-1")))
    assert backend.channels("docs", "acme") == {"bm25", "knn"}
    server.on("POST", f"/{ACME}/_search", Answer(200, probe_response(1)), times=1)
    assert backend.retrieve(query(lang="none")).hits == {"bm25": [], "knn": []}
    assert len(server.sent("POST", f"/{ACME}/_search")) == 2
    before = len(server.requests)
    assert backend.channels("docs", "acme") == {"bm25", "knn"}  # kept: documents are left
    assert len(server.requests) == before

    backend._with_vectors.clear()  # a tenant without vectors: never in the memo
    on_searches(server, Answer(200, msearch_response(search_response([]))))
    assert backend.retrieve(query(("bm25",), lang="none")).hits == {"bm25": []}
    assert len(server.requests) == before + 1  # the search alone


def test_the_per_tenant_memo_drops_expired_answers_once_large(
    server: FakeElasticsearchServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_search, "CHANNELS_MEMO_SIZE", 3)  # where the memo reads it
    now = [0.0]
    backend = backend_for(server)
    backend._clock = lambda: now[0]
    for tenant in ("t1", "t2", "t3"):
        backend._saw_vectors(backend.alias("docs", tenant), tenant, None)
    now[0] = elasticsearch.CHANNELS_TTL_SECONDS + 1
    backend._saw_vectors(backend.alias("docs", "t4"), "t4", "m-1")
    assert set(backend._with_vectors) == {(backend.alias("docs", "t4"), "t4")}
    assert backend.channels("docs", "t4") == {"bm25", "knn"}  # from the memo: no request
    assert backend.probe("docs", "t4").model == "m-1"
    assert server.requests == []


def test_a_whole_request_404_on_the_probes_is_a_missing_index(
    server: FakeElasticsearchServer,
) -> None:
    on_probes(server, Answer(404, index_missing(ACME)))
    assert backend_for(server).channels("docs", "acme") == frozenset()


def test_an_index_only_another_tenant_has_is_not_found_like_a_missing_one(
    server: FakeElasticsearchServer,
) -> None:
    """Beta searching "docs", which acme holds: beta's probes go to beta's own alias, which
    does not exist, so ES answers exactly what it answers for a name nobody has; acme's
    index is never in beta's requests. An alias of beta's emptied by deletes by id, and a
    whole-request 404, say the same words after the same one request."""
    pipeline = SearchPipeline(backend_for(server), FakeEmbedder(), config=PipelineConfig())
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))  # acme's: never asked
    errors: list[IndexNotFound] = []
    for answer in (
        Answer(200, probes_of_a_missing_index(BETA)),  # no alias of beta's: acme's or nobody's
        Answer(200, probes(documents=False, vectors=False)),  # beta's own, emptied by ids
        Answer(404, index_missing(BETA)),
    ):
        server.requests.clear()
        server.on("POST", f"/{BETA}/_msearch", answer)
        with pytest.raises(IndexNotFound) as caught:
            pipeline.search(SearchSpec(index="docs", query="vitamin d"), tenant="beta")
        errors.append(caught.value)
        assert [(r.method, r.path) for r in server.requests] == [("POST", f"/{BETA}/_msearch")]
        assert server.requests[0].ndjson()[1]["query"]["bool"]["filter"] == [
            {"term": {"tenant": "beta"}}
        ]
    assert {(e.code, e.message, e.retryable) for e in errors} == {
        ("index_not_found", "index 'docs' does not exist: ingest documents into it first", False)
    }
    # and a search whose alias vanished after the probes says the same words
    server.on("POST", f"/{BETA}/_msearch", Answer(404, index_missing(BETA)))
    with pytest.raises(IndexNotFound) as late:
        backend_for(server).retrieve(query(tenant="beta"))
    assert late.value.message == errors[0].message
    assert probes_sent(server) == [] and searches_sent(server) == []  # acme's: untouched


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [503, 502, 504, 429, 500])
def test_5xx_and_429_are_retryable_and_the_client_does_not_retry(
    server: FakeElasticsearchServer, status: int
) -> None:
    on_searches(server, Answer(status, error_body("unavailable", "try later", status)))
    with pytest.raises(BackendUnavailable, match=str(status)) as caught:
        backend_for(server).retrieve(query())
    assert caught.value.retryable
    assert caught.value.__cause__ is not None
    assert len(server.requests) == 1  # exactly one HTTP request: no client-side retry


def test_400_is_a_permanent_request_error_with_es_reason(server: FakeElasticsearchServer) -> None:
    on_searches(
        server,
        Answer(400, error_body("x_content_parse_exception", "[knn] unknown field [bogus]")),
    )
    with pytest.raises(BackendRequestError, match=r"400\): x_content_parse_exception") as caught:
        backend_for(server).retrieve(query())
    assert not caught.value.retryable
    assert len(server.requests) == 1


#: ES's reasons for refusing Sift's own credentials: its service user, roles, API key and the
#: concrete index names (the deployment's prefix and the tenant's key) are infrastructure
ACCESS_REFUSED = {
    403: (
        "security_exception",
        "action [indices:data/read/msearch] is unauthorized for user [sift_svc] with effective"
        f" roles [sift_reader] on indices [{CONCRETE}], this action is granted by the index"
        " privileges [read,all]",
    ),
    401: (
        "security_exception",
        "unable to authenticate with provided credentials: API key: api key [k8Hx2] has expired",
    ),
}


@pytest.mark.parametrize("status", list(ACCESS_REFUSED))
@pytest.mark.parametrize("where", ["the request", "one msearch item"])
def test_a_refusal_of_sifts_credentials_is_a_config_error_without_es_reason(
    server: FakeElasticsearchServer, caplog: pytest.LogCaptureFixture, status: int, where: str
) -> None:
    """A 401 or 403 (an API key expired, a role missing) reached the tenant's job record as
    ``backend_request_error`` with ES's reason: the service user, its roles, the key's id and
    the concrete index names. It is the deployment's setting that is wrong: a config_error
    the tenant sees with the status and the cause's type only, the reason in the log."""
    kind, reason = ACCESS_REFUSED[status]
    body = error_body(kind, reason, status)
    if where == "the request":
        on_searches(server, Answer(status, body))
    else:
        on_searches(server, Answer(200, msearch_response(search_response([]), body)))
    with pytest.raises(BackendAccessRefused) as caught:
        backend_for(server).retrieve(query())
    assert caught.value.code == "config_error"
    message = str(caught.value)
    assert f"({status} security_exception)" in message, message
    assert "SIFT_ELASTICSEARCH_API_KEY" in message, message
    for secret in ("sift_svc", "sift_reader", "k8Hx2", tenant_key("acme"), "sift-"):
        assert secret not in message, message
    assert not caught.value.retryable
    assert reason in caplog.text  # the operator's to read


def test_a_refusal_naming_the_concrete_index_shows_the_tenants_index_name(
    server: FakeElasticsearchServer,
) -> None:
    """A 400 the tenant's request caused keeps ES's reason (the tenant fixes it from it), but
    ES names the index it read by its concrete name: the deployment's prefix and the
    tenant's key, and the index's UUID. The tenant sees its own index name there now."""
    reason = (
        f"failed to create query: field [year] of index [{CONCRETE}/kA1qF3ZpQ9-x2Yb7cD8eWg] "
        f"is not numeric; the drop floor in [{FLOORS}] was not read"
    )
    on_searches(server, Answer(400, error_body("query_shard_exception", reason)))
    with pytest.raises(BackendRequestError) as caught:
        backend_for(server).retrieve(query())
    message = str(caught.value)
    assert "query_shard_exception: failed to create query: field [year] of index [docs]" in message
    assert "[Sift's floors index]" in message, message
    for secret in (tenant_key("acme"), "sift-", "kA1qF3ZpQ9"):
        assert secret not in message, message


def test_missing_index_is_index_not_found(server: FakeElasticsearchServer) -> None:
    on_searches(server, Answer(404, index_missing(ACME)))
    with pytest.raises(IndexNotFound, match="'docs'"):
        backend_for(server).retrieve(query())


def test_an_error_inside_one_msearch_item_is_mapped(server: FakeElasticsearchServer) -> None:
    item = {**index_missing(ACME)}
    on_searches(server, Answer(200, msearch_response(search_response([]), item)))
    with pytest.raises(IndexNotFound):
        backend_for(server).retrieve(query())
    shard_failure = error_body("search_phase_execution_exception", "all shards failed", 503)
    on_searches(server, Answer(200, msearch_response(shard_failure, search_response([]))))
    with pytest.raises(BackendUnavailable, match="bm25 search"):
        backend_for(server).retrieve(query())
    bad = error_body("illegal_argument_exception", "[num_candidates] cannot exceed [10000]")
    on_searches(server, Answer(200, msearch_response(search_response([]), bad)))
    with pytest.raises(BackendRequestError, match="num_candidates"):
        backend_for(server).retrieve(query())


def partial(answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` as ES gives it when one of two shards failed (a node left, a shard request
    rejected): 200, the other shard's hits and totals only, the failure in ``_shards``."""
    failure = {
        "shard": 1,
        "index": CONCRETE,
        "node": "n2",
        "reason": {"type": "node_not_connected_exception", "reason": "[n2] not connected"},
    }
    shards = {"total": 2, "successful": 1, "skipped": 0, "failed": 1, "failures": [failure]}
    return {**answer, "_shards": shards}


def test_an_answer_from_some_shards_only_is_retryable_never_a_smaller_truth(
    server: FakeElasticsearchServer,
) -> None:
    """A search ES answered from some of the index's shards (200, ``_shards.failed``) lacks
    the failed shards' documents: used, it would read the tenant's index as missing
    (``index_not_found``, for good), rank without them, or count too few. Each is a
    retryable ``BackendUnavailable`` naming the failure instead."""
    backend = backend_for(server)
    on_probes(server, Answer(200, msearch_response(partial(probe_response(0)), probe_response(0))))
    with pytest.raises(
        BackendUnavailable, match=r"2 shards \(1 failed, node_not_connected_exception\)"
    ):
        backend.probe("docs", "acme")
    hits = [hit(CONCRETE, "acme", "a", 3.0)]
    on_searches(server, Answer(200, msearch_response(partial(search_response(hits)))))
    with pytest.raises(BackendUnavailable, match="bm25 search"):
        backend.retrieve(query(("bm25",)))
    counted = {**partial(probe_response(2)), "aggregations": models_agg("m-1")}
    server.on("POST", f"/{ACME}/_search", Answer(200, counted))
    with pytest.raises(BackendUnavailable, match="count of index 'docs'"):
        backend.index_info("docs", "acme")
    server.on("POST", f"/sift-{tenant_key('acme')}--*/_search", Answer(200, counted))
    server.on(
        "GET", f"/_alias/sift-{tenant_key('acme')}--*", Answer(200, aliases((CONCRETE, ACME)))
    )
    with pytest.raises(BackendUnavailable, match="list of indexes"):
        backend.indexes("acme")


def test_connection_refused_is_retryable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(BackendUnavailable, match="cannot reach") as caught:
        backend_for(f"http://127.0.0.1:{port}").retrieve(query())
    assert caught.value.retryable


def test_the_attempt_timeout_is_the_request_timeout(server: FakeElasticsearchServer) -> None:
    slow = Answer(200, msearch_response(search_response([]), search_response([])), delay=1.0)
    on_searches(server, slow)
    with pytest.raises(BackendUnavailable, match="timed out"):
        backend_for(server).retrieve(query(timeout=0.2))
    assert len(server.requests) == 1


def test_the_probe_waits_no_longer_than_the_search_has_left(
    server: FakeElasticsearchServer,
) -> None:
    """A run with little of its search's deadline left (after a task retry, or a lost
    worker) sent the channels probe under the request timeout alone
    (``SIFT_ELASTICSEARCH_REQUEST_TIMEOUT``, 10 s): a slow ES held it seconds past its
    deadline. The probe is bounded by what is left, as the retrieval is (default settings)."""
    settings = load_settings(search_backend="elasticsearch", elasticsearch_url=server.url)
    on_probes(server, Answer(200, probes(documents=True, vectors=False), delay=3.0))
    on_searches(server, Answer(200, msearch_response(search_response(BM25_HITS))))
    pipeline = SearchPipeline(backend_for(server), FakeEmbedder(), config=pipeline_config(settings))
    spent = settings.search_deadline_seconds - 0.3  # 0.3 s left: less than the probe takes
    spec = SearchSpec(index="docs", query="q", mode="fts")
    with pytest.raises(DeadlineExceeded, match="during the index probe") as caught:
        pipeline.search(spec, tenant="acme", spent=spent)
    assert isinstance(caught.value.__cause__, BackendUnavailable), caught.value.__cause__
    assert "timed out" in caught.value.__cause__.message
    assert len(probes_sent(server)) == 1 and not searches_sent(server)


def test_the_probe_with_its_mapping_read_waits_no_longer_than_the_search_has_left(
    server: FakeElasticsearchServer,
) -> None:
    """The probe's two requests (the ``_msearch``, then the mapping read once the tenant's
    vectors are found) share what is left of the deadline: each was given all of it, so a
    probe could wait up to twice what the search had left (default settings)."""
    settings = load_settings(search_backend="elasticsearch", elasticsearch_url=server.url)
    on_probes(server, Answer(200, probes(documents=True, vectors=True), delay=1.2))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping(), delay=1.2))
    on_searches(server, Answer(200, msearch_response(search_response(BM25_HITS))))
    pipeline = SearchPipeline(backend_for(server), FakeEmbedder(), config=pipeline_config(settings))
    spent = settings.search_deadline_seconds - 2.0  # 2 s left: less than the two take
    spec = SearchSpec(index="docs", query="q", mode="fts")
    with pytest.raises(DeadlineExceeded, match="during the index probe") as caught:
        pipeline.search(spec, tenant="acme", spent=spent)
    assert isinstance(caught.value.__cause__, BackendUnavailable), caught.value.__cause__
    assert "timed out" in caught.value.__cause__.message
    sent = [(r.method, r.path) for r in server.requests]
    assert sent == [("POST", MSEARCH), ("GET", f"/{ACME}/_mapping")], sent


def test_the_pipeline_is_the_one_retry_layer(server: FakeElasticsearchServer) -> None:
    on_probes(server, Answer(200, probes(documents=True, vectors=False)))
    on_searches(
        server,
        Answer(200, msearch_response(search_response(BM25_HITS))),
    )
    on_searches(server, Answer(503, error_body("unavailable", "busy", 503)), times=1)
    sleeps: list[float] = []
    pipeline = SearchPipeline(
        backend_for(server), FakeEmbedder(), config=PipelineConfig(), sleep=sleeps.append
    )
    result = pipeline.search(SearchSpec(index="docs", query="q", mode="fts"), tenant="acme")
    assert [h.id for h in result.hits] == ["a", "b", "c"]
    assert len(searches_sent(server)) == 2 and len(sleeps) == 1


def test_the_client_speaks_es9_media_types(server: FakeElasticsearchServer) -> None:
    """The 9.x client sends ``compatible-with=9``, which an 8.x server refuses: use ES 9."""
    on_searches(server, Answer(200, msearch_response(search_response([]))))
    backend_for(server).retrieve(query(("bm25",)))
    assert server.requests[0].headers["accept"] == (
        "application/vnd.elasticsearch+json; compatible-with=9"
    )


def test_an_8x_server_refusing_the_media_type_gets_a_clear_message(
    server: FakeElasticsearchServer,
) -> None:
    refused = error_body(
        "media_type_header_exception",
        "Invalid media-type value on headers [Content-Type, Accept]",
    )
    on_searches(server, Answer(400, refused))
    with pytest.raises(BackendRequestError, match="Sift needs Elasticsearch 9"):
        backend_for(server).retrieve(query())


def test_bootstrap_builds_the_backend_without_a_network_call(
    server: FakeElasticsearchServer,
) -> None:
    from worker.runtime.bootstrap import build_backend

    backend = build_backend(
        load_settings(search_backend="elasticsearch", elasticsearch_url=server.url)
    )
    assert isinstance(backend, ElasticsearchBackend) and backend.name == "elasticsearch"
    # Client-level options, carried into every request (the 5xx tests show the effect).
    client = backend._client.options(request_timeout=1.0)
    assert client._max_retries == 0
    assert tuple(client._retry_on_status) == ()
    assert client._retry_on_timeout is False
    assert server.requests == []


def test_native_rrf_mode_runs_one_retriever_search_and_the_pipeline_keeps_es_order(
    server: FakeElasticsearchServer,
) -> None:
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    fused = search_response([hit(CONCRETE, "acme", "c", 0.033), hit(CONCRETE, "acme", "a", 0.03)])
    server.on("POST", f"/{ACME}/_search", Answer(200, fused))
    backend = backend_for(server)
    backend.native_rrf = True
    pipeline = SearchPipeline(backend, FakeEmbedder(), config=PipelineConfig())
    result = pipeline.search(
        SearchSpec(index="docs", query="vitamin d", limit=3, include_trace=True), tenant="acme"
    )
    assert [h.id for h in result.hits] == ["c", "a"]
    c = result.hits[0]
    assert (c.ranks.final, c.ranks.rrf, c.ranks.bm25, c.ranks.knn) == (1, 1, None, None)
    assert c.scores.rrf == pytest.approx(0.033) and c.scores.bm25 is None
    assert result.trace is not None and result.trace["fused_by_backend"] is True
    search = server.requests[-1]
    assert (search.method, search.path) == ("POST", f"/{ACME}/_search")
    children = search.json()["retriever"]["rrf"]["retrievers"]
    tenant = {"term": {"tenant": "acme"}}
    assert tenant in children[0]["standard"]["query"]["bool"]["filter"]
    assert tenant in children[1]["knn"]["filter"]


def test_native_fusion_time_is_recorded_under_the_rrf_channel(
    server: FakeElasticsearchServer,
) -> None:
    """The one ``retriever.rrf`` request's seconds are the ``rrf`` channel's, not ``other``:
    the stage the pipeline names (``retrieval_seconds``) and the metric agree."""
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    fused = search_response([hit(CONCRETE, "acme", "c", 0.033)])
    server.on("POST", f"/{ACME}/_search", Answer(200, fused))
    backend = backend_for(server, elasticsearch_native_rrf=True)
    pipeline = SearchPipeline(
        backend, FakeEmbedder(), config=PipelineConfig(), recorder=PrometheusRecorder()
    )
    before = dict(snapshot(REGISTRY))
    result = pipeline.search(
        SearchSpec(index="docs", query="vitamin d", limit=3, include_trace=True), tenant="acme"
    )

    def counted(channel: str) -> float:
        labels = (("backend", "elasticsearch"), ("channel", channel))
        key = ("sift_retrieval_duration_seconds_count", labels)
        return snapshot(REGISTRY).get(key, 0.0) - before.get(key, 0.0)

    assert result.trace is not None and "rrf" in result.trace["retrieval_seconds"]
    assert counted("rrf") == 1
    assert counted("other") == 0


def test_native_rrf_sends_the_searchs_weights_and_rank_constant(
    server: FakeElasticsearchServer,
) -> None:
    """Weighted RRF on ES's own retriever: each child as ``{"retriever", "weight"}`` (ES 9.2+)
    and the rank constant, both the ones the request resolved to."""
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    fused = search_response([hit(CONCRETE, "acme", "c", 0.05)])
    server.on("POST", f"/{ACME}/_search", Answer(200, fused))
    backend = backend_for(server, elasticsearch_native_rrf=True)
    pipeline = SearchPipeline(backend, FakeEmbedder(), config=PipelineConfig())
    asked = SearchSpec.model_validate(
        {
            "index": "docs",
            "query": "vitamin d",
            "limit": 3,
            "include_trace": True,
            "fusion": {"weights": {"bm25": 1.0, "knn": 0.25}, "rank_constant": 20},
        }
    )
    result = pipeline.search(asked, tenant="acme")
    assert [h.id for h in result.hits] == ["c"]
    assert result.trace is not None and result.trace["fusion"]["rank_constant"] == 20
    rrf = server.sent("POST", f"/{ACME}/_search")[-1].json()["retriever"]["rrf"]
    assert rrf["rank_constant"] == 20
    bm25, knn = rrf["retrievers"]
    assert bm25["weight"] == 1.0 and knn["weight"] == 0.25
    _assert_weighted_channels(bm25, knn)


def _assert_weighted_channels(bm25: dict[str, Any], knn: dict[str, Any]) -> None:
    """A native fusion's two weighted children: BM25's query and kNN on the vector field,
    each filtered to the tenant."""
    assert "query" in bm25["retriever"]["standard"]
    assert knn["retriever"]["knn"]["field"] == "vector"
    tenant = {"term": {"tenant": "acme"}}
    assert tenant in bm25["retriever"]["standard"]["query"]["bool"]["filter"]
    assert tenant in knn["retriever"]["knn"]["filter"]


def test_native_linear_sends_es_linear_retriever_with_weights_and_minmax(
    server: FakeElasticsearchServer,
) -> None:
    """``fusion.method`` linear on ES's own retriever: ``retriever.linear`` (ES 8.18+ / 9.x),
    each child as ``{"retriever", "weight", "normalizer": "minmax"}``, no rank constant; the
    pipeline keeps ES's order and score."""
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    fused = search_response([hit(CONCRETE, "acme", "b", 1.25), hit(CONCRETE, "acme", "a", 0.5)])
    server.on("POST", f"/{ACME}/_search", Answer(200, fused))
    backend = backend_for(server, elasticsearch_native_rrf=True)
    pipeline = SearchPipeline(backend, FakeEmbedder(), config=PipelineConfig())
    asked = SearchSpec.model_validate(
        {
            "index": "docs",
            "query": "vitamin d",
            "limit": 3,
            "include_trace": True,
            "fusion": {"method": "linear", "weights": {"bm25": 1.0, "knn": 0.25}},
        }
    )
    result = pipeline.search(asked, tenant="acme")
    assert [h.id for h in result.hits] == ["b", "a"]
    assert result.hits[0].scores.rrf == pytest.approx(1.25)
    assert result.trace is not None and result.trace["fusion"]["method"] == "linear"
    assert result.trace["fused_by_backend"] is True
    body = server.sent("POST", f"/{ACME}/_search")[-1].json()
    assert set(body["retriever"]) == {"linear"}
    linear = body["retriever"]["linear"]
    assert linear["rank_window_size"] == body["size"] and "rank_constant" not in linear
    bm25, knn = linear["retrievers"]
    assert (bm25["weight"], bm25["normalizer"]) == (1.0, "minmax")
    assert (knn["weight"], knn["normalizer"]) == (0.25, "minmax")
    _assert_weighted_channels(bm25, knn)


def test_linear_without_native_fusion_fuses_the_channel_scores_in_sift(
    server: FakeElasticsearchServer,
) -> None:
    """Native fusion off: the two channel searches go in one ``_msearch`` as for RRF, and Sift
    fuses their scores (kNN turned back into cosine; min-max is blind to that anyway)."""
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    bm25 = search_response(
        [hit(CONCRETE, "acme", "a", 9.0), hit(CONCRETE, "acme", "b", 5.0),
         hit(CONCRETE, "acme", "c", 1.0)]
    )  # fmt: skip
    knn = search_response(
        [hit(CONCRETE, "acme", "c", 0.95), hit(CONCRETE, "acme", "b", 0.9),
         hit(CONCRETE, "acme", "a", 0.55)]
    )  # fmt: skip
    on_searches(server, Answer(200, msearch_response(bm25, knn)))
    backend = backend_for(server)
    pipeline = SearchPipeline(backend, FakeEmbedder(), config=PipelineConfig())
    asked = SearchSpec.model_validate(
        {"index": "docs", "query": "vitamin d", "fusion": {"method": "linear"}}
    )
    result = pipeline.search(asked, tenant="acme")
    # bm25 normalised: a 1, b 0.5, c 0; knn (cos 0.9, 0.8, 0.1): c 1, b 0.875, a 0
    assert [(h.id, round(h.scores.rrf or 0.0, 6)) for h in result.hits] == [
        ("b", 1.375), ("a", 1.0), ("c", 1.0)
    ]  # fmt: skip
    assert server.sent("POST", f"/{ACME}/_search") == []


def test_native_rrf_with_knn_weighted_zero_runs_bm25_alone(
    server: FakeElasticsearchServer,
) -> None:
    """A channel weighted 0 is not queried: no retriever, no kNN, one BM25 search."""
    on_probes(server, Answer(200, probes(documents=True, vectors=True)))
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    backend = backend_for(server, elasticsearch_native_rrf=True)
    pipeline = SearchPipeline(backend, FakeEmbedder(), config=PipelineConfig())
    bm25_only = msearch_response(search_response([hit(CONCRETE, "acme", "a", 3.0)]))
    on_searches(server, Answer(200, bm25_only))
    asked = SearchSpec.model_validate(
        {"index": "docs", "query": "vitamin d", "fusion": {"weights": {"knn": 0}}}
    )
    result = pipeline.search(asked, tenant="acme")
    assert [h.id for h in result.hits] == ["a"] and result.hits[0].ranks.bm25 == 1
    assert server.sent("POST", f"/{ACME}/_search") == []
    searches = searches_sent(server)[-1].ndjson()
    assert len(searches) == 2 and "knn" not in searches[1]


# --- the index lifecycle: versioned writes, delete, list, count, get ------------------------


def test_a_versioned_upsert_uses_external_versions_and_skips_a_newer_write(
    server: FakeElasticsearchServer,
) -> None:
    on_existing_index(server)
    server.on(
        "PUT",
        "/_bulk",
        Answer(
            200,
            bulk_response(
                bulk_item("index", CONCRETE, "acme:d1", 201, "created", _version=7),
                version_conflict("index", CONCRETE, "acme:d2", held=9, sent=7),
            ),
        ),
    )
    docs = [Document("d1", "one", revision="r"), Document("d2", "two", revision="r")]
    written = backend_for(server).upsert("docs", "acme", docs, None, version=7, model="m")
    assert written == 1  # d2's newer write (9) stays, and is no error
    # d1's document under another _id goes, not d2's: the newer write took care of it
    (other_ids,) = server.sent("POST", f"/{ACME}/_delete_by_query")
    assert other_ids.json()["query"]["bool"]["should"][0] == {"terms": {"doc_id": ["d1"]}}
    actions = server.sent("PUT", "/_bulk")[0].ndjson()[0::2]
    assert actions == [
        {
            "index": {
                "_index": ACME,
                "_id": f"acme:{d}",
                "version": 7,
                "version_type": "external",
            }
        }
        for d in ("d1", "d2")
    ]
    # the version is in each document too, where a drop's query reads it (ES searches no
    # _version): a drop deletes only what was written before it
    sources = server.sent("PUT", "/_bulk")[0].ndjson()[1::2]
    assert [source["write_version"] for source in sources] == [7, 7]


def on_deletes_mark(server: FakeElasticsearchServer, version: int) -> None:
    """Answer a versioned delete's mark: the template, the floors index, the mark's write."""
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on("PUT", f"/{FLOORS}", Answer(200, {"acknowledged": True, "index": FLOORS}))
    server.on("PUT", DELETES, Answer(201, floor_written(FLOORS, f"{ACME}#deletes", version)))


def test_delete_documents_is_a_versioned_bulk_delete_of_the_tenants_ids(
    server: FakeElasticsearchServer,
) -> None:
    """Before its bulk, a versioned delete records its version as the newest delete on the
    alias (``<alias>#deletes`` in the floors index, external-versioned: a newer one's
    stays), which a drop accepted before it reads to keep the index and its tombstones."""
    on_existing_index(server)
    on_deletes_mark(server, 12)
    server.on(
        "PUT",
        "/_bulk",
        Answer(
            200,
            bulk_response(
                bulk_item("delete", CONCRETE, "acme:d1", 200, "deleted", _version=12),
                bulk_item("delete", CONCRETE, "acme:gone", 404, "not_found", _version=12),
                version_conflict("delete", CONCRETE, "acme:d3", held=15, sent=12),
            ),
        ),
    )
    on_other_ids(server, deleted=1)  # "gone" under the _id its own tool gave it
    server.on("POST", f"/{ACME}/_refresh", Answer(200, {"_shards": {"failed": 0}}))
    deleted = backend_for(server).delete_documents(
        "docs", "acme", ["d1", "gone", "d3", "d1"], version=12
    )
    assert deleted == 2
    # the ids whose tombstone holds this delete's version, not d3's newer write (15)
    (other_ids,) = server.sent("POST", f"/{ACME}/_delete_by_query")
    query = other_ids.json()["query"]["bool"]
    assert query["should"][0] == {"terms": {"doc_id": ["d1", "gone"]}}
    assert query["must_not"] == [{"ids": {"values": ["acme:d1", "acme:gone"]}}]
    # one deleted: refreshed, as the bulk's refresh asks, so no search finds it after the job
    assert [(r.method, r.path) for r in server.requests][-2:] == [
        ("POST", f"/{ACME}/_delete_by_query"),
        ("POST", f"/{ACME}/_refresh"),
    ]
    (bulk,) = server.sent("PUT", "/_bulk")
    assert bulk.ndjson() == [
        {
            "delete": {
                "_index": ACME,
                "_id": f"acme:{d}",
                "version": 12,
                "version_type": "external",
            }
        }
        for d in ("d1", "gone", "d3")
    ]
    sent = [(r.method, r.path) for r in server.requests]
    assert sent.index(("PUT", DELETES)) < sent.index(("PUT", "/_bulk"))
    (mark,) = server.sent("PUT", DELETES)
    assert mark.json() == {}
    assert mark.query == {"version": ["12"], "version_type": ["external"]}


def test_a_document_under_another_id_changed_meanwhile_fails_the_write_retryably(
    server: FakeElasticsearchServer,
) -> None:
    """The tool that wrote the index changed one of the tenant's documents of the ids
    between the ``_delete_by_query``'s search and its delete (a version conflict): it is
    still there, so the write fails retryably (BackendUnavailable) and its retry takes it."""
    on_existing_index(server)
    server.on("PUT", "/_bulk", bulk_ok)
    server.on(
        "POST",
        f"/{ACME}/_delete_by_query",
        Answer(200, delete_by_query_response(0, conflicts=1)),
    )
    with pytest.raises(BackendUnavailable, match=r"other _ids.*1 changed since it began"):
        backend_for(server).upsert("docs", "acme", [Document("d1", "x")], None)


def test_delete_documents_of_a_missing_index_creates_it_to_keep_the_tombstones(
    server: FakeElasticsearchServer,
) -> None:
    """A delete can run before the upsert it was accepted after: its tombstones must exist
    in the index that upsert will write to, so the index is created as an upsert would."""
    server.on("HEAD", f"/_alias/{ACME}", Answer(404))
    server.on("GET", ACME_ALIASES, Answer(200, {}))
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on(
        "PUT",
        f"/{CONCRETE}",
        Answer(200, {"acknowledged": True, "shards_acknowledged": True, "index": CONCRETE}),
    )
    server.on(
        "PUT",
        "/_bulk",
        Answer(200, bulk_response(bulk_item("delete", CONCRETE, "acme:d1", 404, "not_found"))),
    )
    server.on("GET", FLOOR, Answer(404, get_missing(FLOORS, ACME)))
    on_deletes_mark(server, 3)
    on_other_ids(server)
    assert backend_for(server).delete_documents("docs", "acme", ["d1"], version=3) == 0
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", FLOOR),  # no drop of acme's "docs" ran: no floor
        ("HEAD", f"/_alias/{ACME}"),
        ("GET", ACME_ALIASES),  # a new index, counted as an upsert's is
        ("PUT", "/_index_template/sift-sift"),
        ("PUT", f"/{CONCRETE}"),
        ("PUT", f"/{FLOORS}"),
        ("PUT", DELETES),
        ("PUT", "/_bulk"),  # a delete writes nothing back: no floor read after it
        ("POST", f"/{ACME}/_delete_by_query"),  # its tombstone holds: d1 under other _ids
    ]


def test_a_bulk_delete_failing_for_other_reasons_names_the_document(
    server: FakeElasticsearchServer,
) -> None:
    on_existing_index(server)
    failed = {
        "delete": {
            "_index": CONCRETE,
            "_id": "acme:d1",
            "status": 503,
            "error": error_body("unavailable_shards_exception", "primary shard is not active")[
                "error"
            ],
        }
    }
    server.on("PUT", "/_bulk", Answer(200, bulk_response(failed)))
    on_deletes_mark(server, 3)
    with pytest.raises(BackendUnavailable, match="d1"):
        backend_for(server).delete_documents("docs", "acme", ["d1"], version=3)


DROP_SEARCHES = [
    {},
    {
        "size": 0,
        "track_total_hits": True,
        "query": {"bool": {"filter": [{"term": {"tenant": "acme"}}]}},
    },
    {},
    {
        "size": 0,
        "terminate_after": 1,
        "track_total_hits": True,
        "query": {"bool": {"must_not": [{"term": {"tenant": "acme"}}]}},
    },
]


#: A versioned drop's (20) third search: one of acme's documents written after it.
NEWER_SEARCH = [
    {},
    {
        "size": 0,
        "terminate_after": 1,
        "track_total_hits": True,
        "query": {
            "bool": {
                "filter": [{"term": {"tenant": "acme"}}, {"range": {"write_version": {"gt": 20}}}]
            }
        },
    },
]


def on_floors(server: FakeElasticsearchServer, version: int = 20) -> None:
    """Answer a drop's floor write: the template, the floors index, acme's floor."""
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on("PUT", f"/{FLOORS}", Answer(200, {"acknowledged": True, "index": FLOORS}))
    server.on("PUT", FLOOR, Answer(201, floor_written(FLOORS, ACME, version)))


def test_delete_index_deletes_the_tenants_physical_index_and_nothing_else(
    server: FakeElasticsearchServer,
) -> None:
    """Raise acme's floor for "docs" first, find every concrete index of acme's alias (the
    live one, one a reindex kept, closed ones too) in one GET before deleting any, count
    acme's documents and look for another tenant's, delete the kept index, then the live
    one: beta's index of the same name is in no request."""
    kept = f"{ACME}~20260101t000000000000"
    on_floors(server)
    on_searches(server, Answer(200, drop_counts(3, 0)))
    server.on("DELETE", f"/{CONCRETE}", Answer(200, {"acknowledged": True}))
    found = resolved((CONCRETE, [ACME]), (kept, []), (f"{ACME}~other", []))
    server.on("GET", RESOLVE, Answer(200, found))
    server.on("DELETE", f"/{kept}", Answer(200, {"acknowledged": True}))
    assert backend_for(server).delete_index("docs", "acme", version=20) == 3
    assert [(r.method, r.path) for r in server.requests] == [
        ("PUT", "/_index_template/sift-sift"),
        ("PUT", f"/{FLOORS}"),  # once per process
        ("PUT", FLOOR),  # before anything is deleted
        ("GET", DELETES),  # no delete by id accepted after the drop has run
        ("GET", RESOLVE),  # ES registers GET only for _resolve/index
        ("POST", MSEARCH),
        ("DELETE", f"/{kept}"),  # a name Sift did not make (~other) is left
        ("DELETE", f"/{CONCRETE}"),  # last: a drop cut short leaves the alias to find
    ]
    assert server.requests[4].query == {"expand_wildcards": ["all"]}
    assert server.requests[-2].query == {"ignore_unavailable": ["true"]}
    floor = server.requests[2]
    assert floor.json() == {}
    assert floor.query == {"version": ["20"], "version_type": ["external"]}
    assert server.requests[5].ndjson() == DROP_SEARCHES + NEWER_SEARCH
    assert BETA not in str([(r.path, r.body) for r in server.requests])
    assert not server.sent("POST", f"/{ACME}/_delete_by_query")


def test_a_drop_after_a_newer_delete_by_id_keeps_the_index_and_its_tombstones(
    server: FakeElasticsearchServer, quick_polls: None
) -> None:
    """A delete by id accepted after drop 20 ran before it (its mark holds 24): the index
    holds its tombstones, which keep the ingest it was accepted after from writing the
    document back, so it is not deleted: acme's documents not written after the drop go
    by query instead."""
    on_floors(server)
    on_shared_drop(server, delete_by_query_task(DROP_TASK, ACME, deleted=2))
    on_searches(server, Answer(200, drop_counts(2, 0)))  # no document above 20
    server.on("GET", DELETES, Answer(200, floor_found(FLOORS, f"{ACME}#deletes", 24)))
    assert backend_for(server).delete_index("docs", "acme", version=20) == 2
    sent = [(r.method, r.path) for r in server.requests]
    assert sent[sent.index(("PUT", FLOOR)) :] == [
        ("PUT", FLOOR),
        ("GET", DELETES),  # read after the floor is raised
        ("GET", RESOLVE),
        ("POST", MSEARCH),
        ("GET", "/_tasks"),
        ("POST", DBQ),
        ("GET", DROP_TASK_PATH),
    ]
    assert not server.sent("DELETE")
    # a mark at or below the drop's version is an older delete: the index goes whole
    server.requests.clear()
    server.on("GET", DELETES, Answer(200, floor_found(FLOORS, f"{ACME}#deletes", 20)))
    server.on("DELETE", f"/{CONCRETE}", Answer(200, {"acknowledged": True}))
    assert backend_for(server).delete_index("docs", "acme", version=20) == 2
    assert [r.path for r in server.sent("DELETE")] == [f"/{CONCRETE}"]


def test_a_drop_that_finds_a_newer_write_deletes_only_what_was_written_before_it(
    server: FakeElasticsearchServer, quick_polls: None
) -> None:
    """An ingest accepted after drop 20 ran before it: the drop's ``_msearch`` finds one of
    acme's documents whose ``write_version`` is above 20, so the live index is not deleted
    (the index a reindex kept is: nothing writes there). One ``_delete_by_query`` takes
    acme's documents not written after the drop (those without the field, from an earlier
    release, too), run as a task as for a shared index."""
    kept = f"{ACME}~20260101t000000000000"
    on_floors(server)
    on_shared_drop(server, delete_by_query_task(DROP_TASK, ACME, deleted=3))
    on_searches(server, Answer(200, msearch_response(*[
        probe_response(n) for n in (4, 0, 1)
    ])))  # fmt: skip
    server.on("GET", RESOLVE, Answer(200, resolved((CONCRETE, [ACME]), (kept, []))))
    server.on("DELETE", f"/{kept}", Answer(200, {"acknowledged": True}))
    assert backend_for(server).delete_index("docs", "acme", version=20) == 3
    sent = [(r.method, r.path) for r in server.requests]
    assert sent[sent.index(("GET", RESOLVE)) :] == [
        ("GET", RESOLVE),
        ("POST", MSEARCH),
        ("DELETE", f"/{kept}"),
        ("GET", "/_tasks"),
        ("POST", DBQ),
        ("GET", DROP_TASK_PATH),
    ]
    assert server.sent("POST", MSEARCH)[0].ndjson() == DROP_SEARCHES + NEWER_SEARCH
    (deleting,) = server.sent("POST", DBQ)
    assert deleting.json() == {
        "query": {
            "bool": {
                "filter": [{"term": {"tenant": "acme"}}],
                "must_not": [{"range": {"write_version": {"gt": 20}}}],
            }
        }
    }
    assert not server.sent("DELETE", f"/{CONCRETE}")


DROP_TASK = "oTUltX4IQMOUUVeiohTt8A:12346"
DBQ = f"/{ACME}/_delete_by_query"
DROP_TASK_PATH = f"/_tasks/{DROP_TASK.replace(':', '%3A')}"


@pytest.fixture
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "worker.adapters.elasticsearch._drops.DROP_POLL_SECONDS", 0.01, raising=False
    )


def on_shared_drop(server: FakeElasticsearchServer, *answers: dict[str, Any]) -> None:
    """A drop of acme's "docs" from an index beta shares: no delete on the alias running
    yet, ``_delete_by_query`` answering its task, and ``GET _tasks/<id>`` answering
    ``answers`` in turn (the last one from then on)."""
    on_searches(server, Answer(200, drop_counts(3, 1)))
    server.on("GET", RESOLVE, Answer(200, resolved((CONCRETE, [ACME]))))
    server.on("GET", "/_tasks", Answer(200, tasks_list()))
    server.on("POST", DBQ, Answer(200, {"task": DROP_TASK}))
    *first, last = answers
    server.on("GET", DROP_TASK_PATH, Answer(200, last))
    for answer in reversed(first):  # the last added answers first
        server.on("GET", DROP_TASK_PATH, Answer(200, answer), times=1)


def test_delete_index_holding_another_tenants_document_deletes_only_the_tenants(
    server: FakeElasticsearchServer, quick_polls: None
) -> None:
    """Defence in depth: an index that also holds another tenant's document (a key
    collision, or an alias pointed at a shared index) is never deleted outright. Only the
    tenant's documents go, with a ``_delete_by_query`` run as a task (a large tenant's
    outlasts the request timeout: run in the request, it timed out and the job's retry
    started a second delete) and polled until done."""
    running = delete_by_query_task(DROP_TASK, ACME, completed=False, deleted=1)
    on_shared_drop(server, running, delete_by_query_task(DROP_TASK, ACME, deleted=3))
    assert backend_for(server).delete_index("docs", "acme") == 3
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", RESOLVE),
        ("POST", MSEARCH),
        ("GET", "/_tasks"),  # no delete on acme's alias running (an earlier run's)
        ("POST", DBQ),
        ("GET", DROP_TASK_PATH),  # not done yet
        ("GET", DROP_TASK_PATH),  # done
    ]
    listed = server.sent("GET", "/_tasks")[0]
    assert listed.query == {"actions": ["*delete/byquery"], "detailed": ["true"]}
    (sent,) = server.sent("POST", DBQ)
    assert sent.json() == {"query": {"bool": {"filter": [{"term": {"tenant": "acme"}}]}}}
    assert sent.query == {
        "conflicts": ["proceed"],
        "refresh": ["true"],
        "wait_for_completion": ["false"],
    }
    assert not server.sent("DELETE")


REJECTED = {
    "index": CONCRETE,
    "id": "acme:d2",
    "status": 429,
    "cause": {"type": "es_rejected_execution_exception", "reason": "bulk queue full"},
}


@pytest.mark.parametrize(
    ("report", "why"),
    [
        ({"deleted": 2, "conflicts": 1}, "1 changed since it began"),
        ({"deleted": 1, "failures": [REJECTED]}, "1 failure.*es_rejected_execution_exception"),
    ],
)
def test_a_delete_task_that_left_documents_fails_the_drop_retryably(
    server: FakeElasticsearchServer, quick_polls: None, report: dict[str, Any], why: str
) -> None:
    """A delete task that met a document written since it began (a version conflict,
    counted and passed over under ``conflicts=proceed``) or a failure (a rejected bulk)
    did not take all of the tenant's documents: the drop fails retryably, not reported
    done nor failed for good, and its retry deletes what is left."""
    on_shared_drop(server, delete_by_query_task(DROP_TASK, ACME, **report))
    with pytest.raises(BackendUnavailable, match=f"task {DROP_TASK} .*{why}.*run again"):
        backend_for(server).delete_index("docs", "acme")


def test_a_delete_task_es_lost_fails_the_drop_retryably(
    server: FakeElasticsearchServer, quick_polls: None
) -> None:
    """A task ES no longer knows (``GET _tasks/<id>`` answering 404
    ``resource_not_found_exception``: the node running it left, a rolling restart, before
    it stored its result) fails the drop retryably: its run again finds no delete running
    and deletes what is left. It failed the drop for good, as a request ES refused."""
    on_shared_drop(server, delete_by_query_task(DROP_TASK, ACME, completed=False))
    lost = error_body(
        "resource_not_found_exception",
        f"task [{DROP_TASK}] isn't running and hasn't stored its results",
        status=404,
    )
    server.on("GET", DROP_TASK_PATH, Answer(404, lost))
    with pytest.raises(BackendUnavailable, match=f"task {DROP_TASK} .*run again"):
        backend_for(server).delete_index("docs", "acme")


def test_a_delete_task_that_failed_names_es_s_reason(
    server: FakeElasticsearchServer, quick_polls: None
) -> None:
    """One that failed outright is an error naming the task and ES's reason; one whose
    index went meanwhile (another drop) leaves nothing of the tenant's: 0 deleted."""
    failed = {"type": "search_phase_execution_exception", "reason": "all shards failed"}
    on_shared_drop(server, delete_by_query_task(DROP_TASK, ACME, error=failed))
    with pytest.raises(BackendRequestError, match=f"{DROP_TASK} failed: search_phase.*all shards"):
        backend_for(server).delete_index("docs", "acme")
    gone = index_missing(CONCRETE)["error"]
    on_shared_drop(server, delete_by_query_task(DROP_TASK, ACME, error=gone))
    assert backend_for(server).delete_index("docs", "acme") == 0


def test_a_drop_run_again_waits_on_its_delete_still_running_instead_of_a_second(
    server: FakeElasticsearchServer, quick_polls: None
) -> None:
    """A delete not done within the drop's budget (its job's) fails the drop retryably,
    naming the task, which runs on; the job's retry (another worker, maybe) finds that
    task on acme's alias (``GET _tasks``, by its description) and waits on it: not two
    racing. Then it runs its own, which takes what is left (ES does not say what the
    running one deletes: it may be an older drop's), and counts both."""
    running = delete_by_query_task(DROP_TASK, ACME, completed=False, deleted=1)
    on_shared_drop(server, running)
    backend = backend_for(server)
    backend.drop_max_seconds = 0  # the budget spent at the first poll
    with pytest.raises(BackendUnavailable, match=f"not done after 0 s \\(task {DROP_TASK} runs on"):
        backend.delete_index("docs", "acme")

    other = delete_by_query_task("oTUltX4IQMOUUVeiohTt8A:7", BETA, completed=False)["task"]
    server.on("GET", "/_tasks", Answer(200, tasks_list(other, running["task"])))
    server.on("GET", DROP_TASK_PATH, Answer(200, delete_by_query_task(DROP_TASK, ACME, deleted=3)))
    own = "oTUltX4IQMOUUVeiohTt8A:12399"
    own_path = f"/_tasks/{own.replace(':', '%3A')}"
    server.on("POST", DBQ, Answer(200, {"task": own}))
    server.on("GET", own_path, Answer(200, delete_by_query_task(own, ACME, deleted=1)))
    server.requests.clear()
    assert backend_for(server).delete_index("docs", "acme") == 4
    assert [(r.method, r.path) for r in server.requests][2:] == [
        ("GET", "/_tasks"),
        ("GET", DROP_TASK_PATH),  # the first run's, waited on
        ("POST", DBQ),  # then this run's own, after it
        ("GET", own_path),
    ]


def test_a_delete_task_refused_at_its_start_fails_the_drop_retryably(
    server: FakeElasticsearchServer,
) -> None:
    """ES refusing to start the delete (429: its queue full) is a passing failure."""
    on_shared_drop(server, delete_by_query_task(DROP_TASK, ACME, deleted=3))
    busy = error_body("es_rejected_execution_exception", "rejected execution", 429)
    server.on("POST", DBQ, Answer(429, busy), times=1)
    with pytest.raises(BackendUnavailable, match="429"):
        backend_for(server).delete_index("docs", "acme")


def test_delete_index_of_a_missing_index_deletes_nothing(server: FakeElasticsearchServer) -> None:
    on_floors(server)
    server.on("GET", RESOLVE, Answer(200, resolved()))
    for answer in (
        Answer(404, index_missing(ACME)),
        Answer(200, msearch_response(index_missing(ACME), index_missing(ACME))),
    ):
        server.requests.clear()
        on_searches(server, answer)
        assert backend_for(server).delete_index("docs", "acme", version=20) == 0
        # the floor still goes up: an upsert accepted before this drop may run after it
        assert [(r.method, r.path) for r in server.requests][-4:] == [
            ("PUT", FLOOR),
            ("GET", DELETES),
            ("GET", RESOLVE),
            ("POST", MSEARCH),
        ]
    assert not server.sent("DELETE")
    # a newer writer made the index again after the drop found no name: its index is not
    # deleted, nor its documents counted
    on_searches(server, Answer(200, drop_counts(2, 0)))
    assert backend_for(server).delete_index("docs", "acme") == 0
    assert not server.sent("DELETE")
    # another worker deleted it between finding the names and the delete: no error either,
    # and the documents are that drop's to count, not this one's
    server.on("GET", RESOLVE, Answer(200, resolved((CONCRETE, [ACME]))))
    server.on("DELETE", f"/{CONCRETE}", Answer(404, index_missing(CONCRETE)))
    assert backend_for(server).delete_index("docs", "acme") == 0


def test_a_write_after_another_worker_dropped_the_index_makes_it_again(
    server: FakeElasticsearchServer,
) -> None:
    """This process saw acme's index; another worker dropped it. ``require_alias`` refuses
    the bulk write (no bare index auto-created under the alias's name), the index is made
    again from the template, and the write is sent once more."""
    server.on("HEAD", f"/_alias/{ACME}", Answer(200), times=1)
    server.on("PUT", f"/{ACME}/_mapping", Answer(200, {"acknowledged": True}), times=1)
    server.on("PUT", "/_bulk", bulk_ok)
    server.on("GET", FLOOR, Answer(404, get_missing(FLOORS, ACME)))
    on_other_ids(server)
    backend = backend_for(server)
    assert backend.upsert("docs", "acme", [Document("d1", "x")], None, version=4) == 1
    server.requests.clear()
    refused = bulk_response(require_alias_refused("index", ACME, "acme:d2"))
    server.on("PUT", "/_bulk", Answer(200, refused), times=1)
    server.on("HEAD", f"/_alias/{ACME}", Answer(404))
    server.on("GET", ACME_ALIASES, Answer(200, {}))  # dropped: acme holds none now
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on("PUT", f"/{CONCRETE}", Answer(200, {"acknowledged": True, "index": CONCRETE}))
    server.on("PUT", f"/{ACME}/_mapping", Answer(200, {"acknowledged": True}), times=1)
    assert backend.upsert("docs", "acme", [Document("d2", "y")], None, version=5) == 1
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", FLOOR),
        ("PUT", "/_bulk"),
        ("GET", FLOOR),  # the drop was an older one than this write: make the index again
        ("HEAD", f"/_alias/{ACME}"),
        ("GET", ACME_ALIASES),
        ("PUT", "/_index_template/sift-sift"),
        ("PUT", f"/{CONCRETE}"),
        ("PUT", f"/{ACME}/_mapping"),
        ("PUT", "/_bulk"),
        ("GET", FLOOR),  # after the write: no drop of this version or newer ran meanwhile
        ("POST", f"/{ACME}/_delete_by_query"),
    ]
    first, again = server.sent("PUT", "/_bulk")
    assert first.ndjson() == again.ndjson()  # the same actions, the same version
    assert again.query["require_alias"] == ["true"]


def test_writes_accepted_before_a_drop_that_has_run_are_skipped(
    server: FakeElasticsearchServer,
) -> None:
    """A drop of version 20 ran (the floor holds 20): an upsert or delete accepted before it
    (a retry, a redelivery) writes nothing and makes no index; one accepted after it runs."""
    server.on("GET", FLOOR, Answer(200, floor_found(FLOORS, ACME, 20)))
    backend = backend_for(server)
    server.on("HEAD", f"/_alias/{ACME}", Answer(404))
    assert backend.upsert("docs", "acme", [Document("d1", "old")], None, version=19) == 0
    assert backend.delete_documents("docs", "acme", ["d1"], version=20) == 0
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", FLOOR),
        ("GET", FLOOR),  # the upsert's take-back: an earlier attempt's documents go too
        ("HEAD", f"/_alias/{ACME}"),  # ... if the alias is there (a delete would make it)
        ("GET", FLOOR),
    ]
    on_existing_index(server)
    server.on("PUT", "/_bulk", bulk_ok)
    assert backend.upsert("docs", "acme", [Document("d1", "new")], None, version=21) == 1
    assert backend.upsert("docs", "acme", [Document("d2", "any")], None) == 1  # unversioned
    # before and after the versioned write; an unversioned write reads no floor
    assert len(server.sent("GET", FLOOR)) == 5


def test_a_drop_running_between_a_writes_floor_check_and_its_bulk_still_wins(
    server: FakeElasticsearchServer,
) -> None:
    """The write passed the floor check, then the drop (accepted after it) raised the floor
    and deleted the index: ``require_alias`` refuses the bulk, the floor is read again, and
    the write is dropped, not written into a re-made index. Its ids are deleted at the
    floor's version where the alias is (a newer writer made it again): an earlier attempt
    of the write may have put them there."""
    server.on("GET", FLOOR, Answer(200, floor_found(FLOORS, ACME, 30)))
    server.on("GET", FLOOR, Answer(404, get_missing(FLOORS, ACME)), times=1)  # asked first
    on_existing_index(server)
    deleted = {"_index": CONCRETE, "_id": "acme:d1", "_version": 30, "result": "deleted"}
    server.on("PUT", "/_bulk", Answer(200, bulk_response({"delete": {**deleted, "status": 200}})))
    refused = bulk_response(require_alias_refused("index", ACME, "acme:d1"))
    server.on("PUT", "/_bulk", Answer(200, refused), times=1)
    backend = backend_for(server)
    assert backend.upsert("docs", "acme", [Document("d1", "x")], None, version=29) == 0
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", FLOOR),
        ("HEAD", f"/_alias/{ACME}"),
        ("PUT", f"/{ACME}/_mapping"),  # once per process: the fields the template gained
        ("PUT", "/_bulk"),
        ("GET", FLOOR),
        ("GET", FLOOR),
        ("HEAD", f"/_alias/{ACME}"),
        ("PUT", "/_bulk"),
    ]
    assert server.requests[-1].ndjson() == [
        {"delete": {"_index": ACME, "_id": "acme:d1", "version": 30, "version_type": "external"}}
    ]


def test_a_drop_older_than_the_held_floor_leaves_it(server: FakeElasticsearchServer) -> None:
    """Two drops run out of order: the older one's floor write is a 409 (ES keeps the
    higher external version), which is no error."""
    on_floors(server)
    conflict = version_conflict("index", FLOORS, ACME, held=30, sent=20)["index"]["error"]
    server.on("PUT", FLOOR, Answer(409, {"error": conflict, "status": 409}))
    server.on("GET", RESOLVE, Answer(200, resolved()))
    on_searches(server, Answer(200, msearch_response(index_missing(ACME), index_missing(ACME))))
    assert backend_for(server).delete_index("docs", "acme", version=20) == 0


def test_indexes_lists_the_tenants_aliases_with_counts(server: FakeElasticsearchServer) -> None:
    """Acme's aliases by its key's pattern, then one count per concrete index: an index a
    reindex kept (no alias) and one holding none of acme's documents are not listed."""
    stem = f"sift-{tenant_key('acme')}--"
    server.on(
        "GET",
        f"/_alias/{stem}*",
        Answer(200, aliases((CONCRETE, ACME), (f"{stem}faq~20260101t000000000000", f"{stem}faq"))),
    )
    counts = terms_by_index_response(
        {CONCRETE: 4, f"{stem}faq~20260101t000000000000": 2, f"{stem}old~000001": 7},
        {CONCRETE: "m-1"},
    )
    server.on("POST", f"/{stem}*/_search", Answer(200, counts))
    listed = backend_for(server).indexes("acme")
    assert [(i.name, i.documents, i.backend, i.model, i.dimension) for i in listed] == [
        ("docs", 4, "elasticsearch", "m-1", 384),
        ("faq", 2, "elasticsearch", None, 384),  # no vector records a model
    ]
    (search,) = server.sent("POST", f"/{stem}*/_search")
    # filtered on the aliases' own indexes: a kept one takes no bucket of the aggregation
    assert search.json() == {
        "size": 0,
        "query": {
            "bool": {
                "filter": [
                    {"term": {"tenant": "acme"}},
                    {"terms": {"_index": [CONCRETE, f"{stem}faq~20260101t000000000000"]}},
                ]
            }
        },
        "aggs": {
            "indexes": {
                "terms": {"field": "_index", "size": 1000},
                "aggs": {"models": {"terms": {"field": "embedding_model", "size": 1}}},
            }
        },
    }
    # after a name: its aliases after it only, and the count filtered on their concrete
    # indexes (the aggregation's buckets spent on them); "docs" < "faq"
    after = backend_for(server).indexes("acme", "docs")
    assert [(i.name, i.documents) for i in after] == [("faq", 2)]
    assert backend_for(server).indexes("acme", None, 1) == listed[:1]
    searches = server.sent("POST", f"/{stem}*/_search")
    assert searches[1].json()["query"] == {
        "bool": {
            "filter": [
                {"term": {"tenant": "acme"}},
                {"terms": {"_index": [f"{stem}faq~20260101t000000000000"]}},
            ]
        }
    }
    assert searches[2].json() == search.json()  # a first page's, whatever its size
    # after the last name: nothing is left to count, and no search is sent
    assert backend_for(server).indexes("acme", "faq") == []
    assert len(server.sent("POST", f"/{stem}*/_search")) == 3
    # a tenant with no alias at all: ES answers the wildcard with {}, and nothing is counted
    nobody = f"/_alias/sift-{tenant_key('nobody')}--*"
    server.on("GET", nobody, Answer(200, {}))
    assert backend_for(server).indexes("nobody") == []
    assert server.requests[-1].path == nobody
    # with security on and no index the key may see yet, ES answers 404 index_not_found
    server.on("GET", nobody, Answer(404, index_missing("_all")))
    assert backend_for(server).indexes("nobody") == []


def test_a_tenant_past_the_aggregations_size_is_listed_by_name_not_by_count(
    server: FakeElasticsearchServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More aliases than the terms aggregation holds: its buckets would go to the biggest
    indexes, and a small index named before the page's last name would never be shown, on
    this page or after it. The count is filtered to the first names instead."""
    monkeypatch.setattr("worker.adapters.elasticsearch._listing.MAX_LISTED_INDEXES", 2)
    stem = f"sift-{tenant_key('acme')}--"
    concrete = {name: f"{stem}{name}~000001" for name in ("a", "b", "c")}
    server.on(
        "GET",
        f"/_alias/{stem}*",
        Answer(200, aliases(*((concrete[n], f"{stem}{n}") for n in ("c", "a", "b")))),
    )
    # ES would answer the unfiltered count with the two biggest: c and b, not a
    counts = terms_by_index_response({concrete["a"]: 1, concrete["b"]: 9}, {})
    server.on("POST", f"/{stem}*/_search", Answer(200, counts))
    listed = backend_for(server).indexes("acme", None, 1)
    assert [i.name for i in listed] == ["a"]
    (search,) = server.sent("POST", f"/{stem}*/_search")
    assert search.json()["query"]["bool"]["filter"][1] == {
        "terms": {"_index": [concrete["a"], concrete["b"]]}
    }


def test_index_info_is_a_tenant_filtered_count_with_the_recorded_model(
    server: FakeElasticsearchServer,
) -> None:
    answer = {**probe_response(5), "aggregations": models_agg("m-1")}
    server.on("POST", f"/{ACME}/_search", Answer(200, answer), times=1)
    info = backend_for(server).index_info("docs", "acme")
    assert info is not None and info.documents == 5 and info.model == "m-1"
    (sent,) = server.sent("POST", f"/{ACME}/_search")
    assert sent.json() == {
        "size": 0,
        "track_total_hits": True,
        "query": {"bool": {"filter": [{"term": {"tenant": "acme"}}]}},
        "aggs": {"models": {"terms": {"field": "embedding_model", "size": 1}}},
    }
    # globex's own index, emptied by deletes (total 0), and none (404): the same None
    globex = f"/sift-{tenant_key('globex')}--docs/_search"
    empty = {**probe_response(0), "aggregations": models_agg()}
    server.on("POST", globex, Answer(200, empty), times=1)
    assert backend_for(server).index_info("docs", "globex") is None
    server.on("POST", globex, Answer(404, index_missing(globex[1:-8])))
    assert backend_for(server).index_info("docs", "globex") is None
    assert len(server.sent("POST", f"/{ACME}/_search")) == 1  # acme's was never asked again


def test_document_gets_the_tenants_id_without_the_vector(server: FakeElasticsearchServer) -> None:
    found = get_found(CONCRETE, "acme", "d1", 7, text="the text", title="T", metadata={"y": "1"})
    server.on("GET", f"/{ACME}/_doc/acme%3Ad1", Answer(200, found))
    doc = backend_for(server).document("docs", "acme", "d1")
    assert doc is not None
    assert doc.id == "d1" and doc.text == "the text" and doc.title == "T"
    assert doc.revision == "r1" and dict(doc.metadata) == {"y": "1"} and doc.version == 7
    (sent,) = server.sent("GET", f"/{ACME}/_doc/acme%3Ad1")
    assert sent.query["_source_excludes"] == ["vector"]
    server.on("GET", f"/{ACME}/_doc/acme%3Ad2", Answer(404, get_missing(CONCRETE, "acme:d2")))
    server.on("POST", f"/{ACME}/_search", Answer(200, search_response([])))
    assert backend_for(server).document("docs", "acme", "d2") is None
    # not under Sift's _id: the tenant's document of that id under an _id of its own (an
    # index another tool wrote) is looked for by its id field, or its _id where it has none
    (looked,) = server.sent("POST", f"/{ACME}/_search")
    assert looked.json()["query"] == {
        "bool": {
            "filter": [{"term": {"tenant": "acme"}}],
            "should": [{"terms": {"doc_id": ["d2"]}}, {"ids": {"values": ["d2"]}}],
            "minimum_should_match": 1,
        }
    }
    assert looked.query["_source_excludes"] == ["vector"] and looked.json()["version"] is True
    none = f"sift-{tenant_key('acme')}--none"
    server.on("GET", f"/{none}/_doc/acme%3Ad1", Answer(404, index_missing(none)))
    assert backend_for(server).document("none", "acme", "d1") is None
    assert server.sent("GET", f"/{none}/_doc/acme%3Ad1")
    assert not server.sent("POST", f"/{none}/_search")  # a missing index: no search


def listed_page(*hits: dict[str, Any]) -> dict[str, Any]:
    """A sorted ``search_after`` page as ES 9 answers it with ``track_total_hits: false``:
    no total, each hit with its ``_version`` and ``sort`` values and a null ``_score``."""
    answer = search_response(list(hits))
    answer["hits"]["max_score"] = None
    return answer


def listed_hit(doc_id: str, version: int, text: str) -> dict[str, Any]:
    """A listed hit as ES 9 answers the listing: ``_source`` without the text, and the
    text's preview and length as script fields (each value in a list)."""
    found = hit(CONCRETE, "acme", doc_id, 0.0, title=f"T {doc_id}")
    del found["_source"]["text"]
    fields = {"text_preview": [text[:200]], "text_length": [len(text)]}
    return {**found, "_score": None, "_version": version, "sort": [doc_id], "fields": fields}


def text_script(source: str, field: str = "text") -> dict[str, Any]:
    params = {"field": field, "chars": 200}
    return {"script": {"lang": "painless", "source": source, "params": params}}


TEXT_SCRIPTS = {
    "text_preview": text_script(PREVIEW_SCRIPT),
    "text_length": text_script(LENGTH_SCRIPT),
}


def test_documents_page_is_a_tenant_filtered_sorted_search_after_without_the_vector(
    server: FakeElasticsearchServer,
) -> None:
    """One search on the tenant's alias per page: the tenant term and the id field's
    presence as filters, sorted by the id field, from ``search_after`` the cursor's id, the
    vector and the text excluded from ``_source``, the text's preview and length as script
    fields, versions asked for, no total. No hit on a first page, or no alias (404), is no
    index (None); no hit after an id asks the tenant's count: still some (an empty page) or
    none (None)."""
    long_text = "x" * 250
    first = listed_page(listed_hit("a", 3, long_text), listed_hit("b", 5, "short"))
    page_path = f"/{ACME}/_search"
    server.on("POST", page_path, Answer(200, first), times=1)
    page = backend_for(server).documents("docs", "acme", None, 2)
    assert page is not None
    assert [(d.id, d.version, d.title, d.text_length) for d in page] == [
        ("a", 3, "T a", 250),
        ("b", 5, "T b", 5),
    ]
    assert page[0].text_preview == "x" * 200 and page[1].text_preview == "short"
    expected = {
        "size": 2,
        "track_total_hits": False,
        "query": {
            "bool": {"filter": [{"term": {"tenant": "acme"}}, {"exists": {"field": "doc_id"}}]}
        },
        "sort": [{"doc_id": "asc"}],
        "_source": {"excludes": ["vector", "text"]},
        "script_fields": TEXT_SCRIPTS,
        "version": True,
    }
    (sent,) = server.sent("POST", page_path)
    assert sent.json() == expected
    # no hit on a first page: no index, without a count
    server.on("POST", page_path, Answer(200, listed_page()), times=1)
    assert backend_for(server).documents("docs", "acme", None, 2) is None
    assert len(server.sent("POST", page_path)) == 2
    # no hit after an id: the count says whether the tenant still holds a document
    counted = {**probe_response(4), "aggregations": models_agg("m-1")}
    server.on("POST", page_path, Answer(200, counted), times=1)  # the later route answers first
    server.on("POST", page_path, Answer(200, listed_page()), times=1)
    assert backend_for(server).documents("docs", "acme", "b", 2) == []
    after, count = server.sent("POST", page_path)[-2:]
    assert after.json() == {**expected, "search_after": ["b"]}
    assert count.json()["size"] == 0 and count.json()["track_total_hits"] is True
    none = {**probe_response(0), "aggregations": models_agg()}
    server.on("POST", page_path, Answer(200, none), times=1)
    server.on("POST", page_path, Answer(200, listed_page()), times=1)
    assert backend_for(server).documents("docs", "acme", "b", 2) is None
    globex = f"/sift-{tenant_key('globex')}--docs/_search"
    server.on("POST", globex, Answer(404, index_missing(globex[1:-8])))
    assert backend_for(server).documents("docs", "globex", None, 2) is None
    server.on("POST", page_path, Answer(200, partial(first)), times=1)
    with pytest.raises(BackendUnavailable):
        backend_for(server).documents("docs", "acme", None, 2)


def test_a_documents_page_asks_elasticsearch_for_each_preview_not_each_text(
    server: FakeElasticsearchServer,
) -> None:
    """A listing shows each text's first 200 characters and its length, and the page's
    search fetched every text whole to cut it in the worker: a page of 1,000 texts of
    100,000 characters moved 100 MB. The text field (the configured one) is left out of
    ``_source``, and the preview and length are painless script fields, the field and the
    cut their params (a constant source, compiled once); a hit whose text is missing (the
    scripts answer null, and ES leaves the field out) lists as empty."""
    page_path = f"/{ACME}/_search"
    bare = listed_hit("b", 1, "")
    del bare["fields"]
    page = listed_page(listed_hit("a", 1, "é" * 300), bare)
    server.on("POST", page_path, Answer(200, page), times=1)
    backend = backend_for(server, elasticsearch_text_field="body")
    listed = backend.documents("docs", "acme", None, 1000)
    assert [(d.id, d.text_preview, d.text_length) for d in listed or []] == [
        ("a", "é" * 200, 300),
        ("b", "", 0),
    ]
    (sent,) = server.sent("POST", page_path)
    body = sent.json()
    assert body["_source"] == {"excludes": ["vector", "body"]}
    assert body["script_fields"] == {
        "text_preview": text_script(PREVIEW_SCRIPT, "body"),
        "text_length": text_script(LENGTH_SCRIPT, "body"),
    }


def hashed_id(tenant: str, doc_id: str) -> str:
    """The ``_id`` of a document whose ``<tenant>:<id>`` is over ES's 512 bytes."""
    return "#sha256:" + hashlib.sha256(f"{tenant}:{doc_id}".encode()).hexdigest()


def test_an_id_over_512_bytes_with_its_prefix_is_hashed_in_every_request(
    server: FakeElasticsearchServer,
) -> None:
    """ES refuses an ``_id`` over 512 bytes, the gateway takes an id of 512 characters: a
    longer ``<tenant>:<id>`` is sent as a fixed-length digest, in the upsert, the delete and
    the read; an id that fits keeps its ``<tenant>:<id>``, 512 bytes included."""
    on_existing_index(server)
    server.on("PUT", "/_bulk", bulk_ok)
    fits, ascii_512, wide_512 = "f" * 507, "d" * 512, "𝔡" * 512  # 512, 517, 2,053 bytes
    docs = [Document(i, "x") for i in (fits, ascii_512, wide_512)]
    backend = backend_for(server)
    assert backend.upsert("docs", "acme", docs, None) == 3
    (bulk,) = server.sent("PUT", "/_bulk")
    sent = bulk.ndjson()
    ids = [fits, ascii_512, wide_512]
    assert [a["index"]["_id"] for a in sent[0::2]] == [
        f"acme:{fits}",
        hashed_id("acme", ascii_512),
        hashed_id("acme", wide_512),
    ]
    assert [source["doc_id"] for source in sent[1::2]] == ids  # hits read the field
    server.on(
        "PUT",
        "/_bulk",
        Answer(
            200,
            bulk_response(
                bulk_item("delete", CONCRETE, hashed_id("acme", wide_512), 200, "deleted"),
            ),
        ),
    )
    assert backend.delete_documents("docs", "acme", [wide_512], version=None) == 1
    assert server.sent("PUT", "/_bulk")[-1].ndjson() == [
        {"delete": {"_index": ACME, "_id": hashed_id("acme", wide_512)}}
    ]
    path = f"/{ACME}/_doc/" + quote(hashed_id("acme", ascii_512), safe="")
    found = get_found(CONCRETE, "acme", ascii_512, 4, text="x")
    server.on("GET", path, Answer(200, found | {"_id": hashed_id("acme", ascii_512)}))
    stored = backend.document("docs", "acme", ascii_512)
    assert stored is not None and (stored.id, stored.version) == (ascii_512, 4)


def test_a_bulk_error_on_a_hashed_id_names_the_document(server: FakeElasticsearchServer) -> None:
    """The document a failed item names is found through the actions sent (a digest holds
    no id to strip a prefix from)."""
    on_existing_index(server)
    long_id = "é" * 300

    def refused(request: Recorded) -> Answer:
        answer = bulk_ok(request)
        answer.body["errors"] = True
        answer.body["items"][0] = {
            "index": {
                "_index": CONCRETE,
                "_id": hashed_id("acme", long_id),
                "status": 400,
                "error": {"type": "document_parsing_exception", "reason": "bad field"},
            }
        }
        return answer

    server.on("PUT", "/_bulk", refused)
    docs = [Document(long_id, "x"), Document("fine", "y")]
    with pytest.raises(BackendRequestError) as caught:
        backend_for(server).upsert("docs", "acme", docs, None)
    assert str(caught.value).endswith(
        f"1 document(s) not written: {long_id} (400 document_parsing_exception: bad field)"
    )


# --- the embedding model each vector records ---------------------------------------------


MODEL_CHECK = {
    "size": 1,
    "terminate_after": 1,
    "_source": ["embedding_model"],
    "query": {
        "bool": {
            "filter": [{"term": {"tenant": "acme"}}, {"exists": {"field": "embedding_model"}}],
            "must_not": [{"term": {"embedding_model": "m-1"}}],
        }
    },
}


def test_a_write_of_vectors_checks_then_records_its_model_and_another_model_is_refused(
    server: FakeElasticsearchServer,
) -> None:
    on_existing_index(server)
    server.on("POST", f"/{ACME}/_search", Answer(200, probe_response(0)), times=2)
    server.on("PUT", "/_bulk", bulk_ok)
    backend = backend_for(server)
    first = [Document("d1", "x", revision="r")]
    assert backend.upsert("docs", "acme", first, [VECTOR], model="m-1") == 1
    assert [(r.method, r.path) for r in server.requests] == [
        ("HEAD", f"/_alias/{ACME}"),
        ("PUT", f"/{ACME}/_mapping"),  # an index made before the fields existed takes them
        ("POST", f"/{ACME}/_search"),
        ("PUT", "/_bulk"),
        ("POST", f"/{ACME}/_delete_by_query"),
    ]
    assert server.requests[1].json() == {
        "properties": {
            "embedding_model": {"type": "keyword"},
            "metadata_terms": {"type": "keyword"},
            "write_version": {"type": "long"},
        }
    }
    assert server.requests[2].json() == MODEL_CHECK
    _action, source = server.requests[3].ndjson()
    assert source["embedding_model"] == "m-1" and source["vector"] == VECTOR
    assert backend.probe("docs", "acme") == IndexProbe(frozenset({"bm25", "knn"}), "m-1")
    assert len(server.requests) == 5  # the probe answered from the write's memo

    # the next write checks again (another worker may have written), the mapping is known
    assert backend.upsert("docs", "acme", [Document("d2", "y")], [VECTOR], model="m-1") == 1
    assert [(r.method, r.path) for r in server.requests[5:]] == [
        ("POST", f"/{ACME}/_search"),
        ("PUT", "/_bulk"),
        ("POST", f"/{ACME}/_delete_by_query"),
    ]
    # the tenant holds vectors of "m-0": refused before the bulk, nothing written
    held = probe_response(1, [{"embedding_model": "m-0"}])
    server.on("POST", f"/{ACME}/_search", Answer(200, held))
    before = len(server.sent("PUT", "/_bulk"))
    with pytest.raises(EmbeddingModelMismatch, match=r"'m-0'.*'m-1'"):
        backend.upsert("docs", "acme", [Document("d3", "z")], [VECTOR], model="m-1")
    assert len(server.sent("PUT", "/_bulk")) == before
    # a write without vectors records and checks nothing
    assert backend.upsert("docs", "acme", [Document("d4", "w")], None, model="m-1") == 1
    assert "embedding_model" not in server.sent("PUT", "/_bulk")[-1].ndjson()[1]

    # a drop takes the record (with the index) and this worker's memo of it
    on_searches(server, Answer(200, drop_counts(3, 0)))
    server.on("DELETE", f"/{CONCRETE}", Answer(200, {"acknowledged": True}))
    server.on("GET", RESOLVE, Answer(200, resolved((CONCRETE, [ACME]))))
    backend.delete_index("docs", "acme")
    on_probes(server, Answer(200, probes_of_a_missing_index(ACME)))
    assert backend.probe("docs", "acme") == IndexProbe(frozenset())


def test_a_knn_search_of_another_models_vectors_is_refused_from_the_probe_alone(
    server: FakeElasticsearchServer,
) -> None:
    """The probe's vector hit names its model: a vector or hybrid search by another model's
    query is refused after that one round trip (and the mapping read); fts is served."""
    on_probes(
        server,
        Answer(200, probes(documents=True, vectors=True, model="m-0")),
    )
    server.on("GET", f"/{ACME}/_mapping", Answer(200, mapping()))
    on_searches(server, Answer(200, msearch_response(search_response(BM25_HITS))))
    pipeline = SearchPipeline(backend_for(server), FakeEmbedder(), config=PipelineConfig())
    for mode in ("vector", "hybrid"):
        with pytest.raises(EmbeddingModelMismatch, match=r"'m-0'.*'fake-bow-64'"):
            pipeline.search(SearchSpec(index="docs", query="vitamin", mode=mode), "acme")
    assert searches_sent(server) == []  # no channel was searched
    assert [(r.method, r.path) for r in server.requests] == [
        ("POST", MSEARCH),
        ("GET", f"/{ACME}/_mapping"),
    ]  # the second search's probe came from the memo, with the model
    assert server.requests[0].ndjson() == PROBES_OF_ACME
    fts = pipeline.search(SearchSpec(index="docs", query="vitamin", mode="fts"), "acme")
    assert [h.id for h in fts.hits] == [h["_source"]["doc_id"] for h in BM25_HITS]


# --- the shared layout of earlier releases: refused at start, migrated per tenant ------------


def old_layout_server() -> FakeElasticsearchServer:
    """A stateful stand-in holding Sift's shared ``sift-docs`` (acme's 3 documents, beta's 1,
    the mapping the shared layout's template gave), an operator's alias over an index Sift
    did not make, and acme's per-tenant ``docs``."""
    server, state = stateful_server()
    mappings = dict(index_template("sift-", FieldNames(), IndexSettings())["template"]["mappings"])
    del mappings["_meta"]  # no marker then
    with state.lock:
        state.create_index("sift-docs-000001", {"aliases": {"sift-docs": {}}, "mappings": mappings})
        state.create_index("catalogue-v3", {"aliases": {"sift-custom": {}}})
        state.create_index(CONCRETE, {"aliases": {ACME: {}}, "mappings": mappings})
        shared = state.indexes["sift-docs-000001"]
        for n, (tenant, doc) in enumerate(
            [("acme", "a1"), ("acme", "a2"), ("acme", "a3"), ("beta", "b1")]
        ):
            source = {"doc_id": doc, "text": doc, "tenant": tenant, "revision": "1"}
            state.write(shared, f"{tenant}:{doc}", source, 10 + n, external=True)
    return server


@pytest.fixture
def old_layout() -> Iterator[FakeElasticsearchServer]:
    yield from running(old_layout_server())


def test_check_refuses_indexes_of_the_shared_layout_naming_what_to_run(
    old_layout: FakeElasticsearchServer, server: FakeElasticsearchServer
) -> None:
    with pytest.raises(ConfigError, match=r"\(sift-docs\).*sift elasticsearch-migrate"):
        backend_for(old_layout).check()
    server.on("GET", "/_alias/sift-*", Answer(200, aliases((CONCRETE, ACME))))
    backend_for(server).check()  # the per-tenant layout alone passes
    server.on("GET", "/_alias/sift-*", Answer(404, index_missing("_all")))
    backend_for(server).check()  # and a cluster holding no index yet


def test_migrate_shared_copies_each_tenants_documents_into_its_own_index(
    old_layout: FakeElasticsearchServer,
) -> None:
    """Per tenant of the shared index: make its own index, ``_reindex`` its documents (same
    ``_id`` and external version, so a second run copies nothing twice) as a task polled to
    its end, refresh; then the old alias goes (its concrete index is kept) and ``check``
    passes. The operator's ``sift-custom`` is not touched."""
    backend = backend_for(old_layout)
    assert backend.migrate_shared() == {"docs": {"acme": 3, "beta": 1}}
    copies = [r for r in old_layout.sent("POST", "/_reindex")]
    assert [r.json() for r in copies] == [
        {
            "source": {
                "index": "sift-docs",
                "query": {"bool": {"filter": [{"term": {"tenant": tenant}}]}},
            },
            "dest": {"index": alias, "version_type": "external"},
            "conflicts": "proceed",
        }
        for tenant, alias in (("acme", ACME), ("beta", BETA))
    ]
    assert all(r.query == {"wait_for_completion": ["false"]} for r in copies)
    (swap,) = old_layout.sent("POST", "/_aliases")
    assert swap.json() == {
        "actions": [{"remove": {"index": "sift-docs-000001", "alias": "sift-docs"}}]
    }
    assert not old_layout.sent("DELETE")  # kept for a rollback
    backend.check()
    assert backend.document("docs", "acme", "a2").version == 11
    assert backend.index_info("docs", "beta").documents == 1
    assert backend.migrate_shared() == {}


def sift(command: str, url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``sift <command>`` as an operator runs it, on Elasticsearch at ``url`` (no Redis)."""
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *command.split()],
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            "SIFT_DATA_DIR": str(tmp_path),
            "SIFT_REDIS_URL": "redis://127.0.0.1:9/0",
            "SIFT_SEARCH_BACKEND": "elasticsearch",
            "SIFT_ELASTICSEARCH_URL": url,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sift_worker_stops_at_start_over_the_shared_layout(
    old_layout: FakeElasticsearchServer, tmp_path: Path
) -> None:
    """Not a worker that comes up healthy while every tenant's documents are out of reach:
    ``sift worker`` exits 2 naming the migration, before it touches Redis (none listens)."""
    run = sift("worker", old_layout.url, tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "sift elasticsearch-migrate" in run.stderr and "sift-docs" in run.stderr, run.stderr


def test_sift_elasticsearch_migrate_runs_the_migration_and_says_what_it_copied(
    old_layout: FakeElasticsearchServer, tmp_path: Path
) -> None:
    """The command an operator runs: ``--dry-run`` says what would go and writes nothing;
    then the shared ``sift-docs`` goes to acme's and beta's own indexes, and the report
    names how many documents went to how many tenants."""
    dry = sift("elasticsearch-migrate --dry-run", old_layout.url, tmp_path)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "sift-docs -> docs: 4 document(s) would go to 2 tenant(s)" in dry.stdout, dry.stdout
    assert not old_layout.sent("POST", "/_reindex") and not old_layout.sent("POST", "/_aliases")
    run = sift("elasticsearch-migrate", old_layout.url, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "sift-docs -> docs: 4 document(s) went to 2 tenant(s)" in run.stdout, run.stdout
    assert len(old_layout.sent("POST", "/_reindex")) == 2 and old_layout.sent("POST", "/_aliases")
    again = sift("elasticsearch-migrate", old_layout.url, tmp_path)
    assert "nothing to migrate" in again.stdout, again.stdout


SETTINGS_INDEX = "sift-sift-settings"
SETTINGS_DOC = f"/{SETTINGS_INDEX}/_doc/{ACME}"  # acme's settings of "docs"
SETTINGS_MGET = f"/{SETTINGS_INDEX}/_mget"
BETA_OF_ACME = f"sift-{tenant_key('acme')}--beta"  # acme's settings of "beta"


def test_index_settings_are_one_external_versioned_document_per_alias(
    server: FakeElasticsearchServer,
) -> None:
    """An index's own settings live with its data: one document per tenant's alias in
    ``<prefix>sift-settings`` (made once per process, the settings field never mapped), its
    external ``_version`` the settings' write version; an older one is ES's 409, stored
    nothing; read by one realtime ``_mget`` for every index asked, a missing index or
    document as none stored."""
    settings = {"candidate_limit": 40}
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on("PUT", f"/{SETTINGS_INDEX}", Answer(200, {"acknowledged": True}))
    server.on("PUT", SETTINGS_DOC, Answer(201, floor_written(SETTINGS_INDEX, ACME, 10)), times=1)
    server.on("POST", SETTINGS_MGET, Answer(404, index_missing(SETTINGS_INDEX)), times=1)
    backend = backend_for(server)
    assert backend.stored_settings(["docs"], "acme") == [None]
    assert backend.store_settings("docs", "acme", settings, 10)
    assert [(r.method, r.path) for r in server.requests] == [
        ("POST", SETTINGS_MGET),
        ("PUT", "/_index_template/sift-sift"),
        ("PUT", f"/{SETTINGS_INDEX}"),
        ("PUT", SETTINGS_DOC),
    ]
    assert server.requests[0].json() == {"ids": [ACME]}
    never_mapped = {"sift_settings": {"type": "object", "enabled": False}}
    assert server.requests[2].json() == {"mappings": {"properties": never_mapped}}
    written = server.requests[3]
    assert written.json() == {"sift_settings": settings}
    assert written.query == {"version": ["10"], "version_type": ["external"]}

    conflict = error_body("version_conflict_engine_exception", "current version [10]", 409)
    server.on("PUT", SETTINGS_DOC, Answer(409, conflict), times=1)
    assert not backend.store_settings("docs", "acme", {"candidate_limit": 5}, 9)
    assert not server.sent("PUT", f"/{SETTINGS_INDEX}")[1:]  # the index made once

    found = {"_index": SETTINGS_INDEX, "_id": ACME, "_version": 10, "found": True,
             "_seq_no": 0, "_primary_term": 1, "_source": {"sift_settings": settings}}  # fmt: skip
    cleared = {**found, "_id": BETA_OF_ACME, "_version": 12, "_source": {"sift_settings": None}}
    missing = {"_index": SETTINGS_INDEX, "_id": "x", "found": False}
    server.on("POST", SETTINGS_MGET, Answer(200, {"docs": [found, cleared, missing]}), times=1)
    assert backend.stored_settings(["docs", "beta", "x"], "acme") == [
        (settings, 10),
        (None, 12),
        None,
    ]
    assert server.sent("POST", SETTINGS_MGET)[-1].json() == {
        "ids": [ACME, BETA_OF_ACME, f"sift-{tenant_key('acme')}--x"]
    }


def test_index_settings_a_document_es_could_not_read_is_a_retryable_failure(
    server: FakeElasticsearchServer,
) -> None:
    """``_mget`` answers 200 with an error in a document's place when its shard could not
    be read: that is no answer, not "none stored" (a search would run at the defaults, and a
    change would merge into nothing and store over the settings it never read). An index
    not made yet, in a document's place, is none stored."""
    no_shard = error_body("no_shard_available_action_exception", "No shard available", 503)
    failed = {"_index": SETTINGS_INDEX, "_id": ACME, "error": no_shard["error"]}
    gone = index_missing(SETTINGS_INDEX)["error"]
    missing = {"_index": SETTINGS_INDEX, "_id": ACME, "error": gone}
    backend = backend_for(server)
    server.on("POST", SETTINGS_MGET, Answer(200, {"docs": [failed]}), times=1)
    with pytest.raises(BackendUnavailable, match="no_shard_available_action_exception"):
        backend.stored_settings(["docs"], "acme")
    server.on("POST", SETTINGS_MGET, Answer(200, {"docs": [missing]}), times=1)
    assert backend.stored_settings(["docs"], "acme") == [None]


def test_stored_documents_a_document_es_could_not_read_is_a_retryable_failure(
    server: FakeElasticsearchServer,
) -> None:
    """``_mget`` answers 200 with an error in a document's place when its shard could not be
    read (an index of several shards, one of them unassigned): that document is not known
    to be gone. Read as not stored, an economy item finished then dropped it from its hits
    as ``deleted_since_retrieval`` while the index still held it. The alias missing (ES
    answers an ``index_not_found`` in each document's place) is none stored, as before."""
    concrete = f"{ACME}~000001"
    no_shard = error_body("no_shard_available_action_exception", "No shard available", 503)
    failed = {"_index": concrete, "_id": "acme:d2", "error": no_shard["error"]}
    found = get_found(concrete, "acme", "d1", 3, text="one")
    backend = backend_for(server)
    server.on("POST", f"/{ACME}/_mget", Answer(200, {"docs": [found, failed]}), times=1)
    with pytest.raises(BackendUnavailable, match="no_shard_available_action_exception"):
        backend.stored_documents("docs", "acme", ["d1", "d2"])
    gone = {"_index": ACME, "_id": "acme:d1", "error": index_missing(ACME)["error"]}
    server.on("POST", f"/{ACME}/_mget", Answer(200, {"docs": [gone]}), times=1)
    assert backend.stored_documents("docs", "acme", ["d1"]) == {}


@pytest.mark.parametrize("read", ["settings", "documents"])
def test_an_mget_refusing_sifts_credentials_in_a_documents_place_is_a_config_error(
    server: FakeElasticsearchServer, caplog: pytest.LogCaptureFixture, read: str
) -> None:
    """ES authorizes each of an ``_mget``'s shard requests on its own and answers 200 with a
    ``security_exception`` in the place of each document the key may not read (a key whose
    ``names`` leave out ``<prefix>sift-settings``, as deploy/README.md §4's own example for
    an empty prefix did). It was ``backend_unavailable``: every search retried it to its
    deadline as if the cluster were down. It is the deployment's setting that is wrong: a
    config_error, not retried, ES's reason (the service user, its key) in the log only."""
    reason = (
        "action [indices:data/read/mget[shard]] is unauthorized for API key id [k8Hx2] of "
        "user [sift_svc] on indices [sift-sift-settings], this action is granted by the "
        "index privileges [read,all]"
    )
    refused = {"_id": ACME, "error": error_body("security_exception", reason, 403)["error"]}
    target = SETTINGS_MGET if read == "settings" else f"/{ACME}/_mget"
    server.on("POST", target, Answer(200, {"docs": [refused]}), times=1)
    backend = backend_for(server)
    with pytest.raises(BackendAccessRefused) as caught:
        if read == "settings":
            backend.stored_settings(["docs"], "acme")
        else:
            backend.stored_documents("docs", "acme", ["d1"])
    assert caught.value.code == "config_error"
    assert not caught.value.retryable
    message = str(caught.value)
    assert "security_exception" in message and "SIFT_ELASTICSEARCH_API_KEY" in message
    for secret in ("sift_svc", "k8Hx2", tenant_key("acme")):
        assert secret not in message, message
    assert reason in caplog.text


# --- sift tenant purge ------------------------------------------------------------------

SETTINGS_INDEX = "sift-sift-settings"
#: acme's alias "shared", which an operator pointed at an index beta's documents are in too.
SHARED = f"sift-{tenant_key('acme')}--shared"
SHARED_INDEX = "ops-shared-2025"
SHARED_TASK = "oTUltX4IQMOUUVeiohTt8A:12399"
#: acme's alias "bio", over an index a delete by id into the new name made: no document.
BIO = f"sift-{tenant_key('acme')}--bio"
BIO_INDEX = f"{BIO}~000001"
SHARED_TASK_PATH = f"/_tasks/{SHARED_TASK.replace(':', '%3A')}"


def settings_docs(request: Recorded) -> Answer:
    """``_mget`` on the settings index: acme's "docs" holds settings (PATCHed at version 5),
    any other alias none."""
    docs: list[dict[str, Any]] = []
    for doc_id in request.json()["ids"]:
        found: dict[str, Any] = {"_index": SETTINGS_INDEX, "_id": doc_id, "found": False}
        if doc_id == ACME:
            source = {"sift_settings": {"fusion": {"method": "linear"}}}
            found |= {"_version": 5, "_seq_no": 0, "_primary_term": 1, "found": True}
            found["_source"] = source
        docs.append(found)
    return Answer(200, {"docs": docs})


def floor_put(request: Recorded) -> Answer:
    """A drop floor written at the version the request gives."""
    alias = unquote(request.path.rsplit("/", 1)[-1])
    return Answer(201, floor_written(FLOORS, alias, int(request.query["version"][0])))


def counted_by_index(request: Recorded) -> Answer:
    """A search over acme's aliases counting by ``_index``: acme's documents (the listing's,
    filtered on the tenant), or every document (the empty indexes', with no tenant term)."""
    if "bool" in request.json()["query"]:
        return Answer(200, terms_by_index_response({CONCRETE: 3, SHARED_INDEX: 2}))
    return Answer(200, terms_by_index_response({CONCRETE: 3, SHARED_INDEX: 6}))


def on_purge(server: FakeElasticsearchServer, stem: str) -> None:
    """Acme's three aliases, "bio" (an index holding no document), "docs" (3 documents, its
    own index) and "shared" (2, beta's too), as a purge lists and drops them; acme's "docs"
    has settings stored."""
    held = aliases((BIO_INDEX, BIO), (CONCRETE, ACME), (SHARED_INDEX, SHARED))
    server.on("GET", f"/_alias/{stem}*", Answer(200, held))
    server.on("POST", f"/{stem}*/_search", counted_by_index)
    server.on("PUT", "/_index_template/sift-sift", Answer(200, {"acknowledged": True}))
    server.on("PUT", f"/{FLOORS}", Answer(200, {"acknowledged": True, "index": FLOORS}))
    dropped = ((BIO, BIO_INDEX, 0, 0), (ACME, CONCRETE, 3, 0), (SHARED, SHARED_INDEX, 2, 1))
    for alias, concrete, mine, others in dropped:
        floor = f"/{FLOORS}/_doc/{alias}"
        server.on("PUT", floor, floor_put)
        mark = get_missing(FLOORS, f"{alias}#deletes")
        server.on("GET", f"{floor}%23deletes", Answer(404, mark))
        found = resolved((concrete, [alias]))
        server.on("GET", f"/_resolve/index/{alias}*", Answer(200, found))
        drop = msearch_response(probe_response(mine), probe_response(others), probe_response(0))
        server.on("POST", f"/{alias}/_msearch", Answer(200, drop))
    server.on("DELETE", f"/{CONCRETE}", Answer(200, {"acknowledged": True}))
    server.on("DELETE", f"/{BIO_INDEX}", Answer(200, {"acknowledged": True}))
    server.on("GET", "/_tasks", Answer(200, tasks_list()))
    server.on("POST", f"/{SHARED}/_delete_by_query", Answer(200, {"task": SHARED_TASK}))
    done = delete_by_query_task(SHARED_TASK, SHARED, deleted=2)
    server.on("GET", SHARED_TASK_PATH, Answer(200, done))
    server.on("POST", f"/{SETTINGS_INDEX}/_mget", settings_docs)
    reason = f"index [{SETTINGS_INDEX}/x] already exists"
    exists = error_body("resource_already_exists_exception", reason, index=SETTINGS_INDEX)
    server.on("PUT", f"/{SETTINGS_INDEX}", Answer(400, exists))
    cleared = {**floor_written(SETTINGS_INDEX, ACME, 6), "result": "updated"}
    server.on("PUT", f"/{SETTINGS_INDEX}/_doc/{ACME}", Answer(200, cleared))


def test_a_purge_drops_each_of_the_tenants_indexes_as_a_drop_job_does(
    server: FakeElasticsearchServer, redis_url: str, store: Any
) -> None:
    """``sift tenant purge`` on Elasticsearch: acme's aliases listed and counted (as ``GET
    /v1/indexes`` does), and those whose indexes hold no document at all found (the same
    aliases, counted with no tenant term), then each dropped by name at a write version of
    acme's taken from Redis (the floor first, as a drop job's): "bio", holding nothing, and
    "docs", acme's own index, deleted whole after the floor, the deletes mark, ``_resolve``
    and the drop's ``_msearch``, the settings of "docs" cleared at its drop's version;
    "shared", an alias an operator pointed at an index beta's documents are in too, never
    deleted: acme's documents go by a ``_delete_by_query`` task on the alias, polled.
    Beta's own alias is in no request."""
    stem = f"sift-{tenant_key('acme')}--"
    before = next_write_version(store.redis, "acme")
    on_purge(server, stem)

    env = {
        "SIFT_REDIS_URL": redis_url,
        "SIFT_SEARCH_BACKEND": "elasticsearch",
        "SIFT_ELASTICSEARCH_URL": server.url,
    }
    ran = purge(env, "acme")

    assert ran.returncode == 0, ran.stdout + ran.stderr
    removed = purged(ran.stdout)
    assert (removed["indexes dropped"], removed["documents dropped"]) == (3, 5), ran.stdout
    sent = [(r.method, r.path) for r in server.requests]
    assert sent == [
        ("GET", f"/_alias/{stem}*"),  # the list, as GET /v1/indexes reads it
        ("POST", f"/{stem}*/_search"),
        ("GET", f"/_alias/{stem}*"),  # the indexes holding no document (not listed)
        ("POST", f"/{stem}*/_search"),
        ("PUT", "/_index_template/sift-sift"),
        ("PUT", f"/{FLOORS}"),
        ("PUT", f"/{FLOORS}/_doc/{BIO}"),  # bio: the floor before anything is deleted
        ("GET", f"/{FLOORS}/_doc/{BIO}%23deletes"),
        ("GET", f"/_resolve/index/{BIO}*"),
        ("POST", f"/{BIO}/_msearch"),
        ("DELETE", f"/{BIO_INDEX}"),  # nothing of anyone's in it: deleted whole
        ("POST", f"/{SETTINGS_INDEX}/_mget"),  # none stored: nothing to clear
        ("PUT", f"/{FLOORS}/_doc/{ACME}"),  # docs: the same
        ("GET", f"/{FLOORS}/_doc/{ACME}%23deletes"),
        ("GET", RESOLVE),
        ("POST", MSEARCH),
        ("DELETE", f"/{CONCRETE}"),  # acme's alone: deleted whole
        ("POST", f"/{SETTINGS_INDEX}/_mget"),
        ("PUT", f"/{SETTINGS_INDEX}"),
        ("PUT", f"/{SETTINGS_INDEX}/_doc/{ACME}"),  # its settings cleared at the drop's version
        ("PUT", f"/{FLOORS}/_doc/{SHARED}"),  # shared: the same, to the _msearch
        ("GET", f"/{FLOORS}/_doc/{SHARED}%23deletes"),
        ("GET", f"/_resolve/index/{SHARED}*"),
        ("POST", f"/{SHARED}/_msearch"),
        ("GET", "/_tasks"),  # beta's documents there too: acme's go by query, as a task
        ("POST", f"/{SHARED}/_delete_by_query"),
        ("GET", SHARED_TASK_PATH),
        ("POST", f"/{SETTINGS_INDEX}/_mget"),
    ]
    empties = server.sent("POST", f"/{stem}*/_search")[1]
    assert empties.json() == {
        "size": 0,
        "query": {"terms": {"_index": sorted([BIO_INDEX, CONCRETE, SHARED_INDEX])}},
        "aggs": {"indexes": {"terms": {"field": "_index", "size": 3}}},
    }
    assert empties.query == {"ignore_unavailable": ["true"], "allow_no_indices": ["true"]}
    floors = [server.sent("PUT", f"/{FLOORS}/_doc/{a}")[0] for a in (BIO, ACME, SHARED)]
    bio_version, *versions = [int(floor.query["version"][0]) for floor in floors]
    assert before < bio_version < versions[0] < versions[1]  # acme's, each drop its own
    assert {floor.query["version_type"][0] for floor in floors} == {"external"}
    assert server.sent("POST", MSEARCH)[0].ndjson() == [
        *DROP_SEARCHES,
        {},
        {
            "size": 0,
            "terminate_after": 1,
            "track_total_hits": True,
            "query": {
                "bool": {
                    "filter": [
                        {"term": {"tenant": "acme"}},
                        {"range": {"write_version": {"gt": versions[0]}}},
                    ]
                }
            },
        },
    ]
    (deleting,) = server.sent("POST", f"/{SHARED}/_delete_by_query")
    assert deleting.json() == {
        "query": {
            "bool": {
                "filter": [{"term": {"tenant": "acme"}}],
                "must_not": [{"range": {"write_version": {"gt": versions[1]}}}],
            }
        }
    }
    assert deleting.query == {
        "conflicts": ["proceed"],
        "refresh": ["true"],
        "wait_for_completion": ["false"],
    }
    (cleared,) = server.sent("PUT", f"/{SETTINGS_INDEX}/_doc/{ACME}")
    assert cleared.json() == {"sift_settings": None}
    assert cleared.query == {"version": [str(versions[0])], "version_type": ["external"]}
    assert BETA not in str([(r.path, r.body) for r in server.requests])


def test_the_tenants_empty_indexes_are_never_read_from_some_shards_only(
    server: FakeElasticsearchServer,
) -> None:
    """What a purge drops besides the listed indexes: acme's aliases whose indexes hold no
    document at all, read by one count with no tenant term. No alias: no search. A count
    from some shards only is retryable, never an index called empty (the drop would delete
    it whole); an index gone meanwhile (404) holds nothing to drop."""
    stem = f"sift-{tenant_key('acme')}--"
    backend = backend_for(server)
    server.on("GET", f"/_alias/{stem}*", Answer(200, {}), times=1)
    assert backend.empty_indexes("acme") == []
    assert not server.sent("POST")
    held = aliases((BIO_INDEX, BIO), (CONCRETE, ACME))
    server.on("GET", f"/_alias/{stem}*", Answer(200, held))
    counts = terms_by_index_response({CONCRETE: 2})
    server.on("POST", f"/{stem}*/_search", Answer(200, counts), times=1)
    assert backend.empty_indexes("acme") == ["bio"]
    server.on("POST", f"/{stem}*/_search", Answer(200, partial(terms_by_index_response({}))))
    with pytest.raises(BackendUnavailable):
        backend.empty_indexes("acme")
    server.on("POST", f"/{stem}*/_search", Answer(404, index_missing(CONCRETE)))
    assert backend.empty_indexes("acme") == []

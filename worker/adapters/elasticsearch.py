"""The Elasticsearch search backend: BM25 and kNN channels of an ES 9.x index, in one ``_msearch``.

Why this shape (DESIGN.md §6). Beside this module: ``es_layout`` (index names, drop floors),
``es_errors`` (ES's errors as Sift's) and ``es_migrate`` (the shared layout of earlier
releases: the start-up check and ``sift elasticsearch-migrate``).

* **Index layout: one physical index per (tenant, name).** Sift index ``NAME`` of tenant
  ``T`` is the alias ``<prefix><key>--NAME`` over one concrete index
  ``<prefix><key>--NAME~<000001 or UTC timestamp>``, where ``<key>`` is :func:`tenant_key`:
  16 hex digits of the tenant id's SHA-256 (tenant ids may hold characters ES refuses in
  index names; the key never does, and it has a fixed length, so the name after ``--`` is
  exactly the Sift name). ``~`` is valid in an ES index name and never in a Sift name, so no
  Sift name's alias is another name's concrete index. So another tenant's documents change
  neither a tenant's BM25 statistics (document frequency, average length) nor its search
  cost, and a tenant's first write into a name always creates its own index, whether another
  tenant uses the name or not. An index template (``<prefix>sift``, pattern ``<prefix>*``)
  holds the mapping: ``text`` and ``title`` as ``text`` (english analyzer, BM25), ``vector``
  as ``dense_vector`` (cosine, HNSW, int8-quantised by default), ``tenant``, ``revision``
  and ``doc_id`` as ``keyword``, ``metadata`` as ``flattened`` (every value a keyword, so
  equality filters work on strings, numbers and booleans), ``embedding_model`` as
  ``keyword``: the model that made the document's vector. Every field name is a setting, so
  an existing index can be searched through a tenant's alias pointed at it.
* **Embedding models never mix.** A write of vectors first asks (one ``size: 1`` search)
  whether the tenant holds a vector recorded by another model, and is refused with
  ``EmbeddingModelMismatch`` if so, writing nothing; the channel probe returns the model of
  one of the tenant's vectors, so a search learns it with no extra round trip. A drop
  takes the record with the tenant's index. Not transactional: two
  workers of different models writing into one empty index at once can both pass.
* **Tenancy, in depth.** Each document still carries its tenant field, every search
  and count still filters on it, and the ``_id`` stays ``"<tenant>:<doc id>"``: a
  64-bit key collision, or an alias an operator pointed at a shared index, still keeps
  tenants apart, and a migration from the shared layout copies ``_id`` and external
  version as they are. An index exists *for a tenant* once it holds one of the tenant's
  documents: :meth:`ElasticsearchBackend.channels` asks exactly that (two tenant-filtered
  ``size: 0`` probes in one ``_msearch`` on the tenant's alias); a missing alias (a name
  only another tenant has, or nobody) gives the same empty answer after the same one
  round trip, so the pipeline raises the same ``IndexNotFound`` for both.
* **Writes** go through ``elasticsearch.helpers.streaming_bulk`` with ``require_alias``:
  an upsert never auto-creates a concrete index under the alias's name (after another
  worker dropped the index); it is refused, and the index is made again properly, at most
  ``WRITE_ATTEMPTS`` times, reading the drop floor each time; then the write fails
  retryably (``BackendUnavailable``). ES holds no delete to ``require_alias`` and makes a
  missing index for an external-versioned one, so a delete bulk first checks the alias
  (``HEAD _alias``), and one that made a bare index anyway (the alias dropped between the
  check and the bulk: its item answers from an index named like the alias) deletes that
  index (it holds only tombstones) and makes the index again. A concrete index in the
  alias's way that no retry clears (the first concrete name without its alias, or a bare
  index holding documents) fails the write permanently (``BackendRequestError``) naming it
  and the remedy (drop the name again). An upsert by id replaces the whole document, vector
  included. ``refresh=wait_for`` (the default) makes a write visible to search before the
  call returns; ``false`` gives eventual visibility (about 1 s).
* **Drops** (:meth:`ElasticsearchBackend.delete_index`) find every concrete index of the
  tenant's alias first (one ``GET _resolve/index/<alias>*``, closed ones included), then
  delete those a reindex kept for a rollback, then the live one (its alias goes with it),
  unless the live one holds another tenant's document too, when only the tenant's
  documents go (``_delete_by_query``). A drop whose alias is already gone (one cut short)
  still deletes what it finds named after it. A versioned drop first leaves a floor
  (``<prefix>sift-floors``) that every versioned write reads before it writes and again
  after: a write accepted before the drop and run after it writes nothing, or, if the drop
  ran between its check and its bulk, what it wrote is deleted again (by id, with the
  drop's version, so a newer writer's document stays) and it reports none written; the
  deletes go again on every retry of that write, so a take-back cut short completes.
* **Reindexing** (:meth:`ElasticsearchBackend.reindex`, per tenant): create a new
  concrete index from the current template, copy with ``_reindex`` (vectors included, also
  on 9.2+ where they are left out of ``_source``; versions kept), refresh, then move the
  alias in one atomic ``_aliases`` call (remove from the old indexes, add to the new).
  Searches never see a half-built index; the old index is kept for a rollback unless
  ``delete_old`` is set (a drop of the name deletes it too). The copy is an ES task,
  polled for at most ``COPY_MAX_SECONDS``, never started twice into one index; a task
  cancelled, failed or not done by then moves no alias and deletes nothing.
* **Reads**: the BM25 and kNN searches go in ONE ``_msearch`` round trip. The tenant term
  and the caller's metadata terms sit inside both: the ``bool.filter`` of the BM25 query
  and ``knn.filter``, which ES applies *before* it picks the top k (a ``post_filter``
  would apply after, and could return fewer than k; it is never used).
  ``num_candidates`` is ``min(10000, max(size, SIFT_ELASTICSEARCH_NUM_CANDIDATES))``.
  Sift's own RRF fuses the channels (no licence needed; each channel's rank stays
  visible). ES reports a cosine kNN hit as ``(1 + cos) / 2``; this adapter turns it back
  into ``cos`` so ``SIFT_VECTOR_MIN_SIMILARITY`` means the same on every backend.
* **Native fusion** (:meth:`ElasticsearchBackend.retrieve_native`, with
  ``SIFT_ELASTICSEARCH_NATIVE_RRF``): one ``_search`` with ``retriever.rrf``, or with
  ``retriever.linear`` when the search's fusion method is ``linear``. It needs a licence
  tier with that retriever and returns fused hits only: no per-channel rank or score. It is
  not part of the SearchBackend port. RRF's rank constant goes as ``rank_constant``, and
  channel weights other than 1 as each child retriever's ``weight``, which needs
  Elasticsearch 9.2 or later; ``linear`` sends every child with its ``weight`` and
  ``normalizer: minmax`` (Elasticsearch 8.18+ / 9.x).
* **Retries**: the client's own retries are off (``max_retries=0``, no retry on status or
  timeout). The pipeline's tenacity loop is the one retry layer, bounded by the deadline;
  each request's timeout is the attempt's ``ChannelQuery.timeout_seconds``.
* **Errors**: connection errors, timeouts, 429 and 5xx become ``BackendUnavailable``
  (retryable); other 4xx become ``BackendRequestError`` (permanent) with ES's reason; a
  missing index becomes ``IndexNotFound``. The 9.x client sends
  ``compatible-with=9`` media types, which 8.x servers refuse with a 400: use ES 9.

Usage::

    backend = ElasticsearchBackend.from_settings(settings)   # no network call here
    backend.check()  # once at start: refuses indexes of the shared layout (see migrate_shared)
    backend.upsert("docs", "acme", [Document(id="1", text="...")], vectors)
    results = backend.retrieve(ChannelQuery(index="docs", filters=HardFilters("acme"),
                                            channels=("bm25", "knn"), size=120,
                                            text="query", vector=query_vector))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote

from elasticsearch import (
    ApiError,
    Elasticsearch,
    NotFoundError,
    helpers,
)
from elasticsearch.exceptions import GeneralAvailabilityWarning

from worker.adapters.es_errors import (
    _AliasGone,
    _bulk_error,
    _Bulked,
    _error_type,
    _first_key,
    _index_missing,
    _raise_for_item,
    _total,
    _translated,
)
from worker.adapters.es_layout import (
    _SIFT_CONCRETE,
    CONCRETE_SEPARATOR,
    FLOORS_INDEX,
    KEY_SEPARATOR,
    TENANT_KEY_LENGTH,
    DropFloors,
    checked_index_name,
    concrete_name,
    tenant_key,
)
from worker.adapters.es_migrate import SharedLayout
from worker.contract import Channel, FilterValue
from worker.core.catalog import IndexInfo, StoredDocument
from worker.core.types import (
    ChannelHit,
    ChannelQuery,
    ChannelResults,
    Document,
    HardFilters,
    IndexProbe,
)
from worker.errors import (
    BackendRequestError,
    BackendUnavailable,
    ConfigError,
    EmbeddingModelMismatch,
    IndexNotFound,
    InvalidRequest,
    ModeUnavailable,
)

if TYPE_CHECKING:
    from worker.settings import Settings

logger = logging.getLogger(__name__)

MAX_NUM_CANDIDATES = 10_000
#: How long a "this index has vectors" answer is trusted before asking ES again.
CHANNELS_TTL_SECONDS = 60.0
#: Past this many (alias, tenant) answers, expired ones are dropped as a new one is kept.
CHANNELS_MEMO_SIZE = 4096
#: The most indexes one tenant's list shows (the terms aggregation's size).
MAX_LISTED_INDEXES = 1000
_FILTER_KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
#: How long a migration's copy waits between two reads of its task.
COPY_POLL_SECONDS = 0.5
#: How long a reindex or migration waits for its copy task before it gives up (retryably,
#: naming the task, which runs on: a run made after it ends starts the copy again).
COPY_MAX_SECONDS = 6 * 3600.0
#: How often a write makes its index again after ``require_alias`` found it gone (another
#: worker's drop ran in between) before it gives up, retryably.
WRITE_ATTEMPTS = 3
Refresh = Literal["wait_for", "true", "false"]


@dataclass(frozen=True, slots=True)
class FieldNames:
    """Where each part of a Sift document lives in the ES index (settable for existing ones)."""

    id: str = "doc_id"
    text: str = "text"
    title: str = "title"  # "" when the index has no title field
    vector: str = "vector"
    tenant: str = "tenant"
    revision: str = "revision"
    metadata: str = "metadata"
    model: str = "embedding_model"  # "" when the index records no embedding model

    def source(self) -> list[str]:
        """The ``_source`` fields a hit needs; the vector is never fetched."""
        names = [self.id, self.text, self.title, self.revision, self.metadata, self.tenant]
        return [name for name in names if name]


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """How new concrete indexes are built."""

    dims: int = 384
    quantization: str = "int8_hnsw"
    shards: int = 1
    replicas: int = 1


def index_template(prefix: str, fields: FieldNames, index: IndexSettings) -> dict[str, Any]:
    """The body of ``PUT _index_template/<prefix>sift``: Sift's mapping for every new index."""
    properties: dict[str, Any] = {
        fields.id: {"type": "keyword"},
        fields.text: {"type": "text", "analyzer": "english"},
        fields.vector: {
            "type": "dense_vector",
            "dims": index.dims,
            "index": True,
            "similarity": "cosine",
            "index_options": {"type": index.quantization},
        },
        fields.tenant: {"type": "keyword"},
        fields.revision: {"type": "keyword"},
        fields.metadata: {"type": "flattened"},
    }
    if fields.title:
        properties[fields.title] = {"type": "text", "analyzer": "english"}
    if fields.model:
        properties[fields.model] = {"type": "keyword"}
    return {
        "index_patterns": [f"{prefix}*"],
        # ES refuses two templates with overlapping patterns and equal priorities; a longer
        # prefix ("sift-staging-" inside "sift-*") is more specific, so it ranks higher.
        "priority": 100 + len(prefix),
        "template": {
            "settings": {
                "number_of_shards": index.shards,
                "number_of_replicas": index.replicas,
            },
            # Each index Sift makes says so: the start-up check and the migration of the
            # shared layout go by it, never by a name alone.
            "mappings": {
                "dynamic": "strict",
                "_meta": {"sift": {"layout": "per-tenant", "prefix": prefix}},
                "properties": properties,
            },
        },
        "_meta": {"managed_by": "sift"},
    }


def num_candidates(size: int, setting: int) -> int:
    """``num_candidates`` for a kNN search of ``k = size``: at least k, at most 10,000.

    >>> num_candidates(120, 200), num_candidates(500, 200), num_candidates(50, 20_000)
    (200, 500, 10000)
    """
    if size > MAX_NUM_CANDIDATES:
        raise InvalidRequest("size", f"at most {MAX_NUM_CANDIDATES} kNN candidates, got {size}")
    return min(MAX_NUM_CANDIDATES, max(size, setting))


def derive_revision(title: str, text: str, metadata: Mapping[str, FilterValue]) -> str:
    """A stable revision for a document that came without one (same rule as the embedded one)."""
    payload = json.dumps([title, text, dict(metadata)], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class ElasticsearchBackend:
    """A SearchBackend over an Elasticsearch 9.x cluster (see the module docstring)."""

    name = "elasticsearch"

    def __init__(
        self,
        client: Elasticsearch,
        *,
        prefix: str = "sift-",
        fields: FieldNames | None = None,
        index_settings: IndexSettings | None = None,
        num_candidates: int = 200,
        refresh: Refresh = "wait_for",
        request_timeout: float = 10.0,
        bulk_chunk_size: int = 500,
        native_rrf: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self.native_rrf = native_rrf
        self.prefix = prefix
        self.fields = fields or FieldNames()
        self.index_settings = index_settings or IndexSettings()
        self.num_candidates = num_candidates
        self.refresh = refresh
        self.copy_max_seconds = COPY_MAX_SECONDS
        self.request_timeout = request_timeout
        self.bulk_chunk_size = bulk_chunk_size
        self._clock = clock
        self._lock = threading.Lock()
        self._template_ready = False
        self._floors = DropFloors(
            self._es, f"{prefix}{FLOORS_INDEX}", lambda: self._explicit_body()
        )
        self._ready_aliases: set[str] = set()
        self._model_mapped: set[str] = set()  # aliases whose mapping has the model field
        # (alias, tenant) -> when the tenant's knn was last seen available, and its model
        self._with_vectors: dict[tuple[str, str], tuple[float, str | None]] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> ElasticsearchBackend:
        """Build the client (no network call yet) with its own retries off."""
        if not settings.elasticsearch_url:
            raise ConfigError("SIFT_SEARCH_BACKEND=elasticsearch needs SIFT_ELASTICSEARCH_URL")
        client = Elasticsearch(
            settings.elasticsearch_url,
            api_key=settings.elasticsearch_api_key,
            request_timeout=settings.elasticsearch_request_timeout,
            max_retries=0,
            retry_on_status=(),
            retry_on_timeout=False,
        )
        return cls(
            client,
            prefix=settings.elasticsearch_index_prefix,
            fields=FieldNames(
                id=settings.elasticsearch_id_field,
                text=settings.elasticsearch_text_field,
                title=settings.elasticsearch_title_field,
                vector=settings.elasticsearch_vector_field,
                tenant=settings.elasticsearch_tenant_field,
                revision=settings.elasticsearch_revision_field,
                metadata=settings.elasticsearch_metadata_field,
                model=settings.elasticsearch_model_field,
            ),
            index_settings=IndexSettings(
                dims=settings.elasticsearch_vector_dims,
                quantization=settings.elasticsearch_vector_quantization,
                shards=settings.elasticsearch_shards,
                replicas=settings.elasticsearch_replicas,
            ),
            num_candidates=settings.elasticsearch_num_candidates,
            refresh=settings.elasticsearch_refresh,
            request_timeout=settings.elasticsearch_request_timeout,
            bulk_chunk_size=settings.elasticsearch_bulk_chunk_size,
            native_rrf=settings.elasticsearch_native_rrf,
        )

    def floors_index(self) -> str:
        """Where drop floors live (:class:`~worker.adapters.es_layout.DropFloors`)."""
        return self._floors.index

    def tenant_stem(self, tenant: str) -> str:
        """What every alias of the tenant starts with: ``<prefix><key>--``."""
        return f"{self.prefix}{tenant_key(tenant)}{KEY_SEPARATOR}"

    def alias(self, index: str, tenant: str) -> str:
        """The ES alias behind the tenant's Sift index ``index``: ``<prefix><key>--<index>``.

        The gateway admits ``[a-z0-9][a-z0-9_.-]*`` of at most 128 characters, the prefix is
        at most 64 of ``[a-z0-9_.-]``: with the key, the separator and a concrete index's
        ``-<timestamp>``, at most 233 bytes. Checked anyway, for callers of this class."""
        return checked_index_name(f"{self.tenant_stem(tenant)}{index}")

    def _es(self, timeout: float | None = None) -> Elasticsearch:
        return self._client.options(request_timeout=timeout or self.request_timeout)

    # --- the port -----------------------------------------------------------------

    def channels(self, index: str, tenant: str) -> frozenset[Channel]:
        """``bm25`` once the tenant holds a document in the index, plus ``knn`` once one of
        them holds a vector (and the field is a ``dense_vector``); empty otherwise."""
        return self.probe(index, tenant).channels

    def probe(self, index: str, tenant: str) -> IndexProbe:
        """The tenant's channels and the embedding model its vectors were written with.

        One ``_msearch`` on the tenant's own alias with two tenant-filtered probes
        (``terminate_after: 1``): the tenant's documents, and the tenant's documents with a
        vector; the second returns its one hit's model field (writes keep one model per
        tenant's index, so any vector's model is the index's). The alias existing is not
        enough: a drop by ids can leave it empty, and an empty index reads like none. A
        missing alias (a name another tenant has, or nobody) answers the same empty set
        after the same one round trip. The mapping is read only once the tenant's own
        vectors are found, and a positive answer (with the model) is kept per
        (alias, tenant) for ``CHANNELS_TTL_SECONDS``.
        """
        alias = self.alias(index, tenant)
        seen = self._with_vectors.get((alias, tenant))
        if seen is not None and self._clock() - seen[0] < CHANNELS_TTL_SECONDS:
            return IndexProbe(frozenset({"bm25", "knn"}), seen[1])
        none = IndexProbe(frozenset())
        what = f"channels of index {index!r}"
        with _translated(what, index, missing_ok=True) as missing:
            response = self._es().msearch(index=alias, searches=self.probe_searches(tenant)).body
        if missing:
            return none
        answers = response.get("responses", [])
        if len(answers) != 2:
            raise BackendRequestError(f"_msearch answered {len(answers)} probes for 2 sent")
        if any(_index_missing(answer) for answer in answers):
            return none
        for answer in answers:
            _raise_for_item(answer, what, index)
        has_documents, has_vectors = (_total(answer) > 0 for answer in answers)
        bm25: IndexProbe = IndexProbe(frozenset({"bm25"}))
        if not has_documents:
            return none
        if not has_vectors:
            return bm25
        with _translated(what, index, missing_ok=True) as missing:
            mappings = self._es().indices.get_mapping(index=alias).body
        if missing:
            return none
        if not self._maps_vectors(mappings):
            return bm25
        model = self._model_of(answers[1])
        self._saw_vectors(alias, tenant, model)
        return IndexProbe(frozenset({"bm25", "knn"}), model)

    def _model_of(self, answer: Mapping[str, Any]) -> str | None:
        """The model field of a search answer's first hit (None: no hit, or none recorded)."""
        hits = answer.get("hits", {}).get("hits") or []
        if not hits or not self.fields.model:
            return None
        model = (hits[0].get("_source") or {}).get(self.fields.model)
        return str(model) if model else None

    def _saw_vectors(self, alias: str, tenant: str, model: str | None) -> None:
        """Remember that the tenant's part of ``alias`` holds vectors of ``model`` (expired
        entries go once the memo is large, so many tenants don't grow it without bound)."""
        now = self._clock()
        if len(self._with_vectors) >= CHANNELS_MEMO_SIZE:  # a copy: other threads add to it
            self._with_vectors = {
                key: seen
                for key, seen in list(self._with_vectors.items())
                if now - seen[0] < CHANNELS_TTL_SECONDS
            }
        self._with_vectors[(alias, tenant)] = (now, model)

    def retrieve(self, query: ChannelQuery) -> ChannelResults:
        """Both channels in one ``_msearch``; each channel's hits best first.

        With ``native_rrf`` on, a hybrid search is one ``retriever.rrf`` (or
        ``retriever.linear``, by the search's method) instead, and the results carry ES's
        fused list only.
        """
        channels = tuple(dict.fromkeys(query.channels))
        if self.native_rrf and len(channels) == 2:
            started = self._clock()
            fused = self.retrieve_native(query)
            return ChannelResults(hits={}, seconds={"rrf": self._clock() - started}, fused=fused)
        # The tenant's own index in the URL, none in the header lines: the request cannot
        # reach another index (and ES's rest.action.multi.allow_explicit_index=false holds).
        alias = self.alias(query.index, query.filters.tenant)
        searches: list[Mapping[str, Any]] = []
        for channel in channels:
            searches += [{}, self.channel_body(channel, query)]
        started = self._clock()
        with _translated(f"search of index {query.index!r}", query.index):
            es = self._es(query.timeout_seconds)
            response = es.msearch(index=alias, searches=searches).body
        round_trip = self._clock() - started
        answers = response.get("responses", [])
        if len(answers) != len(channels):
            raise BackendRequestError(
                f"_msearch answered {len(answers)} searches for {len(channels)} sent"
            )
        hits: dict[Channel, list[ChannelHit]] = {}
        seconds: dict[str, float] = {}
        for channel, answer in zip(channels, answers, strict=True):
            _raise_for_item(answer, f"{channel} search of index {query.index!r}", query.index)
            hits[channel] = [self._hit(channel, raw) for raw in answer["hits"]["hits"]]
            took = answer.get("took")  # the server's time for this search, in ms
            seconds[channel] = float(took) / 1000.0 if took is not None else round_trip
        return ChannelResults(hits=hits, seconds=seconds)

    def upsert(
        self,
        index: str,
        tenant: str,
        documents: Sequence[Document],
        vectors: Sequence[Sequence[float]] | None,
        *,
        version: int | None = None,
        model: str | None = None,
    ) -> int:
        """Index each document as ``<tenant>:<id>`` (replacing it whole) into the tenant's own
        index (made on its first write) through the bulk helper.

        With a ``version``, each write is ES's external versioning: ES applies it only if
        the version is newer than the one it holds for the ``_id`` (a delete's included,
        for ``index.gc_deletes``), and a refused one (409) is a newer write kept, not an
        error. ``model`` goes on each document with a vector
        (``SIFT_ELASTICSEARCH_MODEL_FIELD``)."""
        if vectors is not None and len(vectors) != len(documents):
            raise InvalidRequest(
                "vectors", f"{len(vectors)} vectors for {len(documents)} documents"
            )
        if not documents:
            return 0
        alias = self.alias(index, tenant)
        recorded = model if vectors is not None and self.fields.model else None
        actions = [
            {
                "_op_type": "index",
                "_index": alias,
                "_id": f"{tenant}:{doc.id}",
                "_source": self.source(
                    tenant, doc, vectors[i] if vectors is not None else None, recorded
                ),
                **_versioned(version),
            }
            for i, doc in enumerate(documents)
        ]
        what = f"bulk write to index {index!r}"

        def check_model() -> None:
            if recorded is not None:
                self._check_model(index, tenant, recorded)

        outcome = self._write(index, tenant, actions, what, version, prepare=check_model)
        ids = [str(action["_id"]) for action in actions]
        # below the floor on this call (None) or after its bulk: an earlier attempt of this
        # write (a retry after a take-back cut short) may have left documents in
        if self._take_back(index, tenant, ids, version, what) or outcome is None:
            return 0
        written = outcome.applied
        if vectors is not None and written:
            self._saw_vectors(alias, tenant, recorded)
        return written

    def _check_model(self, index: str, tenant: str, model: str) -> None:
        """Raise EmbeddingModelMismatch if the tenant's index holds another model's vectors.

        First, once per process and alias, the model field is added to the index's mapping
        (``PUT <alias>/_mapping``: a no-op on an index made from the current template), so
        an index made before the field existed takes it under ``dynamic: strict``. An index
        another worker dropped meanwhile holds no model; the bulk write makes it again."""
        alias = self.alias(index, tenant)
        if alias not in self._model_mapped:
            with _translated(f"mapping of index {index!r}", index, missing_ok=True) as missing:
                self._es().indices.put_mapping(
                    index=alias, properties={self.fields.model: {"type": "keyword"}}
                )
            if missing:
                return
            self._model_mapped.add(alias)
        with _translated(f"model check of index {index!r}", index, missing_ok=True) as missing:
            answer = self._es().search(index=alias, **self.model_check_body(tenant, model)).body
        held = None if missing else self._model_of(answer)
        if held is not None:
            raise EmbeddingModelMismatch(index, held, model)

    def _write(
        self,
        index: str,
        tenant: str,
        actions: list[dict[str, Any]],
        what: str,
        version: int | None,
        prepare: Callable[[], None] | None = None,
    ) -> _Bulked | None:
        """Run ``actions`` into the tenant's index, made if missing; None if a drop accepted
        after this write has already run (nothing is written, no index made).

        Each attempt reads the drop floor first, makes the index, runs ``prepare`` (the
        model check) and the bulk. A delete bulk checks the alias first, not what this
        process remembers: ``require_alias`` does not apply to a delete, so one sent to a
        dropped alias would make a bare index of its name (:meth:`_bulk` clears it).
        The alias found gone (another worker dropped the index since), or the index's first
        concrete name found without its alias, starts the next attempt; every action is sent
        again, which external versions and whole-document writes make safe. After
        ``WRITE_ATTEMPTS`` the write fails, naming what it found: retryably
        (``BackendUnavailable``) if drops kept removing the alias, not retryably
        (``BackendRequestError``) if an index without its alias is in the way, which no
        retry clears."""
        alias = self.alias(index, tenant)
        existed = 0
        gone = _AliasGone(index)
        deleting = any(action.get("_op_type") == "delete" for action in actions)
        for _attempt in range(WRITE_ATTEMPTS):
            if self._floors.below(alias, version):
                return None if not existed else _Bulked(0, existed, [])
            try:
                if deleting:
                    with self._lock:
                        self._ready_aliases.discard(alias)  # ensure_index asks ES
                self.ensure_index(index, tenant)
                if prepare is not None:
                    prepare()
                bulked = self._bulk(actions, what, index, tenant)
            except _AliasGone as refused:
                self._forget(alias, tenant)
                existed += refused.existed
                gone = refused
                continue
            bulked.existed += existed
            return bulked
        if gone.leftover:
            raise BackendRequestError(
                f"the {what} cannot make index {index!r}: the concrete index "
                f"{gone.leftover!r} exists without its alias {alias!r} ({gone.reason}), "
                f"and no retry clears it: drop index {index!r} again (the drop deletes "
                f"it), or delete {gone.leftover!r} by name"
            ) from gone
        raise BackendUnavailable(
            f"the {what} found the alias {alias!r} of index {index!r} gone "
            f"{WRITE_ATTEMPTS} times as it made it again ({gone.reason}): another "
            "worker's drops kept removing it"
        ) from gone

    def _take_back(
        self, index: str, tenant: str, ids: Sequence[str], version: int | None, what: str
    ) -> bool:
        """Whether a versioned write lost to a drop (then none of it stays written).

        The floor check and the bulk are two requests: a drop accepted after this write can
        run between them, and a newer writer can make the index again, so the bulk finds
        the alias and writes. So the floor is read again after the bulk; if a drop of this
        write's version or newer has run, every ``_id`` of the write (``ids``) is deleted
        with the drop's version as external version: a document a newer writer put in
        since answers 409 and stays. The deletes go every time the floor is at or above the
        version, even when this call wrote nothing: a retry of a write whose take-back was
        cut short (a 5xx, a crash) completes it. They go only while the alias exists
        (``HEAD _alias``): a delete is not held to ``require_alias``, and one reaching a
        dropped alias would make a bare index of its name; one that does anyway (the alias
        dropped between the check and the bulk) is cleared by :meth:`_bulk`."""
        if version is None or not ids:
            return False
        alias = self.alias(index, tenant)
        floor = self._floors.floor(alias)
        if floor < version:
            return False
        taken = f"{what} (taken back after drop {floor})"
        deletes = [
            {"_op_type": "delete", "_index": alias, "_id": _id, **_versioned(floor)} for _id in ids
        ]
        if self._alias_exists(alias, taken, index):
            with contextlib.suppress(_AliasGone):  # dropped again: nothing of it is left
                self._bulk(deletes, taken, index, tenant)
        self._forget(alias, tenant)
        logger.info(
            "%s: version %d lost to drop %d run meanwhile; %d document(s) taken back",
            what,
            version,
            floor,
            len(deletes),
        )
        return True

    def _alias_exists(self, alias: str, what: str, index: str) -> bool:
        """``HEAD _alias/<alias>``."""
        with _translated(what, index):
            found = bool(self._es().indices.exists_alias(name=alias))
        return found

    def _clear_bare(self, alias: str, what: str, index: str) -> bool:
        """Delete the bare concrete index named ``alias`` (one a versioned delete
        auto-created after the alias was dropped: Sift's name, the template's mapping, only
        delete tombstones) if it holds no document; whether it is gone. Nothing but deletes
        can land in it meanwhile (every other write is held to ``require_alias``)."""
        with _translated(what, index, missing_ok=True) as missing:
            held = int(self._es().count(index=alias).body.get("count", 0))
            if not held:
                self._es().indices.delete(index=alias, ignore_unavailable=True)
        if missing or not held:
            logger.warning("%s: deleted the bare index %s a delete made", what, alias)
            return True
        return False

    def _bulk(self, actions: list[dict[str, Any]], what: str, index: str, tenant: str) -> _Bulked:
        """Run bulk ``actions``: how many applied, how many found their document, and the
        ``_id`` of each one applied. A 409 (a newer version held) and a delete's 404 (nothing
        to delete) are answers, not failures. ``require_alias``: an index action whose alias
        is gone fails (``_AliasGone``, with what was deleted before it) instead of
        auto-creating a bare concrete index of that name. ES does not hold a delete to
        ``require_alias``, and makes a missing index for an external-versioned one: a delete
        answered from an index named like the alias itself found the alias dropped since
        its check and made that bare index, which is deleted here (:meth:`_clear_bare`)
        before the attempt counts as the alias gone; the rest of the bulk is not sent."""
        failures: list[dict[str, Any]] = []
        bulked = _Bulked(0, 0, [])
        alias = self.alias(index, tenant)
        with _translated(what, index):
            for ok, item in helpers.streaming_bulk(
                self._es(),
                actions,
                chunk_size=self.bulk_chunk_size,
                raise_on_error=False,
                raise_on_exception=True,
                max_retries=0,
                refresh=self.refresh,
                require_alias=True,
            ):
                op = next(iter(item.values())) if item else {}
                status = int(op.get("status", 500))
                if "error" not in op and op.get("_index") == alias:  # a delete made it
                    cleared = self._clear_bare(alias, what, index)
                    raise _AliasGone(
                        index,
                        existed=bulked.existed,
                        leftover="" if cleared else alias,
                        reason=f"a delete made the bare index {alias!r}",
                    )
                if ok:
                    bulked.applied += 1
                    bulked.existed += op.get("result") in ("deleted", "updated")
                    bulked.written.append(str(op.get("_id")))
                elif status == 404 and op.get("result") == "not_found":
                    bulked.applied += 1
                elif _index_missing(op):
                    raise _AliasGone(index, existed=bulked.existed, reason="require_alias")
                elif status != 409:
                    failures.append(item)
        if failures:
            raise _bulk_error(failures, tenant)
        return bulked

    def _forget(self, alias: str, tenant: str | None = None) -> None:
        """Drop what this process remembers of an alias that is gone or was rebuilt: for
        ``tenant``'s part of it, or every tenant's (None)."""
        with self._lock:
            self._ready_aliases.discard(alias)
            self._model_mapped.discard(alias)
        for key in [key for key in list(self._with_vectors) if key[0] == alias]:
            if tenant is None or key[1] == tenant:
                self._with_vectors.pop(key, None)

    def move_alias(
        self, alias: str, old: Sequence[str], new: str | None, *, delete_old: bool
    ) -> None:
        """In one ``POST _aliases`` (atomic: searches see the old indexes or the new one,
        never none), remove ``alias`` from ``old`` and add it to ``new`` (None: nowhere);
        then delete ``old`` if ``delete_old``. Errors are the caller's to translate."""
        actions: list[Mapping[str, Any]] = [
            {"remove": {"index": name, "alias": alias}} for name in old
        ]
        if new is not None:
            actions.append({"add": {"index": new, "alias": alias}})
        self._es().indices.update_aliases(actions=actions)
        if delete_old:
            self._es().indices.delete(index=",".join(old))

    # --- the index lifecycle ----------------------------------------------------------

    def tenant_query(self, tenant: str) -> dict[str, Any]:
        return {"bool": {"filter": [{"term": {self.fields.tenant: tenant}}]}}

    def delete_documents(
        self, index: str, tenant: str, ids: Sequence[str], *, version: int | None = None
    ) -> int:
        """Delete ``<tenant>:<id>`` for each id (external version: a newer write stays, and
        the delete's tombstone refuses an older upsert for ``index.gc_deletes``, 60 s by
        default); answers how many existed. The tenant's index is created first if it is
        missing, as an upsert would: a delete may run before the upsert it was accepted
        after."""
        alias = self.alias(index, tenant)
        actions = [
            {"_op_type": "delete", "_index": alias, "_id": f"{tenant}:{i}", **_versioned(version)}
            for i in dict.fromkeys(ids)
        ]
        # the index is made if missing, so the tombstones exist for an older upsert that
        # runs later
        if not actions:
            return 0
        bulked = self._write(index, tenant, actions, f"bulk delete in index {index!r}", version)
        return 0 if bulked is None else bulked.existed

    def delete_index(self, index: str, tenant: str, *, version: int | None = None) -> int:
        """Delete the tenant's index: its concrete indexes (the alias goes with them);
        answers how many of the tenant's documents the one the alias pointed at held.

        The names to delete are found first, before anything is deleted (a write accepted
        after the drop may make the index again while it runs; its new index is not on the
        list), in one request (``GET _resolve/index/<alias>*``, closed ones too): the
        indexes the alias points at, and every concrete index named after it: those a reindex
        kept (``<alias>~<suffix>``) and a bare index of the alias's own name (a delete
        made it). Then one ``_msearch`` on the alias (or that bare index) counts the
        tenant's documents and looks for one of another tenant's (``terminate_after: 1``).
        An index holding one (a key collision, or an alias an operator pointed at an index
        it shares) is never deleted: only the tenant's documents go, with one
        ``_delete_by_query`` on the tenant term. Else the kept indexes are deleted, then the
        live ones. The alias already gone (a drop cut short, or run twice) still deletes what
        is found named after it, so a drop run again completes one cut short.

        With a ``version``, the drop first raises the tenant's floor for the index
        (:meth:`DropFloors.raise_to`), before anything is deleted: a write accepted before the drop
        and run after it is skipped, as on the embedded backend. One accepted after the
        drop but run before it goes with the index (the embedded backend keeps it;
        deploy/README.md §6 says so)."""
        alias = self.alias(index, tenant)
        what = f"delete of index {index!r}"
        if version is not None:
            self._floors.raise_to(alias, version, what, index)
        with _translated(what, index):
            live, named = self._named(alias)
        with _translated(what, index, missing_ok=True) as missing:
            response = self._es().msearch(index=alias, searches=self.drop_searches(tenant)).body
        answers = [] if missing else response.get("responses", [])
        if missing or any(_index_missing(answer) for answer in answers):
            mine = others = 0
        else:
            for answer in answers:
                _raise_for_item(answer, what, index)
            mine, others = (_total(answer) for answer in answers)
        if others:
            gone = self._delete_tenants_documents(alias, tenant, what, index)
        else:
            gone = mine if self._delete_concrete(live, named, what, index) else 0
        self._forget(alias, tenant)
        return gone

    def drop_searches(self, tenant: str) -> list[Mapping[str, Any]]:
        """The ``_msearch`` lines of :meth:`delete_index`: the tenant's documents counted, and
        whether the index holds any other tenant's (stopping at the first)."""
        others = {"bool": {"must_not": [{"term": {self.fields.tenant: tenant}}]}}
        return [
            {},
            {"size": 0, "track_total_hits": True, "query": self.tenant_query(tenant)},
            {},
            {"size": 0, "terminate_after": 1, "track_total_hits": True, "query": others},
        ]

    def _delete_concrete(
        self, live: Sequence[str], named: Sequence[str], what: str, index: str
    ) -> bool:
        """Delete the concrete indexes of an alias, found before (ES deletes no index by
        its alias): ``named`` (those a reindex kept for a rollback, whose documents the drop
        takes too and whose first name would otherwise block the next write; a bare index
        of the alias's name), then ``live``, the ones it points at, last: a drop cut short
        leaves the alias, and the next one finds everything again. Whether this call
        deleted the index the alias pointed at: a concurrent drop that got there first
        deleted it, and counts it."""
        with _translated(what, index):
            kept = [name for name in named if name not in live]
            if kept:
                self._es().indices.delete(index=",".join(kept), ignore_unavailable=True)
        with _translated(what, index, missing_ok=True) as missing:
            if live:
                self._es().indices.delete(index=",".join(live))
        return bool(live) and not missing

    def _named(self, alias: str) -> tuple[list[str], list[str]]:
        """The concrete indexes ``alias`` points at (or a bare index named ``alias`` itself,
        one a delete made), and those named after it, ``<alias>~<suffix>`` (the live one
        and any a reindex kept). One snapshot of both:
        ``GET _resolve/index/<alias>*?expand_wildcards=all`` (ES registers only GET for it;
        ``all``: a closed kept index is found too)."""
        answer = self._es().perform_request(
            "GET",
            f"/_resolve/index/{quote(alias, safe='')}*",
            params={"expand_wildcards": "all"},
            headers={"accept": "application/json"},
        )
        stem = f"{alias}{CONCRETE_SEPARATOR}"
        names = [str(found.get("name", "")) for found in answer.body.get("indices", [])]
        live = [
            str(name)
            for found in answer.body.get("aliases", [])
            if found.get("name") == alias
            for name in found.get("indices", [])
        ]
        named = [
            name
            for name in names
            if name.startswith(stem) and _SIFT_CONCRETE.fullmatch(name.removeprefix(stem))
        ]
        if alias in names:  # no alias then: that bare index is what the alias's name reads
            live.append(alias)
        return sorted(live), sorted(named)

    def _concrete(self, alias: str) -> list[str]:
        """The concrete indexes ``alias`` points at (none if it is missing)."""
        return sorted(name for name, held in self._aliases(alias).items() if alias in held)

    def _aliases(self, name: str) -> dict[str, list[str]]:
        """``GET _alias/<name or pattern>`` as concrete index -> its aliases matching it.

        Nothing found is ``{}`` in every shape ES answers it: a wildcard matching nothing
        (200 ``{}``), a missing alias (404 ``{"error": "alias [..] missing", "status":
        404}``), or, with security on and no index the key may see yet, a 404
        ``index_not_found_exception``."""
        answer = self._es().options(ignore_status=404).indices.get_alias(name=name).body
        return {
            concrete: list(about.get("aliases") or {})
            for concrete, about in answer.items()
            if isinstance(about, Mapping) and "aliases" in about
        }

    def _delete_tenants_documents(self, alias: str, tenant: str, what: str, index: str) -> int:
        """Only the tenant's documents, from an index another tenant's share."""
        with _translated(what, index, missing_ok=True) as missing:
            answer = (
                self._es()
                .delete_by_query(
                    index=alias,
                    query=self.tenant_query(tenant),
                    conflicts="proceed",
                    refresh=True,
                )
                .body
            )
        return 0 if missing else int(answer.get("deleted", 0))

    def indexes(self, tenant: str) -> list[IndexInfo]:
        """The tenant's indexes: its aliases (``GET _alias/<prefix><key>--*``; a wildcard
        that matches nothing answers ``{}``), then one tenant-filtered ``size: 0`` search
        over the same pattern with a terms aggregation on ``_index`` (and, inside it, on
        the model field) for the counts. A concrete index no alias of the tenant points at
        (one a reindex kept) is not listed, nor an index holding none of its documents."""
        stem = self.tenant_stem(tenant)
        pattern = f"{stem}*"
        with _translated("list of indexes", None):
            aliases = self._aliases(pattern)
        names = {
            concrete: alias.removeprefix(stem)
            for concrete, held in aliases.items()
            for alias in held
            if alias.startswith(stem)
        }
        if not names:
            return []
        by_index: dict[str, Any] = {"terms": {"field": "_index", "size": MAX_LISTED_INDEXES}}
        if self.fields.model:
            by_index["aggs"] = self._models_agg()
        with _translated("list of indexes", None, missing_ok=True) as missing:
            answer = (
                self._es()
                .search(
                    index=pattern,
                    size=0,
                    query=self.tenant_query(tenant),
                    aggs={"indexes": by_index},
                    ignore_unavailable=True,
                    allow_no_indices=True,
                )
                .body
            )
        if missing:
            return []
        listed: dict[str, IndexInfo] = {}
        for bucket in answer.get("aggregations", {}).get("indexes", {}).get("buckets", []):
            name = names.get(bucket["key"])
            if name is not None and int(bucket["doc_count"]):
                listed[name] = self._info(name, int(bucket["doc_count"]), _first_key(bucket))
        return [listed[name] for name in sorted(listed)]

    def _models_agg(self) -> dict[str, Any]:
        """The aggregation naming the model the tenant's vectors record (one, by design)."""
        return {"models": {"terms": {"field": self.fields.model, "size": 1}}}

    def _info(self, name: str, count: int, model: str | None) -> IndexInfo:
        return IndexInfo(name, count, self.name, model, self.index_settings.dims, None)

    def index_info(self, index: str, tenant: str) -> IndexInfo | None:
        """The tenant's part of one index: a tenant-filtered ``size: 0`` search, its total
        the count and its aggregation the recorded embedding model."""
        body: dict[str, Any] = {
            "size": 0,
            "track_total_hits": True,
            "query": self.tenant_query(tenant),
        }
        if self.fields.model:
            body["aggs"] = self._models_agg()
        with _translated(f"count of index {index!r}", index, missing_ok=True) as missing:
            answer = self._es().search(index=self.alias(index, tenant), **body).body
        count = 0 if missing else _total(answer)
        model = None if missing else _first_key(answer.get("aggregations", {}))
        return self._info(index, count, model) if count else None

    def document(self, index: str, tenant: str, doc_id: str) -> StoredDocument | None:
        """``GET <alias>/_doc/<tenant>:<id>`` without the vector; None if the tenant has none."""
        with _translated(f"document in index {index!r}", index, missing_ok=True) as missing:
            try:
                answer = (
                    self._es()
                    .get(
                        index=self.alias(index, tenant),
                        id=f"{tenant}:{doc_id}",
                        source_excludes=[self.fields.vector],
                    )
                    .body
                )
            except NotFoundError as exc:
                if _error_type(exc) == "index_not_found_exception":
                    raise
                return None
        if missing or not answer.get("found"):
            return None
        src = answer.get("_source", {})
        if src.get(self.fields.tenant) != tenant:
            return None
        return StoredDocument(
            id=doc_id,
            text=str(src.get(self.fields.text, "")),
            title=str(src.get(self.fields.title, "")) if self.fields.title else "",
            revision=str(src.get(self.fields.revision, "")),
            metadata=dict(src.get(self.fields.metadata) or {}),
            version=int(answer["_version"]) if "_version" in answer else None,
        )

    # --- index management ------------------------------------------------------------

    def _explicit_body(self) -> dict[str, Any]:
        """Settings and mappings for ``indices.create``: the template's, or none if it applies.

        With an empty prefix no template is put (its pattern would be ``*``), so each new
        index carries the mapping itself.
        """
        if self.prefix:
            self.ensure_template()
            return {}
        template = index_template(self.prefix, self.fields, self.index_settings)["template"]
        return {"settings": template["settings"], "mappings": template["mappings"]}

    def ensure_template(self) -> None:
        """Put Sift's index template (idempotent; once per process; needs a prefix)."""
        if self._template_ready or not self.prefix:
            return
        body = index_template(self.prefix, self.fields, self.index_settings)
        with _translated("index template", None):
            self._es().indices.put_index_template(name=f"{self.prefix}sift", **body)
        self._template_ready = True

    def ensure_index(self, index: str, tenant: str) -> bool:
        """Create the tenant's alias and its first concrete index if they don't exist yet;
        whether this call created them.

        The alias is what is looked for (``HEAD _alias/<alias>``): a concrete index of the
        alias's own name is not it. The first concrete name is fixed, so two workers racing
        both end with the one index. Found already there, the alias is checked too: that
        index without its alias (a drop cut short) is never written into again
        (``_AliasGone`` naming it). A concrete index named like the alias (a delete sent as
        the alias was dropped made it: ES holds no delete to ``require_alias``) makes the
        create fail; it is deleted if it holds no document (:meth:`_clear_bare`) and the
        next attempt makes the index, else it is named as in the way (``_AliasGone``)."""
        alias = self.alias(index, tenant)
        if alias in self._ready_aliases:
            return False
        created = False
        with self._lock:
            if not self._alias_exists(alias, f"index {index!r}", index):
                created = self._create_first(index, alias)
            self._ready_aliases.add(alias)
        return created

    def _create_first(self, index: str, alias: str) -> bool:
        """``PUT <alias>~000001`` with the alias; whether this call made it."""
        concrete = concrete_name(alias, "000001")
        what = f"create index {index!r}"
        with _translated(what, index):
            try:
                self._es().indices.create(
                    index=concrete, aliases={alias: {}}, **self._explicit_body()
                )
                return True
            except ApiError as exc:
                kind = _error_type(exc)
                if kind == "invalid_alias_name_exception":  # an index has the alias's name
                    cleared = self._clear_bare(alias, what, index)
                    reason = f"the concrete index {alias!r} has the alias's name"
                    leftover = "" if cleared else alias
                    raise _AliasGone(index, leftover=leftover, reason=reason) from exc
                if kind != "resource_already_exists_exception":
                    raise
                if not self._es().indices.exists_alias(name=alias):
                    reason = "a drop cut short, or the alias removed by hand"
                    raise _AliasGone(index, leftover=concrete, reason=reason) from exc
        return False

    def reindex(self, index: str, tenant: str, *, delete_old: bool = False) -> str:
        """Rebuild the tenant's ``index`` into a new concrete index, then swap the alias
        atomically.

        1. ``PUT <alias>-<timestamp>`` (the current template applies: new mapping,
           quantisation, shard count);
        2. ``POST _reindex`` from the alias into it (``version_type: external``: each
           document keeps its version, so the write ordering holds across it), then
           ``POST <new>/_refresh``;
        3. ``POST _aliases`` with ``remove`` of the alias from every old index and ``add``
           to the new one, in one request (atomic: searches see old or new, never none);
        4. optionally delete the old indexes (kept by default, for a rollback).

        Answers the new concrete index's name.
        """
        return self._rebuild(index, self.alias(index, tenant), delete_old)

    def reindex_all(self, index: str, *, delete_old: bool = False) -> list[str]:
        """:meth:`reindex` of every tenant's ``index`` (an operator knows names, not which
        tenants hold them): each alias ``<prefix><key>--<index>`` found by
        ``GET _alias/<prefix>*--<index>`` (a name that merely ends so is left out)."""
        exact = re.compile(
            rf"{re.escape(self.prefix)}[0-9a-f]{{{TENANT_KEY_LENGTH}}}{KEY_SEPARATOR}"
            + re.escape(index)
        )
        self.alias(index, "")  # refuses a name ES would
        with _translated(f"reindex of index {index!r}", index):
            answer = self._aliases(f"{self.prefix}*{KEY_SEPARATOR}{index}")
        found = {alias for held in answer.values() for alias in held}
        return [self._rebuild(index, a, delete_old) for a in sorted(found) if exact.fullmatch(a)]

    def _rebuild(self, index: str, alias: str, delete_old: bool) -> str:
        """The steps of :meth:`reindex` for one alias."""
        stamp = datetime.now(UTC).strftime("%Y%m%dt%H%M%S%f")
        concrete = concrete_name(alias, stamp)
        self._template_ready = False  # put the template again: the current settings apply
        with _translated(f"reindex of index {index!r}", index):
            old = self._concrete(alias)
            if not old:
                raise IndexNotFound(index)
            self._es().indices.create(index=concrete, **self._explicit_body())
            self._copy({"index": alias}, concrete, f"reindex of index {index!r}")
            self.move_alias(alias, old, concrete, delete_old=delete_old)
        self._forget(alias)
        logger.info("reindexed %s: %s -> %s", alias, old, concrete)
        return concrete

    def _copy(self, source: Mapping[str, Any], dest: str, what: str) -> int:
        """``POST _reindex`` into ``dest`` keeping each document's ``_id`` and version (a newer
        one already in ``dest`` stays), then refresh ``dest``; answers how many documents
        were written.

        The copy runs as an ES task (``wait_for_completion=false``), polled with the
        adapter's request timeout, so no request waits for the whole copy and a cut
        connection leaves the task running on its own. A copy into ``dest`` still running
        (an earlier run cut short) refuses a second one, retryably, naming its task (a
        check, then the start: two runs started at the same moment can both copy; the
        external versions keep the result right). A task that reports failures, an error,
        or ``canceled`` (someone ran ``_tasks/<id>/_cancel``: a partial copy) fails the
        copy, and so does one not done after ``COPY_MAX_SECONDS`` (retryably): the caller
        then neither moves an alias nor deletes a source."""
        with _translated(what, None):
            running = self._running_copy(dest)
            if running:
                raise BackendUnavailable(
                    f"a copy into {dest!r} is still running (task {running}): wait for it "
                    "to end, then run again"
                )
            task = (
                self._es()
                .reindex(
                    source=dict(source),
                    dest={"index": dest, "version_type": "external"},
                    conflicts="proceed",
                    wait_for_completion=False,
                )
                .body["task"]
            )
            answer = self._task(task)
            deadline = self._clock() + self.copy_max_seconds
            while not answer.get("completed"):
                if self._clock() >= deadline:
                    raise BackendUnavailable(
                        f"{what} into {dest!r} not done after {self.copy_max_seconds:g} s "
                        f"(task {task} runs on): wait for it to end, then run again"
                    )
                time.sleep(COPY_POLL_SECONDS)
                answer = self._task(task)
            report = answer.get("response") or {}
            status = (answer.get("task") or {}).get("status") or {}
            canceled = report.get("canceled") or status.get("canceled")
            if canceled:
                raise BackendRequestError(
                    f"{what} into {dest!r} was cancelled (task {task}: {canceled}): the copy "
                    "is partial; run it again"
                )
            failed = answer.get("error") or report.get("failures")
            if failed:
                raise BackendRequestError(f"{what} into {dest!r} failed: {json.dumps(failed)}")
            self._es().indices.refresh(index=dest)
        return int(report.get("created", 0)) + int(report.get("updated", 0))

    def _task(self, task: str) -> Mapping[str, Any]:
        """``GET _tasks/<id>`` (the client flags the task API a preview; it is in every 9.x)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GeneralAvailabilityWarning)
            answer: Mapping[str, Any] = self._es().tasks.get(task_id=task).body
        return answer

    def _running_copy(self, dest: str) -> str | None:
        """The id of a running ``_reindex`` task into ``dest`` (``GET _tasks``), if any."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GeneralAvailabilityWarning)
            answer = self._es().tasks.list(actions="*reindex", detailed=True).body
        for node in (answer.get("nodes") or {}).values():
            for task_id, task in (node.get("tasks") or {}).items():
                if f"to [{dest}]" in str(task.get("description", "")):
                    return str(task_id)
        return None

    # --- the shared layout of earlier releases (worker/adapters/es_migrate.py) ----------

    def check(self) -> None:
        """Refuse to run over the shared layout's indexes (:meth:`SharedLayout.check`)."""
        SharedLayout(self).check()

    def shared_layout(self) -> dict[str, list[str]]:
        """The shared layout's aliases and their concrete indexes (:meth:`SharedLayout.find`)."""
        return SharedLayout(self).find()

    def migrate_shared(
        self, *, delete_old: bool = False, dry_run: bool = False
    ) -> dict[str, dict[str, int]]:
        """Copy the shared layout into per-tenant indexes (:meth:`SharedLayout.migrate`)."""
        return SharedLayout(self).migrate(delete_old=delete_old, dry_run=dry_run)

    # --- request bodies (pure) -----------------------------------------------------------

    def filters(self, filters: HardFilters) -> list[dict[str, Any]]:
        """The hard filters as ES ``term`` queries: the tenant first, then the caller's."""
        terms: list[dict[str, Any]] = [{"term": {self.fields.tenant: filters.tenant}}]
        for key, value in sorted(filters.fields.items()):
            if not _FILTER_KEY.match(key):
                raise InvalidRequest(f"filters.{key}", "filter names use letters, digits and _.:-")
            terms.append({"term": {f"{self.fields.metadata}.{key}": _term_value(value)}})
        return terms

    def probe_searches(self, tenant: str) -> list[Mapping[str, Any]]:
        """The ``_msearch`` lines of :meth:`probe`: does the tenant hold a document, and one
        with a vector (returning that one's model field)? Each probe stops at the first
        match (per shard); the first returns no hit."""
        tenant_filter = self.filters(HardFilters(tenant))
        with_vector = [*tenant_filter, {"exists": {"field": self.fields.vector}}]
        model = {"size": 1, "_source": [self.fields.model]} if self.fields.model else {"size": 0}
        searches: list[Mapping[str, Any]] = []
        for filters, returned in ((tenant_filter, {"size": 0}), (with_vector, model)):
            searches += [
                {},
                {
                    **returned,
                    "terminate_after": 1,
                    "track_total_hits": True,
                    "query": {"bool": {"filter": filters}},
                },
            ]
        return searches

    def model_check_body(self, tenant: str, model: str) -> dict[str, Any]:
        """The ``_search`` body that finds one of the tenant's vectors recorded by a model
        other than ``model`` (documents that record none are not counted)."""
        return {
            "size": 1,
            "terminate_after": 1,
            "_source": [self.fields.model],
            "query": {
                "bool": {
                    "filter": [
                        *self.filters(HardFilters(tenant)),
                        {"exists": {"field": self.fields.model}},
                    ],
                    "must_not": [{"term": {self.fields.model: model}}],
                }
            },
        }

    def channel_body(self, channel: Channel, query: ChannelQuery) -> dict[str, Any]:
        """The ``_msearch`` body of one channel, with the hard filters inside it."""
        if channel == "bm25":
            return self.bm25_body(query)
        if channel == "knn":
            return self.knn_body(query)
        raise BackendRequestError(f"unknown channel {channel!r}")

    def bm25_body(self, query: ChannelQuery) -> dict[str, Any]:
        text_fields = [name for name in (self.fields.title, self.fields.text) if name]
        return {
            "size": query.size,
            "query": {
                "bool": {
                    "must": {
                        "multi_match": {
                            "query": query.text,
                            "fields": text_fields,
                            "type": "best_fields",
                            "operator": "or",
                        }
                    },
                    "filter": self.filters(query.filters),
                }
            },
            "_source": self.fields.source(),
            "track_total_hits": False,
        }

    def knn_body(self, query: ChannelQuery) -> dict[str, Any]:
        if query.vector is None:
            raise ModeUnavailable("the knn channel needs a query vector")
        return {
            "size": query.size,
            "knn": {
                "field": self.fields.vector,
                "query_vector": [float(v) for v in query.vector],
                "k": query.size,
                "num_candidates": num_candidates(query.size, self.num_candidates),
                "filter": self.filters(query.filters),
            },
            "_source": self.fields.source(),
            "track_total_hits": False,
        }

    def source(
        self,
        tenant: str,
        doc: Document,
        vector: Sequence[float] | None,
        model: str | None = None,
    ) -> dict[str, Any]:
        """The ``_source`` Sift writes for one document (``model``: its vector's embedder)."""
        for key, value in doc.metadata.items():
            if not _FILTER_KEY.match(key) or not isinstance(value, str | int | float | bool):
                raise InvalidRequest(
                    f"documents[{doc.id}].metadata", f"bad key or value for {key!r}"
                )
        revision = doc.revision or derive_revision(doc.title, doc.text, doc.metadata)
        body: dict[str, Any] = {
            self.fields.id: doc.id,
            self.fields.text: doc.text,
            self.fields.tenant: tenant,
            self.fields.revision: revision,
            self.fields.metadata: dict(doc.metadata),
        }
        if self.fields.title:
            body[self.fields.title] = doc.title
        if vector is not None:
            body[self.fields.vector] = [float(v) for v in vector]
            if model is not None and self.fields.model:
                body[self.fields.model] = model
        return body

    def native_body(self, query: ChannelQuery) -> dict[str, Any]:
        """The ``_search`` body that fuses on ES's side, by the search's fusion method."""
        if query.method == "linear":
            return self.native_linear_body(query)
        return self.native_rrf_body(query)

    def _children(self, query: ChannelQuery) -> list[tuple[Channel, dict[str, Any]]]:
        """The filtered BM25 and kNN child retrievers of a native fusion."""
        bm25 = self.bm25_body(query)
        knn = self.knn_body(query)["knn"]
        return [("bm25", {"standard": {"query": bm25["query"]}}), ("knn", {"knn": knn})]

    def native_rrf_body(self, query: ChannelQuery) -> dict[str, Any]:
        """One ``_search`` whose ``retriever.rrf`` fuses a filtered BM25 and a filtered kNN,
        with the search's rank constant. Weights other than 1 go as each child retriever's
        ``weight`` (the ``{"retriever": ..., "weight": w}`` form, Elasticsearch 9.2+); at
        equal weights of 1 the plain form is sent, which every 9.x reads."""
        children = self._children(query)
        weights = {channel: float(query.weights.get(channel, 1.0)) for channel, _ in children}
        retrievers: list[dict[str, Any]] = (
            [child for _, child in children]
            if all(weight == 1.0 for weight in weights.values())
            else [{"retriever": child, "weight": weights[c]} for c, child in children]
        )
        return {
            "size": query.size,
            "retriever": {
                "rrf": {
                    "retrievers": retrievers,
                    "rank_window_size": query.size,
                    "rank_constant": query.rank_constant,
                }
            },
            "_source": self.fields.source(),
            "track_total_hits": False,
        }

    def native_linear_body(self, query: ChannelQuery) -> dict[str, Any]:
        """One ``_search`` whose ``retriever.linear`` (Elasticsearch 8.18+ / 9.x) sums each
        child's ``minmax``-normalised score times its weight: Sift's ``linear`` fusion. Each
        child is normalised over its own ``rank_window_size`` hits, as Sift normalises over
        each channel's list; the kNN score ES reports, ``(1 + cos) / 2``, normalises to the
        same values as ``cos`` does (min-max is blind to an affine map)."""
        return {
            "size": query.size,
            "retriever": {
                "linear": {
                    "retrievers": [
                        {
                            "retriever": child,
                            "weight": float(query.weights.get(channel, 1.0)),
                            "normalizer": "minmax",
                        }
                        for channel, child in self._children(query)
                    ],
                    "rank_window_size": query.size,
                }
            },
            "_source": self.fields.source(),
            "track_total_hits": False,
        }

    def retrieve_native(self, query: ChannelQuery) -> list[ChannelHit]:
        """Fused hits from ES's own ``rrf`` or ``linear`` retriever (by ``query.method``;
        each needs a licence tier that has it).

        The hits carry ES's fused score only: no per-channel rank or score, and no kNN
        similarity floor can apply. :meth:`retrieve` calls it when ``native_rrf`` is on.
        """
        body = self.native_body(query)
        what = f"native {query.method} search of index {query.index!r}"
        with _translated(what, query.index):
            alias = self.alias(query.index, query.filters.tenant)
            response = self._es(query.timeout_seconds).search(index=alias, **body)
        return [self._hit("bm25", raw, native=True) for raw in response.body["hits"]["hits"]]

    # --- parsing ---------------------------------------------------------------------

    def _maps_vectors(self, mappings: Mapping[str, Any]) -> bool:
        for mapping in mappings.values():
            node: Any = mapping.get("mappings", {})
            for part in self.fields.vector.split("."):
                node = node.get("properties", {}).get(part, {})
            if node.get("type") == "dense_vector":
                return True
        return False

    def _hit(self, channel: Channel, raw: Mapping[str, Any], native: bool = False) -> ChannelHit:
        source = raw.get("_source") or {}
        fields = self.fields
        doc_id = source.get(fields.id)
        if doc_id is None:  # an existing index without an id field: the _id is the id
            doc_id = str(raw["_id"]).split(":", 1)[-1]
        metadata = source.get(fields.metadata) or {}
        title = source.get(fields.title, "") if fields.title else ""
        text = source.get(fields.text, "")
        revision = source.get(fields.revision) or derive_revision(
            str(title), str(text), metadata if isinstance(metadata, Mapping) else {}
        )
        document = Document(
            id=str(doc_id),
            text=str(text),
            title=str(title or ""),
            revision=str(revision),
            metadata=dict(metadata) if isinstance(metadata, Mapping) else {},
        )
        score = float(raw.get("_score") or 0.0)
        if channel == "knn" and not native:
            score = 2.0 * score - 1.0  # ES's cosine score is (1 + cos) / 2
        return ChannelHit(document, score)


def _versioned(version: int | None) -> dict[str, Any]:
    """Bulk action metadata for ES's external versioning (none without a version)."""
    return {} if version is None else {"version": version, "version_type": "external"}


def _term_value(value: FilterValue) -> str:
    """A ``flattened`` field holds every value as a keyword: ``true``, ``5``, ``2.5``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)

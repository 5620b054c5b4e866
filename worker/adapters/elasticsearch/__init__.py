"""The Elasticsearch search backend: BM25 and kNN channels of an ES 9.x index, in one ``_msearch``.

The package's private modules, one job each (every public name is re-exported here, so
``from worker.adapters.elasticsearch import …`` is the way in):

* ``_backend``: :class:`ElasticsearchBackend`, the parts below in one class, built from
  the settings;
* ``_core``: the state every part shares, the tenant's alias names, the index template;
* ``_mapping``: the field names, the index settings and the template's mapping (pure);
* ``_bodies``: every request body (pure); ``num_candidates``, the derived revision;
* ``_search``: the channels probe and its memo, the ``_msearch`` of both channels,
  native fusion, hit parsing;
* ``_writes``: upserts and deletes by id (bulk, ``require_alias``, retries, take-backs);
* ``_indexes``: making a tenant's index, clearing a bare index in its alias's way;
* ``_drops``: drops of a tenant's index;
* ``_listing``: the tenant's indexes, counts and documents, and those holding no document
  (what a purge drops besides);
* ``_reindex``: rebuilding an index and moving its alias; the copy task;
* ``_settings``: each tenant's index's own search settings (``<prefix>sift-settings``);
* ``_layout``: index names and drop floors; ``_errors``: ES's errors as Sift's;
  ``_migrate``: the shared layout of earlier releases (the start-up check and
  ``sift elasticsearch-migrate``).

Why this shape (DESIGN.md §6).

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
  holds the mapping: ``text`` and ``title`` as ``text`` (BM25, with the analyzer of
  ``SIFT_ELASTICSEARCH_ANALYZER``, ``english`` by default: an index keeps the one it was
  made with), ``vector`` as ``dense_vector`` (cosine, HNSW, int8-quantised by default),
  ``tenant``, ``revision`` and ``doc_id`` as ``keyword``, ``metadata`` as ``flattened``
  (what a hit's metadata is read from), ``metadata_terms`` as ``keyword`` (one typed
  token per metadata value, ``year=n:2020``: what filters match, see *Reads*),
  ``embedding_model`` as ``keyword``:
  the model that made the document's vector, ``write_version`` as ``long``: the version of
  the write that wrote the document (what a drop compares with its own). A write adds the
  fields a later template gained to an index made before (``PUT <alias>/_mapping``, once per
  process and alias, an index it just made included: the template ES holds may be an earlier
  release's; a write ``dynamic: strict`` refuses for such a field fails retryably and maps
  it again), and a reindex adds them to its new index before the alias moves.
  Every field name is a setting, so an existing index can be searched through a tenant's
  alias pointed at it.
* **Embedding models never mix.** A write of vectors first asks (one ``size: 1`` search)
  whether the tenant holds a vector recorded by another model, and is refused with
  ``EmbeddingModelMismatch`` if so, writing nothing; the channel probe returns the model of
  one of the tenant's vectors, so a search learns it with no extra round trip. A drop
  takes the record with the tenant's index. Not transactional: two
  workers of different models writing into one empty index at once can both pass.
* **Tenancy, in depth.** Each document still carries its tenant field, every search
  and count still filters on it, and the ``_id`` stays ``"<tenant>:<doc id>"`` (a
  digest of it past ES's 512 bytes: ``_layout.document_es_id``): a
  64-bit key collision, or an alias an operator pointed at a shared index, still keeps
  tenants apart in every read (not in every write: a one-tenant ``reindex`` copies the
  asker's documents alone, and the alias's drop floors are shared; ``reindex_all`` copies
  every tenant), and a migration from the shared layout copies ``_id`` and external
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
  unless the live one holds another tenant's document too, or (a versioned drop) one of the
  tenant's written after the drop (``write_version`` above the drop's: an ingest accepted
  after the drop whose job ran first), when only the tenant's documents not written after
  the drop go (``_delete_by_query``, run as an ES task and polled; one still running on
  the alias is waited on first): the write accepted last wins. The same if a delete by id
  accepted after the drop has run (its version, recorded before its bulk as
  ``<alias>#deletes`` in the floors index, is above the drop's): the index keeps its
  tombstones. A drop whose alias is already gone (one cut short) still deletes what it
  finds named after it. A versioned drop first
  leaves a floor (``<prefix>sift-floors``) that every versioned write reads before it writes
  and again after: a write accepted before the drop and run after it writes nothing, or, if
  the drop ran between its check and its bulk, what it wrote is deleted again (by id, with
  the drop's version, so a newer writer's document stays) and it reports none written; the
  deletes go again on every retry of that write, so a take-back cut short completes.
* **Reindexing** (:meth:`ElasticsearchBackend.reindex`, per tenant): create a new
  concrete index from the current template, copy the tenant's documents (a tenant-term
  ``query``: an operator's alias may be over an index tenants share) with ``_reindex``
  (vectors included, also on 9.2+ where they are left out of ``_source``; versions kept),
  refresh, then move the alias in one atomic ``_aliases`` call (remove from the old
  indexes, add to the new). Searches never see a half-built index; the old index is kept
  for a rollback unless ``delete_old`` is set and it holds no other tenant's document (a
  drop of the name deletes it too). The copy is an ES task, polled for at most
  ``COPY_MAX_SECONDS``; a run made while an earlier run's copy from the alias still runs
  (``GET _tasks``) waits on that copy and uses its index, never starting a second; a task
  cancelled, failed or not done by then moves no alias and deletes nothing.
* **Reads**: the BM25 and kNN searches go in ONE ``_msearch`` round trip. The tenant term
  and the caller's metadata terms sit inside both: the ``bool.filter`` of the BM25 query
  and ``knn.filter``, which ES applies *before* it picks the top k (a ``post_filter``
  would apply after, and could return fewer than k; it is never used). A metadata filter
  compares JSON values as the embedded backend does (``5`` is ``5.0``, ``true`` is not
  ``1``, ``"5"`` is not ``5``): a ``term`` on the document's typed tokens
  (:func:`~worker.adapters.elasticsearch._bodies.metadata_term`), or, on a document
  without them (written before they existed, or not by Sift), on its ``flattened``
  metadata, as text (a number in each of its JSON spellings, ``5`` and ``5.0``).
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
* **Errors**: connection errors, timeouts, 408, 429 and 5xx become ``BackendUnavailable``
  (retryable), and so does a search or count answered from some shards only (200 with
  ``_shards.failed``: used, it would read an index as empty or rank without documents);
  other 4xx become ``BackendRequestError`` (permanent) with ES's reason; a missing index
  becomes ``IndexNotFound``. The 9.x client sends
  ``compatible-with=9`` media types, which 8.x servers refuse with a 400: use ES 9.

Usage::

    backend = ElasticsearchBackend.from_settings(settings)   # no network call here
    backend.check()  # once at start: refuses indexes of the shared layout (see migrate_shared)
    backend.upsert("docs", "acme", [Document(id="1", text="...")], vectors)
    results = backend.retrieve(ChannelQuery(index="docs", filters=HardFilters("acme"),
                                            channels=("bm25", "knn"), size=120,
                                            text="query", vector=query_vector))
"""

from worker.adapters.elasticsearch._backend import ElasticsearchBackend
from worker.adapters.elasticsearch._bodies import MAX_NUM_CANDIDATES, num_candidates
from worker.adapters.elasticsearch._core import COPY_MAX_SECONDS, Refresh
from worker.adapters.elasticsearch._layout import (
    CONCRETE_SEPARATOR,
    FLOORS_INDEX,
    KEY_SEPARATOR,
    MAX_INDEX_NAME_BYTES,
    TENANT_KEY_LENGTH,
    DropFloors,
    checked_index_name,
    concrete_name,
    tenant_key,
)
from worker.adapters.elasticsearch._listing import MAX_LISTED_INDEXES
from worker.adapters.elasticsearch._mapping import FieldNames, IndexSettings, index_template
from worker.adapters.elasticsearch._migrate import SharedLayout
from worker.adapters.elasticsearch._reindex import COPY_POLL_SECONDS
from worker.adapters.elasticsearch._search import CHANNELS_MEMO_SIZE, CHANNELS_TTL_SECONDS
from worker.adapters.elasticsearch._writes import WRITE_ATTEMPTS
from worker.core.types import derive_revision

__all__ = [
    "CHANNELS_MEMO_SIZE",
    "CHANNELS_TTL_SECONDS",
    "CONCRETE_SEPARATOR",
    "COPY_MAX_SECONDS",
    "COPY_POLL_SECONDS",
    "FLOORS_INDEX",
    "KEY_SEPARATOR",
    "MAX_INDEX_NAME_BYTES",
    "MAX_LISTED_INDEXES",
    "MAX_NUM_CANDIDATES",
    "TENANT_KEY_LENGTH",
    "WRITE_ATTEMPTS",
    "DropFloors",
    "ElasticsearchBackend",
    "FieldNames",
    "IndexSettings",
    "Refresh",
    "SharedLayout",
    "checked_index_name",
    "concrete_name",
    "derive_revision",
    "index_template",
    "num_candidates",
    "tenant_key",
]

"""The index lifecycle on a worker: run a delete job, answer an index read or change an
index's own search settings.

All go to the backend the worker's runtime holds, through the
:class:`~worker.core.ports.IndexCatalog` port, always with the job's tenant: another
tenant's index or document reads like one that does not exist and is never deleted. An
index's settings (:mod:`worker.adapters.index_settings`) are shown with it, changed only
once the tenant is known to have the index, and go with it: with a drop, or with the
delete that takes its last document.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from typing import Any, cast

from worker.adapters.index_settings import IndexSettingsStore
from worker.constants import MAX_LIST_READ_BYTES
from worker.core.catalog import IndexInfo, SearchSettings
from worker.core.pipeline import shown_metadata
from worker.core.ports import IndexCatalog, IndexSizing
from worker.errors import ConfigError, IndexNotFound, InvalidRequest, SiftError
from worker.queue.jobstore import IngestJob, JobStore
from worker.runtime.inprocess import Runtime

log = logging.getLogger(__name__)

# documents a page reads from the backend at a time: at most ~41 MB of metadata, where the
# page's 1,000 were read at once (each read is a seek on either backend)
_DOCUMENTS_CHUNK = 50


def catalog(runtime: object) -> IndexCatalog:
    """The runtime's backend as an :class:`IndexCatalog` (both shipped backends are one).
    ``runtime`` is a :class:`~worker.runtime.inprocess.Runtime` (the tasks see it through a
    Protocol)."""
    backend: Any = cast(Runtime, runtime).pipeline.backend
    if not all(hasattr(backend, m) for m in ("indexes", "index_info", "document", "documents")):
        raise ConfigError(f"the {backend.name} backend has no index lifecycle")
    return cast(IndexCatalog, backend)


def settings_store(runtime: object) -> IndexSettingsStore | None:
    """Where the runtime's pipeline reads index settings (None: nowhere, defaults only)."""
    source = getattr(cast(Runtime, runtime).pipeline, "index_settings", None)
    return source if isinstance(source, IndexSettingsStore) else None


def delete(
    runtime: object, job: IngestJob, ids: list[str] | None, *, jobs: JobStore | None = None
) -> int:
    """Run one delete job (by ids, or the tenant's whole index): how many documents went.
    The index's own settings go with it: with a drop, and with a delete by ids that leaves
    the index without a document (an index exists while it holds one, so a later ingest
    starts a new index, at the defaults, as after a drop), unless an upsert of the index
    accepted before the delete has yet to land (``jobs``: the job store that knows)."""
    backend, store = catalog(runtime), settings_store(runtime)
    if job.operation == "drop":
        return drop(backend, store, job.index, job.tenant, job.version)
    gone = backend.delete_documents(job.index, job.tenant, ids or [], version=job.version)
    if store is not None and _left_empty(backend, job, jobs):
        store.clear(job.index, job.tenant, job.version)
    return gone


def record_size(runtime: object, jobs: JobStore, job: IngestJob) -> None:
    """After a write job (an upsert, a delete, a drop) ran, record what the tenant's index
    holds now, as the backend sums it, for the gateway's admission of batches (a hit there
    is priced by its index's mean document). A backend that does not sum it
    (Elasticsearch) records nothing, and the gateway prices a hit at its fixed size; a
    backend that fails the reading leaves the last one, logged: the write itself is done. A
    runtime without a pipeline (a test's scripted one) has no backend to read."""
    backend = getattr(getattr(runtime, "pipeline", None), "backend", None)
    if not hasattr(backend, "index_size"):
        return
    try:
        size = cast(IndexSizing, backend).index_size(job.index, job.tenant)
    except SiftError as exc:
        log.warning("ingest %s: the size of index %r not read (%s)", job.id, job.index, exc)
        return
    if size is None:
        jobs.record_index_size(job.tenant, job.index, 0, 0)
    else:
        jobs.record_index_size(job.tenant, job.index, size.documents, size.stored_bytes)


def drop(
    backend: IndexCatalog,
    store: IndexSettingsStore | None,
    index: str,
    tenant: str,
    version: int | None,
) -> int:
    """Drop the tenant's index at write ``version``: its documents (the backend keeps the
    version as the index's floor, so a write accepted before the drop and run after it lands
    nothing), then its own settings. A drop job's run, and ``sift tenant purge``'s for each
    of a removed tenant's indexes; answers how many documents went."""
    gone = backend.delete_index(index, tenant, version=version)
    if store is not None:
        store.clear(index, tenant, version)
    return gone


def _left_empty(backend: IndexCatalog, job: IngestJob, jobs: JobStore | None) -> bool:
    """The delete by ids left the tenant's index without a document, and no upsert accepted
    before it is still to land. Where the backend recorded it (the embedded one's
    ``emptied``), as the delete found it when it ran: run again after a newer ingest landed,
    it still emptied the index in the order the writes were accepted; else as it is now."""
    recorded = getattr(backend, "emptied", None)
    emptied = None
    if recorded is not None and job.version is not None:
        emptied = recorded(job.index, job.tenant, job.version)
    if emptied is None:
        emptied = backend.index_info(job.index, job.tenant) is None
    if not emptied:
        return False
    return jobs is None or not _earlier_upsert_pending(jobs, job)


def _earlier_upsert_pending(jobs: JobStore, delete: IngestJob) -> bool:
    """An upsert of the index accepted before ``delete`` (a lower write version) and not yet
    finished: it lands after the delete, so in the order the writes were accepted the index
    was never empty (new documents sent, then the old deleted, the delete's task run first
    while the upsert was being embedded). Its documents are visible before it is final, so
    one finished already would have been counted. (One whose every id the delete took lands
    nothing, and the settings stay with an index that has none until a drop or a later
    delete: kept is the safer way to be wrong.) Asked only of a delete that emptied the
    index: the tenant's own unfinished ingests are read, once (not every tenant's active
    jobs, so the delete's run does not grow with the others' backlog)."""
    if delete.version is None:
        return False
    for job_id in jobs.active_ingests(delete.tenant):
        if job_id == delete.id:
            continue
        other = jobs.get_ingest(job_id)
        if (
            other is not None
            and other.operation == "upsert"
            and (other.tenant, other.index) == (delete.tenant, delete.index)
            and other.version is not None
            and other.version < delete.version
            and not other.status.final
        ):
            return True
    return False


def _index(info: IndexInfo, settings: SearchSettings) -> dict[str, Any]:
    return {**asdict(info), "settings": settings.shown()}


def _update(runtime: object, tenant: str, index: str, body: str, start_by: float) -> Any:
    """Apply a settings patch to the tenant's index: its metadata, or None if it has none.
    ``start_by``: the change's lock must be had by then (its gateway waits only a grace
    more), or it gives up unapplied."""
    info = catalog(runtime).index_info(index, tenant)
    if info is None:
        return None
    store = settings_store(runtime)
    if store is None:
        raise ConfigError("this deployment keeps no index settings (it has no SIFT_REDIS_URL)")
    return _index(info, store.update(index, tenant, json.loads(body or "{}"), lock_by=start_by))


def _document(backend: IndexCatalog, tenant: str, index: str, doc_id: str) -> Any:
    """One of the tenant's documents as stored, or None when its index has no such one.
    :class:`IndexNotFound` when the tenant has no such index, as ``show`` and ``documents``
    answer (a miss named the id, whether or not the index existed). Only a miss asks which,
    with a one-document page (a seek on either backend): a document found costs one read."""
    doc = backend.document(index, tenant, doc_id)
    if doc is not None:
        shown = {**asdict(doc), "metadata": shown_metadata(doc.metadata)}
        del shown["terms"]  # what the backend's filters match on, not part of the document
        return shown
    if backend.documents(index, tenant, None, 1) is None:
        raise IndexNotFound(index)
    return None


def _documents(backend: IndexCatalog, tenant: str, index: str, body: str) -> Any:
    """A page of the tenant's documents (``body``: ``{"after": id or null, "limit": n}``,
    checked by the gateway): ``{"documents": [...], "more": bool}``, or None when the
    tenant has no such index. Each read takes one more than it needs, so ``more`` is known
    without a request for an empty last page.

    A listed document shows its metadata whole, up to 100 values of 8 kB (~830 kB), so the
    page also ends before the document that would take its JSON past
    ``MAX_LIST_READ_BYTES`` (its first is shown however large, so paging moves on), and is
    read ``_DOCUMENTS_CHUNK`` at a time: a page of 1,000 such documents was 830 MB read,
    written to Redis and parsed by the gateway at once."""
    asked = json.loads(body)
    limit, after = int(asked["limit"]), asked.get("after")
    shown: list[dict[str, Any]] = []
    room = MAX_LIST_READ_BYTES
    while True:
        want = min(limit - len(shown), _DOCUMENTS_CHUNK)
        docs = backend.documents(index, tenant, after, want + 1)
        if docs is None:
            return None if not shown else {"documents": shown, "more": False}
        for doc in docs[:want]:
            entry = {**asdict(doc), "metadata": shown_metadata(doc.metadata)}
            size = len(json.dumps(entry))
            if shown and size > room:
                return {"documents": shown, "more": True}
            room -= size
            shown.append(entry)
        if len(docs) <= want or len(shown) == limit:
            return {"documents": shown, "more": len(docs) > want}
        after = shown[-1]["id"]


def _indexes(
    backend: IndexCatalog, store: IndexSettingsStore | None, tenant: str, body: str
) -> dict[str, Any]:
    """A page of the tenant's indexes with their settings (``body``: ``{"after": name or
    null, "limit": n}``, checked by the gateway): ``{"indexes": [...], "more": bool}``. As
    with documents, one more than the page is read, so ``more`` needs no empty last page."""
    asked = json.loads(body)
    limit = int(asked["limit"])
    infos = backend.indexes(tenant, asked.get("after"), limit + 1)
    shown = infos[:limit]
    stored = (
        store.read_many([i.name for i in shown], tenant)
        if store is not None
        else [SearchSettings()] * len(shown)
    )
    indexes = [_index(i, s) for i, s in zip(shown, stored, strict=True)]
    return {"indexes": indexes, "more": len(infos) > limit}


def read(
    runtime: object,
    operation: str,
    tenant: str,
    index: str,
    doc_id: str,
    body: str = "",
    start_by: float = 0.0,
) -> str:
    """One index read's answer, as the JSON the gateway parses: ``{"found": ...}`` (None
    when the tenant has no such index or document) or ``{"error": {...}}``. ``update``
    (``body``: a validated settings patch) changes the index's settings (its lock had by
    ``start_by``, epoch seconds on Redis's clock, if given), then reads it;
    ``list`` and ``documents`` (``body``: where the page starts and its size) list a page."""
    try:
        backend = catalog(runtime)
        store = settings_store(runtime)
        found: Any
        if operation == "list":
            found = _indexes(backend, store, tenant, body)
        elif operation == "show":
            info = backend.index_info(index, tenant)
            settings = store.read(index, tenant) if store and info else SearchSettings()
            found = None if info is None else _index(info, settings)
        elif operation == "update":
            found = _update(runtime, tenant, index, body, start_by)
        elif operation == "documents":
            found = _documents(backend, tenant, index, body)
        elif operation == "document":
            found = _document(backend, tenant, index, doc_id)
        else:
            raise ValueError(f"unknown index read {operation!r}")
    except InvalidRequest as exc:
        error = {"type": exc.code, "message": str(exc), "field": exc.field}
        return json.dumps({"error": error})
    except SiftError as exc:
        return json.dumps({"error": {"type": exc.code, "message": str(exc)}})
    return json.dumps({"found": found})

"""The index lifecycle on a worker: run a delete job, answer an index read.

Both go to the backend the worker's runtime holds, through the
:class:`~worker.core.ports.IndexCatalog` port, always with the job's tenant: another
tenant's index or document reads like one that does not exist and is never deleted.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, cast

from worker.core.catalog import IndexInfo
from worker.core.ports import IndexCatalog
from worker.errors import ConfigError, SiftError
from worker.queue.jobstore import IngestJob
from worker.runtime import Runtime

READ_OPERATIONS = ("list", "show", "document")


def catalog(runtime: object) -> IndexCatalog:
    """The runtime's backend as an :class:`IndexCatalog` (both shipped backends are one).
    ``runtime`` is a :class:`~worker.runtime.Runtime` (the tasks see it through a Protocol)."""
    backend: Any = cast(Runtime, runtime).pipeline.backend
    if not all(hasattr(backend, m) for m in ("indexes", "index_info", "document")):
        raise ConfigError(f"the {backend.name} backend has no index lifecycle")
    return cast(IndexCatalog, backend)


def delete(runtime: object, job: IngestJob, ids: list[str] | None) -> int:
    """Run one delete job (by ids, or the tenant's whole index): how many documents went."""
    backend = catalog(runtime)
    if job.operation == "drop":
        return backend.delete_index(job.index, job.tenant, version=job.version)
    return backend.delete_documents(job.index, job.tenant, ids or [], version=job.version)


def _index(info: IndexInfo) -> dict[str, Any]:
    return asdict(info)


def read(runtime: object, operation: str, tenant: str, index: str, doc_id: str) -> str:
    """One index read's answer, as the JSON the gateway parses: ``{"found": ...}`` (None
    when the tenant has no such index or document) or ``{"error": {...}}``."""
    try:
        backend = catalog(runtime)
        found: Any
        if operation == "list":
            found = [_index(i) for i in backend.indexes(tenant)]
        elif operation == "show":
            info = backend.index_info(index, tenant)
            found = None if info is None else _index(info)
        elif operation == "document":
            doc = backend.document(index, tenant, doc_id)
            found = None if doc is None else {**asdict(doc), "metadata": dict(doc.metadata)}
        else:
            raise ValueError(f"unknown index read {operation!r}")
    except SiftError as exc:
        return json.dumps({"error": {"type": exc.code, "message": str(exc)}})
    return json.dumps({"found": found})

"""The v1 job routes: documents, searches, batches (DESIGN.md §9).

Its modules, by what they hold:

* ``_documents``, ``_searches``, ``_batches``: each kind of job's routes, registered on
  :data:`router` in that order (the order of the OpenAPI document) as they are imported here;
* ``_shared``: the router, backpressure, storing and enqueueing, the answer for a lost job;
* ``_idempotency``: the ``Idempotency-Key`` header; ``_cancel_count``: counting what a
  batch's cancel ended, taken again while Redis is away (:func:`stop_retakes`).

Import the names from here: ``from api_gateway.jobs import router``.
"""

from __future__ import annotations

from api_gateway.jobs._shared import BUSY, router

# isort: split
from api_gateway.jobs._idempotency import IdemKey

# isort: split
from api_gateway.jobs._documents import (
    get_ingestion,
    ingest_out,
    submit_write,
    upsert_documents,
)

# isort: split
from api_gateway.jobs._searches import create_search, erase_search, get_search

# isort: split
from api_gateway.jobs._batches import (
    batch_out,
    cancel_batch,
    create_batch,
    erase_batch,
    get_batch,
    get_batch_results,
)

# isort: split
from api_gateway.jobs._cancel_count import COUNT_RETAKE_SECONDS, stop_retakes

__all__ = [
    "BUSY",
    "COUNT_RETAKE_SECONDS",
    "IdemKey",
    "batch_out",
    "cancel_batch",
    "create_batch",
    "create_search",
    "erase_batch",
    "erase_search",
    "get_batch",
    "get_batch_results",
    "get_ingestion",
    "get_search",
    "ingest_out",
    "router",
    "stop_retakes",
    "submit_write",
    "upsert_documents",
]

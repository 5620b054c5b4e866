"""An economy item's end: the pipeline's second half and its final status, the failure policy
for items that could not be sent or polled, or a cancel; and the batch's completion with its
last item."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from worker.constants import ECONOMY_RUNS_KEY
from worker.contract import ErrorInfo, JobStatus
from worker.core.pipeline import Prepared, RerankRun, SearchPipeline, as_stored, load_prepared
from worker.errors import BackendError, IndexNotFound, RerankAttemptError, RerankFailed
from worker.observability import metrics
from worker.queue.base import SiftTask, count_completed, error_info
from worker.queue.economy.records import economy_pipeline, rerank_run, running_items
from worker.queue.jobstore import BatchJob, ItemTransition

log = logging.getLogger(__name__)


def _item_done(task: SiftTask, batch: BatchJob, transition: ItemTransition) -> None:
    if transition.batch_completed:
        store = task.context.store
        store.economy_delete(batch.id)
        done = store.get_batch(batch.id)
        log.info("batch %s: completed", batch.id)
        status = done.status.value if done else JobStatus.SUCCEEDED.value
        metrics.job_completed("batch", status)  # once: only one transition completes it
        task.announce_batch(batch, status)


def cancel_item(
    task: SiftTask, batch: BatchJob, query_id: str, record: dict[str, Any] | None = None
) -> None:
    """Cancel one item. ``record`` is its run (None: read here): what its earlier rounds
    were billed goes on the canceled item's record, as the counters counted it."""
    store = task.context.store
    if record is None:
        raw = store.economy_get(batch.id, ECONOMY_RUNS_KEY, [query_id])[0]
        record = json.loads(raw) if raw else None
    usage = rerank_run(record).job_usage() if record and record["attempts"] else None
    transition = store.cancel_item(batch.id, query_id, usage=usage)
    if transition.applied:
        metrics.job_completed("batch_item", "canceled")
    _item_done(task, batch, transition)


def finish_item(
    task: SiftTask,
    batch: BatchJob,
    query_id: str,
    prepared: Prepared,
    run: RerankRun,
    *,
    figures: Sequence[Callable[[], None]] = (),
    must_end: bool = False,
) -> None:
    """The pipeline's second half for one item, and its final status. Its figures of the
    search (and ``figures``, the caller's of the item) are counted once the item is saved: a
    poll dying before that leaves them to the poll finishing it again, once. The backend
    failing the read of its candidates raises (the poll is sent again), unless the item
    ``must_end`` (its failure policy applied after the poll gave up, nothing left to run it
    again): it then ends failed with that error, its billed usage shown."""
    pipeline = economy_pipeline(task)
    error: ErrorInfo | None = None
    later = list(figures)
    try:
        result = pipeline.finish(as_stored_now(pipeline, batch, prepared), run, later=later)
    except RerankFailed as exc:
        error, result = error_info(exc), None
    except (IndexNotFound, BackendError) as exc:  # its calls billed all the same
        if isinstance(exc, BackendError) and not must_end:
            raise
        exc.job_usage = run.job_usage()
        error, result = error_info(exc), None
    transition = task.context.store.finish_item(batch.id, query_id, result=result, error=error)
    if count_completed("batch_item", transition.applied, error):
        for record in later:
            record()
    _item_done(task, batch, transition)


def as_stored_now(pipeline: SearchPipeline, batch: BatchJob, prepared: Prepared) -> Prepared:
    """The item's candidates as its index holds them now (:func:`as_stored`), one read of
    their ids: they were kept when it was prepared, and a delete or an upsert finished since
    (while its provider batch ran, hours at most) must show in its hits. Raises
    :class:`IndexNotFound` when the tenant's index is gone (dropped, or emptied), as a search
    on it would."""
    if not prepared.candidates:
        return prepared
    backend = pipeline.backend
    index, ids = prepared.spec.index, [c.document.id for c in prepared.candidates]
    stored = backend.stored_documents(index, batch.tenant, ids)
    if not stored and not backend.channels(index, batch.tenant):
        raise IndexNotFound(index)
    return as_stored(prepared, stored)


def fail_items(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], failure: RerankAttemptError
) -> None:
    """Apply the failure policy to running items that could not be sent or polled. Each
    item's failed attempt is counted in the metrics once its failure is saved: a task killed
    between the two, run again, fails the item again, and counted first, it counted the
    attempt twice (and once for an item another run had finished meanwhile)."""
    pipeline = economy_pipeline(task)
    for qid, data, record in running_items(task, batch, query_ids):
        run = rerank_run(record)
        model = record.get("model")  # the model its request went to, if it was sent
        cost = pipeline.add_attempt(
            run, failure.outcome, None, 0.0, model=model, provider_error=True
        )
        run.failure = failure
        counted = partial(pipeline.count_attempt, failure.outcome, None, cost, model)
        prepared = load_prepared(pipeline, data)
        if model:
            prepared.trace["model"] = model
        finish_item(task, batch, qid, prepared, run, figures=[counted], must_end=True)

"""An economy item's end: the pipeline's second half and its final status, the failure policy
for items that could not be sent or polled, or a cancel; and the batch's completion with its
last item."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from functools import partial
from itertools import islice
from typing import Any

from worker import clock
from worker.constants import ECONOMY_RUNS_KEY
from worker.contract import ErrorInfo, JobStatus
from worker.core.catalog import StoredDocument
from worker.core.pipeline import Prepared, RerankRun, as_stored, load_prepared
from worker.core.ports import SearchBackend
from worker.errors import BackendError, IndexNotFound, RerankAttemptError, RerankFailed, SiftError
from worker.observability import metrics
from worker.queue.base import SiftTask, count_completed, error_info
from worker.queue.economy.records import (
    PAGE,
    as_sent,
    backed_off,
    economy_pipeline,
    out_for,
    rerank_run,
    running_items,
)
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


def fail_unsent(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], failure: SiftError
) -> None:
    """End these running items, whose prompts this submission was to send, ``failed`` with
    ``failure`` (the tenant removed): no call of theirs is made, so no failure policy applies
    (a ``fail_open`` fallback would serve a tenant that no longer exists); what earlier
    rounds were billed goes on the failed item's record, as :func:`cancel_item` does."""
    store = task.context.store
    for qid, _, record in running_items(task, batch, query_ids):
        error = error_info(failure)
        if record["attempts"]:
            error = error.model_copy(update={"usage": rerank_run(record).job_usage()})
        transition = store.finish_item(batch.id, qid, error=error)
        count_completed("batch_item", transition.applied, error)
        _item_done(task, batch, transition)


def finish_item(
    task: SiftTask,
    batch: BatchJob,
    query_id: str,
    prepared: Prepared,
    run: RerankRun,
    *,
    now: Prepared | SiftError,
    figures: Sequence[Callable[[], None]] = (),
    must_end: bool = False,
    without_model: bool = False,
) -> None:
    """The pipeline's second half for one item, and its final status. ``now`` is
    ``prepared`` on its candidates as stored now (:func:`as_stored_now`), or what that read
    met: the index gone (the item ends ``index_not_found``, its billed usage shown) or the
    backend failing. The latter raises (the poll is sent again), unless the item
    ``must_end`` (its failure policy applied after the poll gave up, nothing left to run it
    again): it then ends failed with that error, its billed usage shown. Its figures of the
    search (and ``figures``, the caller's of the item) are counted once the item is saved,
    finished or not (:meth:`SearchPipeline.unfinished`): a poll dying before that leaves
    them to the poll finishing it again, once. ``without_model``: the item was never sent,
    and this worker has no model to send it: the failure policy as such a worker answers
    (:meth:`SearchPipeline.finish_without_model`), ``run`` only what earlier rounds billed,
    and no model answer to count."""
    pipeline = economy_pipeline(task)
    error: ErrorInfo | None = None
    result = None
    later = list(figures)
    if isinstance(now, Prepared):
        try:
            if without_model:
                result = pipeline.finish_without_model(now, run, later=later)
            else:
                result = pipeline.finish(now, run, later=later)
        except RerankFailed as exc:
            error = error_info(exc)
    elif isinstance(now, BackendError) and not must_end:
        raise now
    else:  # its calls billed all the same, and counted as a search failing after them
        billed = run.job_usage() if run.attempts else None
        error = error_info(now).model_copy(update={"usage": billed})
        pipeline.unfinished(prepared, None if without_model else run, later=later)
    transition = task.context.store.finish_item(batch.id, query_id, result=result, error=error)
    if count_completed("batch_item", transition.applied, error):
        for record in later:
            record()
    _item_done(task, batch, transition)


#: Ids per read of stored documents: a page of 500 items of 50 candidates each, all on one
#: index, is 25 reads at most (fewer as their candidates overlap), each an ``_mget`` of
#: 1,000 documents on Elasticsearch (their texts, never their vectors).
STORED_READ_IDS = 1_000


def as_stored_now(
    backend: SearchBackend, tenant: str, items: Sequence[Prepared]
) -> list[Prepared | SiftError]:
    """Each item on its candidates as its index holds them now (:func:`as_stored`): they
    were kept when it was prepared, and a delete or an upsert finished since (while its
    provider batch ran, hours at most) must show in its hits. The candidates of all the
    items on one index are read together, :data:`STORED_READ_IDS` ids at a time: read item
    by item, a provider batch of 100,000 items was 100,000 calls to the backend in its poll.
    An item whose index is gone (dropped, or emptied) is :class:`IndexNotFound`, as a
    search on it would be; the items of an index whose read failed, its
    :class:`BackendError`."""
    now: list[Prepared | SiftError] = list(items)
    by_index: dict[str, list[int]] = {}
    for n, item in enumerate(items):
        if item.candidates:  # none: nothing to read, nothing gone
            by_index.setdefault(item.spec.index, []).append(n)
    for index, members in by_index.items():
        try:
            stored = _stored(backend, index, tenant, [items[n] for n in members])
        except BackendError as exc:
            for n in members:
                now[n] = exc
            continue
        for n in members:
            now[n] = (
                IndexNotFound(index)
                if stored is None
                else as_stored(items[n], stored, backend.holds_filters)
            )
    return now


def _stored(
    backend: SearchBackend, index: str, tenant: str, items: Sequence[Prepared]
) -> dict[str, StoredDocument] | None:
    """The items' candidates as ``index`` holds them now, by id; None if the tenant's index
    is gone (it holds none of them, nor any other document)."""
    ids = list(dict.fromkeys(c.document.id for item in items for c in item.candidates))
    stored: dict[str, StoredDocument] = {}
    for start in range(0, len(ids), STORED_READ_IDS):
        stored.update(backend.stored_documents(index, tenant, ids[start : start + STORED_READ_IDS]))
    # none of them stored: the index gone, or only they deleted. Asked of the store, not
    # of :meth:`channels`, which Elasticsearch answers from a memo kept for a minute.
    if not stored and not backend.holds(index, tenant):
        return None
    return stored


#: How :func:`_end_items` ends one running item, given its run record: the run it is
#: finished on (what its rounds billed, and the failure that ends it) and the figures of
#: that failure, counted once the item is saved (:func:`finish_item`).
Ending = Callable[[dict[str, Any]], tuple[RerankRun, list[Callable[[], None]]]]


def _end_items(
    task: SiftTask,
    batch: BatchJob,
    query_ids: Sequence[str],
    ending: Ending,
    *,
    without_model: bool = False,
    unread: BackendError | None = None,
) -> None:
    """End these running items, each by ``ending`` and :func:`finish_item` (``must_end``:
    nothing is left to run them again; ``without_model`` as it takes it), a page at a time,
    their candidates read together (:func:`as_stored_now`), or not read (``unread``: the
    backend's failure they end with). The lane's ways of ending the items it gave up on
    (:func:`fail_items`, :func:`end_without_model`, :func:`end_unread`) differ in their
    ending alone: each item is saved and counted (its metrics, its batch's counts, its
    usage, the webhook with the batch's last item) as a result mapped to it would be."""
    pipeline = economy_pipeline(task)
    items = running_items(task, batch, query_ids)
    while page := list(islice(items, PAGE)):
        ended = []
        for qid, data, record in page:
            run, figures = ending(record)
            ended.append((qid, as_sent(load_prepared(pipeline, data), record), run, figures))
        sent = [item for _, item, _, _ in ended]
        stored: list[Prepared | SiftError] = (
            as_stored_now(pipeline.backend, batch.tenant, sent)
            if unread is None
            else [unread] * len(sent)
        )
        for (qid, prepared, run, figures), now in zip(ended, stored, strict=True):
            finish_item(task, batch, qid, prepared, run, now=now, figures=figures, must_end=True,
                        without_model=without_model)  # fmt: skip


def fail_items(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], failure: RerankAttemptError
) -> None:
    """Apply the failure policy to running items that could not be sent or polled
    (:func:`_end_items`): each item's run gets the failed attempt, its ``seconds`` the time
    its request was out till the failure (:func:`out_for`), and the run's (the trace's
    ``rerank_seconds``) its first send till then, as a mapped result's run; both were 0.
    That attempt is counted in the metrics once its failure is saved: a task killed between
    the two, run again, fails the item again, and counted first, it counted the attempt
    twice (and once for an item another run had finished meanwhile)."""
    pipeline = economy_pipeline(task)

    def failed(record: dict[str, Any]) -> tuple[RerankRun, list[Callable[[], None]]]:
        run, now = rerank_run(record), clock.now()
        model = record.get("model")  # the model its request went to, if it was sent
        cost = pipeline.add_attempt(
            run,
            failure.outcome,
            None,
            out_for(record, now),
            model=model,
            provider_error=True,
            backoff_wait_seconds=backed_off(record, now),
        )
        run.failure = failure
        # its first send to its failure, as a mapped result's run is to its result
        run.seconds = now - float(record["first_submitted_at"] or now)
        return run, [partial(pipeline.count_attempt, failure.outcome, None, cost, model)]

    _end_items(task, batch, query_ids, failed)


def end_unread(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], error: BackendError
) -> None:
    """End these running items, answered by the provider, whose candidates the backend
    failed to read until their poll gave up: ``failed`` with the backend's ``error``, their
    billed usage shown (:func:`finish_item`'s ``must_end``). The poll, sent again at its
    cadence, would keep a backend failing for good (a request it refuses) from ever ending
    them."""
    _end_items(task, batch, query_ids, lambda record: (rerank_run(record), []), unread=error)


def end_without_model(task: SiftTask, batch: BatchJob, query_ids: Sequence[str]) -> None:
    """End these running items, never sent to the provider, on a worker with no generation
    model once the economy deadline has passed: the failure policy, as the standard lane
    answers a rerank asked of such a worker (:meth:`SearchPipeline.finish_without_model`:
    ``rerank_failed`` naming ``no_generation_model`` under ``fail_closed``, the fused order
    under ``fail_open``), on their candidates as stored now (:func:`as_stored_now`: an index
    gone ends its items ``index_not_found``, a backend failing, with its error, as
    :func:`fail_items` ends them past the deadline). :func:`fail_items`' ending cannot serve:
    it prices a failed call, which needs the model, and no call was made; the loop is the
    same (:func:`_end_items`). Without this, a pool with no worker of the model left kept
    such a batch ``running`` for ever, its submission asked again at the poll's cadence."""
    _end_items(task, batch, query_ids, lambda record: (rerank_run(record), []),
               without_model=True)  # fmt: skip

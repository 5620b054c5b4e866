"""Deleting an erased batch's provider batches (``sift.economy_delete``).

Why. The provider keeps a Message Batch's requests and results (the queries, the candidates'
text, the model's answers) for 29 days after it was created; an erase
(``DELETE /v1/batches/{id}/results``) that left them there deleted only Sift's copy. The
erase's script keeps the ids of the provider batches Sift made and recorded
(``sift:eco-delete:<batch>``: never a create in doubt's candidates, each of which may be
another client's, but those its results proved ours) and writes this task's message with
them; the task deletes each at the provider and drops it from the set, until none is left.

The provider deletes an ended batch only. The Sift batch has finished (an erase asks it),
so each of its provider batches has ended, or is canceling (a canceled Sift batch's), or
still processing (its items failed by the economy deadline, say): such a one is canceled,
and asked again later. A 404 is done (deleted already, or expired). A transient failure
(429, 5xx, a timeout) is asked again later too, at the poll's cadence, for as long as the set
lives (the erasure mark's retention, ``SIFT_RESULT_RETENTION_SECONDS``). A delete refused for
the key (401: not valid; 403: not allowed to) is not: no retry changes that answer, and it was
asked again every poll, an ERROR logged each time, for the whole retention. It is logged once
at ERROR, naming the batch and the provider batch (left at the provider for its 29 days: to
delete by hand), counted (``sift_provider_batch_deletes_total{result="refused"}``) and dropped
from the set.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery import shared_task

from worker.constants import ECONOMY_DELETE_TASK
from worker.errors import RerankAttemptError
from worker.observability import metrics
from worker.queue.base import SiftTask
from worker.queue.economy.ids import submission_of
from worker.queue.economy.records import batches_client
from worker.queue.economy.watch import poll_countdown

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches

log = logging.getLogger(__name__)

#: The provider's answers to a delete that no retry changes: the key is not valid (401), or
#: may not delete the batch (403).
KEY_REFUSALS = frozenset({401, 403})


def refused_for_good(exc: RerankAttemptError) -> bool:
    """Whether the provider refused the call for the key, which no retry changes."""
    return exc.status in KEY_REFUSALS


def delete_provider_batch(client: AnthropicMessageBatches, provider_id: str) -> float | None:
    """Delete one provider batch: None once it is gone (deleted now, or there was none),
    else how long the provider asked to wait before the next try (0: no word). One not ended
    is canceled first (a delete of it is refused): its lines are of no use to a batch
    erased. Raises the :class:`RerankAttemptError` of a refusal no retry changes
    (:func:`refused_for_good`)."""
    try:
        if client.delete(provider_id):
            log.info("provider batch %s: deleted", provider_id)
        return None
    except RerankAttemptError as exc:
        if exc.retryable:
            log.warning("provider batch %s: delete failed, retrying: %s", provider_id, exc)
            return exc.retry_after or 0.0
        if refused_for_good(exc):
            raise
        refused = exc
    try:
        batch = client.retrieve(provider_id)
        if batch.processing_status == "in_progress":
            client.cancel(provider_id)
    except RerankAttemptError as exc:
        if refused_for_good(exc):
            raise
        log.warning("provider batch %s: delete refused (%s), then %s", provider_id, refused, exc)
        return exc.retry_after or 0.0
    if batch.ended:  # refused for another reason than its status: said, and tried again
        log.error("provider batch %s: delete refused: %s", provider_id, refused)
    return 0.0


def judge_candidate(
    client: AnthropicMessageBatches, provider_id: str, submission: str
) -> bool | None:
    """Whether a create in doubt's candidate is Sift's, by its results as a poll judges it
    (:func:`~worker.queue.economy.results.map_results`): True once it ended with a line whose
    ``custom_id`` names ``submission``, False once it ended with none, or when the provider
    has no batch by that id (deleted or expired: nothing of it to delete), None while it
    runs (only its results tell, and it is never canceled: it may be another client's).
    Raises the :class:`RerankAttemptError` of a read that failed."""
    try:
        batch = client.retrieve(provider_id)
    except RerankAttemptError as exc:
        if exc.status == 404:
            return False
        raise
    if not batch.ended:
        return None
    return any(submission_of(line.custom_id) == submission for line in client.results(provider_id))


@shared_task(  # type: ignore[untyped-decorator]
    name=ECONOMY_DELETE_TASK, base=SiftTask, bind=True, max_retries=None
)
def economy_delete(self: SiftTask, batch_id: str) -> None:
    """:func:`delete_erased` of ``batch_id``."""
    delete_erased(self, batch_id)


def delete_erased(task: SiftTask, batch_id: str) -> None:
    """Judge the erased batch ``batch_id``'s candidates kept aside, then delete its provider
    batches still kept for it, those judged ours with them; those not judged or deleted yet
    are tried again later (this message, retried), each judged or deleted one dropped."""
    store = task.context.store
    candidates = store.provider_candidates(batch_id)
    if not candidates and not store.provider_deletions(batch_id):
        return
    try:
        client = batches_client(task)
    except RerankAttemptError as exc:
        log.error("batch %s: provider batches %s not deleted: %s", batch_id,
                  store.provider_deletions(batch_id) + list(candidates), exc)  # fmt: skip
        return
    waits = [
        w
        for w in (_judged(task, client, batch_id, *c) for c in candidates.items())
        if w is not None
    ]
    for provider_id in store.provider_deletions(batch_id):
        try:
            wait = delete_provider_batch(client, provider_id)
        except RerankAttemptError as exc:  # for good: asked again, it answers the same
            log.error("batch %s: provider batch %s not deleted, and not asked again: the "
                      "provider refused its key (%s); it keeps the batch's requests and "
                      "results for 29 days unless deleted there by hand",
                      batch_id, provider_id, exc)  # fmt: skip
            store.provider_deleted(batch_id, provider_id)
            metrics.provider_batch_delete("refused")
            continue
        if wait is None:
            store.provider_deleted(batch_id, provider_id)
            metrics.provider_batch_delete("deleted")
        else:
            waits.append(wait)
    if waits:
        log.info("batch %s: %d provider batches left to judge or delete", batch_id, len(waits))
        raise task.retry(countdown=max(poll_countdown(task), *waits))


def _judged(
    task: SiftTask,
    client: AnthropicMessageBatches,
    batch_id: str,
    provider_id: str,
    submission: str,
) -> float | None:
    """Judge one candidate kept aside (:func:`judge_candidate`): ours, it is kept to delete;
    another client's, dropped. Answers None once judged, else how long the provider asked to
    wait before the next try (0: no word)."""
    store = task.context.store
    try:
        ours = judge_candidate(client, provider_id, submission)
    except RerankAttemptError as exc:
        if refused_for_good(exc):
            log.error("batch %s: candidate %s not judged, and not asked again: the provider "
                      "refused its key (%s); if it is Sift's, it keeps the batch's requests and "
                      "results for 29 days unless deleted there by hand",
                      batch_id, provider_id, exc)  # fmt: skip
            store.candidate_judged(batch_id, provider_id, ours=False)
            metrics.provider_batch_delete("refused")
            return None
        log.warning("provider batch %s: not judged yet (%s); asked again", provider_id, exc)
        return exc.retry_after or 0.0
    if ours is None:
        return 0.0
    store.candidate_judged(batch_id, provider_id, ours=ours)
    log.info("batch %s: candidate %s %s", batch_id, provider_id,
             "is ours: deleted with the rest" if ours else "is another client's: left")  # fmt: skip
    return None

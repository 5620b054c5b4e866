"""Polling one provider batch until it ended (``sift.economy_poll``), with backoff, then
mapping its results (:mod:`worker.queue.economy.results`); past the economy deadline and the
provider's own 24 hours, the failure policy for what is left."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from worker import clock
from worker.constants import ECONOMY_POLL_TASK
from worker.errors import BackendError, RerankAttemptError
from worker.queue.base import SiftTask
from worker.queue.economy.cancel import cancel_quietly
from worker.queue.economy.finish import end_unread, fail_items
from worker.queue.economy.leases import expect, leased
from worker.queue.economy.records import (
    DOUBT,
    items_waiting,
    provider_record,
    save_provider_record,
)
from worker.queue.economy.results import candidate_ended, map_results
from worker.queue.economy.watch import (
    batches_client,
    message_taken,
    poll_countdown,
    retry_countdown,
)
from worker.queue.jobstore import BatchJob, JobStore

log = logging.getLogger(__name__)


# Past the economy deadline plus the provider's own 24 h, a poll that still cannot reach the
# provider gives up and applies the failure policy to what is left.
PROVIDER_EXPIRY_SECONDS = 24 * 3600.0

# The calls that read a provider batch (a failed create of a resubmission is no such read)
READS = frozenset({"retrieve", "results"})

# A candidate of a create in doubt whose every read failed (a status error, not an outage)
# for this long is another client's batch its owner deleted: its items are sent again. An
# hour is far past the minutes a new batch may answer 404 for, well inside the deadline.
CANDIDATE_UNREAD_SECONDS = 3600.0


def polled_again(exc: RerankAttemptError) -> bool:
    """Whether a poll that failed with ``exc`` is tried again, until it gives up: a retryable
    failure, or any failure reading the provider batch (its retrieve, its results). The
    provider runs the batch on, and bills it, whatever one read answered; its results stay
    29 days. A status error there (the API answers 404 for a while after a create:
    anthropics/anthropic-sdk-python#1432; a 401 while a key is rotated; the SDK's error on a
    missing ``results_url``) failed every item waiting on a batch Sift had recorded, with
    no usage, and judged a candidate of a create in doubt another client's, its requests
    sent and billed a second time. A candidate is judged by its results lines alone."""
    return exc.retryable or exc.call in READS


@shared_task(  # type: ignore[untyped-decorator]
    name=ECONOMY_POLL_TASK, base=SiftTask, bind=True, max_retries=None
)
def economy_poll(self: SiftTask, batch_id: str, provider_id: str) -> None:
    """Poll one provider batch until it ended, then map its results to the batch's items
    (:func:`_poll`), as the one run of that poll under way (:func:`leased`)."""
    leased(self, batch_id, provider_id, lambda: _poll(self, batch_id, provider_id))


def _poll(self: SiftTask, batch_id: str, provider_id: str) -> None:
    """Poll one provider batch until it ended, then map its results to the batch's items."""
    store, settings = self.context.store, self.context.settings
    batch = store.get_batch(batch_id)
    if batch is None or batch.finished_at is not None:
        store.economy_met(batch_id, provider_id)
    if batch is None or not message_taken(self, batch_id, provider_id):
        return
    if batch.finished_at is not None:
        if self.delivery() > 1 and store.webhook_unattempted(batch_id):
            # a redelivered poll of a finished batch: the worker whose mapping completed it
            # may have died before enqueueing its webhook: sent again (the same webhook-id)
            log.info("batch %s: completed (webhook sent again)", batch_id)
            self.announce_batch(batch, batch.status.value)
        # every item is final: nothing the provider batch holds would count. Polled on, a
        # provider batch Sift may not cancel (a candidate of a create in doubt, maybe
        # another client's) would be retrieved every 10 minutes for up to 24 hours.
        return
    client = batches_client(self, batch_id, provider_id)
    record = provider_record(store, batch_id, provider_id)
    # past this, a failing read (the provider's, or the backend's of the candidates) ends it
    give_up = batch.created_at + settings.economy_deadline_seconds + PROVIDER_EXPIRY_SECONDS
    expect(self, batch_id, provider_id, 0.0)
    try:
        status = client.retrieve(provider_id)
        if record.pop("unread_since", None) is not None:  # read again: the hour starts anew
            save_provider_record(store, batch_id, provider_id, record)
        if not status.ended:
            # a candidate of a create in doubt may be another client's: never canceled
            ours = not record.get("doubt")
            if batch.canceled_at is not None and status.processing_status == "in_progress" and ours:
                # a refused cancel (the batch ended meanwhile, say) is no failure of its
                # items: the next poll sees it ended, or asks again
                cancel_quietly(store, batch_id, client, provider_id)
            expect(self, batch_id, provider_id, poll_countdown(self))
            raise self.retry(countdown=poll_countdown(self))
        map_results(self, batch, provider_id, status.shared_ended_at)
        store.economy_met(batch_id, provider_id)
    except BackendError as exc:  # an item's candidates unread: those finished stay finished
        if clock.now() < give_up:
            log.warning("provider batch %s: %s; mapping its results again", provider_id, exc)
            expect(self, batch_id, provider_id, poll_countdown(self))
            raise self.retry(countdown=poll_countdown(self)) from exc
        log.error("provider batch %s: giving up mapping its results: %s", provider_id, exc)
        store.economy_met(batch_id, provider_id)
        end_unread(
            self, batch, items_waiting(store, batch_id, provider_id, record.get("submission")), exc
        )
    except RerankAttemptError as exc:
        if record.get("doubt") and not exc.retryable:
            give_up = min(give_up, _unread_since(store, batch_id, provider_id, record)
                          + CANDIDATE_UNREAD_SECONDS)  # fmt: skip
        if polled_again(exc) and clock.now() < give_up:
            log.warning("provider batch %s: %s; polling again", provider_id, exc)
            # a retry-after honoured, a read's or a resubmission's create's, as the submission's
            countdown = retry_countdown(self, exc)
            expect(self, batch_id, provider_id, countdown)
            raise self.retry(countdown=countdown) from exc
        log.error("provider batch %s: giving up: %s", provider_id, exc)
        store.economy_met(batch_id, provider_id)
        if record.get("doubt") and exc.call in READS:  # unread: as if another client's
            _resend_after_candidate(self, batch, provider_id, give_up)
            return
        # a create failed (a resubmission's, or the resend after a candidate the mapping
        # judged): its items, and a create in doubt's, fail. A candidate judged again here
        # had its resend sent a second time, refused as the first was.
        mine = items_waiting(store, batch_id, provider_id, record.get("submission"))
        fail_items(self, batch, mine, exc)


def _unread_since(
    store: JobStore, batch_id: str, provider_id: str, record: dict[str, Any]
) -> float:
    """Since when every read of a candidate has failed with a status error (now, at the first
    one; a successful retrieve clears it)."""
    if record.get("unread_since") is None:
        record["unread_since"] = clock.now()
        save_provider_record(store, batch_id, provider_id, record)
    return float(record["unread_since"])


def _resend_after_candidate(
    task: SiftTask, batch: BatchJob, provider_id: str, give_up: float
) -> None:
    """A candidate that cannot be polled any more (its poll gave up) is judged not Sift's
    (:func:`candidate_ended`).
    Should that resend of its items fail, it is retried as any failed create is (this poll
    again: the candidate is kept as ended, so only the resend is), else the items take their
    failure policy. The error never escapes the task: its watch is met by then, so nothing
    would run it again, and the items would wait forever."""
    try:
        candidate_ended(task, batch, provider_id, proven=False)
    except RerankAttemptError as exc:
        if exc.retryable and clock.now() < give_up:
            log.warning("batch %s: resending after candidate %s failed, retrying: %s",
                        batch.id, provider_id, exc)  # fmt: skip
            countdown = retry_countdown(task, exc)
            expect(task, batch.id, provider_id, countdown)
            raise task.retry(countdown=countdown) from exc
        submission = provider_record(task.context.store, batch.id, provider_id).get("submission")
        waiting = items_waiting(task.context.store, batch.id, DOUBT + str(submission), None)
        fail_items(task, batch, waiting, exc)

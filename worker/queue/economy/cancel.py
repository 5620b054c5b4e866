"""Canceling a Sift batch's provider batches (``sift.economy_cancel``), and the items waiting
on a create in doubt."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from celery import shared_task

from worker.constants import (
    ECONOMY_CANCEL_SENT_MARK,
    ECONOMY_CANCEL_TASK,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RUNS_KEY,
    ECONOMY_STATE_KEY,
)
from worker.errors import RerankAttemptError
from worker.queue.base import SiftTask
from worker.queue.economy.finish import cancel_item
from worker.queue.economy.records import DOUBT
from worker.queue.economy.watch import SUBMIT_CLAIM, batches_client, send_anew

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches
    from worker.queue.jobstore import JobStore

log = logging.getLogger(__name__)

# A provider batch Sift canceled is polled again this soon: its lines end the items once
# mapped, and the poll's chain may otherwise be minutes from its next turn (up to
# SIFT_ECONOMY_POLL_MAX_SECONDS). Still canceling then, the new chain polls at its cadence.
CANCELED_POLL_SECONDS = 5.0


def cancel_quietly(
    store: JobStore, batch_id: str, client: AnthropicMessageBatches, provider_id: str
) -> bool:
    """Ask the provider to cancel a canceled Sift batch's provider batch; if it had not ended
    when the cancel reached it, write that down (:func:`cancel_sent`). Answers whether the
    provider answered the cancel (it ends the batch, now or soon). A refused cancel is
    logged, never an error."""
    try:
        answer = client.cancel(provider_id)
    except RerankAttemptError as exc:
        log.warning("provider batch %s: cancel failed (%s); the poll will retry", provider_id, exc)
        return False
    if not answer.ended:  # ended before this cancel came (outside Sift, say): not the user's
        mark = {ECONOMY_CANCEL_SENT_MARK + provider_id: "1"}
        store.economy_save(batch_id, ECONOMY_STATE_KEY, mark)
    return True


def open_provider_batches(store: JobStore, batch_id: str) -> list[str]:
    """The batch's provider batches Sift would cancel: those not ended, and its own (a
    create in doubt's candidates are never canceled: each may be another client's)."""
    providers = store.economy_all(batch_id, ECONOMY_PROVIDERS_KEY)
    return [
        provider_id
        for provider_id, raw in providers.items()
        if (record := json.loads(raw)).get("ended_at") is None and not record.get("doubt")
    ]


def creates_in_doubt(
    store: JobStore, batch_id: str
) -> tuple[list[str], dict[str, tuple[float, int]]]:
    """What a purge of the batch cannot cancel of its creates whose answer was lost: the
    candidates not ended of those looked for (:func:`~worker.queue.economy.doubts.settle_doubts`;
    each may be another client's), and, by submission, when each create not looked for yet
    was made and of how many requests (the provider batch it made, if any, is known to no
    one: its answer never came). Read before the batch's economy state is deleted, so that
    they can be named."""
    providers = {
        provider_id: json.loads(raw)
        for provider_id, raw in store.economy_all(batch_id, ECONOMY_PROVIDERS_KEY).items()
    }
    candidates = [
        provider_id
        for provider_id, record in providers.items()
        if record.get("doubt") and record.get("ended_at") is None
    ]
    known = {record.get("submission") for record in providers.values()}
    unsought: dict[str, tuple[float, int]] = {}
    for raw in store.economy_all(batch_id, ECONOMY_RUNS_KEY).values():
        pending = json.loads(raw).get("pending")
        if pending and pending["submission"] not in known:
            unsought[pending["submission"]] = (float(pending["at"]), int(pending["requests"]))
    return candidates, unsought


def cancel_sent(store: JobStore, batch_id: str, provider_id: str) -> bool:
    """Whether Sift's cancel of ``provider_id`` reached it before it ended, so the user's
    cancel came before its end: known without setting the gateway's clock (``canceled_at``)
    against the provider's (``ended_at``)."""
    mark = ECONOMY_CANCEL_SENT_MARK + provider_id
    return store.economy_get(batch_id, ECONOMY_STATE_KEY, [mark])[0] is not None


@shared_task(  # type: ignore[untyped-decorator]
    name=ECONOMY_CANCEL_TASK, base=SiftTask, bind=True, max_retries=None
)
def economy_cancel(self: SiftTask, batch_id: str) -> None:
    """:func:`cancel_economy_batch` of ``batch_id``."""
    cancel_economy_batch(self, batch_id)


def cancel_economy_batch(task: SiftTask, batch_id: str) -> None:
    """Cancel a canceled Sift batch's provider batches that have not ended, and the items
    waiting on a create in doubt: its candidates are never canceled (each may be another
    client's), so no canceled line would end them; they would wait for every candidate to
    end, up to the provider's 24 hours. Should a candidate prove theirs, its lines find
    them final and count for nothing (its cost is the price of not canceling another's).

    A worker without ``SIFT_GENERATION_MODEL`` (rerank turned off since the batch ran) asks
    again at the poll's cadence, for as long as the batch's provider batches are recorded: a
    worker with it takes a later try. The task failed there before, its message acked, and
    the provider batches ran on to their end, billed."""
    store = task.context.store
    if store.economy_waiting(batch_id, SUBMIT_CLAIM):
        # a submission waiting to try its create again (a provider outage, the processing
        # queue full) runs now and cancels the items it has still to send: its retry came up
        # to SIFT_ECONOMY_POLL_MAX_SECONDS later, the canceled batch running until then
        send_anew(task, batch_id, SUBMIT_CLAIM, 0.0)
    if not store.economy_fields(batch_id, ECONOMY_PROVIDERS_KEY):
        return
    client = batches_client(task, batch_id)
    for provider_id in open_provider_batches(store, batch_id):
        if cancel_quietly(store, batch_id, client, provider_id):
            send_anew(task, batch_id, provider_id, CANCELED_POLL_SECONDS)
        log.info("batch %s: provider batch %s canceled", batch_id, provider_id)
    batch = store.get_batch(batch_id)
    if batch is None:
        return
    for qid, raw in store.economy_all(batch_id, ECONOMY_RUNS_KEY).items():
        record = json.loads(raw)
        if str(record["provider"] or "").startswith(DOUBT):
            cancel_item(task, batch, qid, record)

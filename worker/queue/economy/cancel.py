"""Canceling a Sift batch's provider batches (``sift.economy_cancel``), and the items waiting
on a create in doubt."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from celery import shared_task

from worker.constants import ECONOMY_CANCEL_TASK, ECONOMY_PROVIDERS_KEY, ECONOMY_RUNS_KEY
from worker.errors import RerankAttemptError
from worker.queue.base import SiftTask
from worker.queue.economy.finish import cancel_item
from worker.queue.economy.records import DOUBT, batches_client

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches

log = logging.getLogger(__name__)


def cancel_quietly(client: AnthropicMessageBatches, provider_id: str) -> None:
    try:
        client.cancel(provider_id)
    except RerankAttemptError as exc:
        log.warning("provider batch %s: cancel failed (%s); the poll will retry", provider_id, exc)


@shared_task(  # type: ignore[untyped-decorator]
    name=ECONOMY_CANCEL_TASK, base=SiftTask, bind=True
)
def economy_cancel(self: SiftTask, batch_id: str) -> None:
    """Cancel a canceled Sift batch's provider batches that have not ended, and the items
    waiting on a create in doubt: its candidates are never canceled (each may be another
    client's), so no canceled line would end them; they would wait for every candidate to
    end, up to the provider's 24 hours. Should a candidate prove theirs, its lines find
    them final and count for nothing (its cost is the price of not canceling another's)."""
    store = self.context.store
    providers = store.economy_all(batch_id, ECONOMY_PROVIDERS_KEY)
    if not providers:
        return
    client = batches_client(self)
    for provider_id, raw in providers.items():
        record = json.loads(raw)
        if record.get("ended_at") is None and not record.get("doubt"):  # never another's
            cancel_quietly(client, provider_id)
            log.info("batch %s: provider batch %s canceled", batch_id, provider_id)
    batch = store.get_batch(batch_id)
    if batch is None:
        return
    for qid, raw in store.economy_all(batch_id, ECONOMY_RUNS_KEY).items():
        record = json.loads(raw)
        if str(record["provider"] or "").startswith(DOUBT):
            cancel_item(self, batch, qid, record)

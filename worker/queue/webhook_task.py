"""The webhook task: one signed delivery of a finished job's event, its retries made in hops
of half the broker's visibility timeout, each one settled or recorded as due in the job store
(:mod:`worker.webhooks.delivery` signs, sends and decides the retry).
"""

from __future__ import annotations

import logging
import random
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from worker import clock
from worker.constants import BATCH_ID_PREFIX, WEBHOOK_QUEUE, WEBHOOK_TASK
from worker.observability import metrics
from worker.queue import liveness
from worker.queue.base import SiftTask, WaitHop
from worker.queue.config import visibility_timeout
from worker.queue.jobstore import BatchJob, JobStore, SearchJob, webhook_figures
from worker.redis_client import OUTAGE_SECONDS
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.webhooks.delivery import DeliveryDecision

log = logging.getLogger(__name__)

# How long a delivery is put off when this process already sends its most at once: a
# uniform wait in this range (a hop; no attempt spent), so the put-off ones spread out.
DEFER_SECONDS = (1.0, 3.0)


@shared_task(  # type: ignore[untyped-decorator]
    name=WEBHOOK_TASK, base=SiftTask, bind=True, max_retries=None
)
def webhook(self: SiftTask, event: dict[str, Any]) -> None:
    """Deliver one signed webhook; :func:`worker.webhooks.delivery.run_delivery` decides the retry.

    The event carries its attempt number and, while it waits for that attempt, when it is
    due (``due_at``). A wait is made in hops of at most half the broker's visibility timeout,
    each a message of its own, acked as the next is sent: a message held unacked past the
    timeout is put back by kombu while its worker still holds it, and the copies each made
    the attempt (the schedule's waits run to 10 hours; the timeout is about 27 minutes).

    The job's final move recorded the webhook owed; a retry records when its attempt is
    due, and a final attempt (or a drop) settles it: one still owed long past its due time
    lost its message, and the re-drive sends it again (:mod:`worker.queue.redrive`). Two
    copies of one attempt (a redelivered task sends one while the first may be on its way)
    send it once: the first to claim it in the job's record does, the other waits out that
    claim and then finds the attempt made (:meth:`JobStore.claim_webhook`).

    At most ``SIFT_WEBHOOK_DELIVERIES_PER_PROCESS`` deliveries run at once in a process,
    and at most ``SIFT_WEBHOOK_DELIVERIES_PER_TENANT`` of one tenant's, a quarter kept for
    tenants sending nothing else (:class:`worker.webhooks.shares.TenantSlots`); one due
    while they all send (or its tenant's share does, or only the kept ones are free) is put
    off a second or two by a hop, its attempt
    unspent, so slow receivers hold a few threads, never the ones searches and batch items
    need, and one tenant's never hold the other tenants' webhooks back."""
    from worker.webhooks import delivery as webhooks

    settings = self.context.settings
    # due_at is on the shared clock, whichever host wrote it: on its own clock, a host 3
    # minutes ahead held its retries back 3 minutes on every other host
    wait = float(event.get("due_at", 0.0)) - clock.now()
    if wait > 0:  # not yet due: another hop
        raise _hop(self, event, min(wait, _hop_seconds(settings)))
    data = event["data"]
    store = self.context.store
    if store.webhook_was_settled(data["id"]):  # another copy delivered it, or spent its schedule
        log.info("webhook %s: settled already; this copy is dropped", data["id"])
        return
    if store.was_erased(data["id"]):  # its tenant erased the job: it announces nothing kept
        log.info("webhook %s: the job was erased; this copy is dropped", data["id"])
        return
    slots = webhooks.delivery_slots(
        settings.webhook_deliveries_per_process, settings.webhook_deliveries_per_tenant
    )
    with slots.take(event["tenant"]) as slot:
        if not slot:  # every slot, or the tenant's share, sends, or only the kept ones are
            # free and the tenant sends already: put this one off, the same event, its
            # attempt unspent
            log.debug(
                "webhook %s: %d deliveries sending, or %d of tenant %s, or all but the %d "
                "kept; put off",
                data["id"],
                slots.limit,
                slots.per_tenant,
                event["tenant"],
                slots.reserved,
            )
            # the attempt is written down: a first message's is the retry count, which a hop bumps
            same = {**event, "attempt": _attempt_number(self, event)}
            hop = _hop(self, same, random.uniform(*DEFER_SECONDS))
            metrics.webhook_deferred(event["type"])  # sift_webhook_deferrals_total
            raise hop
        _attempt(self, event)


def _attempt(self: SiftTask, event: dict[str, Any]) -> None:
    """One attempt of a due, unsettled webhook, holding a delivery slot."""
    from worker.webhooks import delivery as webhooks

    settings = self.context.settings
    data = event["data"]
    store = self.context.store
    attempt = _attempt_number(self, event)
    # one copy per attempt sends it, whatever its task id: a redelivered search, chunk or
    # poll sends a copy while the first message may be on its way (JobStore.claim_webhook)
    claim = store.claim_webhook(
        data["id"], attempt, liveness.run_owner(), lease_seconds=_claim_seconds(settings)
    )
    if not claim.granted and not claim.wait:
        log.info("webhook %s: attempt %d made, or settled, by another copy", data["id"], attempt)
        return
    if not claim.granted:  # another copy is sending it: look again once its claim is over
        log.info("webhook %s: another copy makes attempt %d; this one waits", data["id"], attempt)
        raise _hop(self, {**event, "attempt": attempt}, min(claim.wait, _hop_seconds(settings)))
    # how late the attempt runs after it was due: the job's end, or its retry's time
    due = event.get("due_at") or datetime.fromisoformat(event["occurred_at"]).timestamp()
    metrics.observe_queue_wait(WEBHOOK_QUEUE, clock.now() - float(due))
    # the keys as the worker read them at its start (Settings.all_api_keys), not the file now
    secrets = next(
        (k.webhook_secrets() for k in settings.all_api_keys() if k.tenant == event["tenant"]), None
    )
    if secrets is None:  # the tenant was removed (its job ended ``tenant_removed``)
        log.warning(
            "webhook for %s: tenant %s has no key here (removed), so nothing can sign it; "
            "settled failed with no attempt made",
            data["id"],
            event["tenant"],
        )
        # ``failed`` after the attempts made before the removal (0 for a job that ended
        # unrun): docs/queue.md, "Where a webhook stands"
        store.webhook_settled(data["id"], "failed", attempt - 1)  # this one was not made
        return
    # the job's final figures and its end (the body's timestamp), read from its record (final
    # since the move that sent this) at the first attempt, and carried by every later one:
    # each attempt sends the same bytes, and so does a copy sent again for the same job
    if "figures" not in event:
        event = {**event, **_final_figures(store, event)}
    try:
        decision = webhooks.run_delivery(
            url=event["url"],
            event_type=event["type"],
            job_id=data["id"],
            status=data["status"],
            occurred_at=event["occurred_at"],
            attempt=attempt,
            secrets=secrets,
            settings=settings,
            figures=event["figures"],
            tenant=event["tenant"],
        )
    except SoftTimeLimitExceeded:
        decision = _cut_by_time_limit(data["id"], attempt, settings)
    # the last attempt of a spent schedule is a failure, not a retry: nothing comes after it
    failed = webhooks.DeliveryOutcome.FAILED
    metrics.webhook_delivery(failed if decision.gave_up else decision.result.outcome)
    if decision.retry_in is None:
        delivered = decision.result.outcome is webhooks.DeliveryOutcome.DELIVERED
        store.webhook_settled(data["id"], "delivered" if delivered else "failed", attempt)
        return
    later = {**event, "attempt": attempt + 1}
    later["due_at"] = clock.now() + decision.retry_in
    if not store.webhook_due(data["id"], later["due_at"], later["attempt"]):
        log.info("webhook %s: settled, or another copy makes attempt %d", data["id"], attempt + 1)
        return
    raise self.retry(args=[later], countdown=min(decision.retry_in, _hop_seconds(settings)))


def _cut_by_time_limit(job_id: str, attempt: int, settings: Settings) -> DeliveryDecision:
    """The decision on an attempt the task's soft time limit cut (``--pool prefork`` raises
    it wherever the task runs, the POST too): a timeout, retried on the schedule or given
    up, as one the attempt's cap cut. The limit outlasts the cap (worker/queue/config.py),
    so only job store writes stalled before the POST leave it so little time. Raised out
    of the task, the attempt was recorded nowhere: the webhook stayed owed and ``pending``,
    and the re-drive sent it again every visibility timeout for 7 days."""
    from worker.webhooks import delivery as webhooks

    log.warning("webhook %s: attempt %d cut by the task's soft time limit", job_id, attempt)
    cut = webhooks.DeliveryResult(
        webhooks.DeliveryOutcome.RETRY, "timeout: the task's soft time limit"
    )
    return webhooks.decide(cut, job_id=job_id, attempt=attempt, settings=settings)


def _attempt_number(self: SiftTask, event: dict[str, Any]) -> int:
    """The attempt this message makes: the event's, or for a first message (none) its retry's."""
    return int(event.get("attempt", self.request.retries + 1))


def _final_figures(store: JobStore, event: dict[str, Any]) -> dict[str, Any]:
    """The ``figures`` of the finished job ``event`` announces and its end (``occurred_at``),
    from its record; no figures (the thin body) and the event's own time when the record is
    gone (expired) or is not that tenant's."""
    job_id = event["data"]["id"]
    job: BatchJob | SearchJob | None = (
        store.get_batch(job_id) if job_id.startswith(BATCH_ID_PREFIX) else store.get_search(job_id)
    )
    if job is None or job.tenant != event["tenant"]:
        return {"figures": {}}
    final: dict[str, Any] = {"figures": webhook_figures(job)}
    if job.finished_at is not None:
        final["occurred_at"] = datetime.fromtimestamp(job.finished_at, UTC).isoformat()
    return final


def _hop(self: SiftTask, event: dict[str, Any], countdown: float) -> WaitHop:
    """``event``'s message sent again in ``countdown`` seconds, as the :class:`WaitHop` for
    the task to raise (a wait, not a retry of the work)."""
    hop = self.retry(args=[event], countdown=countdown, throw=False)
    return WaitHop(when=hop.when, is_eager=hop.is_eager, sig=hop.sig)


def _claim_seconds(settings: Settings) -> float:
    """How long a copy's claim of an attempt holds the other copies of it back, its worker
    alive: the attempt's cap, and as long as the job store rides out a Redis restart for the
    write that records how it ended. A claim whose worker died (its heartbeat gone) is
    taken over then."""
    return settings.webhook_total_timeout_seconds + OUTAGE_SECONDS


def _hop_seconds(settings: Settings) -> float:
    """The longest a webhook's message waits for its attempt: half the visibility timeout."""
    return visibility_timeout(settings) / 2

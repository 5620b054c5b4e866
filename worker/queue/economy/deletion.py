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
lives (the erasure mark's retention, ``SIFT_RESULT_RETENTION_SECONDS``), and so is one a
worker without ``SIFT_GENERATION_MODEL`` takes (rerank turned off since the batch ran): a
worker with it takes a later try. Before, that worker logged the ids and acked the message,
and nothing read the set again: the provider kept the batches for their 29 days. A delete
refused for the key (401: not valid; 403: not allowed to) is not asked again at each try: no retry
changes that answer until the key does, and it was asked every poll, an ERROR logged each
time, for the whole retention. It is logged once at ERROR, naming the batch and the provider
batch, counted (``sift_provider_batch_deletes_total{result="refused"}``) and kept aside among
the batch's refused ones (``sift:eco-delete-refused:<batch>``, for as long as it would have
been kept to delete), which a worker asks again once as it starts (:func:`ask_refused_again`):
a key is fixed by changing the workers' setting, which restarts them. A retry the key still
refuses is logged again, once, and waits for the next start, not counted again (each provider
batch's refusal counts once, so ``refused`` less the ``deleted`` that follow is what the
provider still holds); one that goes through is counted ``deleted``. Before, a refusal was
final: fixed key or not, the provider batch stayed there for its 29 days. A candidate whose
judgement the key refuses is kept aside the same way, and not counted: it may be another
client's. One task retries per batch (its chain, holding a lease in Redis): a
starting worker's task that finds it live leaves the refused ones it put back to it. A chain
whose run ends by an exception Celery does not retry gives the lease back as it ends (its
retries keep it): before, it stayed until it lapsed, and such a task left its work to a chain
that no longer existed.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
from celery import shared_task
from celery.exceptions import Reject, Retry

from worker.constants import ECONOMY_DELETE_TASK, SEARCH_QUEUE
from worker.errors import RerankAttemptError
from worker.observability import metrics
from worker.queue.base import SiftTask
from worker.queue.economy.ids import submission_of
from worker.queue.economy.watch import batches_client, no_batches_client, poll_countdown

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches
    from worker.queue.jobstore import JobStore

log = logging.getLogger(__name__)

#: The provider's answers to a delete that no retry changes: the key is not valid (401), or
#: may not delete the batch (403).
KEY_REFUSALS = frozenset({401, 403})

#: A delete chain's lease past three polls (:func:`chain_lease`): a run's provider calls, each
#: bounded by the SDK's timeout, fit in it.
CHAIN_LEASE_MARGIN_SECONDS = 120.0


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
def economy_delete(self: SiftTask, batch_id: str, refused_token: str = "") -> None:
    """:func:`delete_erased` of ``batch_id``; sent with a starting worker's ``refused_token``
    (:func:`ask_refused_again`), it asks the batch's refused deletes again first."""
    delete_erased(self, batch_id, refused_token)


def delete_erased(task: SiftTask, batch_id: str, refused_token: str = "") -> None:
    """Judge the erased batch ``batch_id``'s candidates kept aside, then delete its provider
    batches still kept for it, those judged ours with them; those not judged or deleted yet
    are tried again later (this message, retried), each judged or deleted one dropped. With
    the ``refused_token`` a starting worker sent it, its refused ones are tried again too,
    once (the task's retries do not carry the token).

    One task retries per batch (its chain: :meth:`JobStore.claim_delete_chain`). Every run
    reads the whole of the batch's sets, so a second chain would only ask the provider the
    same again at each poll: a task finding another's chain live (a starting worker's, whose
    refused ones it just put back in those sets) leaves them to it and ends. Before, each
    worker start added a chain for as long as a candidate ran (up to 24 hours)."""
    store = task.context.store
    if refused_token and (taken := store.take_refused(batch_id, refused_token)):
        log.info("batch %s: asking %d refused provider batch deletes again", batch_id, taken)
    chain = task.request.id or uuid.uuid4().hex
    candidates = store.provider_candidates(batch_id)
    if not candidates and not store.provider_deletions(batch_id):
        _go_on(task, batch_id, chain, waits=[])  # something put back since: this one asks it
        return
    if not store.claim_delete_chain(batch_id, chain, chain_lease(poll_countdown(task))):
        log.info("batch %s: its provider batches are left to the delete task already "
                 "asking them", batch_id)  # fmt: skip
        return
    try:
        _run_chain(task, batch_id, chain, candidates)
    except (Retry, Reject):  # the chain goes on in the same message: its lease is its own
        raise
    except Exception:  # acked, never retried: the chain is over, and its lease goes with it
        _let_go(store, batch_id, chain)
        raise


def _let_go(store: JobStore, batch_id: str, chain: str) -> None:
    """Give the chain ``chain``'s lease back (:meth:`JobStore.let_go_delete_chain`), as its run
    ends by an exception no retry follows. Before, the lease stayed until it lapsed (three
    polls: up to 32 minutes at the default cap), and a starting worker's task in that window
    handed the refused ones it put back to a chain that no longer existed. Never raises: the
    run's own exception is the one to see (Redis failing here, the lease lapses)."""
    try:
        store.let_go_delete_chain(batch_id, chain)
    except redis.RedisError as exc:
        log.warning("batch %s: the delete chain's lease not given back (%s): it lapses",
                    batch_id, exc)  # fmt: skip


def _run_chain(task: SiftTask, batch_id: str, chain: str, candidates: dict[str, str]) -> None:
    """The run of the chain ``chain``, which holds ``batch_id``'s lease: judge the
    ``candidates``, delete the provider batches, and go on (:func:`_go_on`) or end."""
    store = task.context.store
    if (missing := no_batches_client(task)) is not None:  # one with a model may take the retry
        waiting = store.provider_deletions(batch_id) + list(candidates)
        log.error("batch %s: provider batches %s not deleted yet, asked again later: %s",
                  batch_id, waiting, missing)  # fmt: skip
        _go_on(task, batch_id, chain, waits=[0.0], cause=missing)
        return
    client = batches_client(task, batch_id)  # not None: asked above, with the chain's retry
    waits = [
        wait
        for wait in (_judged(task, client, batch_id, *c) for c in candidates.items())
        if wait is not None
    ]
    for provider_id in store.provider_deletions(batch_id):
        try:
            wait = delete_provider_batch(client, provider_id)
        except RerankAttemptError as exc:  # until the key changes, asked again it answers the same
            log.error("batch %s: provider batch %s not deleted: the provider refused its key "
                      "(%s); asked again once when a worker starts (a fixed key restarts "
                      "them), else it keeps the batch's requests and results for 29 days "
                      "unless deleted there by hand", batch_id, provider_id, exc)  # fmt: skip
            if store.provider_refused(batch_id, provider_id):  # counted once, however
                metrics.provider_batch_delete("refused")  # many starts ask it again
            continue
        if wait is None:
            store.provider_deleted(batch_id, provider_id)
            metrics.provider_batch_delete("deleted")
        else:
            waits.append(wait)
    if waits:
        log.info("batch %s: %d provider batches left to judge or delete", batch_id, len(waits))
    _go_on(task, batch_id, chain, waits)


def chain_lease(countdown: float) -> float:
    """How long a delete chain's lease lasts past its run's start or its retry: a few polls
    (its retry comes after ``countdown``), and a margin for a run's provider calls. A chain
    whose worker died leaves it to lapse, and the next message for the batch (the old one's
    copy, redelivered, or a starting worker's) takes the chain over."""
    return 3 * countdown + CHAIN_LEASE_MARGIN_SECONDS


def _go_on(
    task: SiftTask,
    batch_id: str,
    chain: str,
    waits: list[float],
    cause: Exception | None = None,
) -> None:
    """Retry the chain ``chain`` after the poll's cadence (or what the provider asked, if
    longer) while it holds the batch's lease and has work left (:meth:`JobStore.
    end_delete_chain`), its lease renewed; else end, the lease let go."""
    countdown = max([poll_countdown(task), *waits])
    if task.context.store.end_delete_chain(
        batch_id, chain, chain_lease(countdown), waiting=bool(waits)
    ):
        # without the token: a retry asks no refused delete again
        raise task.retry(countdown=countdown, args=[batch_id], kwargs={}) from cause


def ask_refused_again(store: JobStore, send: Callable[[str, str], None]) -> int:
    """Send the delete task, with a fresh token, for each erased batch some of whose deletes
    the provider refused for the key (``send(batch id, token)``): a worker starting (with a
    fixed key, most likely) asks each again once. Two workers starting at once each send
    one; only the last token given takes the refused ones (:meth:`JobStore.take_refused`).
    Answers how many were sent."""
    sent = 0
    for batch_id in store.refused_batches():
        token = uuid.uuid4().hex
        if store.ask_refused(batch_id, token):
            send(batch_id, token)
            sent += 1
    return sent


def ask_refused_at_start(app: Any, redis_url: str, result_ttl: int) -> threading.Thread:
    """:func:`ask_refused_again` through the worker's Celery ``app``, on a thread of its own
    (a Redis slow to answer delays no start); a failure is logged, and the next start asks."""

    def run() -> None:
        from worker.queue.jobstore import JobStore

        store = JobStore.from_url(redis_url, max_connections=2, result_ttl=result_ttl)
        try:
            sent = ask_refused_again(
                store,
                lambda batch_id, token: app.send_task(
                    ECONOMY_DELETE_TASK,
                    args=[batch_id, token],
                    queue=SEARCH_QUEUE,
                    ignore_result=True,
                ),
            )
            if sent:
                log.info("asking again the refused provider batch deletes of %d erased "
                         "batches", sent)  # fmt: skip
        except Exception as exc:  # Redis or the broker unreachable: the next start asks
            log.warning("refused provider batch deletes not asked again: %s", exc)
        finally:
            store.close()

    thread = threading.Thread(target=run, name="sift-refused-deletes", daemon=True)
    thread.start()
    return thread


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
            log.error("batch %s: candidate %s not judged: the provider refused its key (%s); "
                      "asked again once when a worker starts, else, if it is Sift's, it keeps "
                      "the batch's requests and results for 29 days unless deleted there by "
                      "hand", batch_id, provider_id, exc)  # fmt: skip
            # not counted: no delete was refused, and it may be another client's
            store.provider_refused(batch_id, provider_id, submission)
            return None
        log.warning("provider batch %s: not judged yet (%s); asked again", provider_id, exc)
        return exc.retry_after or 0.0
    if ours is None:
        return 0.0
    store.candidate_judged(batch_id, provider_id, ours=ours)
    log.info("batch %s: candidate %s %s", batch_id, provider_id,
             "is ours: deleted with the rest" if ours else "is another client's: left")  # fmt: skip
    return None

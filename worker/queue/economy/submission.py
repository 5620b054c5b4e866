"""Sending a batch's prepared prompts as Message Batches (``sift.economy_submit``), chunked
under the provider's limits, each create written down before it is made."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from celery import shared_task

from worker import clock
from worker.adapters.rate_budget import BatchQueueFull
from worker.constants import (
    ECONOMY_PREPARED_KEY,
    ECONOMY_STATE_KEY,
    ECONOMY_SUBMIT_TASK,
)
from worker.core.pipeline import load_prepared
from worker.errors import AttemptOutcome, RerankAttemptError, TenantRemoved
from worker.queue.base import SiftTask
from worker.queue.economy.cancel import CANCELED_POLL_SECONDS, cancel_quietly
from worker.queue.economy.doubts import settle_doubts
from worker.queue.economy.finish import cancel_item, end_without_model, fail_items, fail_unsent
from worker.queue.economy.ids import SUBMISSION_CHARS, chunk_requests, custom_id, new_submission
from worker.queue.economy.leases import WATCH_MARGIN_SECONDS, expect, leased, upload_guard
from worker.queue.economy.records import (
    economy_pipeline,
    record_sent,
    running_items,
    save_provider_record,
    save_runs,
)
from worker.queue.economy.watch import (
    NO_CLIENT,
    SUBMIT_CLAIM,
    batches_client,
    message_taken,
    retry_countdown,
    send_anew,
    send_poll,
)
from worker.queue.jobstore import BatchJob
from worker.queue.liveness import economy_sender_alive

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches

log = logging.getLogger(__name__)


def maybe_submit(task: SiftTask, batch_id: str) -> None:
    """Enqueue the submission once every item is final or prepared (one chunk wins).

    Its watch is set before the claim: a chunk that dies between its claim and the message
    (its worker killed, Redis gone past the client's retries) leaves the claim taken, so no
    other chunk sends it, and no re-drive comes for prepared items; the watch's sweep sends
    it once overdue (:func:`rewake`). Once claimed, the watch is left as the submission
    keeps it (met once it is done: a late chunk sets none again)."""
    store = task.context.store
    if not store.economy_settled(batch_id):
        return
    if store.economy_get(batch_id, ECONOMY_STATE_KEY, [SUBMIT_CLAIM])[0] is not None:
        return  # claimed already
    store.economy_expect(batch_id, SUBMIT_CLAIM, clock.now() + WATCH_MARGIN_SECONDS)
    if store.economy_claim(batch_id, SUBMIT_CLAIM):
        send_anew(task, batch_id, SUBMIT_CLAIM, 0.0)
        log.info("batch %s: every item prepared; submission enqueued", batch_id)


@dataclass(slots=True)
class _Pending:
    query_id: str
    request: dict[str, Any]
    size: int
    run: dict[str, Any]
    policy: str  # its prompt's


def _pending(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], expected: str | None, watch: str
) -> Iterator[_Pending]:
    """The items to send now: running, and in provider batch ``expected`` (None: never sent).
    Their ``custom_id`` is set when their provider batch is made up (:func:`submit`)."""
    from worker.adapters.anthropic_batches import encode_body  # the adapter is the worker's

    pipeline, client = economy_pipeline(task), batches_client(task, batch.id, watch)
    for qid, data, run in running_items(task, batch, query_ids):
        if run["provider"] != expected or run.get("pending"):
            continue  # sent already (a redelivered task), or its create is in doubt
        item = load_prepared(pipeline, data)
        assert item.prompt is not None
        request = {
            "custom_id": custom_id(run["pos"], "x" * SUBMISSION_CHARS),  # its size, for now
            "params": client.request_params(item.prompt),
        }
        size = len(encode_body(request))  # its bytes in the create's body
        yield _Pending(qid, request, size, run, item.prompt.policy)


def _may_have_created(error: RerankAttemptError) -> bool:
    """False when the create surely made nothing: refused (4xx, 429) or never sent (the
    rate budget, the processing queue's cap). A timeout (a 408, the provider's request
    timeout, included), a cut connection or a 5xx (and a 409 or a 4xx the provider says to
    retry, counted with them) may have come after the provider made the batch."""
    return error.outcome not in (
        AttemptOutcome.HTTP_4XX,
        AttemptOutcome.RATE_LIMITED,
        AttemptOutcome.BUDGET_EXHAUSTED,
    )


def _record_provider(
    task: SiftTask, batch: BatchJob, provider_id: str, record: dict[str, Any]
) -> bool:
    """Keep a provider batch on the batch's record and start polling it. False if the
    batch's record is gone (``sift tenant purge`` erased it while the create ran): nothing
    is kept, and nothing polls it."""
    store = task.context.store
    if not save_provider_record(store, batch.id, provider_id, record):
        return False
    send_poll(task, batch, provider_id)
    return True


def _cancel_erased(client: AnthropicMessageBatches, batch_id: str, provider_id: str) -> None:
    """Cancel a provider batch made for a batch erased meanwhile (``sift tenant purge``
    read its provider batches before this one was made, then deleted every key naming
    them): nothing else knows of it, so it would run to its end, billed for a tenant that
    is gone. A cancel that fails is logged as an error naming it, for an operator to cancel
    it by hand: no record is left to retry it from."""
    try:
        client.cancel(provider_id)
    except RerankAttemptError as exc:
        log.error(
            "batch %s: erased while its create ran; its provider batch %s could not be "
            "canceled (%s): cancel it at the provider",
            batch_id,
            provider_id,
            exc,
        )
        return
    log.warning(
        "batch %s: erased while its create ran; its provider batch %s canceled",
        batch_id,
        provider_id,
    )


def _erased_in_doubt(
    batch_id: str, submission: str, started: float, requests: int, error: RerankAttemptError
) -> None:
    """A create failed for a batch erased meanwhile: one that may have made a provider batch
    (its answer lost) is logged as an error with when it was made and its size. Nothing will
    look for it (its runs are gone) and it is not canceled here: a candidate found by time
    and size may be another client's."""
    if _may_have_created(error):
        made = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
        log.error(
            "batch %s: erased while its create %s of %d requests (made at %s) ran, whose "
            "answer was lost (%s): a provider batch it may have made is not canceled",
            batch_id,
            submission,
            requests,
            made,
            error,
        )


def _send(
    task: SiftTask,
    batch: BatchJob,
    client: AnthropicMessageBatches,
    chunks: Iterator[list[_Pending]],
    watch: str,
    created: list[str],
) -> None:
    """Create a provider batch for each chunk, each id added to ``created`` as soon as it is
    made: :func:`submit` cancels them all should the batch be erased meanwhile, at whatever
    point this stops (a refused save or record, a failed create, a lease taken).

    A batch canceled meanwhile (during an earlier create) gets no create more: the items
    still to send, this chunk's and the rest's, are canceled at once, as a submission that
    finds the cancel at its start cancels them."""
    for chunk in chunks:
        expect(task, batch.id, watch, 0.0)
        current = task.context.store.get_batch(batch.id)
        if current is not None and current.canceled_at is not None:
            for p in chain(chunk, *chunks):
                cancel_item(task, current, p.query_id, p.run)
            log.info("batch %s: canceled; its items not sent yet are canceled", batch.id)
            return
        submission = new_submission()
        started = clock.now()
        for p in chunk:
            p.request["custom_id"] = custom_id(p.run["pos"], submission)
            p.run["pending"] = {"submission": submission, "at": started, "requests": len(chunk)}
            # what its answer is priced at: a worker of another model may poll it
            p.run["model"] = p.request["params"]["model"]
            # the policy its answer is labelled (records.as_sent): its prompt is this
            # release's, though an older one may have prepared it, or sent it before
            p.run["policy"] = p.policy
        if not save_runs(task, batch, ((p.query_id, p.run) for p in chunk)):
            log.info("batch %s: erased (sift tenant purge); nothing more is sent", batch.id)
            return
        try:
            guard = upload_guard(task, batch.id, watch, submission)
            provider = client.create([p.request for p in chunk], before_write=guard)
        except RerankAttemptError as exc:
            if task.context.store.get_batch(batch.id) is None:  # erased meanwhile: a purge
                _erased_in_doubt(batch.id, submission, started, len(chunk), exc)
                raise
            # a run stalled past its lease (taken over meanwhile) writes nothing more: the
            # items' runs may be the new holder's by now (sent again once the window passed)
            expect(task, batch.id, watch, 0.0)
            for p in chunk:
                if _may_have_created(exc):  # its call is over: settled at once, not waited for
                    p.run["pending"]["answered"] = True
                else:
                    p.run["pending"] = None
            save_runs(task, batch, ((p.query_id, p.run) for p in chunk))
            raise
        now = clock.now()
        round_ = max(p.run["round"] for p in chunk) + 1
        # the provider batch first: killed before the runs say so, the items are still
        # pending, and settle_doubts finds it here by its submission
        record = {"round": round_, "requests": len(chunk), "created_at": now,
                  "ended_at": None, "submission": submission}  # fmt: skip
        if not _record_provider(task, batch, provider.id, record):
            created.append(provider.id)  # canceled by submit, with the ones before it
            return
        for p in chunk:
            record_sent(p.run, provider.id, submission, now)
        save_runs(task, batch, ((p.query_id, p.run) for p in chunk))
        created.append(provider.id)
        log.info(
            "batch %s: provider batch %s with %d requests (round %d)",
            batch.id,
            provider.id,
            len(chunk),
            round_,
        )


def submit(
    task: SiftTask,
    batch: BatchJob,
    query_ids: Sequence[str],
    *,
    expected: str | None = None,
    watch: str = SUBMIT_CLAIM,
) -> list[str]:
    """Send these items' prompts as provider batches; answers the provider batch ids.

    Each create is written down before it is made (its items' ``pending``), so that one whose
    answer is lost is looked for before anything is sent again (:func:`settle_doubts`).
    ``watch`` is the task sending them (the submission, or a provider batch's poll): each
    create tells the watch it is alive, so that a long submission is not sent again while
    it runs (a second one would create the same items' batches again).

    A batch erased by ``sift tenant purge`` while this ran (``--force``, or a worker not
    restarted yet) gets no create more, and every provider batch this run made for it is
    canceled here, whichever way the run ends (:func:`_cancel_erased`): the purge may have
    read its provider batches before they were made or recorded, and nothing else would
    cancel them."""
    settings = task.context.settings
    if batch.canceled_at is not None:
        _cancel_unsent(task, batch, query_ids, expected, watch)
        return []
    try:  # a removed tenant's prompts go nowhere: the items still to send end failed
        task.context.admit(batch.tenant)
    except TenantRemoved as exc:
        to_send = [qid for qid, _, run in running_items(task, batch, query_ids)
                   if run["provider"] == expected]  # fmt: skip
        fail_unsent(task, batch, to_send, exc)
        return []
    if not query_ids:  # every item ended without a prompt: nothing to send, no client needed
        return []
    if _ended_without_model(task, batch, query_ids, expected):
        return []
    client = batches_client(task, batch.id, watch)
    # still this run's to do (a run whose lease was taken over stops before it settles or
    # sends anything: the new holder does; after a results page this is the mapping's mark)
    expect(task, batch.id, watch, 0.0)
    settle_doubts(task, batch, query_ids, expected, watch)
    created: list[str] = []
    chunks = chunk_requests(
        _pending(task, batch, query_ids, expected, watch),
        lambda p: p.size,
        max_requests=settings.economy_max_requests_per_batch,
        max_bytes=settings.economy_max_batch_bytes,
    )
    try:
        _send(task, batch, client, chunks, watch, created)
    finally:  # every way out: a refused save or record, a failed create, a stood-down run
        again = task.context.store.get_batch(batch.id)
        for provider_id in created if again is None else []:  # erased since: by its purge
            _cancel_erased(client, batch.id, provider_id)
    if created and again is not None and again.canceled_at is not None:
        for provider_id in created:  # canceled while we were sending: cancel what we sent,
            # polled soon as sift.economy_cancel's are (it ran before these were recorded)
            if cancel_quietly(task.context.store, batch.id, client, provider_id):
                send_anew(task, batch.id, provider_id, CANCELED_POLL_SECONDS)
    return created


def _cancel_unsent(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], expected: str | None, watch: str
) -> None:
    """End the items still to send of a canceled batch; one already in a provider batch (sent
    by an earlier run of this submission, its message delivered again) waits on it: the
    cancel's sift.economy_cancel ends its request unless the provider processed it.

    A create of theirs whose answer was lost is looked for first (:func:`settle_doubts`):
    the provider batch it may have made becomes a candidate, polled and judged as any
    (deleted at an erase if its lines prove it Sift's, named by a purge). A create that may
    still be under way (its window not passed), or a provider that does not answer the
    list, leaves it unsought: the cancel is not held up."""
    to_end = [qid for qid, _, run in running_items(task, batch, query_ids)
              if run["provider"] == expected]  # fmt: skip
    if task.context.batches is not None:
        try:
            settle_doubts(task, batch, to_end, expected, watch)
        except RerankAttemptError as exc:
            log.warning("batch %s: canceled; a create in doubt not looked for: %s", batch.id, exc)
    for qid in to_end:
        cancel_item(task, batch, qid)


def _ended_without_model(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], expected: str | None
) -> bool:
    """On a worker with no generation model, past the economy deadline, with no worker that
    can send them alive in the pool: end the items to send that were never sent
    (:func:`end_without_model`); True if none is left to send. One whose create is in doubt
    may be in a provider batch: it waits, as the items sent do, for a worker with the model
    to settle it (:func:`batches_client` asks again). Before, with no worker of the model
    left in the pool, the submission was asked again for ever, its batch ``running``.

    While a worker with the model and the batch queue lives (its beats,
    :func:`~worker.queue.liveness.economy_sender_alive`), nothing ends: the submission is
    asked again, for that worker to take a later try and send them. This worker's lack of
    the model alone ended them, in a pool of mixed settings: the same items were sent or
    failed ``no_generation_model`` by which worker took one message."""
    deadline = batch.created_at + task.context.settings.economy_deadline_seconds
    if task.context.batches is not None or clock.now() < deadline:
        return False
    if economy_sender_alive(task.context.store.redis):
        return False
    to_send = [(qid, run) for qid, _, run in running_items(task, batch, query_ids)
               if run["provider"] == expected]  # fmt: skip
    never_sent = [qid for qid, run in to_send if not run.get("pending")]
    if never_sent:
        log.warning("batch %s: past its economy deadline with %s on this worker and no "
                    "worker of the model alive; %d items never sent end by the failure "
                    "policy", batch.id, NO_CLIENT,
                    len(never_sent))  # fmt: skip
        end_without_model(task, batch, never_sent)
    return len(never_sent) == len(to_send)


def _unsent(task: SiftTask, batch: BatchJob, query_ids: Sequence[str]) -> list[str]:
    """The items among ``query_ids`` still running and in no provider batch yet."""
    return [qid for qid, _, run in running_items(task, batch, query_ids) if run["provider"] is None]


@shared_task(  # type: ignore[untyped-decorator]
    name=ECONOMY_SUBMIT_TASK, base=SiftTask, bind=True, max_retries=None
)
def economy_submit(self: SiftTask, batch_id: str) -> None:
    """Send a batch's prepared prompts as Message Batches (:func:`_submit`), as the one run
    of the submission under way (:func:`leased`)."""
    leased(self, batch_id, SUBMIT_CLAIM, lambda: _submit(self, batch_id))


def _submit(self: SiftTask, batch_id: str) -> None:
    """Send a batch's prepared prompts as Message Batches.

    A transient failure (429, 5xx, 529, a timeout) is retried at the poll's cadence for as
    long as the economy deadline lasts, not within the task retry budget: a provider outage
    of a minute must not fail a batch that may take 24 hours. A permanent one fails only the
    items not sent yet: those already in a provider batch wait for its results."""
    store, settings = self.context.store, self.context.settings
    batch = store.get_batch(batch_id)
    if batch is None:
        store.economy_met(batch_id, SUBMIT_CLAIM)
        return
    if not message_taken(self, batch_id, SUBMIT_CLAIM):
        return
    expect(self, batch_id, SUBMIT_CLAIM, 0.0)
    query_ids = store.economy_fields(batch_id, ECONOMY_PREPARED_KEY)
    try:
        submit(self, batch, query_ids)
        store.economy_met(batch_id, SUBMIT_CLAIM)
    except BatchQueueFull as exc:
        # not a failure: the provider's queue frees as its batches end. Sent again, the task
        # keeps its retry budget; what was sent already is not sent twice (``_pending``).
        log.info("batch %s: %s; submitting the rest later", batch_id, exc)
        send_anew(self, batch_id, SUBMIT_CLAIM, exc.retry_after or 0.0)
    except RerankAttemptError as exc:
        deadline = batch.created_at + settings.economy_deadline_seconds
        if exc.retryable and clock.now() < deadline:
            log.warning("batch %s: submission failed, retrying: %s", batch_id, exc)
            again = store.get_batch(batch_id)
            # canceled meanwhile: tried again at once, to cancel the items it has to send
            canceled = again is not None and again.canceled_at is not None
            countdown = 0.0 if canceled else retry_countdown(self, exc)
            expect(self, batch_id, SUBMIT_CLAIM, countdown)
            raise self.retry(exc=exc, countdown=countdown) from exc
        log.error("batch %s: submission failed for good: %s", batch_id, exc)
        fail_items(self, batch, _unsent(self, batch, query_ids), exc)
        store.economy_met(batch_id, SUBMIT_CLAIM)

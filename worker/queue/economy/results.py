"""Mapping an ended provider batch's results to the batch's items: each line by its
``custom_id``, counted once; a failed one resubmitted while its class, its attempts and the
deadline allow; and a candidate of a create in doubt found ours, or not."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker import clock
from worker.constants import (
    BATCH_ITEMS_KEY,
    ECONOMY_PREPARED_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RESEND_CLAIM,
    ECONOMY_RUNS_KEY,
)
from worker.contract import JobStatus
from worker.core.pipeline import Prepared, RerankRun, SearchPipeline, load_prepared
from worker.core.types import TokenUsage
from worker.errors import AttemptOutcome, RerankAttemptError
from worker.observability.logcontext import job_context
from worker.queue.base import SiftTask
from worker.queue.economy.cancel import cancel_sent
from worker.queue.economy.finish import as_stored_now, cancel_item, fail_items, finish_item
from worker.queue.economy.ids import custom_id, position_of, submission_of
from worker.queue.economy.leases import expect
from worker.queue.economy.records import (
    DOUBT,
    PAGE,
    as_sent,
    backed_off,
    economy_pipeline,
    items_waiting,
    provider_record,
    rerank_run,
    running_items,
    save_provider_record,
    save_runs,
    store_run,
)
from worker.queue.economy.submission import submit
from worker.queue.economy.watch import batches_client
from worker.queue.jobstore import BatchJob

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import BatchLine

log = logging.getLogger(__name__)


def _is_current(run: dict[str, Any], provider_id: str, submission: str | None) -> bool:
    """Whether a result of ``provider_id`` whose ``custom_id`` names ``submission`` is the
    answer the item waits for: its create's (the one recorded, or one still in doubt)."""
    if submission is None:  # a custom_id of before submissions were named
        return bool(run["provider"] == provider_id)
    pending = run.get("pending") or {}
    return submission in (run.get("submission"), pending.get("submission"))


def candidate_ended(task: SiftTask, batch: BatchJob, provider_id: str, *, proven: bool) -> None:
    """A candidate of a create in doubt ended: kept as such, and if every candidate of that
    create ended without a line of it, the create made nothing: its items are sent again."""
    store = task.context.store
    record = provider_record(store, batch.id, provider_id)
    record.update(ended_at=record.get("ended_at") or clock.now(), proven=proven)
    save_provider_record(store, batch.id, provider_id, record)
    submission = record.get("submission")
    if proven or submission is None:
        return
    group = [
        json.loads(raw)
        for raw in store.economy_all(batch.id, ECONOMY_PROVIDERS_KEY).values()
        if json.loads(raw).get("submission") == submission
    ]
    if any(r.get("proven") or r.get("ended_at") is None for r in group):
        return  # ours, or one still running may be
    # Two candidates' polls that map their results at the same instant both find every
    # candidate ended, and both read the items waiting before either sends them: each would
    # send them, two provider batches paid. One poll claims the resend (its own retries and
    # redeliveries keep it: a resend that failed, or died, is done by that poll again).
    if not store.economy_claim_for(batch.id, ECONOMY_RESEND_CLAIM + submission, provider_id):
        log.info("batch %s: create %s's requests are sent again by another candidate's poll",
                 batch.id, submission)  # fmt: skip
        return
    waiting = items_waiting(store, batch.id, DOUBT + submission, None)
    if waiting:
        log.warning("batch %s: no provider batch was made by create %s; sending its %d "
                    "requests again", batch.id, submission, len(waiting))  # fmt: skip
        submit(task, store.get_batch(batch.id) or batch, waiting, expected=DOUBT + submission,
               watch=provider_id)  # fmt: skip


def map_results(
    task: SiftTask, batch: BatchJob, provider_id: str, ended_at: float | None = None
) -> None:
    """Stream an ended provider batch's results and map each line to its item. ``ended_at``
    is when the provider says it ended, on the shared clock (epoch seconds,
    :attr:`~worker.adapters.anthropic_batches.ProviderBatch.shared_ended_at`; None: not
    known): its ``canceled`` lines are the user's cancel only if that came before it
    (:func:`_user_canceled`)."""
    client, store = batches_client(task, batch.id, provider_id), task.context.store
    # read again: a cancel may have come since the poll read the batch, and been the cause
    batch = store.get_batch(batch.id) or batch
    sent = batch.canceled_at is not None and cancel_sent(store, batch.id, provider_id)
    user_canceled = _user_canceled(batch, ended_at, sent)
    record = provider_record(store, batch.id, provider_id)
    submission = record.get("submission")
    resubmit: list[str] = []
    page: list[BatchLine] = []
    lines = ours = 0
    seen: set[str] = set()
    for line in client.results(provider_id):
        if line.custom_id in seen:  # a request's result given twice: the first one counts
            log.warning("provider batch %s: %r again; ignored", provider_id, line.custom_id)
            continue
        if line.custom_id:
            seen.add(line.custom_id)
        page.append(line)
        lines += 1
        ours += submission is not None and submission_of(line.custom_id) == submission
        if len(page) >= PAGE:
            resubmit += _map_page(task, batch, provider_id, page, user_canceled)
            page = []
            expect(task, batch.id, provider_id, 0.0)  # a long mapping is no lost message
    resubmit += _map_page(task, batch, provider_id, page, user_canceled)
    in_doubt = bool(record.get("doubt")) and not ours
    if not in_doubt:
        resubmit += _map_left_out(task, batch, provider_id, submission, set(resubmit))
    if resubmit:
        fresh = store.get_batch(batch.id) or batch
        # once each: a custom_id twice in one create is refused (400) for the whole batch
        submit(task, fresh, list(dict.fromkeys(resubmit)), expected=provider_id, watch=provider_id)
    if in_doubt:
        log.info("provider batch %s: not the create in doubt (no line of it)", provider_id)
        candidate_ended(task, batch, provider_id, proven=False)
        return
    record = provider_record(store, batch.id, provider_id)
    record.update(ended_at=clock.now(), results=lines, resubmitted=len(resubmit))
    if record.get("doubt"):
        record["proven"] = True
    save_provider_record(store, batch.id, provider_id, record)
    log.info(
        "batch %s: provider batch %s mapped, %d results, %d resubmitted",
        batch.id,
        provider_id,
        lines,
        len(resubmit),
    )


def _map_left_out(
    task: SiftTask,
    batch: BatchJob,
    provider_id: str,
    submission: str | None,
    resubmitting: set[str],
) -> list[str]:
    """The requests an ended provider batch's results left out (no line, or one that named
    no request), each mapped as a ``malformed`` result of its item: resubmitted while its
    attempts and the deadline last, as the standard lane retries an unreadable answer, then
    the failure policy. They were failed at once, with two attempts of the three unused,
    so a batch's economy lane failed items its standard lane would have answered.

    Every item still waiting on the provider batch and not among ``resubmitting`` (the
    file's lines to resubmit) is one: a task run again after a kill maps it again, counting
    nothing twice (its run is ``handled``) and resubmitting it if it was to be."""
    from worker.adapters.anthropic_batches import BatchLine  # the adapter is the worker's

    waiting = items_waiting(task.context.store, batch.id, provider_id, submission)
    left_out = [
        (qid, int(data["pos"]), run.get("submission") if submission is None else submission)
        for qid, data, run in running_items(task, batch, waiting)
        if qid not in resubmitting
    ]
    if not left_out:
        return []
    log.warning("provider batch %s: %d requests had no result", provider_id, len(left_out))
    failure = RerankAttemptError(
        AttemptOutcome.MALFORMED, f"provider batch {provider_id} ended without its result"
    )
    lines = [
        BatchLine(custom_id(pos, sub) if sub else f"i{pos}", "malformed", error=failure)
        for _, pos, sub in left_out
    ]
    resubmit: list[str] = []
    for start in range(0, len(lines), PAGE):
        resubmit += _map_page(task, batch, provider_id, lines[start : start + PAGE])
    # an item the mapping did not take as current (none should be) fails, as all did before,
    # rather than wait forever
    taken = resubmitting | set(resubmit)
    stuck = [qid for qid, _, _ in running_items(task, batch, waiting) if qid not in taken]
    if stuck:
        fail_items(task, batch, stuck, failure)
    return resubmit


def _user_canceled(batch: BatchJob, ended_at: float | None, sent: bool) -> bool:
    """Whether the user's cancel of ``batch`` may have ended the provider batch that ended at
    ``ended_at``: Sift's cancel of it reached it before it ended (``sent``), or the user's came
    before that end (or the end is not known). ``sent`` holds whatever the clocks read: the
    gateway's (``canceled_at``) running ahead of the provider's (``ended_at``) by more than
    the cancel took made a cancel Sift sent look like one from outside. Otherwise the
    provider batch was canceled outside Sift (in the Console, say), and its ``canceled``
    lines are failed attempts, not a cancel the user never asked for.

    Both times are on the shared clock: ``canceled_at`` is, and ``ended_at``, stamped on the
    provider's, is moved by its offset (the poll's answer's ``Date``), which errs late by up
    to a second, not early. Set against the provider's own ``ended_at``, a provider 5
    minutes behind turned the user's cancel into one from outside (an item's last attempt
    then failed it), and one 5 minutes ahead the reverse."""
    if batch.canceled_at is None:
        return False
    return sent or ended_at is None or batch.canceled_at <= ended_at


def _map_page(
    task: SiftTask,
    batch: BatchJob,
    provider_id: str,
    lines: Sequence[BatchLine],
    user_canceled: bool = False,
) -> list[str]:
    """Map one page of result lines; answers the query ids to resubmit. A ``canceled`` line
    cancels its item only if ``user_canceled`` (:func:`_user_canceled`)."""
    if not lines:
        return []
    store, pipeline = task.context.store, economy_pipeline(task)
    client = batches_client(task, batch.id, provider_id)
    settings = task.context.settings
    positions = [position_of(line.custom_id) for line in lines]
    qids = store.query_ids_at(batch.id, [p if p is not None else -1 for p in positions])
    known = [
        (line, qid)
        for line, position, qid in zip(lines, positions, qids, strict=True)
        if position is not None and qid is not None
    ]
    for line, position in zip(lines, positions, strict=True):
        if position is None:
            log.warning("provider batch %s: unknown custom_id %r", provider_id, line.custom_id)
    ids = [qid for _, qid in known]
    statuses = store.economy_get(batch.id, BATCH_ITEMS_KEY, ids)
    prepared = store.economy_get(batch.id, ECONOMY_PREPARED_KEY, ids)
    runs = store.economy_get(batch.id, ECONOMY_RUNS_KEY, ids)
    now = clock.now()
    deadline = batch.created_at + settings.economy_deadline_seconds
    mapped: list[_Mapped] = []
    for (line, qid), status, raw, raw_run in zip(known, statuses, prepared, runs, strict=True):
        if status != JobStatus.RUNNING.value or raw is None or raw_run is None:
            continue  # final already, or canceled
        record = json.loads(raw_run)
        submission = submission_of(line.custom_id)
        if not _is_current(record, provider_id, submission):
            continue  # a stale result (the item moved on), or another create's
        record.update(provider=provider_id, pending=None)
        record["submission"] = submission or record.get("submission")
        if line.kind == "canceled" and user_canceled:
            with job_context(f"{batch.id}/{qid}"):
                cancel_item(task, batch, qid, record)
            continue
        item = as_sent(load_prepared(pipeline, json.loads(raw)), record)
        if item.prompt is not None:  # the standard lane's check of an answer's length
            line = client.checked(line, item.prompt)
        one = _Mapped(qid, line, record, item, rerank_run(record))
        one.run.seconds = now - float(record["first_submitted_at"] or now)
        one.failure = None if line.reply is not None else _line_failure(line, provider_id)
        if record["handled"] != provider_id:  # else counted by an earlier run of this task
            _add_attempt(pipeline, one, provider_id, now, deadline)
        mapped.append(one)
    # The runs are saved before the metrics count their attempts: a task run again after a
    # kill between the two finds them ``handled`` and counts nothing twice.
    fresh = [one for one in mapped if one.counted is not None]
    save_runs(task, batch, ((one.qid, one.record) for one in fresh))
    for one in fresh:
        assert one.counted is not None
        pipeline.count_attempt(*one.counted)
    resubmit = [one.qid for one in mapped if one.record["resubmit"]]
    ending = [one for one in mapped if not one.record["resubmit"]]
    # the page's candidates read as stored now, together: not a backend call per item
    stored = as_stored_now(pipeline.backend, batch.tenant, [one.item for one in ending])
    for one, held in zip(ending, stored, strict=True):
        if one.line.reply is not None:
            one.run.reply, one.run.returned = one.line.reply, one.line.reply.positions
        else:
            one.run.failure = one.failure
        with job_context(f"{batch.id}/{one.qid}"):
            finish_item(task, batch, one.qid, one.item, one.run, now=held)
    return resubmit


@dataclass(slots=True)
class _Mapped:
    """One result line mapped to its item, between its run's save and its item's finish."""

    qid: str
    line: BatchLine
    record: dict[str, Any]
    item: Prepared
    run: RerankRun
    failure: RerankAttemptError | None = None
    counted: tuple[AttemptOutcome, TokenUsage | None, float | None, str | None] | None = None


def _line_failure(line: BatchLine, provider_id: str) -> RerankAttemptError:
    """The failure a result line without an answer stands for."""
    if line.kind == "expired":
        return RerankAttemptError(
            AttemptOutcome.TIMEOUT,
            f"the provider expired the request unprocessed (batch {provider_id})",
        )
    if line.kind == "canceled":  # not by the user (:func:`_user_canceled`): as a 5xx
        return RerankAttemptError(
            AttemptOutcome.HTTP_5XX,
            f"the provider batch {provider_id} was canceled outside Sift, the request unprocessed",
        )
    assert line.error is not None
    return line.error


def _add_attempt(
    pipeline: SearchPipeline, one: _Mapped, provider_id: str, now: float, deadline: float
) -> None:
    """Count a line's attempt in its item's run (not yet in the metrics: ``one.counted``
    says what to count once the run is saved), and decide whether it is resubmitted. In a
    batch canceled meanwhile, one to resubmit is canceled by the resubmission instead
    (:func:`submit`), as its resubmitted request is canceled once the cancel came after it:
    whenever the cancel came, the item ends ``canceled``, not in the failure policy."""
    record, run, failure = one.record, one.run, one.failure
    waited = now - float(record["submitted_at"] or now)
    detail = {
        "provider_batch": provider_id,
        "provider_result": one.line.kind,
        "backoff_wait_seconds": backed_off(record, now),
    }
    usage: TokenUsage | None
    if one.line.reply is not None:
        outcome, usage = AttemptOutcome.OK, one.line.reply.usage
    else:
        assert failure is not None
        found = getattr(failure, "usage", None)
        outcome, usage = failure.outcome, found if isinstance(found, TokenUsage) else None
    # priced and labelled as the model its request went to (the run's, since its submission):
    # the worker polling may be of another model, after a deploy
    model = record.get("model")
    cost = pipeline.add_attempt(run, outcome, usage, waited, model=model, **detail)
    one.counted = (outcome, usage, cost, model)
    again = (
        failure is not None
        and failure.retryable
        and len(run.attempts) < pipeline.config.max_requests
        and now < deadline
    )
    store_run(record, run)
    record.update(handled=provider_id, resubmit=again, mapped_at=now)
    if failure is not None:
        record["last_error"] = failure.message

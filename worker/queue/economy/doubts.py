"""Creates whose answer never came: their provider batches are looked for before anything is
sent again, since the Message Batches API has no idempotency key (:func:`settle_doubts`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from worker import clock
from worker.constants import ECONOMY_PROVIDERS_KEY, ECONOMY_SENDING_MARK, ECONOMY_STATE_KEY
from worker.errors import AttemptOutcome, RerankAttemptError
from worker.queue.base import SiftTask
from worker.queue.economy.leases import expect
from worker.queue.economy.records import (
    DOUBT,
    record_sent,
    running_items,
    save_provider_record,
    save_runs,
)
from worker.queue.economy.watch import batches_client, send_poll
from worker.queue.jobstore import BatchJob

log = logging.getLogger(__name__)


# A create whose answer was lost (a timeout, a cut connection, the worker killed) may have
# made a provider batch: it is looked for among those created from this long before the call
# to this long after the last piece of its body went out (the provider's own time to make
# it). Both times are on the shared clock (worker/clock.py), whichever worker wrote them.
DOUBT_WINDOW_SECONDS = 120.0


def settle_doubts(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str], expected: str | None, watch: str
) -> None:
    """Find the provider batches of creates whose answer never came (a timeout, a cut
    connection, a worker killed between the call and its record), before anything is sent
    again: the Message Batches API has no idempotency key, so a second create would be a
    second provider batch, paid twice.

    A create in doubt left ``pending`` on its items' runs: its submission token, when it was
    made and how many requests it held, and ``answered`` once its call came back (failed).
    The workspace's provider batches created from :data:`DOUBT_WINDOW_SECONDS` before it to
    that long past the last piece of its body (marked as it went out: :func:`upload_guard`; a
    large body on a slow link outlasts the window), with as many requests, that this batch
    does not know yet are its candidates. None: the create made nothing, and its items are
    sent now; but a create whose call never came back may still be under way in a run
    judged dead (stalled) or slow, until the window's end past that last piece: till then
    the settling is tried again later (a retryable error). A run taken over sends no piece
    more (its guard finds its lease gone), so its batch, if the provider makes it, was made
    by then.
    Otherwise every candidate is polled (never canceled: it may be another client's), its
    items wait as ``doubt:<submission>``, and the results tell: lines whose ``custom_id``
    carries the submission prove the candidate ours (:func:`map_results`); when every
    candidate ended without one, the items are sent again. ``watch`` is the task settling
    them (:func:`~worker.queue.economy.submission.submit`'s)."""
    doubts: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for qid, _, run in running_items(task, batch, query_ids):
        pending = run.get("pending")
        if pending and run["provider"] == expected:
            doubts.setdefault(pending["submission"], []).append((qid, run))
    if not doubts:
        return
    client, store = batches_client(task, batch.id, watch), task.context.store
    known = {
        provider_id: json.loads(raw)
        for provider_id, raw in store.economy_all(batch.id, ECONOMY_PROVIDERS_KEY).items()
    }
    marks = store.economy_get(
        batch.id, ECONOMY_STATE_KEY, [ECONOMY_SENDING_MARK + s for s in doubts]
    )
    for (submission, items), mark in zip(doubts.items(), marks, strict=True):
        pending = items[0][1]["pending"]
        at, requests = float(pending["at"]), int(pending["requests"])
        # the last piece of its body went out by then, or never will (its run, taken over,
        # stops its upload short): a create whose upload lasted past the window is covered
        last = max(at, float(mark)) if mark else at
        mine = [pid for pid, r in known.items() if r.get("submission") == submission]
        recorded = [pid for pid in mine if not known[pid].get("doubt")]
        if recorded:  # its answer came and was kept: the runs just never said so
            for _, run in items:
                record_sent(run, recorded[0], submission, at)
            save_runs(task, batch, items)
            send_poll(task, batch, recorded[0])  # its poll may not have been sent
            continue
        # candidates kept already: a settling killed before the runs said so; else looked for
        found = mine or [
            b.id
            for b in client.created_between(at - DOUBT_WINDOW_SECONDS, last + DOUBT_WINDOW_SECONDS)
            if b.requests == requests and b.id not in known
        ]
        wait = last + DOUBT_WINDOW_SECONDS - clock.now()
        if not found and not pending.get("answered") and wait > 0:
            # No answer came to its run, which may not be dead but stalled (its lease taken
            # over) or slow, its create still under way: the provider may make the batch yet,
            # as late as the window's end. Sent again now, the items would be paid twice.
            raise RerankAttemptError(
                AttemptOutcome.CONNECTION,
                f"create {submission} of {requests} requests may still be under way",
                retry_after=wait,
            )
        round_ = max(run["round"] for _, run in items) + 1
        # the candidates first, each watched: killed before the runs are saved, the items are
        # still pending and the next settling finds them here; killed after, before a poll
        # went, the watch sends it. Never the runs first: items waiting on candidates that
        # no record names, and no poll, would wait forever.
        for provider_id in found:
            if provider_id not in known:
                record = {"round": round_, "requests": requests, "created_at": at,
                          "ended_at": None, "submission": submission, "doubt": True}  # fmt: skip
                save_provider_record(store, batch.id, provider_id, record)
            expect(task, batch.id, provider_id, task.context.settings.economy_poll_seconds)
        for _, run in items:
            run["pending"] = None
            if found:
                record_sent(run, DOUBT + submission, submission, at)
        save_runs(task, batch, items)
        for provider_id in found:
            send_poll(task, batch, provider_id)
        log.warning(
            "batch %s: a create of %d requests got no answer; %s",
            batch.id,
            requests,
            f"polling its candidates {found}" if found else "it made no provider batch",
        )

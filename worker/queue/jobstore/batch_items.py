"""A batch item's moves: started, checked against its batch's cancel, finished (with the
next item's start in the same round trip), requeued or canceled, each at most once, and what
a final item adds to its batch's totals.
"""

from __future__ import annotations

from worker.constants import BATCH_KEY, ERROR_TENANT_REMOVED
from worker.contract import ErrorInfo, JobStatus, SearchResult, Usage
from worker.queue.jobstore.records import ItemTransition
from worker.queue.jobstore.store import (
    _CHECK_ITEM,
    _START_ITEM,
    NO_CANCEL,
    Claimant,
    _Move,
    _StoreCore,
)

# A batch's totals in its record, by field prefix: its failed items by their error's type
# ("failure_rerank_failed") and its rerank_failed items by their class
# ("rerank_failure_malformed"): both open sets, read back by prefix (batches.py)
FAILURE_PREFIX = "failure_"
RERANK_FAILURE_PREFIX = "rerank_failure_"
# A batch's totals in its record: the usage its items' outcomes add (``_TRANSITION_ITEM``)
_USAGE_TOKENS = (
    "requests",
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)


def batch_tally(
    result: SearchResult | None = None, error: ErrorInfo | None = None, usage: Usage | None = None
) -> list[str]:
    """What one final item adds to its batch's totals, as (field, increment) pairs: its
    usage (the result's, the error's, or a canceled item's billed ``usage``), each stage's
    seconds (the result's, or the error's up to its failure: time over the items cost is
    counted over; a failed item's were left out), for a result, its rerank outcome, and for
    a failure, its error's type (and a ``rerank_failed`` one's class). An unknown cost counts
    as unpriced, never as 0.

    >>> batch_tally(usage=Usage(requests=1, input_tokens=10, cost_usd=None))[-2:]
    ['usage_unpriced', '1']
    >>> batch_tally(error=ErrorInfo(type="rerank_failed", message="m", reason="malformed"))
    ['failure_rerank_failed', '1', 'rerank_failure_malformed', '1']
    """
    used = result.usage if result is not None else error.usage if error is not None else usage
    pairs: list[str] = []
    if used is not None:
        for name in _USAGE_TOKENS:
            pairs += ["usage_" + name, str(getattr(used, name))]
        if used.cost_usd is None:
            pairs += ["usage_unpriced", "1"]
        else:
            pairs += ["usage_cost_usd", repr(used.cost_usd)]
    timed = result if result is not None else error
    if timed is not None:
        for stage, seconds in timed._stage_seconds.items():
            pairs += ["seconds_" + stage, repr(seconds)]
    if error is not None:
        pairs += [FAILURE_PREFIX + error.type, "1"]
        if error.reason is not None:
            pairs += [RERANK_FAILURE_PREFIX + error.reason, "1"]
    if error is not None and error.type == ERROR_TENANT_REMOVED:
        # the batch's webhook settles failed as it completes (scripts.py, _OWE_WEBHOOK)
        pairs += ["tenant_removed", "1"]
    if result is not None:
        rerank = result.rerank
        outcome = (
            "applied" if rerank.applied else "fallback" if rerank.fallback_reason else "skipped"
        )
        pairs += ["rerank_" + outcome, "1"]
    return pairs


class BatchItemRecords(_StoreCore):
    """A batch item's status moves, each one script shared with other threads' moves."""

    def start_item(self, batch_id: str, query_id: str, *, claimant: Claimant = ("", 0.0)) -> bool:
        """queued (or running, on redelivery) -> running. False if final, canceled or missing,
        or if another live run holds its run claim, or its economy first half is kept
        (nothing is written: that run, or its provider batch, finishes it), or if its batch
        has been canceled (then the item is canceled instead, unless its run claim kept the
        model's answer: then it starts, to finish on that paid answer). ``claimant``: the
        worker id and lease this run would claim with (:meth:`claim_item`), by which the
        claim is judged as the claim itself would judge it (one its worker's runs do not
        hold is a run gone; one that kept no lease, an older release's, has the claimant's)."""
        return self.begin_item(batch_id, query_id, claimant=claimant).started

    def begin_item(
        self, batch_id: str, query_id: str, *, claimant: Claimant = ("", 0.0)
    ) -> ItemTransition:
        """:meth:`start_item`, answering the transition: ``canceled`` (and maybe
        ``batch_completed``) when the batch's cancel mark canceled the item instead."""
        return self._item(batch_id, query_id, *_START_ITEM, claimant=claimant)

    def check_item(
        self, batch_id: str, query_id: str, *, usage: Usage | None = None
    ) -> ItemTransition:
        """Before a running item's model call: if its batch has been canceled, running ->
        canceled (``canceled`` set; go no further), else nothing changes (``applied``: go
        on). Not ``applied``: the item is no longer running (finished by another
        delivery); go no further either. One script, one round trip, shared with other
        threads' transitions. ``usage``: what the item was billed already (a dead run's
        answer kept, for other candidates), on its record and its batch's totals if
        canceled, as :meth:`cancel_item`'s."""
        to, allowed, _, cancelable = _CHECK_ITEM
        payload = '{"usage":' + usage.model_dump_json() + "}" if usage is not None else ""
        tally = batch_tally(usage=usage)
        return self._item(batch_id, query_id, to, allowed, payload, cancelable, tally=tally)

    def batch_canceled(self, batch_id: str) -> bool:
        """Whether a cancel has marked the batch (one ``HEXISTS``; :meth:`check_item` is
        what acts on it, atomically)."""
        return bool(self.redis.hexists(BATCH_KEY + batch_id, "canceled_at"))

    def requeue_item(self, batch_id: str, query_id: str) -> bool:
        """running -> queued (for a retry, or the item handed back by its stopping worker), on a
        Redis at its ``maxmemory`` too (:data:`~worker.queue.jobstore.scripts._REQUEUE_ITEM`)."""
        move = (JobStatus.QUEUED, "running", "", NO_CANCEL)
        return self._item(batch_id, query_id, *move, script=self._requeue_item).applied

    def finish_item(
        self,
        batch_id: str,
        query_id: str,
        *,
        result: SearchResult | None = None,
        error: ErrorInfo | None = None,
    ) -> ItemTransition:
        """-> succeeded or failed, at most once; says whether that completed the batch."""
        transition, _ = self.finish_and_start_item(batch_id, query_id, result=result, error=error)
        return transition

    def finish_and_start_item(
        self,
        batch_id: str,
        query_id: str,
        *,
        result: SearchResult | None = None,
        error: ErrorInfo | None = None,
        start: tuple[str, str] | None = None,
        claimant: Claimant = ("", 0.0),
    ) -> tuple[ItemTransition, ItemTransition | None]:
        """:meth:`finish_item`, then :meth:`begin_item` of ``start`` (batch id, query id; of
        any batch; with ``claimant``), in one round trip: a thread that runs items back to back
        pays one per item. Answers the finish, and the start's transition (None without
        ``start``)."""
        if error is not None:
            status, payload = JobStatus.FAILED, '{"error":' + error.model_dump_json() + "}"
        else:
            assert result is not None
            status, payload = JobStatus.SUCCEEDED, '{"result":' + result.model_dump_json() + "}"
        moves: list[_Move] = [(batch_id, query_id, status, "queued,running", payload, NO_CANCEL)]
        if start is not None:
            moves.append((*start, *_START_ITEM))
        transitions = self._items(moves, batch_tally(result, error), claimant)
        return transitions[0], transitions[1] if start is not None else None

    def cancel_item(
        self, batch_id: str, query_id: str, *, usage: Usage | None = None
    ) -> ItemTransition:
        """queued or running -> canceled (the provider canceled its request), at most once.
        ``usage``: what the item's earlier rounds were billed (an economy item resubmitted,
        then canceled), shown on its record as ``usage``, so that the record agrees with the
        counters and the bill; a canceled item has no result or error to carry it."""
        payload = '{"usage":' + usage.model_dump_json() + "}" if usage is not None else ""
        return self._item(
            batch_id,
            query_id,
            JobStatus.CANCELED,
            "queued,running",
            payload,
            NO_CANCEL,
            tally=batch_tally(usage=usage),
        )

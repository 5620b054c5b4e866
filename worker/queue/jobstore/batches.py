"""Batch records and their items: a batch is staged item by item and committed in one MULTI
with its task messages; each item then moves on its own, and the cancel marks the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import redis

from worker.constants import (
    ACTIVE_JOBS_KEY,
    BATCH_CHUNK_RUNS_KEY,
    BATCH_COUNTS_KEY,
    BATCH_ID_PREFIX,
    BATCH_ITEMS_KEY,
    BATCH_KEY,
    BATCH_LOST_KEY,
    BATCH_MOVES_KEY,
    BATCH_ORDER_KEY,
    BATCH_RESULTS_KEY,
    BATCH_RUNS_KEY,
    BATCH_SPECS_KEY,
    BATCH_STAGE_SLICE,
    BATCH_STAGING_TTL_SECONDS,
    ECONOMY_PREPARED_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RUNS_KEY,
    ECONOMY_STATE_KEY,
    LANE_STANDARD,
    MAX_RESULTS_PAGE_BYTES,
    STATS_KEY,
    WEBHOOKS_OWED_KEY,
)
from worker.contract import JobStatus, SearchSpec, Usage
from worker.queue.jobstore.batch_items import (
    _USAGE_TOKENS,
    FAILURE_PREFIX,
    RERANK_FAILURE_PREFIX,
)
from worker.queue.jobstore.idempotency import (
    IdempotencyKeyBound,
    IdempotencyRef,
    _bound,
    _idem_binding,
)
from worker.queue.jobstore.jobindex import KIND_BATCH, index_job
from worker.queue.jobstore.records import (
    _STATUSES,
    BatchItem,
    BatchJob,
    CancelOutcome,
    Enqueue,
    ItemOutcome,
    _new_id,
    _now,
    _opt_float,
    webhook_state,
)
from worker.queue.jobstore.store import (
    BATCH_KEYS,
    RE_DRIVE_KEYS,
    _StoreCore,
    move_token,
    resending,
)

#: The batch's keys a cancel's script names after its first three (items, counts, record), in
#: its KEYS' order: a cancel that completes the batch gives all of them the retention from now.
_CANCEL_RETAINED = (
    BATCH_ORDER_KEY,
    BATCH_SPECS_KEY,
    BATCH_RESULTS_KEY,
    BATCH_MOVES_KEY,
    BATCH_RUNS_KEY,
    BATCH_LOST_KEY,
    BATCH_CHUNK_RUNS_KEY,
    ECONOMY_PREPARED_KEY,
    ECONOMY_RUNS_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_STATE_KEY,
)


def _staged_keys(batch_id: str) -> tuple[str, str, str]:
    """A batch's item keys, written before its record (order, specs, statuses)."""
    return BATCH_ORDER_KEY + batch_id, BATCH_SPECS_KEY + batch_id, BATCH_ITEMS_KEY + batch_id


def raise_exec_error(replies: Sequence[object]) -> None:
    """Raise the first error inside an ``EXEC`` reply among a plain pipeline's replies, as
    redis-py does for its own transactions: a ``MULTI`` sent by hand in a plain pipeline
    gets its ``EXEC``'s replies back as a list, a command's run-time error (a WRONGTYPE) an
    element of it, and nothing raised.

    >>> from redis.exceptions import ResponseError
    >>> raise_exec_error(["OK", "QUEUED", "QUEUED", [2, True]])
    >>> raise_exec_error(["OK", "QUEUED", "QUEUED", [ResponseError("WRONGTYPE x"), 1]])
    Traceback (most recent call last):
    ...
    redis.exceptions.ResponseError: WRONGTYPE x
    """
    for reply in replies:
        if isinstance(reply, list):
            for element in reply:
                if isinstance(element, Exception):
                    raise element


# A batch's totals in its record by rerank outcome (what batch_items.batch_tally adds)
RERANK_OUTCOMES = ("applied", "fallback", "skipped")
# Written in a batch's record at its creation: every item's outcome is added to its totals
# (an older release's batch has none: items it finished were never added, so its totals
# are unknown, not the sum of what the items finished since added)
TOTALS_MARKER = ("totals", "1")
# Written beside it since its items' failures are counted by kind (``failures``,
# ``rerank_failures``): a batch made before kept its totals but not those, which are unknown
FAILURES_MARKER = ("totals_failures", "1")
# a search's stages in the order they run; slot_wait: its wait for a CPU slot (the trace's
# slot_wait_seconds); rrf: both channels fused by the backend itself (Elasticsearch's
# retriever, SIFT_ELASTICSEARCH_NATIVE_RRF), in place of bm25, knn and fuse
STAGES = ("queue_wait", "slot_wait", "embed", "bm25", "knn", "fuse", "rrf", "rerank")


def _batch_usage(raw: dict[str, str]) -> Usage:
    """The batch's usage from its record's totals: cost ``None`` if any item's was unknown."""
    tokens = {name: int(raw.get("usage_" + name, 0)) for name in _USAGE_TOKENS}
    unpriced = int(raw.get("usage_unpriced", 0)) > 0
    cost = None if unpriced else round(float(raw.get("usage_cost_usd", 0)), 12)
    return Usage(**tokens, cost_usd=cost)


def _stage_seconds(raw: dict[str, str]) -> dict[str, float]:
    """The batch's seconds by stage from its record, in the order the stages run."""
    found = {
        name.removeprefix("seconds_"): round(float(value), 6)
        for name, value in raw.items()
        if name.startswith("seconds_")
    }
    order = {stage: n for n, stage in enumerate(STAGES)}
    return dict(sorted(found.items(), key=lambda item: order.get(item[0], len(order))))


def _by_prefix(raw: dict[str, str], prefix: str) -> dict[str, int]:
    """The counts in a batch's record whose fields start with ``prefix``, by the rest of
    their name, in name order (a kind no item ended with is absent, not 0).

    >>> _by_prefix({"failure_timeout": "2", "failure_a": "1", "rerank": "1"}, "failure_")
    {'a': 1, 'timeout': 2}
    """
    found = {
        name.removeprefix(prefix): int(value)
        for name, value in raw.items()
        if name.startswith(prefix)
    }
    return dict(sorted(found.items()))


def _batch_of(
    batch_id: str, raw: dict[str, str], counts: dict[str, str], *, owed: bool
) -> BatchJob | None:
    """The batch its record and counts hashes make, None if the record is gone; ``owed``:
    whether its webhook is in ``sift:webhooks-owed`` (:func:`webhook_state`)."""
    if not raw:
        return None
    rerank = raw.get("rerank", "")
    known = raw.get(TOTALS_MARKER[0]) == TOTALS_MARKER[1]
    failures_known = known and raw.get(FAILURES_MARKER[0]) == FAILURES_MARKER[1]
    return BatchJob(
        id=batch_id,
        tenant=raw["tenant"],
        index=raw["index"],
        lane=raw.get("lane", LANE_STANDARD),
        total=int(raw["total"]),
        created_at=float(raw["created_at"]),
        counts={s.value: int(counts.get(s.value, 0)) for s in _STATUSES},
        rerank=None if rerank == "" else rerank == "1",
        webhook_url=raw.get("webhook_url") or None,
        canceled_at=_opt_float(raw.get("canceled_at")),
        finished_at=_opt_float(raw.get("finished_at")),
        usage=_batch_usage(raw) if known else None,
        rerank_outcomes=(
            {name: int(raw.get("rerank_" + name, 0)) for name in RERANK_OUTCOMES} if known else None
        ),
        stage_seconds=_stage_seconds(raw) if known else None,
        failures=_by_prefix(raw, FAILURE_PREFIX) if failures_known else None,
        rerank_failures=_by_prefix(raw, RERANK_FAILURE_PREFIX) if failures_known else None,
        webhook=webhook_state(raw, owed=owed),
    )


class BatchRecords(_StoreCore):
    """A batch, its items in submission order, their results, and its cancel (its items'
    moves: :class:`~worker.queue.jobstore.batch_items.BatchItemRecords`)."""

    def create_batch(
        self,
        tenant: str,
        index: str,
        items: Sequence[tuple[str, SearchSpec | str]],
        *,
        lane: str = LANE_STANDARD,
        rerank: bool | None = None,
        webhook_url: str | None = None,
        enqueue: Enqueue | None = None,
        claim: IdempotencyRef | None = None,
        owed_bytes: int = 0,
    ) -> BatchJob:
        """Store a batch and its items, all ``queued``, with its task messages from
        ``enqueue`` and, with ``claim``, the Idempotency-Key bound to it. ``owed_bytes``:
        what its items' results will add, as the gateway priced them
        (``api_gateway.backpressure.results_bytes``), owed an even share an item (its record's
        ``owed_item_bytes``, rounded up) until each item ends.

        The items go first, in a pipeline of slices (:meth:`_stage_items`): Redis serves
        other clients between two slices, where one MULTI of 100,000 items held it for a
        quarter of a second. Nothing reads them until the batch's record exists, which the
        commit then writes in one MULTI with its counts, its task messages and the key's
        binding (the outbox: no record without its messages). The MULTI runs under a WATCH
        of the key and of the record: it raises :class:`IdempotencyKeyBound`, writing
        nothing and dropping the items, if the key names a job already; and a MULTI whose
        reply was lost to a broken connection is not written twice (the WATCH makes redis-py
        try again, which finds the record; with Redis away then, a restart, it is tried
        again for :data:`~worker.queue.jobstore.store.RESEND_SECONDS`). Query ids must be
        unique; a spec may come as its JSON already (the gateway's, which turns each slice
        of a big batch into strings as it validates it)."""
        batch = BatchJob(
            id=_new_id(BATCH_ID_PREFIX),
            tenant=tenant,
            index=index,
            lane=lane,
            total=len(items),
            created_at=_now(),
            rerank=rerank,
            webhook_url=webhook_url,
        )
        batch.counts = {s.value: 0 for s in _STATUSES}
        batch.counts[JobStatus.QUEUED.value] = batch.total
        bid = batch.id
        self._stage_items(
            bid, [(qid, s if isinstance(s, str) else s.model_dump_json()) for qid, s in items]
        )
        messages = list(enqueue(bid)) if enqueue is not None else []
        binding = _idem_binding(claim, bid) if claim is not None else None
        watched = [BATCH_KEY + bid] + ([binding[0]] if binding is not None else [])

        def commit(pipe: redis.client.Pipeline) -> None:
            if pipe.exists(BATCH_KEY + bid):
                return  # this MULTI was applied, its reply lost
            if not pipe.exists(BATCH_ORDER_KEY + bid):  # Redis came back without them
                pipe.unwatch()
                raise redis.ConnectionError(f"batch {bid}: its items were lost before its commit")
            if binding is not None and claim is not None:
                earlier = _bound(cast(str | None, pipe.get(binding[0])), claim.fingerprint)
                if earlier is not None:
                    pipe.unwatch()
                    self.redis.delete(*_staged_keys(bid))
                    raise IdempotencyKeyBound(earlier)
            # dated at its commit, not before its items were staged (a big batch's take
            # seconds): newest first, a batch committed after another is listed above it
            batch.created_at = _now()
            pipe.multi()
            self._commit_batch(pipe, batch, messages, -(-owed_bytes // max(1, batch.total)))
            if binding is not None:
                name, value, ttl = binding
                pipe.set(name, value, ex=ttl)

        resending()(self.redis.transaction, commit, *watched)
        return batch

    def _stage_items(self, batch_id: str, specs: Sequence[tuple[str, str]]) -> None:
        """Write a new batch's items (order, specs, statuses), ``BATCH_STAGE_SLICE`` per
        command, living ``BATCH_STAGING_TTL_SECONDS`` until the commit keeps them: a gateway
        that dies before its commit leaves nothing for long.

        One pipeline of slices, each its own ``MULTI`` with the keys' ``EXPIRE``: Redis
        serves other clients between two slices, and a pipeline cut short (the gateway
        killed, the connection broken) applies whole slices only, each key's TTL with its
        first write. The first slice starts by emptying the keys, so a retry of the
        pipeline (redis-py sends it again after a broken connection) does not push the
        order twice. A command failing inside a slice's ``EXEC`` raises, as in
        redis-py's own transactions (:func:`raise_exec_error`)."""
        keys = _staged_keys(batch_id)
        order, spec_key, item_key = keys
        pipe = self.redis.pipeline(transaction=False)
        for start in range(0, len(specs), BATCH_STAGE_SLICE):
            part = specs[start : start + BATCH_STAGE_SLICE]
            # MULTI inside a plain pipeline: one transaction per slice, not one for all
            pipe.execute_command("MULTI")  # type: ignore[no-untyped-call]
            if start == 0:
                pipe.delete(*keys)
            pipe.rpush(order, *[qid for qid, _ in part])
            pipe.hset(spec_key, mapping=dict(part))
            pipe.hset(item_key, mapping={qid: "queued" for qid, _ in part})
            for key in keys:
                pipe.expire(key, BATCH_STAGING_TTL_SECONDS)
            pipe.execute_command("EXEC")  # type: ignore[no-untyped-call]
        raise_exec_error(pipe.execute())

    def _commit_batch(
        self,
        pipe: redis.client.Pipeline,
        batch: BatchJob,
        messages: Sequence[tuple[str, str]],
        owed_item: int = 0,
    ) -> None:
        """Queue a new batch's commit in ``pipe``'s MULTI: its record, counts, its staged
        items kept (their short TTL dropped: no key of a batch not final expires, so its items
        stay counted as long as they are queued or running; the move or cancel that completes
        it gives every key its retention), the queued count and the bytes its items owe
        (``owed_item`` each, released as each ends), the re-drive's active set and its task
        messages."""
        bid = batch.id
        pipe.hset(
            BATCH_KEY + bid,
            mapping={
                "tenant": batch.tenant,
                "index": batch.index,
                "lane": batch.lane,
                "rerank": "" if batch.rerank is None else ("1" if batch.rerank else "0"),
                "webhook_url": batch.webhook_url or "",
                "total": str(batch.total),
                "created_at": repr(batch.created_at),
                TOTALS_MARKER[0]: TOTALS_MARKER[1],
                FAILURES_MARKER[0]: FAILURES_MARKER[1],
            },
        )
        if owed_item > 0:
            pipe.hset(BATCH_KEY + bid, "owed_item_bytes", str(owed_item))
            pipe.hincrby(STATS_KEY, "owed_bytes", owed_item * batch.total)
        pipe.hset(BATCH_COUNTS_KEY + bid, mapping={k: str(v) for k, v in batch.counts.items()})
        # a placeholder field ("" is never a query id) so the key exists now, as it always has
        pipe.hset(BATCH_RESULTS_KEY + bid, "", "")
        for prefix in BATCH_KEYS:  # its staged items' (the others come later, with none)
            pipe.persist(prefix + bid)
        pipe.hincrby(STATS_KEY, JobStatus.QUEUED.value, batch.total)
        # An economy batch too: its chunks are re-driven as any batch's. Once its items are
        # prepared they wait on provider batches (not pending for the re-drive, which then
        # forgets the batch); its submission and polls have their own watch.
        pipe.zadd(ACTIVE_JOBS_KEY, {bid: batch.created_at})
        index_job(pipe, KIND_BATCH, batch.tenant, bid, batch.created_at, self.result_ttl)
        for key, raw in messages:
            pipe.lpush(key, raw)

    def get_batch(self, batch_id: str) -> BatchJob | None:
        # one snapshot, as a search's GET reads it (SearchRecords.get_search)
        [raw, counts], [owed] = self._snapshot(
            [BATCH_KEY + batch_id, BATCH_COUNTS_KEY + batch_id], [batch_id]
        )
        return _batch_of(batch_id, raw, counts, owed=owed)

    def batch_query_ids(self, batch_id: str, start: int, stop: int) -> list[str]:
        """Query ids ``start`` (inclusive) to ``stop`` (exclusive), in submission order."""
        if stop <= start:
            return []
        return cast(list[str], self.redis.lrange(BATCH_ORDER_KEY + batch_id, start, stop - 1))

    def batch_items(self, batch_id: str, query_ids: Sequence[str]) -> list[BatchItem]:
        if not query_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(BATCH_ITEMS_KEY + batch_id, list(query_ids))
        pipe.hmget(BATCH_SPECS_KEY + batch_id, list(query_ids))
        statuses, specs = cast(list[list[str | None]], pipe.execute())
        items = []
        for qid, status, spec in zip(query_ids, statuses, specs, strict=True):
            if status is None:
                continue
            items.append(
                BatchItem(
                    qid, JobStatus(status), SearchSpec.model_validate_json(spec) if spec else None
                )
            )
        return items

    def cancel_batch(
        self,
        batch_id: str,
        *,
        announce: Sequence[tuple[str, str]] = (),
        count: tuple[str, str] | None = None,
        provider: tuple[str, str] | None = None,
    ) -> tuple[int, bool] | CancelOutcome:
        """Mark the batch canceled and cancel every item still queued; an item already
        taken by a worker is canceled when it next checks the mark (before it starts and
        before its model call). Returns (canceled now, batch completed now); a missing or
        finished batch changes nothing and returns why.

        ``announce`` (broker messages, (list key, raw message): the batch's webhook) is
        written by the same script if the cancel completes the batch, so that completion is
        announced even when the caller never hears the answer. The script is sent again,
        with the same token, on a broken connection for
        :data:`~worker.queue.jobstore.store.RESEND_SECONDS`: a reply lost after the cancel
        ran is answered as it ran (not ``already_finished``).

        ``count`` (a broker message: the batch's :data:`~worker.constants.CANCEL_COUNT_TASK`)
        is written by the same script if the cancel ended any item, which it adds up in the
        batch's record for that task to count (:meth:`take_cancel_count`): counted once, even
        when the caller never hears the answer (who hears it then counts nothing). Without
        it, counting is the caller's.

        ``provider`` (a broker message: an economy batch's
        :data:`~worker.constants.ECONOMY_CANCEL_TASK`) is written by the same script if the
        cancel leaves the batch running (items wait on provider batches): its provider
        batches are canceled even when the caller never hears the answer or dies."""
        messages = [
            *([count] if count is not None else []),
            *([provider] if provider is not None else []),
            *announce,
        ]
        keys = [
            BATCH_ITEMS_KEY + batch_id,
            BATCH_COUNTS_KEY + batch_id,
            BATCH_KEY + batch_id,
            STATS_KEY,
            ACTIVE_JOBS_KEY,
            WEBHOOKS_OWED_KEY,
            *[prefix + batch_id for prefix in _CANCEL_RETAINED],
            *[prefix + batch_id for prefix in RE_DRIVE_KEYS],
            *[key for key, _ in messages],
        ]
        args = [
            repr(_now()),
            batch_id,
            move_token(),
            ("1" if count is not None else "0") + ("1" if provider is not None else "0"),
            str(self.result_ttl),
            *[raw for _, raw in messages],
        ]
        retrying = resending()
        reply = retrying(self._cancel_batch, keys=keys, args=args)
        canceled, completed = cast(list[int], reply)
        if canceled == -1:
            return CancelOutcome.MISSING
        if canceled == -2:
            return CancelOutcome.ALREADY_FINISHED
        return int(canceled), bool(completed)

    def take_cancel_count(self, batch_id: str, token: str | None = None) -> tuple[int, bool]:
        """What the batch's cancels ended that is not counted yet (items canceled, whether a
        cancel completed the batch), taken: the next take answers (0, False). Sent again
        with the same token on a broken connection, as a cancel is: a reply lost after the
        take ran is answered as it ran, so what it took is still counted. ``token``: the
        take's own (a caller sending it again after this gave up, Redis down past
        :data:`~worker.queue.jobstore.store.RESEND_SECONDS`, is answered what it took); a
        fresh one if None."""
        retrying = resending()
        args = [token or move_token()]
        got = retrying(self._take_cancel_count, keys=[BATCH_KEY + batch_id], args=args)
        return int(got[0]), bool(int(got[1]))

    def batch_results(self, batch_id: str, start: int, count: int) -> list[ItemOutcome]:
        """At most ``count`` results from position ``start``, in submission order, as a page
        has them (none of a batch gone)."""
        return self.batch_results_page(batch_id, start, count) or []

    def batch_results_page(
        self, batch_id: str, start: int, count: int, max_bytes: int = MAX_RESULTS_PAGE_BYTES
    ) -> list[ItemOutcome] | None:
        """At most ``count`` results from position ``start``, in submission order, ending
        before the first whose stored outcome would take the page's past ``max_bytes`` (the
        first is always read, however large, so paging goes on); None if the batch is gone
        (erased or expired) when they are read. A count alone let a page of items of long
        hits be 948 MB, all of it held by the gateway at once; the sizes are read in Redis
        before the outcomes, so one past the budget is never copied out. Its record is read
        in the one snapshot that reads its items (_READ_RESULTS_PAGE: a MULTI would be
        refused at Redis's maxmemory), so an erase coming between the page's reads is seen:
        it made a page of ``[]`` (the order read after it), or of items each read as
        ``queued`` with no outcome (read after it), answered with a token for the next
        page."""
        qids = self.batch_query_ids(batch_id, start, start + count)
        keys = [BATCH_KEY + batch_id, BATCH_ITEMS_KEY + batch_id, BATCH_RESULTS_KEY + batch_id]
        kept, statuses, outcomes = cast(
            tuple[int, list[str | None], list[str | None]],
            self._read_results_page(keys=keys, args=[max_bytes, *qids]),
        )
        if not kept:
            return None
        return [
            ItemOutcome(qid, JobStatus(status or "queued"), outcome or None)
            for qid, status, outcome in zip(qids[: len(statuses)], statuses, outcomes, strict=True)
        ]

    def query_ids_at(self, batch_id: str, positions: Sequence[int]) -> list[str | None]:
        """The query ids at these positions of the submission order (None past the end)."""
        pipe = self.redis.pipeline(transaction=False)
        for position in positions:
            pipe.lindex(BATCH_ORDER_KEY + batch_id, position)
        return cast(list[str | None], pipe.execute())

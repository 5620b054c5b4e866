"""The economy lane's state of a batch (:mod:`worker.queue.economy`): its prepared searches,
its runs and provider batches (``ECONOMY_*_KEY`` hashes), and its once-only claims.

Each hash lives as long as the batch's record (``_ECONOMY_WRITE``, ``_ECONOMY_LEASE``, with
every write): no TTL while the batch runs, as none of its keys has (a batch that waits on its
provider batches, or on workers stopped, longer than the retention still has what it needs to
finish), and the retention from the move or cancel that completes it (``_TRANSITION_ITEM``,
``_CANCEL_BATCH``). And each is written only while that record exists, as is the economy
watch's member and a lease: ``sift tenant purge`` deletes the record with every other key of
the batch, and a step of the lane still running then (``--force``, or a worker not restarted
yet) wrote its key back, named by no record a second purge could find. A write refused so
answers False: the batch is gone, and there is nothing left to do for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import redis

from worker.constants import (
    BATCH_COUNTS_KEY,
    BATCH_ITEMS_KEY,
    BATCH_KEY,
    ECONOMY_LEASE_KEY,
    ECONOMY_LEASED_MARK,
    ECONOMY_PREPARED_KEY,
    ECONOMY_STATE_KEY,
    ECONOMY_WATCH_KEY,
    WORKER_HEARTBEAT_KEY,
)
from worker.queue.jobstore.records import FINAL, _now
from worker.queue.jobstore.store import _StoreCore


class EconomyLaneRecords(_StoreCore):
    """The economy lane's hashes of one batch, living as long as its record."""

    def _economy_write(self, batch_id: str, key: str, op: str, pairs: list[str]) -> list[Any]:
        """``_ECONOMY_WRITE``: ``[-1, ""]`` when refused (the batch's record gone)."""
        return cast(
            list[Any], self._economy_write_script(keys=[key + batch_id, BATCH_KEY + batch_id],
                                                  args=[op, *pairs])
        )  # fmt: skip

    def economy_save(self, batch_id: str, key: str, values: dict[str, str]) -> bool:
        """HSET ``values`` into one of the batch's economy hashes (``ECONOMY_*_KEY``), if the
        batch's record exists: False if it is gone (erased, or expired), nothing written."""
        if not values:
            return True
        pairs = [part for item in values.items() for part in item]
        return int(self._economy_write(batch_id, key, "HSET", pairs)[0]) >= 0

    def economy_save_prepared(self, batch_id: str, query_id: str, value: str) -> bool:
        """Keep an item's prepared first half (``ECONOMY_PREPARED_KEY``), the first one only,
        and only while the batch's record exists and the item is running (``_SAVE_PREPARED``):
        True if it was written. False if one was there already (kept as it was), or the item
        is gone: canceled, finished, or erased by ``sift tenant purge`` while its first half
        ran, which an unconditional write put back (the tenant's query and its documents'
        texts) for the whole retention."""
        keys = [ECONOMY_PREPARED_KEY, BATCH_KEY, BATCH_ITEMS_KEY]
        written = self._save_prepared(keys=[k + batch_id for k in keys], args=[query_id, value])
        return int(written) == 1

    def economy_get(self, batch_id: str, key: str, fields: Sequence[str]) -> list[str | None]:
        if not fields:
            return []
        return cast(list[str | None], self.redis.hmget(key + batch_id, list(fields)))

    def economy_all(self, batch_id: str, key: str) -> dict[str, str]:
        return cast(dict[str, str], self.redis.hgetall(key + batch_id))

    def economy_fields(self, batch_id: str, key: str) -> list[str]:
        return cast(list[str], self.redis.hkeys(key + batch_id))

    def economy_claim(self, batch_id: str, claim: str) -> bool:
        """True for the first caller only: e.g. the one chunk that enqueues the submission.
        False for every caller once the batch's record is gone."""
        written, _ = self._economy_write(batch_id, ECONOMY_STATE_KEY, "HSETNX",
                                         [claim, repr(_now())])  # fmt: skip
        return int(written) == 1

    def economy_claim_for(self, batch_id: str, claim: str, owner: str) -> bool:
        """True for ``owner`` if it is the first to claim ``claim``, or the one that did: a
        once-only step that its owner's next run (a retry, a redelivery) may still take.
        False once the batch's record is gone."""
        written, holder = self._economy_write(batch_id, ECONOMY_STATE_KEY, "HSETNX",
                                              [claim, owner])  # fmt: skip
        return int(written) >= 0 and holder == owner

    def economy_settled(self, batch_id: str) -> bool:
        """True once every item of the batch is final or prepared (its prompt waits to go)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hlen(ECONOMY_PREPARED_KEY + batch_id)
        pipe.hmget(BATCH_COUNTS_KEY + batch_id, [s.value for s in FINAL])
        pipe.hget(BATCH_KEY + batch_id, "total")
        prepared, finals, total = pipe.execute()
        done = int(prepared) + sum(int(n or 0) for n in finals)
        return total is not None and done >= int(total)

    def economy_delete(self, batch_id: str) -> None:
        """Forget a finished batch's prepared searches (the biggest economy key)."""
        self.redis.delete(ECONOMY_PREPARED_KEY + batch_id)

    def economy_expect(self, batch_id: str, what: str, due: float) -> None:
        """The economy task for ``what`` (a provider batch id, or ``submit``) of the batch
        should run again by ``due`` (epoch seconds); past it, its message was lost. Nothing
        is watched once the batch's record is gone."""
        self._economy_expect(keys=[ECONOMY_WATCH_KEY, BATCH_KEY + batch_id],
                             args=[repr(due), f"{batch_id} {what}"])  # fmt: skip

    def economy_hand_over(self, batch_id: str, what: str, task_id: str) -> None:
        """The message ``task_id``, about to be sent, is the one to run the economy task for
        ``what``: any other message of that task still on its way is superseded."""
        self.economy_save(batch_id, ECONOMY_STATE_KEY, {f"chain {what}": task_id})

    def economy_take(self, batch_id: str, what: str, task_id: str) -> bool:
        """Whether the message ``task_id`` is the one to run the economy task for ``what``
        (one sent before any was named, as by an earlier release, is taken as it). None is,
        once the batch's record is gone."""
        return self.economy_claim_for(batch_id, f"chain {what}", task_id)

    def economy_lease(
        self, batch_id: str, what: str, holder: str, seconds: float, *,
        renew: bool = False, resume: bool = False, mark: tuple[str, str] | None = None,
    ) -> bool:  # fmt: skip
        """Take, or keep, the lease on running the economy task for ``what``: True if the run
        ``holder`` (``"<worker id> <run token>"``) holds it now, for ``seconds`` more. False
        while another run holds it and that run's worker is alive (its heartbeat key lives;
        a holder of no known worker, until the lease expires): that run is under way, and two
        runs at once would each map and resubmit. A dead worker's lease is taken over.
        ``renew``: only kept, never taken again: False unless ``holder`` holds it still. A
        run whose lease was taken over may find it free again (its taker ended, or the lease
        ran out), and taking it again, would go on where another run went on already.
        ``resume`` (with ``renew``, the run's own next step): also taken again if it ran out
        with no run taking it since (Redis away past its term), as every take records its
        taker; the run goes on where it was.
        ``mark`` (a field and value of the batch's ``ECONOMY_STATE_KEY`` hash) is written in
        the same step, only if the lease is held: what its holder did while it held it.
        False, nothing written, once the batch's record is gone (the lease names the batch,
        and its taker is written into its state)."""
        key = ECONOMY_LEASE_KEY + f"{batch_id} {what}"
        state = ECONOMY_STATE_KEY + batch_id
        taker = ECONOMY_LEASED_MARK + what  # every take writes it (a take changes ``key``)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]
                    current = cast(str | None, pipe.get(key))
                    if (
                        renew
                        and current != holder
                        and (current is not None or not resume or pipe.hget(state, taker) != holder)
                    ):
                        pipe.unwatch()
                        return False
                    if current is not None and current != holder:
                        worker = current.split(" ", 1)[0]
                        if not worker or pipe.exists(WORKER_HEARTBEAT_KEY + worker):
                            pipe.unwatch()
                            return False
                    fields = [*([taker, holder] if current != holder else []), *(mark or ())]
                    pipe.multi()
                    self._economy_lease(
                        keys=[key, state, BATCH_KEY + batch_id],
                        args=[holder, str(max(1, int(seconds * 1000))), *fields],
                        client=pipe,
                    )
                    (taken,) = pipe.execute()
                    return int(taken) == 1
                except redis.WatchError:
                    continue

    def economy_unlease(self, batch_id: str, what: str, holder: str) -> None:
        """Give the lease back, if ``holder`` still holds it (its run ended)."""
        key = ECONOMY_LEASE_KEY + f"{batch_id} {what}"
        with self.redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)  # type: ignore[no-untyped-call]
                if pipe.get(key) == holder:
                    pipe.multi()
                    pipe.delete(key)
                    pipe.execute()
                else:
                    pipe.unwatch()
            except redis.WatchError:
                pass  # taken meanwhile: no longer ours to give back

    def economy_waiting(self, batch_id: str, what: str) -> bool:
        """Whether the economy task for ``what`` is to run again (its watch set, not met)
        and no run of it holds its lease now: it waits for its message (a retry's)."""
        watched = self.redis.zscore(ECONOMY_WATCH_KEY, f"{batch_id} {what}") is not None
        return watched and not self.redis.exists(ECONOMY_LEASE_KEY + f"{batch_id} {what}")

    def economy_met(self, batch_id: str, what: str) -> None:
        """That economy task needs no other run (its provider batch mapped, say)."""
        self.redis.zrem(ECONOMY_WATCH_KEY, f"{batch_id} {what}")

    def economy_overdue(self, now: float, limit: int = 1000) -> list[tuple[str, str]]:
        """(batch id, what) of the economy tasks that should have run by ``now``."""
        members = cast(
            list[str], self.redis.zrangebyscore(ECONOMY_WATCH_KEY, "-inf", now, 0, limit)
        )
        return [cast(tuple[str, str], tuple(m.split(" ", 1))) for m in members if " " in m]

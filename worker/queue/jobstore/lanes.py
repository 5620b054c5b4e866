"""The economy lane's state of a batch (:mod:`worker.queue.economy`): its prepared searches,
its runs and provider batches (``ECONOMY_*_KEY`` hashes), and its once-only claims.

Each hash lives as long as the batch's record (``_LIVE_AS_BATCH``, after every write): no TTL
while the batch runs, as none of its keys has (a batch that waits on its provider batches, or
on workers stopped, longer than the retention still has what it needs to finish), and the
retention from the move or cancel that completes it (``_TRANSITION_ITEM``, ``_CANCEL_BATCH``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

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

    def _live_as_record(self, pipe: redis.client.Pipeline, batch_id: str, key: str) -> None:
        """Queue, in ``pipe`` after its write, the TTL of the batch's economy hash ``key``:
        its record's (none while the batch runs; the retention for a record gone)."""
        self._live_as_batch(
            keys=[key, BATCH_KEY + batch_id], args=[str(self.result_ttl)], client=pipe
        )

    def economy_save(self, batch_id: str, key: str, values: dict[str, str]) -> None:
        """HSET ``values`` into one of the batch's economy hashes (``ECONOMY_*_KEY``)."""
        if not values:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key + batch_id, mapping={k: v for k, v in values.items()})
        self._live_as_record(pipe, batch_id, key + batch_id)
        pipe.execute()

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
        """True for the first caller only: e.g. the one chunk that enqueues the submission."""
        key = ECONOMY_STATE_KEY + batch_id
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(key, claim, repr(_now()))
        self._live_as_record(pipe, batch_id, key)
        won, _ = pipe.execute()
        return bool(won)

    def economy_claim_for(self, batch_id: str, claim: str, owner: str) -> bool:
        """True for ``owner`` if it is the first to claim ``claim``, or the one that did: a
        once-only step that its owner's next run (a retry, a redelivery) may still take."""
        key = ECONOMY_STATE_KEY + batch_id
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(key, claim, owner)
        pipe.hget(key, claim)
        self._live_as_record(pipe, batch_id, key)
        _, holder, _ = pipe.execute()
        return bool(holder == owner)

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
        should run again by ``due`` (epoch seconds); past it, its message was lost."""
        self.redis.zadd(ECONOMY_WATCH_KEY, {f"{batch_id} {what}": due})

    def economy_hand_over(self, batch_id: str, what: str, task_id: str) -> None:
        """The message ``task_id``, about to be sent, is the one to run the economy task for
        ``what``: any other message of that task still on its way is superseded."""
        key = ECONOMY_STATE_KEY + batch_id
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, f"chain {what}", task_id)
        self._live_as_record(pipe, batch_id, key)
        pipe.execute()

    def economy_take(self, batch_id: str, what: str, task_id: str) -> bool:
        """Whether the message ``task_id`` is the one to run the economy task for ``what``
        (one sent before any was named, as by an earlier release, is taken as it)."""
        key = ECONOMY_STATE_KEY + batch_id
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(key, f"chain {what}", task_id)
        pipe.hget(key, f"chain {what}")
        self._live_as_record(pipe, batch_id, key)
        _, owner, _ = pipe.execute()
        return bool(owner == task_id)

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
        the same step, only if the lease is held: what its holder did while it held it."""
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
                    pipe.multi()
                    pipe.set(key, holder, px=max(1, int(seconds * 1000)))
                    if current != holder:
                        pipe.hset(state, taker, holder)
                    if mark is not None:
                        pipe.hset(state, mark[0], mark[1])
                    if current != holder or mark is not None:
                        self._live_as_record(pipe, batch_id, state)
                    pipe.execute()
                    return True
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

    def economy_met(self, batch_id: str, what: str) -> None:
        """That economy task needs no other run (its provider batch mapped, say)."""
        self.redis.zrem(ECONOMY_WATCH_KEY, f"{batch_id} {what}")

    def economy_overdue(self, now: float, limit: int = 1000) -> list[tuple[str, str]]:
        """(batch id, what) of the economy tasks that should have run by ``now``."""
        members = cast(
            list[str], self.redis.zrangebyscore(ECONOMY_WATCH_KEY, "-inf", now, 0, limit)
        )
        return [cast(tuple[str, str], tuple(m.split(" ", 1))) for m in members if " " in m]

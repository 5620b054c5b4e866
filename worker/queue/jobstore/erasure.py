"""One finished job's erasure by its tenant (``DELETE /v1/searches/{id}``, ``DELETE
/v1/batches/{id}/results``): every key of it deleted, as ``sift tenant purge`` deletes a
tenant's, and a mark left that says it was erased.

Why. A result is a snapshot of the hits it returned, their text included, kept for the
retention (7 days by default) after a delete of the documents it holds; so is a search's or
a batch's query text. A takedown or erasure request for one job could only be met by lowering
``SIFT_RESULT_RETENTION_SECONDS`` for everyone or purging the whole tenant.

What goes: the job's record (spec and query, result with hits and trace, error, usage), a
batch's items, order, specs, results, counts, moves, run claims, chunk claims, runs lost and
its economy lane's hashes (prepared items hold candidates' text), the re-drive's counters,
and the job's members in the tenant's job list, the active set, the webhooks owed (a webhook
not yet delivered is not sent: the task drops a copy whose job was erased), the economy watch
and the re-drive's suspects. The check that the job has finished, the delete of its keys and
the mark are one script (``_ERASE_JOB``); the families found by a ``SCAN`` (an economy
task's leases, the watch's members, which name the batch and hold no text) go after, through
the purge's own :meth:`~worker.queue.jobstore.tenants.TenantRecords.delete_tenant_jobs`.

An economy batch's provider batches (the provider keeps their requests and results, queries
and candidates' text, for 29 days) are deleted there by a task the erase's script enqueues
(``sift.economy_delete``, :mod:`worker.queue.economy.deletion`), their ids kept for it in
``sift:eco-delete:<id>`` until each is deleted: those Sift made and recorded, and a create in
doubt's candidates whose results proved them ours; never one judged another client's. A
candidate not judged yet (still running, so whose it is no one knows; never canceled: it may
be another client's) is kept aside with its create's submission
(``sift:eco-delete-candidates:<id>``), and the task judges it once it ended, by its results as
a poll would have: ours, it is deleted with the rest; else it is left. After the erase no
poll reads it again: kept with the others only, one of Sift's stayed at the provider, queries
and candidates' text, for its 29 days.

Redis's files: the AOF (and an RDB snapshot) still hold the writes that stored the job. The
erase's script marks a rewrite owed and the erase asks for it (``BGREWRITEAOF``, or
``BGSAVE``), at most once per :data:`~worker.constants.REWRITE_INTERVAL_SECONDS`, the re-drive's
sweep asking for one held back (:mod:`~worker.queue.jobstore.rewrite`). An erase of a job
erased already owes it again: one made by a gateway older than the mark owed none, and the
AOF kept the text; sent again, the erase has it leave the disk.

What stays: the mark (``sift:erased:<id>``: tenant, kind, time; no text) for the retention,
so the job answers ``410 erased`` to its tenant rather than ``404`` (another tenant still gets
``404``), and the job's Idempotency-Key binding, for its 24 hours (the SHA-256 of the key and
of the request, and the job id; no text): a request sent again with the key is told the job
was erased rather than run again.

Nothing resurrects an erased job: every write a late run makes (a redelivered search's claim,
start or finish; an item's move; a webhook's claim, retry or end; an economy step; the
outage note of a run Redis unreachable ended) is a script that writes only while the job's
record (or a batch's items) exists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

import redis

from worker.constants import (
    ACTIVE_JOBS_KEY,
    ECONOMY_DELETE_CANDIDATES_KEY,
    ECONOMY_DELETE_CHAIN_KEY,
    ECONOMY_DELETE_COUNTED_KEY,
    ECONOMY_DELETE_KEY,
    ECONOMY_DELETE_REFUSALS_KEY,
    ECONOMY_DELETE_REFUSED_KEY,
    ECONOMY_PROVIDERS_KEY,
    ERASED_KEY,
    REWRITE_OWED_KEY,
    WEBHOOKS_OWED_KEY,
)
from worker.queue.jobstore.jobindex import KIND_BATCH, KIND_SEARCH, job_index_key
from worker.queue.jobstore.records import _now
from worker.queue.jobstore.rewrite import DueMessage, Rewrite, rewrite_if_owed, schedule_payment
from worker.queue.jobstore.store import resending
from worker.queue.jobstore.tenants import _JOB_KEYS, TenantJobs, TenantRecords

ERASABLE = (KIND_SEARCH, KIND_BATCH)
log = logging.getLogger(__name__)


class EraseOutcome(StrEnum):
    """What :meth:`ErasureRecords.erase_job` found."""

    ERASED = "erased"  # now, or by an earlier call (``erased_at`` says when)
    MISSING = "missing"  # no such job of the tenant's: never made, expired, or another's
    NOT_FINISHED = "not_finished"  # queued or running: nothing was erased


@dataclass(frozen=True, slots=True)
class Erasure:
    """An erase's outcome: when the job was erased, or the status it is still in."""

    outcome: EraseOutcome
    erased_at: float | None = None
    status: str | None = None


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ErasureRecords(TenantRecords):
    """Erase one finished search or batch of a tenant, and say whether one was erased."""

    def erase_job(
        self,
        kind: str,
        tenant: str,
        job_id: str,
        provider: tuple[str, str] | None = None,
        payment: DueMessage | None = None,
    ) -> Erasure:
        """Erase ``tenant``'s finished ``kind`` job ``job_id`` (``search`` or ``batch``). Safe to
        call again: a job erased already answers as erased, with its first erasure's time, and
        owes Redis's rewrite again (an older gateway's erase owed none).

        ``provider`` (a broker message, (list key, raw message): a batch's
        :data:`~worker.constants.ECONOMY_DELETE_TASK`) is written by the same script if the
        batch's economy lane made provider batches, whose ids it keeps for that task
        (:meth:`provider_deletions`, and the candidates it has to judge:
        :meth:`provider_candidates`): the provider holds their requests and results (queries,
        candidates' text) for 29 days, and they are deleted there even if the caller never
        hears the answer.

        ``payment`` (a :data:`~worker.constants.REWRITE_TASK` message due in so many seconds)
        is pushed when the rewrite's latch holds this erasure's rewrite back, due at its
        expiry (:func:`~worker.queue.jobstore.rewrite.schedule_payment`)."""
        if kind not in ERASABLE:
            raise ValueError(f"kind: {kind!r} is not one of {ERASABLE}")
        record, *rest = (prefix + job_id for prefix in _JOB_KEYS[kind])
        queue, message = provider if provider is not None else (ECONOMY_DELETE_KEY + job_id, "")
        keys = [record, ERASED_KEY + job_id, job_index_key(kind, tenant), ACTIVE_JOBS_KEY,
                WEBHOOKS_OWED_KEY, ECONOMY_DELETE_KEY + job_id, queue,
                ECONOMY_PROVIDERS_KEY + job_id, REWRITE_OWED_KEY,
                ECONOMY_DELETE_CANDIDATES_KEY + job_id, *rest]  # fmt: skip
        args = [tenant, job_id, kind, repr(_now()), self.result_ttl, message]
        # sent again on a broken connection: a run whose reply was lost answers "erased" then
        code, value = resending()(self._erase_job, keys=keys, args=args)
        if int(code) == -1:
            return Erasure(EraseOutcome.MISSING)
        if int(code) == 0:
            return Erasure(EraseOutcome.NOT_FINISHED, status=_text(value) or None)
        # the families a SCAN finds (leases, the economy watch's members), as a purge does
        self.delete_tenant_jobs(TenantJobs({kind: [job_id]}))
        if self.rewrite_files() is Rewrite.LATCHED and payment is not None:
            self.schedule_rewrite(payment)
        return Erasure(EraseOutcome.ERASED, erased_at=float(_text(value)))

    def schedule_rewrite(self, payment: DueMessage) -> None:
        """:func:`~worker.queue.jobstore.rewrite.schedule_payment`. Never raises: the erasure
        is done, and the rewrite stays owed for the next erase or the re-drive's sweep."""
        try:
            schedule_payment(self.redis, lambda due: self.redis.lpush(*payment(due)))
        except redis.RedisError as exc:
            log.warning("the rewrite an erasure owes not scheduled (%s): the next erase past "
                        "the interval, or the re-drive's sweep, asks it", exc)  # fmt: skip

    def rewrite_files(self) -> Rewrite:
        """Ask Redis to rewrite its files (AOF, RDB) now that an erasure owes it, unless one
        was asked within :data:`~worker.constants.REWRITE_INTERVAL_SECONDS`
        (:mod:`~worker.queue.jobstore.rewrite`). Never raises: the erasure is done, and a
        rewrite not asked stays owed for the re-drive's sweep."""
        try:
            return rewrite_if_owed(self.redis)
        except redis.RedisError as exc:
            log.warning("Redis not asked to rewrite its files after an erasure (%s): the "
                        "re-drive's sweep asks it", exc)  # fmt: skip
            return Rewrite.FAILED

    def erasure(self, job_id: str, tenant: str) -> float | None:
        """When ``tenant`` erased the job ``job_id``; None if it did not (or its mark expired)."""
        owner, when = cast(
            list[str | None], self.redis.hmget(ERASED_KEY + job_id, "tenant", "erased_at")
        )
        if owner is None or when is None or _text(owner) != tenant:
            return None
        return float(_text(when))

    def keep_provider_deletions(self, batch_id: str) -> list[str]:
        """Keep the ids of the batch's provider batches Sift made and recorded (not a create
        in doubt's candidates, unless their results proved them ours) for
        :data:`~worker.constants.ECONOMY_DELETE_TASK`, and its candidates not judged yet for
        it to judge (:meth:`provider_candidates`), as an erase keeps them (``sift tenant
        purge``, before it deletes the state naming them); answers the ids kept to delete."""
        keys = [ECONOMY_PROVIDERS_KEY + batch_id, ECONOMY_DELETE_KEY + batch_id,
                ECONOMY_DELETE_CANDIDATES_KEY + batch_id]  # fmt: skip
        # the erase's own choice (_MADE_PROVIDERS); sent again on a broken connection: a set
        made = resending()(self._keep_provider_deletions, keys=keys, args=[self.result_ttl])
        return sorted(_text(p) for p in made)

    def provider_deletions(self, batch_id: str) -> list[str]:
        """The erased batch ``batch_id``'s provider batches not deleted at the provider yet."""
        return sorted(_text(m) for m in self.redis.smembers(ECONOMY_DELETE_KEY + batch_id))

    def provider_candidates(self, batch_id: str) -> dict[str, str]:
        """The erased batch ``batch_id``'s candidates of a create in doubt not judged yet,
        each with its create's submission (the ``custom_id`` of each of its lines names it)."""
        held = self.redis.hgetall(ECONOMY_DELETE_CANDIDATES_KEY + batch_id)
        return {_text(p): _text(s) for p, s in sorted(held.items())}

    def candidate_judged(self, batch_id: str, provider_id: str, *, ours: bool) -> None:
        """The erased batch's candidate ``provider_id`` is judged: no longer kept to judge,
        and if ``ours`` (its results hold a line of the create), kept to delete
        (:meth:`provider_deletions`) instead."""
        keys = [ECONOMY_DELETE_CANDIDATES_KEY + batch_id, ECONOMY_DELETE_KEY + batch_id]
        # sent again on a broken connection: a run whose reply was lost finds nothing to do
        resending()(self._candidate_judged, keys=keys, args=[provider_id, "1" if ours else "0"])

    def provider_deleted(self, batch_id: str, provider_id: str) -> None:
        """``provider_id`` is deleted at the provider (or has no batch there any more)."""
        self.redis.srem(ECONOMY_DELETE_KEY + batch_id, provider_id)

    def provider_refused(
        self, batch_id: str, provider_id: str, submission: str | None = None
    ) -> bool:
        """The provider refused the key to delete ``provider_id`` (or, a candidate of the
        create ``submission``, to read it): no retry changes that until the key does. It is
        no longer asked at each try, but kept among the batch's refused ones, for as long as
        it would have been kept to delete, until a starting worker asks it again
        (:meth:`ask_refused`). Answers whether its delete was refused for the first time
        (to count once, however many starts ask it again; a candidate's read never is)."""
        source = ECONOMY_DELETE_KEY if submission is None else ECONOMY_DELETE_CANDIDATES_KEY
        keys = [source + batch_id, ECONOMY_DELETE_REFUSED_KEY + batch_id,
                ECONOMY_DELETE_REFUSALS_KEY, ECONOMY_DELETE_COUNTED_KEY + batch_id]  # fmt: skip
        args = [provider_id, submission or "", self.result_ttl, batch_id]
        # sent again on a broken connection: a run whose reply was lost finds it moved (so
        # a lost first reply goes uncounted, never counted twice)
        return int(resending()(self._delete_refused, keys=keys, args=args)) == 2

    def refused_batches(self) -> list[str]:
        """The erased batches some of whose provider batches' deletes were refused."""
        return sorted(_text(b) for b in self.redis.hkeys(ECONOMY_DELETE_REFUSALS_KEY))

    def refused_provider_batches(self) -> dict[str, int]:
        """How many provider batches of erasures are kept aside because the provider refused
        the key, by kind: ``delete`` (Sift's own, whose delete was refused: the provider holds
        them) and ``candidate`` (a create in doubt's, whose read was refused: maybe another
        client's), for ``sift_provider_batch_deletes_refused``. Read in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in self.redis.hkeys(ECONOMY_DELETE_REFUSALS_KEY):
            pipe.hvals(ECONOMY_DELETE_REFUSED_KEY + _text(batch_id))
        submissions = [_text(s) for held in pipe.execute() for s in held]
        made = sum(1 for s in submissions if not s)
        return {"delete": made, "candidate": len(submissions) - made}

    def ask_refused(self, batch_id: str, token: str) -> bool:
        """Whether the delete task sent with ``token`` is to ask ``batch_id``'s refused
        deletes again (:meth:`take_refused`): False when they expired (the batch leaves the
        index of refusals). The last token given is the one: a task sent with an earlier one
        takes nothing."""
        keys = [ECONOMY_DELETE_REFUSALS_KEY, ECONOMY_DELETE_REFUSED_KEY + batch_id]
        return bool(self._ask_refused(keys=keys, args=[batch_id, token]))

    def take_refused(self, batch_id: str, token: str) -> int:
        """Put ``batch_id``'s refused deletes back among those to delete (and its refused
        candidates among those to judge), if ``token`` is the one :meth:`ask_refused` gave
        last; answers how many (0: another task's turn, or none)."""
        keys = [ECONOMY_DELETE_REFUSALS_KEY, ECONOMY_DELETE_REFUSED_KEY + batch_id,
                ECONOMY_DELETE_KEY + batch_id,
                ECONOMY_DELETE_CANDIDATES_KEY + batch_id]  # fmt: skip
        # sent again on a broken connection: a run whose reply was lost took them (0 then)
        return int(resending()(self._take_refused, keys=keys, args=[batch_id, token]))

    def claim_delete_chain(self, batch_id: str, task_id: str, lease_seconds: float) -> bool:
        """Whether the delete task ``task_id`` is ``batch_id``'s one retrying chain: the lease
        was free (or lapsed: its worker died) or its own, and is now its own for
        ``lease_seconds``. False: another task's chain is live, and reads the same sets, so
        this task's work (refused ones it put back, say) is that chain's to do."""
        keys = [ECONOMY_DELETE_CHAIN_KEY + batch_id]
        return bool(self._claim_delete_chain(keys=keys, args=[task_id, _ms(lease_seconds)]))

    def end_delete_chain(
        self, batch_id: str, task_id: str, lease_seconds: float, *, waiting: bool
    ) -> bool:
        """Whether the delete task ``task_id`` retries at the end of its run: it still holds
        the chain's lease (free counts) and is ``waiting`` on the provider, or finds ids to
        delete or candidates to judge (put back since it read them); the lease is renewed
        then, let go when there is nothing left. A task whose lease another took ends."""
        keys = [ECONOMY_DELETE_CHAIN_KEY + batch_id, ECONOMY_DELETE_KEY + batch_id,
                ECONOMY_DELETE_CANDIDATES_KEY + batch_id, ECONOMY_DELETE_REFUSED_KEY + batch_id,
                ECONOMY_DELETE_COUNTED_KEY + batch_id]  # fmt: skip
        args: list[str | int] = [task_id, _ms(lease_seconds), "1" if waiting else "0"]
        return bool(self._end_delete_chain(keys=keys, args=args))

    def let_go_delete_chain(self, batch_id: str, task_id: str) -> bool:
        """Let the delete task ``task_id``'s lease on ``batch_id``'s chain go, if it still
        holds it: its run ended by an exception Celery does not retry, so no retry of it
        comes, and the next message for the batch (a starting worker's) is to take the chain
        rather than hand its work to one that no longer exists. Answers whether it was let go."""
        keys = [ECONOMY_DELETE_CHAIN_KEY + batch_id]
        return bool(self._let_go_delete_chain(keys=keys, args=[task_id]))

    def was_erased(self, job_id: str) -> bool:
        """Whether the job was erased (by its tenant: the mark's is the job's)."""
        return bool(self.redis.exists(ERASED_KEY + job_id))

"""A tenant's erasure from the job store (``sift tenant purge``): its jobs found, ended, then
every key that names the tenant or one of its jobs deleted.

Why. Removing a tenant's keys stops its requests, and the workers run none of its queued work
(``tenant_removed``), but its records (results with hit texts, specs with its queries,
idempotency keys, the job lists) stayed for the whole retention window, and a tenant name
used again inherited them. Each key family below is the job store's own (every prefix is in
:mod:`worker.constants`; the layout is :mod:`worker.queue.jobstore`'s docstring):

- per job: its record, and a batch's items, order, specs, results, counts, moves, run claims,
  runs lost, chunk claims, the economy lane's prepared items, runs, provider batches, state
  and leases, and the re-drive's counters;
- members naming a job in shared keys: the active set, the webhooks owed, the economy watch,
  the re-drive's suspects;
- per tenant: its job lists, its Idempotency-Keys, an earlier release's index settings and
  their locks, the marks of the jobs it erased one by one, and its write-version counter
  (safe to drop: a version is never below the Redis clock, :mod:`worker.write_versions`, so
  a later write of the name still comes after every write the backend applied).

Not deleted: ``sift:eco-delete:<batch id>``, the ids of an economy batch's provider batches
that ``sift tenant purge`` (or an erase before it) handed to ``sift.economy_delete``, and
``sift:eco-delete-candidates:<batch id>``, its candidates of a create in doubt for that task to
judge. They are that task's list of what is left to delete at the provider, which keeps the
batch's queries and candidates' text 29 days; they hold the provider's batch ids and the
creates' submission tokens only (no name, query or text) and go once each is deleted (or
judged another client's), or with their retention; one the provider refused for the key moves
to ``sift:eco-delete-refused:<batch id>`` (and the batch's id into
``sift:eco-delete-refusals``), asked again when a worker starts.

A job not final yet is canceled first, through the status transitions, so the counts of
queued and running work (``sift:stats:jobs``) and a batch's counts move as a cancel moves
them; a batch is canceled as ``DELETE /v1/batches/{id}`` cancels it, so an item a worker runs
stops before its model call. Only then are the keys deleted. Everything is found afresh on
each run, so a second run finds nothing and deletes nothing. ``sift tenant purge`` then asks
Redis to rewrite its files (:mod:`~worker.queue.jobstore.rewrite`), whose AOF still holds the
writes of what went.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

from worker.constants import (
    ACTIVE_JOBS_KEY,
    BATCH_CHUNK_RUNS_KEY,
    BATCH_ITEMS_KEY,
    BATCH_KEY,
    ECONOMY_LEASE_KEY,
    ECONOMY_PREPARED_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RUNS_KEY,
    ECONOMY_STATE_KEY,
    ECONOMY_WATCH_KEY,
    ERASED_KEY,
    IDEMPOTENCY_KEY,
    INDEX_SETTINGS_KEY,
    INDEX_SETTINGS_LOCK_KEY,
    INDEX_SIZE_KEY,
    INGEST_DOCS_KEY,
    INGEST_KEY,
    REDRIVE_COUNT_KEY,
    REDRIVE_OUTAGES_KEY,
    REDRIVE_POSITIONS_KEY,
    REDRIVE_SUSPECTS_KEY,
    REDRIVE_WEBHOOK_SUSPECTS_KEY,
    SEARCH_KEY,
    WEBHOOKS_OWED_KEY,
    WRITE_VERSION_TENANT_KEY,
)
from worker.contract import JobStatus
from worker.queue.jobstore.batch_items import BatchItemRecords
from worker.queue.jobstore.batches import BatchRecords
from worker.queue.jobstore.jobindex import KIND_BATCH, KIND_INGEST, KIND_SEARCH, job_index_key
from worker.queue.jobstore.records import CancelOutcome, _now
from worker.queue.jobstore.store import BATCH_KEYS

# each kind's record prefix, and the keys of one job besides its record
_RECORDS = {KIND_SEARCH: SEARCH_KEY, KIND_BATCH: BATCH_KEY, KIND_INGEST: INGEST_KEY}
_JOB_KEYS = {
    KIND_SEARCH: (SEARCH_KEY, REDRIVE_COUNT_KEY, REDRIVE_OUTAGES_KEY),
    KIND_INGEST: (INGEST_KEY, INGEST_DOCS_KEY, REDRIVE_COUNT_KEY, REDRIVE_OUTAGES_KEY),
    KIND_BATCH: (  # the keys that live as long as its record (BATCH_KEYS), and the rest
        *BATCH_KEYS, BATCH_CHUNK_RUNS_KEY, ECONOMY_PREPARED_KEY, ECONOMY_RUNS_KEY,
        ECONOMY_PROVIDERS_KEY, ECONOMY_STATE_KEY, REDRIVE_COUNT_KEY, REDRIVE_POSITIONS_KEY,
        REDRIVE_OUTAGES_KEY,
    ),
}  # fmt: skip
SCAN_COUNT = 1000
#: An ingest's statuses while a worker may still write it (:meth:`unfinished_write_indexes`).
_UNENDED = {JobStatus.QUEUED.value, JobStatus.RUNNING.value, JobStatus.CANCELED.value}


@dataclass
class TenantJobs:
    """A tenant's job ids by kind (``search``, ``batch``, ``ingest``)."""

    ids: dict[str, list[str]] = field(default_factory=dict)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for kind, ids in self.ids.items():
            for job_id in ids:
                yield kind, job_id


class TenantRecords(BatchRecords, BatchItemRecords):
    """Find, end and delete every record of one tenant (``sift tenant purge``)."""

    def tenant_jobs(self, tenant: str) -> TenantJobs:
        """The tenant's jobs: those its job lists name, and those whose record says the
        tenant (read by a ``SCAN`` of each kind's records: a record an earlier release made
        before the lists existed is named by none), each once."""
        found = TenantJobs()
        for kind, prefix in _RECORDS.items():
            ids = set(cast(list[str], self.redis.zrange(job_index_key(kind, tenant), 0, -1)))
            keys = list(self.redis.scan_iter(match=f"{prefix}*", count=SCAN_COUNT))
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.hget(key, "tenant")
            for key, owner in zip(keys, pipe.execute(), strict=True):
                if owner == tenant:
                    ids.add(str(key).removeprefix(prefix))
            # a listed id whose record expired has no job left to end, but may have keys
            found.ids[kind] = sorted(ids)
        return found

    def unfinished_write_indexes(self, jobs: TenantJobs) -> set[str]:
        """The indexes named by the tenant's ingest and delete jobs that no worker ended:
        queued, running, or canceled (only a purge cancels one, this run or an earlier one
        cut short, and the worker running it is not told: it writes at its own version when
        it gets there). The purge drops them with the indexes holding documents, so each
        gets a floor: one the tenant never had a document in has nothing to drop, and without
        a floor the write a worker was running landed after the purge, all of it."""
        ids = jobs.ids.get(KIND_INGEST, [])
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(INGEST_KEY + job_id, ["index", "status"])
        return {
            index
            for index, status in cast(list[list[str | None]], pipe.execute() if ids else [])
            if index is not None and status in _UNENDED
        }

    def cancel_tenant_jobs(self, jobs: TenantJobs) -> Counter[str]:
        """Cancel each job not final yet (a batch: as its ``DELETE`` does, then each item a
        worker holds); answers what was canceled by kind (``batch_item`` for items)."""
        canceled: Counter[str] = Counter()
        now = {"finished_at": repr(_now())}
        for kind, job_id in jobs:
            if kind == KIND_BATCH:
                canceled["batch_item"] += self._cancel_batch_items(job_id)
                continue
            prefix = _RECORDS[kind]
            allowed = "queued,running"
            # ingests are counted apart from the searches' gauge (stats:untracked)
            if self._job(prefix, job_id, JobStatus.CANCELED, allowed, now, count=kind != "ingest"):
                canceled[kind] += 1
        return canceled

    def _cancel_batch_items(self, batch_id: str) -> int:
        outcome = self.cancel_batch(batch_id)
        if isinstance(outcome, CancelOutcome):  # missing, or finished already
            return 0
        ended = outcome[0]
        statuses = cast(dict[str, str], self.redis.hgetall(BATCH_ITEMS_KEY + batch_id))
        for query_id, status in statuses.items():
            if status in ("queued", "running"):  # a worker holds it: canceled now
                ended += int(self.cancel_item(batch_id, query_id).applied)
        return ended

    def delete_tenant_jobs(self, jobs: TenantJobs) -> Counter[str]:
        """Delete every key of each job, and its members in the shared keys; answers the jobs
        that had any by kind, and ``keys`` (how many keys and members went)."""
        deleted: Counter[str] = Counter()
        batches = {job_id for kind, job_id in jobs if kind == KIND_BATCH}
        # lazy: no batch, no scan
        lease_keys = self.redis.scan_iter(match=ECONOMY_LEASE_KEY + "*", count=SCAN_COUNT)
        leases = self._named_by(batches, lease_keys, ECONOMY_LEASE_KEY)
        members = (m for m, _ in self.redis.zscan_iter(ECONOMY_WATCH_KEY, count=SCAN_COUNT))
        watched = self._named_by(batches, members)
        for kind, job_id in jobs:
            keys = [prefix + job_id for prefix in _JOB_KEYS[kind]] + leases.get(job_id, [])
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(*keys)
            pipe.zrem(ACTIVE_JOBS_KEY, job_id)
            pipe.zrem(WEBHOOKS_OWED_KEY, job_id)
            pipe.hdel(REDRIVE_SUSPECTS_KEY, job_id)
            pipe.hdel(REDRIVE_WEBHOOK_SUSPECTS_KEY, job_id)
            if watched.get(job_id):
                pipe.zrem(ECONOMY_WATCH_KEY, *watched[job_id])
            gone = sum(int(n) for n in pipe.execute())
            if gone:
                deleted[kind] += 1
                deleted["keys"] += gone
        return deleted

    @staticmethod
    def _named_by(
        batches: set[str], names: Iterable[str], prefix: str = ""
    ) -> dict[str, list[str]]:
        """``names`` (``<prefix><batch id> <what>``: an economy lease's key, a watch member)
        grouped by the batch of ``batches`` each names; one pass over the keyspace for every
        batch a purge deletes, where a scan per batch read it whole once per batch."""
        found: dict[str, list[str]] = {}
        if batches:
            for name in names:
                batch_id = name[len(prefix) :].split(" ", 1)[0]
                if batch_id in batches:
                    found.setdefault(batch_id, []).append(name)
        return found

    def delete_tenant_keys(self, tenant: str) -> Counter[str]:
        """Delete the keys that name the tenant: its job lists, its Idempotency-Keys, an
        earlier release's index settings (and locks), its indexes' recorded sizes, its
        write-version counter, the marks of the jobs it erased
        (:mod:`~worker.queue.jobstore.erasure`). Run after its indexes are dropped (each
        drop takes a write version)."""
        deleted: Counter[str] = Counter()
        families = {
            "job lists": [job_index_key(kind, tenant) for kind in _RECORDS],
            "idempotency keys": list(
                self.redis.scan_iter(match=f"{IDEMPOTENCY_KEY}{tenant}:*", count=SCAN_COUNT)
            ),
            "index settings": [
                *self.redis.scan_iter(match=f"{INDEX_SETTINGS_KEY}{tenant}:*", count=SCAN_COUNT),
                *self.redis.scan_iter(
                    match=f"{INDEX_SETTINGS_LOCK_KEY}{tenant}:*", count=SCAN_COUNT
                ),
            ],
            "index sizes": list(
                self.redis.scan_iter(match=f"{INDEX_SIZE_KEY}{tenant}:*", count=SCAN_COUNT)
            ),
            "write version": [WRITE_VERSION_TENANT_KEY + tenant],
            "erasure marks": self._erasure_marks(tenant),
        }
        for name, keys in families.items():
            gone = int(self.redis.delete(*keys)) if keys else 0
            if gone:
                deleted[name] += gone
        return deleted

    def _erasure_marks(self, tenant: str) -> list[str]:
        """The marks of the jobs ``tenant`` erased (each names its tenant in a field)."""
        keys = list(self.redis.scan_iter(match=f"{ERASED_KEY}*", count=SCAN_COUNT))
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "tenant")
        return [key for key, owner in zip(keys, pipe.execute(), strict=True) if owner == tenant]

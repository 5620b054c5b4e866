"""A tenant's jobs, newest first: the reads behind ``GET /v1/searches``, ``/v1/batches`` and
``/v1/ingestions``, from the tenant's job index (:mod:`~worker.queue.jobstore.jobindex`).

Pages go by a cursor, the (creation time, id) of the last member read, not by an offset: a
job created while a client pages through its list would shift an offset by one (an item
shown twice), while a cursor goes on below where the last page ended. A status filter reads
the records to decide, so one request reads at most ``MAX_LIST_SCAN`` members; a filtered
page can hold fewer than asked, with a cursor to go on from. So can any page once the records
it read hold ``MAX_LIST_READ_BYTES`` in their large fields (a search's spec holds its filters,
up to ~830 kB): a page of 1,000 such searches read 830 MB into the gateway. A member whose
record has expired (or is not the tenant's) is never listed, and is dropped from the index as
it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from worker.constants import (
    BATCH_COUNTS_KEY,
    BATCH_KEY,
    INGEST_KEY,
    MAX_LIST_READ_BYTES,
    MAX_LIST_SCAN,
    SEARCH_KEY,
)
from worker.contract import JobStatus
from worker.queue.jobstore.batches import _batch_of
from worker.queue.jobstore.ingests import _ingest_of
from worker.queue.jobstore.jobindex import KIND_BATCH, KIND_INGEST, KIND_SEARCH, job_index_key
from worker.queue.jobstore.records import BatchJob, IngestJob, SearchJob
from worker.queue.jobstore.searches import _search_of
from worker.queue.jobstore.store import _StoreCore

J = TypeVar("J", SearchJob, BatchJob, IngestJob)

# what a search's list entry needs: everything but its result, which can be large
_SEARCH_FIELDS = (
    "kind", "tenant", "status", "spec", "created_at", "webhook_url", "started_at",
    "finished_at", "error",
)  # fmt: skip
_FILTERED_CHUNK = 500  # members read per round trip when a status filter skips some


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a page ended: the last member read (its creation time and id)."""

    created_at: float
    job_id: str


@dataclass(slots=True)
class JobPage(Generic[J]):
    """Jobs newest first, and the cursor to read on from (None: the list ended here)."""

    jobs: list[J]
    next: Cursor | None


def fitting(sizes: Sequence[int], room: int, *, at_least_one: bool) -> int:
    """How many of ``sizes``, from the first, add up to ``room`` at most; the first always
    counts when ``at_least_one`` (a page's first entry, however large: each page moves on).

    >>> fitting([3, 3, 3], 7, at_least_one=False), fitting([9, 1], 7, at_least_one=True)
    (2, 1)
    >>> fitting([9, 1], 7, at_least_one=False)
    0
    """
    used = 0
    for count, size in enumerate(sizes):
        if used + size > room and not (at_least_one and count == 0):
            return count
        used += size
    return len(sizes)


class JobListing(_StoreCore):
    """A tenant's searches, batches and ingests, newest first, by status, a page at a time."""

    def list_searches(
        self, tenant: str, *, status: JobStatus | None, after: Cursor | None, page_size: int
    ) -> JobPage[SearchJob]:
        """Each search as its record holds it, without its result."""
        return self._list(KIND_SEARCH, tenant, self._searches, status, after, page_size)

    def list_batches(
        self, tenant: str, *, status: JobStatus | None, after: Cursor | None, page_size: int
    ) -> JobPage[BatchJob]:
        return self._list(KIND_BATCH, tenant, self._batches, status, after, page_size)

    def list_ingests(
        self, tenant: str, *, status: JobStatus | None, after: Cursor | None, page_size: int
    ) -> JobPage[IngestJob]:
        return self._list(KIND_INGEST, tenant, self._ingests, status, after, page_size)

    def _list(
        self,
        kind: str,
        tenant: str,
        read: Callable[[Sequence[str]], list[J | None]],
        status: JobStatus | None,
        after: Cursor | None,
        page_size: int,
    ) -> JobPage[J]:
        key = job_index_key(kind, tenant)
        # one more than a page: a page that ends the list says so (no empty page after it);
        # a filter's reads widen as they skip, up to a chunk of _FILTERED_CHUNK
        first = min(page_size + 1, MAX_LIST_SCAN)
        most = first if status is None else min(max(first, _FILTERED_CHUNK), MAX_LIST_SCAN)
        jobs: list[J] = []
        scanned, room, last_read = 0, MAX_LIST_READ_BYTES, after
        for chunk, last_chunk in self._scan(key, after, first, most):
            sizes = self._read_sizes(kind, [job_id for job_id, _ in chunk])
            rows = chunk[: fitting(sizes, room, at_least_one=scanned == 0)]
            if not rows:  # the budget is spent: the next page starts at this chunk
                return JobPage(jobs, last_read)
            room -= sum(sizes[: len(rows)])
            cut = len(rows) < len(chunk)
            last_chunk = last_chunk and not cut
            records = read([job_id for job_id, _ in rows])
            gone = [
                job_id
                for (job_id, _), job in zip(rows, records, strict=True)
                if job is None or job.tenant != tenant
            ]
            if gone:  # expired since: never listed again
                self.redis.zrem(key, *gone)
            for at, ((job_id, score), job) in enumerate(zip(rows, records, strict=True), 1):
                scanned += 1
                if job is not None and job.tenant == tenant and status in (None, job.status):
                    jobs.append(job)
                ended = last_chunk and at == len(rows)
                last_read = Cursor(score, job_id)
                if len(jobs) == page_size or scanned >= MAX_LIST_SCAN or (cut and at == len(rows)):
                    return JobPage(jobs, None if ended else last_read)
        return JobPage(jobs, None)

    def _read_sizes(self, kind: str, ids: Sequence[str]) -> list[int]:
        """The bytes each job's record holds in the fields its entry is read from that can be
        large: a search's spec (its filters: up to 100 values of 8 kB) and error. A batch's or
        an ingest's record is small (its queries and documents are kept apart): 0."""
        if kind != KIND_SEARCH:
            return [0] * len(ids)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hstrlen(SEARCH_KEY + job_id, "spec")
            pipe.hstrlen(SEARCH_KEY + job_id, "error")
        lengths = cast(list[int], pipe.execute())
        return [lengths[i] + lengths[i + 1] for i in range(0, len(lengths), 2)]

    def _scan(
        self, key: str, after: Cursor | None, first: int, most: int
    ) -> Iterator[tuple[list[tuple[str, float]], bool]]:
        """The index's members after ``after``, newest first, ``first`` in the first round
        trip and twice as many in each next one up to ``most``, each chunk with whether it is
        the last. Each read starts at the last member yielded
        (never at an offset, which the members pruned meanwhile would shift). Members of equal
        creation time come in Redis's order for them (reverse lexicographic), so "after" is
        exact for ties too; a tie wider than a chunk is read in wider reads."""
        cursor, chunk, num = after, first, first
        while True:
            top = "+inf" if cursor is None else repr(cursor.created_at)
            rows = cast(
                list[tuple[str, float]],
                self.redis.zrange(
                    key, top, "-inf", desc=True, byscore=True, withscores=True, offset=0, num=num
                ),
            )
            fresh = [
                (job_id, score)
                for job_id, score in rows
                if cursor is None or score < cursor.created_at or job_id < cursor.job_id
            ]
            last = len(rows) < num
            if fresh:
                yield fresh, last
                chunk = min(2 * chunk, most)
                cursor, num = Cursor(fresh[-1][1], fresh[-1][0]), chunk
            else:
                num *= 2  # every member read ties with the cursor: read further into the tie
            if last:
                return

    def _searches(self, ids: Sequence[str]) -> list[SearchJob | None]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(SEARCH_KEY + job_id, _SEARCH_FIELDS)
        replies = cast(list[list[str | None]], pipe.execute())
        # a search's entry shows no webhook (its fields are not read)
        return [
            _search_of(
                job_id, {k: v for k, v in zip(_SEARCH_FIELDS, values, strict=True) if v}, owed=True
            )
            for job_id, values in zip(ids, replies, strict=True)
        ]

    def _batches(self, ids: Sequence[str]) -> list[BatchJob | None]:
        # one snapshot: an entry shows its webhook, as a batch's GET does (get_batch)
        hashes = [key + batch_id for batch_id in ids for key in (BATCH_KEY, BATCH_COUNTS_KEY)]
        read, owed = self._snapshot(hashes, ids)
        return [
            _batch_of(batch_id, read[2 * i], read[2 * i + 1], owed=owed[i])
            for i, batch_id in enumerate(ids)
        ]

    def _ingests(self, ids: Sequence[str]) -> list[IngestJob | None]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(INGEST_KEY + job_id)
        replies = cast(list[dict[str, str]], pipe.execute())
        return [_ingest_of(job_id, raw) for job_id, raw in zip(ids, replies, strict=True)]

"""The job lists against a real redis-server: newest first, cursors exact under ties and
concurrent creates, expired records never listed, tenants apart, the filter's bounded scan."""

from __future__ import annotations

import pytest

from worker.constants import (
    BATCH_KEY,
    JOB_INDEX_RETENTIONS,
    MAX_LIST_SCAN,
    RESULT_TTL_SECONDS,
    SEARCH_KEY,
)
from worker.contract import ErrorInfo, JobStatus, SearchSpec
from worker.queue.jobstore import Cursor, JobStore
from worker.queue.jobstore.jobindex import KIND_BATCH, KIND_INGEST, KIND_SEARCH, job_index_key

pytestmark = pytest.mark.integration


def spec(query: str = "q") -> SearchSpec:
    return SearchSpec(index="docs", query=query)


def every_page(store: JobStore, tenant: str, page_size: int, **kw: object) -> list[list[str]]:
    pages: list[list[str]] = []
    after: Cursor | None = None
    while True:
        page = store.list_searches(tenant, after=after, page_size=page_size, **kw)  # type: ignore[arg-type]
        pages.append([job.id for job in page.jobs])
        if page.next is None:
            return pages
        after = page.next


def test_searches_are_listed_newest_first_page_by_page(store: JobStore) -> None:
    ids = [store.create_search("acme", spec(f"q{i}")).id for i in range(7)]
    pages = every_page(store, "acme", 3, status=None)
    assert pages == [ids[6:3:-1], ids[3:0:-1], ids[0:1]]


def test_a_job_created_between_pages_shifts_nothing(store: JobStore) -> None:
    ids = [store.create_search("acme", spec()).id for i in range(4)]
    first = store.list_searches("acme", status=None, after=None, page_size=2)
    newer = store.create_search("acme", spec()).id
    second = store.list_searches("acme", status=None, after=first.next, page_size=2)
    assert [j.id for j in first.jobs] == [ids[3], ids[2]]
    assert [j.id for j in second.jobs] == [ids[1], ids[0]]
    assert newer not in [j.id for j in first.jobs + second.jobs]


def test_equal_creation_times_are_each_listed_once(store: JobStore) -> None:
    """Ties (two gateways in one microsecond) go by id, more of them than a page holds."""
    key = job_index_key(KIND_SEARCH, "acme")
    ids = [store.create_search("acme", spec()).id for _ in range(9)]
    store.redis.zadd(key, {job_id: 1000.5 if i < 7 else 999.0 for i, job_id in enumerate(ids)})
    for size in (1, 2, 3, 10):
        pages = every_page(store, "acme", size, status=None)
        listed = [job_id for page in pages for job_id in page]
        assert sorted(listed[:7], reverse=True) == listed[:7]
        assert len(listed) == len(set(listed)) == 9, size
        assert set(listed[7:]) == set(ids[7:])


def test_an_expired_record_is_never_listed_and_leaves_the_index(store: JobStore) -> None:
    ids = [store.create_search("acme", spec()).id for _ in range(3)]
    key = job_index_key(KIND_SEARCH, "acme")
    assert 0 < store.redis.ttl(key) <= RESULT_TTL_SECONDS * JOB_INDEX_RETENTIONS
    store.redis.delete(SEARCH_KEY + ids[1])  # its TTL ran out
    page = store.list_searches("acme", status=None, after=None, page_size=10)
    assert [j.id for j in page.jobs] == [ids[2], ids[0]] and page.next is None
    assert store.redis.zscore(key, ids[1]) is None
    assert store.redis.zcard(key) == 2


def test_a_page_filled_by_the_last_member_has_no_next(store: JobStore) -> None:
    for _ in range(4):
        store.create_search("acme", spec())
    page = store.list_searches("acme", status=None, after=None, page_size=4)
    assert len(page.jobs) == 4 and page.next is None


def test_tenants_have_lists_of_their_own(store: JobStore) -> None:
    mine = {store.create_search("acme", spec()).id for _ in range(3)}
    theirs = {store.create_search("globex", spec()).id for _ in range(2)}
    batch = store.create_batch("globex", "docs", [("a", spec())])
    ingest = store.create_ingest("acme", "docs", [])
    listed = store.list_searches("acme", status=None, after=None, page_size=100).jobs
    assert {j.id for j in listed} == mine
    assert {
        j.id for j in store.list_searches("globex", status=None, after=None, page_size=100).jobs
    } == theirs
    assert [
        b.id for b in store.list_batches("globex", status=None, after=None, page_size=9).jobs
    ] == [batch.id]
    assert store.list_batches("acme", status=None, after=None, page_size=9).jobs == []
    assert [
        i.id for i in store.list_ingests("acme", status=None, after=None, page_size=9).jobs
    ] == [ingest.id]
    # a record of another tenant's, put in this tenant's index by hand, is not shown
    store.redis.zadd(job_index_key(KIND_SEARCH, "acme"), {next(iter(theirs)): 9e9})
    listed = store.list_searches("acme", status=None, after=None, page_size=100).jobs
    assert {j.id for j in listed} == mine


def test_the_status_filter_reads_records_and_bounds_its_scan(store: JobStore) -> None:
    failed = store.create_search("acme", spec())
    store.finish_search(failed.id, error=ErrorInfo(type="x", message="no"))
    queued = [store.create_search("acme", spec()).id for _ in range(MAX_LIST_SCAN + 5)]
    page = store.list_searches("acme", status=JobStatus.FAILED, after=None, page_size=10)
    assert page.jobs == [] and page.next is not None  # the scan stopped; a cursor goes on
    rest = store.list_searches("acme", status=JobStatus.FAILED, after=page.next, page_size=10)
    assert [j.id for j in rest.jobs] == [failed.id] and rest.next is None
    running = store.list_searches("acme", status=JobStatus.QUEUED, after=None, page_size=3)
    assert [j.id for j in running.jobs] == queued[:-4:-1]


def test_a_filtered_page_reads_more_records_only_as_it_skips_them(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filtered read widens as it skips: a page of 1 whose newest job matches reads a few
    records, not a full chunk of 500 (each a search's spec), and one behind skipped jobs
    still comes in a handful of round trips."""
    queued = [store.create_search("acme", spec()).id for _ in range(600)]
    reads: list[int] = []
    searches = store._searches

    def reading(ids: list[str]) -> list[object]:
        reads.append(len(ids))
        return searches(ids)  # type: ignore[return-value]

    monkeypatch.setattr(store, "_searches", reading)
    page = store.list_searches("acme", status=JobStatus.QUEUED, after=None, page_size=1)
    assert [j.id for j in page.jobs] == [queued[-1]] and sum(reads) <= 4, reads
    reads.clear()
    assert store.list_searches("acme", status=JobStatus.FAILED, after=None, page_size=1).jobs == []
    assert sum(reads) == 600 and len(reads) <= 10, reads


def test_a_batch_is_filtered_by_its_own_status(store: JobStore) -> None:
    done = store.create_batch("acme", "docs", [("a", spec())])
    store.cancel_batch(done.id)
    waiting = store.create_batch("acme", "docs", [("a", spec())])
    canceled = store.list_batches("acme", status=JobStatus.CANCELED, after=None, page_size=9)
    assert [b.id for b in canceled.jobs] == [done.id]
    queued = store.list_batches("acme", status=JobStatus.QUEUED, after=None, page_size=9)
    assert [b.id for b in queued.jobs] == [waiting.id]
    store.redis.delete(BATCH_KEY + waiting.id)
    assert store.list_batches("acme", status=None, after=None, page_size=9).jobs[0].id == done.id


def test_members_pruned_at_the_end_of_a_read_skip_nothing(store: JobStore) -> None:
    """The last members of one read expired: the next read starts after them, not at an
    offset they no longer fill."""
    ids = [store.create_search("acme", spec()).id for _ in range(12)]
    expired = {ids[10], ids[8], ids[4]}  # a page of 3 reads 4: ids[8] ends the first read
    for job_id in expired:
        store.redis.delete(SEARCH_KEY + job_id)
    pages = every_page(store, "acme", 3, status=None)
    listed = [job_id for page in pages for job_id in page]
    assert listed == [job_id for job_id in reversed(ids) if job_id not in expired]


def test_each_create_trims_members_too_old_to_have_a_record(store: JobStore) -> None:
    """A tenant that never lists its jobs does not grow its index without bound: each create
    drops the members older than the index keeps (JOB_INDEX_RETENTIONS retention periods)."""
    keep = RESULT_TTL_SECONDS * JOB_INDEX_RETENTIONS
    for kind, create in (
        (KIND_SEARCH, lambda: store.create_search("acme", spec()).id),
        (KIND_BATCH, lambda: store.create_batch("acme", "docs", [("a", spec())]).id),
        (KIND_INGEST, lambda: store.create_ingest("acme", "docs", []).id),
    ):
        key = job_index_key(kind, "acme")
        first = create()
        now = store.redis.zscore(key, first)
        assert now is not None
        store.redis.zadd(key, {"ancient": now - keep - 10, "recent": now - keep + 3600})
        newest = create()
        assert set(store.redis.zrange(key, 0, -1)) == {first, "recent", newest}, kind
        assert keep - 5 < store.redis.ttl(key) <= keep

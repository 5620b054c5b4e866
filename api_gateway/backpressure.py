"""Backpressure: past ``SIFT_MAX_BACKLOG`` queued searches and batch items, refuse new work.

The backlog is the job store's count of ``queued`` searches and batch items, with the work
every gateway admitted and is still storing (until then the store does not count it), read
and added to in one Redis script (:meth:`AsyncJobStore.hold_backlog`), so however many
gateways admit at once, together they never pass the limit.

    backlog = Backlog(async_store.hold_backlog, async_store.release_backlog, limit=10_000)
    async with backlog.admitted(len(items)):  # BacklogFull (429 with Retry-After) past the limit
        ...                                   # store the job: counted by the store from then on

And past 90 % of Redis's ``maxmemory`` (:class:`StoreMemory`), new jobs are refused with a
503 ``job_store_full`` (nothing stored, as at the limit itself), so the jobs running can
still write their ends. A batch, or a search as a batch of one, is judged with what it will
add (:func:`batch_bytes`, its items and their results, each hit priced by its index's mean
document, :func:`hit_bytes`, and each candidate its traces list by the same, cut where a
trace cuts its text, :func:`trace_candidate_bytes`, as each an economy item keeps while it
waits at the provider, :func:`waiting_candidates`), so one admitted below 90 % does not
fill Redis on its own as a rule: the price is an estimate, which errs low where the results
hold more than the index's mean (a skewed index's longest documents, a text JSON escapes,
a trace's candidates of several bytes a character; docs/queue.md, ``job_store_full``). And
what Redis holds is read with the results the work queued or running still owes, each
job's as it was priced when admitted (:func:`with_results_owed`), and with the jobs this
gateway admitted and is storing (:meth:`StoreMemory.storing`), so
batches admitted one after another, or together, do not fill it together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import redis

from worker.constants import LANE_ECONOMY
from worker.contract import SearchSpec

log = logging.getLogger(__name__)

READ_EVERY_SECONDS = 0.5
RETRY_AFTER_SECONDS = 5
HOLD_SECONDS = 60.0  # a gateway's hold on the backlog while it stores a job, at most


class BacklogFull(Exception):
    """The backlog is at its limit: answer 429 with ``Retry-After``. ``str()`` is the log's
    line, with the queued count; :attr:`public` is the client's, without it."""

    def __init__(self, queued: int, adding: int, limit: int) -> None:
        self.queued, self.adding, self.limit = queued, adding, limit
        super().__init__(
            f"the backlog is full: {queued} searches and batch items are queued, and "
            f"{adding} more would pass the limit of {limit} (SIFT_MAX_BACKLOG); "
            f"retry after {RETRY_AFTER_SECONDS} s"
        )

    @property
    def public(self) -> str:
        """What the caller is told. Not the queued count: that is every tenant's work, and
        with one other tenant busy it was that tenant's own volume, to the item."""
        return (
            f"the backlog is full: {self.adding} more searches and batch items would pass "
            f"the limit of {self.limit} (SIFT_MAX_BACKLOG); retry after {RETRY_AFTER_SECONDS} s"
        )


Hold = Callable[[str, int, int, float], Awaitable[int | None]]  # AsyncJobStore.hold_backlog
Release = Callable[[str], Awaitable[None]]  # AsyncJobStore.release_backlog


class Backlog:
    """The admission decision, made in Redis by one script for every gateway at once: the
    queued count the store keeps, plus the holds of the work each gateway admitted and is
    still storing, against the limit, so N gateways never admit N times the room left."""

    def __init__(self, hold: Hold, release: Release, limit: int) -> None:
        self.hold = hold
        self.release = release
        self.limit = limit

    @contextlib.asynccontextmanager
    async def admitted(self, items: int) -> AsyncIterator[None]:
        """Admit ``items`` or raise :class:`BacklogFull` (all or nothing); the block stores
        their job, held in the count until it ends (the store counts it from its write on;
        counted twice meanwhile, the count errs high, never low). A hold this gateway cannot
        drop (it died, Redis went away) lapses after ``HOLD_SECONDS``."""
        if self.limit <= 0:
            yield
            return
        token = uuid.uuid4().hex
        queued = await self.hold(token, items, self.limit, HOLD_SECONDS)
        if queued is not None:
            raise BacklogFull(queued, items, self.limit)
        try:
            yield
        finally:
            try:
                await asyncio.shield(self.release(token))
            except redis.RedisError as exc:  # the job's answer stands; the hold lapses
                log.warning("backpressure: a backlog hold was not dropped (%s)", exc)


#: What a search's or batch's bytes hold, and how to send one that never fits, as its refusal
#: says them (an ingest's are its documents: api_gateway/jobs/_documents.py)
RESULTS = "with its results"
SMALLER = "send its queries in smaller batches (a search: ask for fewer hits)"
#: New jobs are refused past this share of Redis's ``maxmemory``: at the limit itself Redis
#: refuses the workers' writes too (a result, a move, a heartbeat), and the jobs already
#: queued could not end. What is left is theirs.
MEMORY_ADMITTED = 0.9
FULL_RETRY_AFTER_SECONDS = 30  # a full Redis frees as finished jobs expire: not within seconds
#: What frees a full job store, said by its 503s (nearly full here, full in api_gateway.errors)
FREES = (
    "it frees as finished jobs expire (SIFT_RESULT_RETENTION_SECONDS), or with a larger "
    f"maxmemory; retry after {FULL_RETRY_AFTER_SECONDS} s"
)

MemoryReading = Callable[[], Awaitable[tuple[int, int]]]  # AsyncJobStore.memory


#: About what a batch item holds in Redis beside its id, its spec and its hits: its status,
#: its place in the order, its result's rerank, usage and timings (measured on the sample
#: corpus: a result of 10 hits took 4.3 kB, of 30 hits 12.5 kB; an item's record some 300 B)
ITEM_BYTES = 400
#: About what one hit of a result holds when its index's documents are not known: its id,
#: revision, scores, ranks, and the document's text (the sample corpus's, some 100
#: characters). Used where no worker has recorded the index's size (:func:`hit_bytes`)
HIT_BYTES = 420
#: About what one hit holds beside its document's title, text and metadata: its id,
#: revision, scores, ranks and their JSON keys (HIT_BYTES less the sample's text)
HIT_OVERHEAD_BYTES = 320
#: About what an item's trace (``include_trace``) holds beside its candidates: its fusion,
#: timings, model attempts and usage (measured 1.0 kB with one attempt)
TRACE_BYTES = 2_000
#: About what one candidate of a trace holds beside its title and text: its id, revision,
#: ranks, scores and their JSON keys (measured 175 to 231 B)
TRACE_CANDIDATE_OVERHEAD_BYTES = 250
#: What one candidate of a trace takes when its index's documents are not known (as
#: :data:`HIT_BYTES`: the sample corpus's text, some 100 characters)
TRACE_CANDIDATE_BYTES = TRACE_CANDIDATE_OVERHEAD_BYTES + HIT_BYTES - HIT_OVERHEAD_BYTES
#: What Redis holds for a result, to its JSON's bytes. A result is the value of a hash's
#: field (a batch's results hash, a search's record), past ``hash-max-listpack-value`` (64 B):
#: the hash is a hashtable, each value an allocation of its own in jemalloc's next size class
#: up, four classes to each doubling, so up to a quarter more than its bytes (and some 60 B
#: beside it, its field and entry: within ITEM_BYTES). Measured on redis-server 7.0.15
#: (jemalloc 5.3.0), values written as a worker's finish script writes them (``MEMORY USAGE
#: ... SAMPLES 0``): 2**k + 1 bytes held 1.25 times from 8 kB to 2 MB; hashes of 1 to 40
#: values of 2 kB to 2 MB (log-uniform) 1.10 times at the median, 1.22 at the 95th
#: percentile, 1.35 at most (one value of 2 kB, with its hash's own 200 B). So the bound is
#: priced, not the mean: a batch of 12 results of 363 kB, priced at their JSON (4.37 MB),
#: held 4.72 MB in its results hash and 5.1 MB of Redis in all; taken at 89.5 % of
#: maxmemory it left Redis at 90.6 %, and reached its limit on the way (a finish refused).
#: Each value also passes through a buffer of its size on its writer's connection, freed by
#: Redis's cron within a second (1.1 MB for that batch's 12 at its end): not priced, the
#: 10 % above MEMORY_ADMITTED is for that.
STORED_FACTOR = 1.25


def hit_bytes(size: tuple[int, int] | None) -> int:
    """About what one hit of a result over an index takes, from the index's ``size`` (its
    documents and their stored bytes, title, text and metadata, as a worker recorded them
    after its last write job): the hit's own fields and the index's mean document, which it
    carries whole. A result is stored as UTF-8 JSON, as the document is, so the factor is
    one: only the characters JSON escapes (a quote, a line break) weigh more there. Unknown
    (no write since this release, or a backend that does not sum it): :data:`HIT_BYTES`.
    A fixed size for every index let a batch of 40 queries over documents of 99,000
    characters be admitted as 1.7 MB and write 400 MB.

    >>> hit_bytes(None), hit_bytes((10, 1_000)), hit_bytes((100, 9_900_000))
    (420, 420, 99320)
    """
    if size is None or size[0] <= 0:
        return HIT_BYTES
    documents, stored = size
    return HIT_OVERHEAD_BYTES + -(-stored // documents)


def trace_candidate_bytes(size: tuple[int, int] | None, max_chars: int) -> int:
    """About what one candidate of a trace over an index of ``size`` (as :func:`hit_bytes`
    reads it) takes: its own fields, and its document's title and text, the text cut to
    ``max_chars`` characters (``SIFT_RERANK_CANDIDATE_MAX_CHARS``): the index's mean
    document, at most ``max_chars``. A trace's candidates were priced at a fixed 4 kB a
    trace, and carried their texts whole: one search of 50 candidates of 50,000 characters
    was priced at 55 kB and wrote 2.6 MB.

    >>> trace_candidate_bytes(None, 1_200), trace_candidate_bytes((100, 9_900_000), 1_200)
    (350, 1450)
    """
    return TRACE_CANDIDATE_OVERHEAD_BYTES + min(hit_bytes(size) - HIT_OVERHEAD_BYTES, max_chars)


def traced_candidates(spec: SearchSpec, window: int) -> int:
    """How many candidates ``spec``'s trace lists: none without ``include_trace``; its
    rerank's coarse window when it reranks (its ``limit``, or its ``candidate_limit`` if
    larger, ``window`` where it sets none: the deployment's ``SIFT_RERANK_CANDIDATE_LIMIT``),
    else its hits. An index's own ``candidate_limit`` is not known here (it is kept in the
    backend): a larger one lists more than this counts.

    >>> spec = SearchSpec(index="i", query="q", limit=5, include_trace=True, rerank=True)
    >>> unranked = spec.model_copy(update={"rerank": False})
    >>> traced_candidates(spec, 30), traced_candidates(unranked, 30)
    (30, 5)
    """
    if not spec.include_trace:
        return 0
    return _rerank_window(spec, window) if spec.rerank else spec.limit


def waiting_candidates(spec: SearchSpec, window: int, lane: str) -> int:
    """How many candidates an item of ``spec`` keeps in Redis while it waits at the provider
    (the economy ``lane``'s, reranked: its prepared search, the head of each candidate's
    text up to the prompt's cut): its rerank's coarse window, as :func:`traced_candidates`
    counts it; none in the standard lane, or unreranked.

    >>> spec = SearchSpec(index="i", query="q", limit=5, rerank=True)
    >>> waiting_candidates(spec, 30, "economy"), waiting_candidates(spec, 30, "standard")
    (30, 0)
    """
    return _rerank_window(spec, window) if lane == LANE_ECONOMY and spec.rerank else 0


def _rerank_window(spec: SearchSpec, window: int) -> int:
    return max(spec.limit, spec.candidate_limit or window)


def batch_bytes(
    items: list[tuple[str, str]],
    hits: int,
    traced: int = 0,
    per_hit: int = HIT_BYTES,
    per_candidate: int = TRACE_CANDIDATE_BYTES,
    waiting: int = 0,
) -> int:
    """About how many bytes a batch will hold in Redis once each item has its result:
    ``items`` its (query id, spec JSON) pairs, ``hits`` the most hits their results hold (the
    sum of their limits), ``traced`` the candidates their traces list (the sum of
    :func:`traced_candidates`: 0 without ``include_trace``), ``per_hit`` what one hit takes
    (:func:`hit_bytes` of its index), ``per_candidate`` one candidate of a trace
    (:func:`trace_candidate_bytes`), and ``waiting`` the candidates its economy items keep
    while they wait at the provider (the sum of :func:`waiting_candidates`), each priced as
    a trace's. An estimate, not a bound: a result's hits carry their documents, which are
    priced at their index's mean.

    >>> batch_bytes([("q1", "{}")], hits=10)
    5754
    >>> batch_bytes([("q1", "{}")], hits=10, per_hit=99_320)
    1242004
    """
    stored = sum(len(query_id) + len(spec) for query_id, spec in items)
    return stored + results_bytes(len(items), hits, traced, per_hit, per_candidate, waiting)


def results_bytes(
    items: int,
    hits: int,
    traced: int = 0,
    per_hit: int = HIT_BYTES,
    per_candidate: int = TRACE_CANDIDATE_BYTES,
    waiting: int = 0,
) -> int:
    """What a batch of ``items`` (:func:`batch_bytes`'s other arguments) still owes once it is
    stored: its items' results, written as each finishes, their traces with them, and what
    its economy items keep while they wait at the provider (their prepared searches, held
    until the batch completes), each such record priced as a trace of its ``waiting``
    candidates. The job store keeps it, from the job's admission until its items finish
    (``owed_bytes`` in ``sift:stats:jobs``), and each reading of Redis's memory is judged
    with it (:func:`with_results_owed`): a waiting item's record is counted twice, held and
    owed, from its prepare to its item's end.

    Priced as Redis holds them, :data:`STORED_FACTOR` times their JSON (a result of 10 hits,
    4.6 kB of JSON; 17.1 kB with a trace of 30 candidates):

    >>> results_bytes(1, hits=10), results_bytes(1, hits=10, traced=30)
    (5750, 21375)
    >>> results_bytes(1, hits=10, waiting=30), results_bytes(1, hits=10, traced=30, waiting=30)
    (21375, 34500)
    """
    listed = traced + waiting
    traces = items * TRACE_BYTES + listed * per_candidate if listed else 0
    stored = items * ITEM_BYTES + hits * per_hit + traces
    return math.ceil(stored * STORED_FACTOR)


OwedReading = Callable[[], Awaitable[int]]  # AsyncJobStore.owed_bytes


def with_results_owed(read: MemoryReading, owed: OwedReading) -> MemoryReading:
    """``read`` (what Redis holds, and its ``maxmemory``), what it holds counted with the
    results its searches and batch items queued or running will still write, each priced as
    it was admitted (:func:`results_bytes`; ``owed``, the store's sum of them). Counted
    only until the next reading, a batch's results were forgotten 0.5 s after its
    admission: batches admitted one after another at 80 % each passed, and together filled
    Redis; counted at a fixed 4.6 kB an item, so were batches over documents of 30 kB,
    each priced at 3.6 MB and counted at 55 kB once admitted (three admitted at 79 %, two
    thirds of their items written when Redis was at 99 %)."""

    async def with_owed() -> tuple[int, int]:
        used, limit = await read()
        if not limit:  # no maxmemory: nothing to judge, no second read
            return used, limit
        return used + await owed(), limit

    return with_owed


def _mb(size: float) -> str:
    return f"{size / 1_000_000:.1f} MB"


class StoreFull(Exception):
    """Redis holds :data:`MEMORY_ADMITTED` of its ``maxmemory`` or more, or would with the
    ``adding`` bytes of the job being judged (``what``: as its refusal names it): answer 503
    ``job_store_full``, as at the limit itself: the job was refused before any write.
    ``str()`` is the log's line, with what Redis holds; :attr:`public` is the client's,
    without it."""

    def __init__(
        self, used: int, limit: int, adding: int = 0, what: str = "", holds: str = RESULTS
    ) -> None:
        self.adding, self.what, self.holds = adding, what, holds
        held = f"Redis holds {used / limit:.0%} of its maxmemory, with the results owed"
        super().__init__(self._said(f"{held} ({_mb(limit)})"))

    @property
    def public(self) -> str:
        """What the caller is told: its own job's size and the line, not what Redis holds.
        That is every tenant's work, stored and owed, and with one other tenant busy it
        was that tenant's volume, to the percent of ``maxmemory``."""
        return self._said()

    def _said(self, held: str = "") -> str:
        line = f"new jobs are refused past {MEMORY_ADMITTED:.0%} of Redis's maxmemory"
        if self.adding:
            said = (
                f"the job store has no room for {self.what}: "
                + (f"{held}, " if held else "")
                + f"it would add about {_mb(self.adding)} {self.holds}, and {line}"
            )
        else:
            said = "the job store is nearly full: " + (f"{held}, and " if held else "") + line
        return f"{said} so those running can end: nothing was stored; {FREES}"


class TooLargeForStore(Exception):
    """A batch (or a search) whose ``adding`` bytes alone pass :data:`MEMORY_ADMITTED` of
    ``maxmemory``: no retry admits it, however much Redis frees (answer 422 naming its
    queries, a search's limit)."""

    def __init__(
        self, limit: int, adding: int, what: str, holds: str = RESULTS, smaller: str = SMALLER
    ) -> None:
        super().__init__(
            f"{what} would take about {_mb(adding)} of the job store {holds}, more than the "
            f"{MEMORY_ADMITTED:.0%} of Redis's maxmemory ({_mb(limit)}) new jobs may fill, so "
            f"no retry admits it: {smaller}, or give Redis a larger maxmemory"
        )


class StoreMemory:
    """A cached reading of Redis's memory and its limit (``INFO memory``), read at most every
    ``READ_EVERY_SECONDS``, and the admission decision: past :data:`MEMORY_ADMITTED` of the
    limit, :class:`StoreFull`. No limit (``maxmemory`` 0), no refusal."""

    def __init__(self, read: MemoryReading, *, clock: Callable[[], float] = time.monotonic):
        self.read = read
        self._clock = clock
        self._used, self._limit = 0, 0
        self._read_at: float | None = None
        # the bytes this gateway admitted, and of them those whose storing ended, ever: a
        # reading counts the difference as it stood at its start and since (see storing)
        self._admitted, self._stored = 0, 0

    async def admit(
        self, adding: int = 0, what: str = "", holds: str = RESULTS, smaller: str = SMALLER
    ) -> None:
        """Admit a job that will add about ``adding`` bytes (``what``: the job, as its
        refusal names it, ``holds`` what those bytes hold, ``smaller`` how to send it in
        parts), or raise :class:`StoreFull` (:class:`TooLargeForStore` when it
        alone would pass the share). What it admits is added to the cached reading, so the
        requests before the next reading are judged with it."""
        await self.limited()
        if self._limit and adding >= MEMORY_ADMITTED * self._limit:
            raise TooLargeForStore(self._limit, adding, what, holds, smaller)
        if self._limit and self._used + adding >= MEMORY_ADMITTED * self._limit:
            raise StoreFull(self._used, self._limit, adding, what, holds)
        self._used += adding
        self._admitted += adding

    @contextlib.contextmanager
    def storing(self, adding: int) -> Iterator[None]:
        """Entered once :meth:`admit` took a job's ``adding`` bytes, left once the block
        stored the job (or did not): until then a reading counts them on top of what Redis
        holds with the results owed, which counts them only once the job's commit is written
        (a batch's items are staged in slices first). Before, a reading taken in between
        dropped them, and the next batch was admitted against that: at 80 % of maxmemory, two
        batches of 6 % each both taken. A reading started before the block ended counts them
        even if the commit was written before it read: the reading errs high, never low."""
        try:
            yield
        finally:
            self._stored += adding

    async def limited(self) -> bool:
        """Whether Redis has a ``maxmemory`` to admit by, from the cached reading (read again
        when it is ``READ_EVERY_SECONDS`` old): without one, nothing is priced."""
        now = self._clock()
        if self._read_at is None or now - self._read_at >= READ_EVERY_SECONDS:
            stored = self._stored  # what ended storing before the reading: Redis counts it
            try:
                used, self._limit = await self.read()
                self._used = used + self._admitted - stored
            except redis.ResponseError as exc:  # INFO refused (an ACL): no check, said once
                if self._read_at is None:
                    log.warning("Redis's memory is not read (%s): no admission by it", exc)
                self._used, self._limit = 0, 0
            self._read_at = now
        return self._limit > 0

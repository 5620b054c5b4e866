"""The store's core: how it connects, and the script plumbing every kind of record shares.

A job's or an item's status change goes through :meth:`_StoreCore._job` or
:meth:`_StoreCore._items`; both hand their script calls to one coalescer, so the calls that
threads make while one round trip is out go together in the next, on the store's own
connection.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, Self, cast

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError
from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from worker.coalesce import Coalescer
from worker.constants import (
    ACTIVE_JOBS_KEY,
    BATCH_CHUNK_RUNS_KEY,
    BATCH_COUNTS_KEY,
    BATCH_ITEMS_KEY,
    BATCH_KEY,
    BATCH_LOST_KEY,
    BATCH_MOVES_KEY,
    BATCH_ORDER_KEY,
    BATCH_RESULTS_KEY,
    BATCH_RUNS_KEY,
    BATCH_SPECS_KEY,
    ECONOMY_PREPARED_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RUNS_KEY,
    ECONOMY_STATE_KEY,
    ERROR_TENANT_REMOVED,
    REDRIVE_COUNT_KEY,
    REDRIVE_OUTAGES_KEY,
    REDRIVE_POSITIONS_KEY,
    RESULT_TTL_SECONDS,
    STATS_KEY,
    STATS_UNTRACKED_KEY,
    WEBHOOKS_OWED_KEY,
    WORKER_HEARTBEAT_KEY,
)
from worker.contract import ErrorInfo, JobStatus, SearchResult
from worker.queue.jobstore.records import ItemTransition, _now
from worker.queue.jobstore.scripts import (
    _ASK_REFUSED,
    _CANCEL_BATCH,
    _CANDIDATE_JUDGED,
    _CLAIM_DELETE_CHAIN,
    _CLAIM_IDEMPOTENCY,
    _CLAIM_RUN,
    _CLAIM_WEBHOOK,
    _COUNT_DELIVERY,
    _COUNT_REDRIVES,
    _CREATE_SEARCH,
    _CREATE_WRITE,
    _DELETE_REFUSED,
    _ECONOMY_EXPECT,
    _ECONOMY_LEASE,
    _ECONOMY_WRITE,
    _END_DELETE_CHAIN,
    _ERASE_JOB,
    _HELD_CHUNKS,
    _KEEP_ANSWER,
    _KEEP_PROVIDER_DELETIONS,
    _LET_GO_DELETE_CHAIN,
    _NOTE_OUTAGE,
    _READ_JOBS,
    _READ_RESULTS_PAGE,
    _RELEASE_IDEMPOTENCY,
    _RELEASE_RUN,
    _REQUEUE_ITEM,
    _SAVE_PREPARED,
    _SET_DELIVERIES,
    _TAKE_CANCEL_COUNT,
    _TAKE_REFUSED,
    _TRANSITION_ITEM,
    _TRANSITION_JOB,
    _WEBHOOK_DUE,
    _WEBHOOK_SETTLED,
)
from worker.redis_client import connect

_ScriptCall = tuple[Script, list[str], list[str]]  # a registered script, its keys and args
# Whether the batch's cancel mark turns an item's move into a cancel: never, always (the check
# before the model call), or unless the item's run claim kept a model answer (a start: the
# item is past its model call, paid for, and finishes on that answer as an item whose worker
# lived does; canceled, its record lost that call's usage)
NO_CANCEL, CANCEL, CANCEL_UNANSWERED = "", "1", "2"
# to, allowed-from, outcome, and when the batch's cancel mark turns the move into a cancel
_START_ITEM = (JobStatus.RUNNING, "queued,running", "", CANCEL_UNANSWERED)
_CHECK_ITEM = (JobStatus.RUNNING, "running", "", CANCEL)  # before the model call
_Move = tuple[str, str, JobStatus, str, str, str]  # batch id, query id, then as above
Claimant = tuple[str, float]  # who would claim an item's run: its worker id, its lease


# How long the gateway sends again, on a broken connection (a Redis restart), a write that is
# safe to send again (a batch's or an ingest's commit: it checks for its own record first; a
# search's create script: it does nothing when its record exists; a cancel, a cancel-count
# take and an Idempotency-Key's claim: each knows its own by its token) before it answers
# 503: a 503 for a job whose write ran, its reply lost, had the client make a second job.
RESEND_SECONDS = 5.0
_RESEND: dict[str, Any] = {
    "retry": retry_if_exception_type((redis.ConnectionError, redis.TimeoutError)),
    "stop": stop_after_delay(RESEND_SECONDS),
    "wait": wait_exponential(multiplier=0.05, max=1.0),
    "reraise": True,
}


def resending() -> Retrying:
    """The retry of such a write: on a broken connection, backing off from 50 ms to 1 s, for
    :data:`RESEND_SECONDS`.

    >>> resending()(lambda: "written")
    'written'
    """
    return Retrying(**_RESEND)


def resending_async() -> AsyncRetrying:
    """:func:`resending`, for the gateway's ``redis.asyncio`` store."""
    return AsyncRetrying(**_RESEND)


def move_token() -> str:
    """A fresh token for one status change: its script keeps it with what it did, so the same
    call sent again (redis-py does, after a connection broke with the reply still out) answers
    what the first run did instead of refusing its own move."""
    return os.urandom(8).hex()


def _rerun(call: _ScriptCall) -> Any:
    """A script call made through redis-py, which loads the script first if need be; its
    reply, or its error."""
    script, keys, args = call
    try:
        return script(keys=keys, args=args)
    except redis.RedisError as exc:
        return exc


#: A batch's keys that live as long as its record: what its GET, its results and its items
#: read (none has a TTL while the batch runs, so its items stay counted as long as they are
#: queued or running; the script that ends it, ``_TRANSITION_ITEM``'s or ``_CANCEL_BATCH``'s,
#: gives each, its chunks' run claims and its economy lane's hashes, the retention).
BATCH_KEYS = (
    BATCH_KEY,
    BATCH_ORDER_KEY,
    BATCH_SPECS_KEY,
    BATCH_ITEMS_KEY,
    BATCH_COUNTS_KEY,
    BATCH_RESULTS_KEY,
    BATCH_MOVES_KEY,
    BATCH_RUNS_KEY,
    BATCH_LOST_KEY,
)

#: A job's re-drive bookkeeping (its outage notes, its re-drive count, a batch's positions'
#: counts), which its final move deletes (``_TRANSITION_JOB``, ``_TRANSITION_ITEM``,
#: ``_CANCEL_BATCH``): a final job is never re-driven, and they lived their retention naming
#: a finished or erased job.
RE_DRIVE_KEYS = (REDRIVE_OUTAGES_KEY, REDRIVE_COUNT_KEY, REDRIVE_POSITIONS_KEY)


class _StoreCore:
    """The connection, the registered scripts and the status transitions: the base of each
    record kind's methods, which :class:`~worker.queue.jobstore.JobStore` puts together."""

    def __init__(self, client: redis.Redis, *, result_ttl: int = RESULT_TTL_SECONDS) -> None:
        self.redis = client
        self.result_ttl = result_ttl
        self._transition_job = client.register_script(_TRANSITION_JOB)
        self._transition_item = client.register_script(_TRANSITION_ITEM)
        self._requeue_item = client.register_script(_REQUEUE_ITEM)
        self._cancel_batch = client.register_script(_CANCEL_BATCH)
        self._create_search = client.register_script(_CREATE_SEARCH)
        self._create_write_script = client.register_script(_CREATE_WRITE)
        self._claim_idempotency = client.register_script(_CLAIM_IDEMPOTENCY)
        self._release_idempotency = client.register_script(_RELEASE_IDEMPOTENCY)
        self._claim_run = client.register_script(_CLAIM_RUN)
        self._release_run = client.register_script(_RELEASE_RUN)
        self._held_chunks = client.register_script(_HELD_CHUNKS)
        self._keep_answer = client.register_script(_KEEP_ANSWER)
        self._count_redrives = client.register_script(_COUNT_REDRIVES)
        self._note_outage = client.register_script(_NOTE_OUTAGE)
        self._count_delivery = client.register_script(_COUNT_DELIVERY)
        self._set_deliveries = client.register_script(_SET_DELIVERIES)
        self._take_cancel_count = client.register_script(_TAKE_CANCEL_COUNT)
        self._webhook_due = client.register_script(_WEBHOOK_DUE)
        self._webhook_settled = client.register_script(_WEBHOOK_SETTLED)
        self._claim_webhook = client.register_script(_CLAIM_WEBHOOK)
        self._save_prepared = client.register_script(_SAVE_PREPARED)
        self._economy_write_script = client.register_script(_ECONOMY_WRITE)
        self._economy_expect = client.register_script(_ECONOMY_EXPECT)
        self._economy_lease = client.register_script(_ECONOMY_LEASE)
        self._erase_job = client.register_script(_ERASE_JOB)
        self._keep_provider_deletions = client.register_script(_KEEP_PROVIDER_DELETIONS)
        self._candidate_judged = client.register_script(_CANDIDATE_JUDGED)
        self._delete_refused = client.register_script(_DELETE_REFUSED)
        self._ask_refused = client.register_script(_ASK_REFUSED)
        self._take_refused = client.register_script(_TAKE_REFUSED)
        self._claim_delete_chain = client.register_script(_CLAIM_DELETE_CHAIN)
        self._end_delete_chain = client.register_script(_END_DELETE_CHAIN)
        self._let_go_delete_chain = client.register_script(_LET_GO_DELETE_CHAIN)
        self._read_jobs = client.register_script(_READ_JOBS)
        self._read_results_page = client.register_script(_READ_RESULTS_PAGE)
        # status transitions that threads ask for while one round trip is out go together
        # in the next (a worker's hundreds of threads each make two per search)
        self._transitions: Coalescer[list[_ScriptCall], list[Any]] = Coalescer(
            self._run_scripts, size=len
        )
        self._own: Any = None  # the transitions' connection (see _evalsha_all)
        self._own_pid = 0
        # the run claims this process's runs hold ("key|field" -> tokens): a claim naming this
        # worker that none holds is a run gone (worker/queue/jobstore/runs.py)
        self._running: dict[str, set[str]] = {}
        self._running_lock = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        max_connections: int | None = None,
        outage_seconds: float = 0.0,
        socket_timeout: float | None = None,
        result_ttl: int = RESULT_TTL_SECONDS,
    ) -> Self:
        """A store on ``url``, connected as :func:`worker.redis_client.connect` says, its
        records kept ``result_ttl`` seconds from their end (``SIFT_RESULT_RETENTION_SECONDS``)."""
        return cls(
            connect(
                url,
                max_connections=max_connections,
                outage_seconds=outage_seconds,
                socket_timeout=socket_timeout,
            ),
            result_ttl=result_ttl,
        )

    def close(self) -> None:
        """Close the client and its pool's connections (a pool given to redis-py explicitly,
        as ``from_url(max_connections=)`` does, is not closed by ``Redis.close``)."""
        self.redis.close()
        self.redis.connection_pool.disconnect()
        if self._own is not None:
            self._own.disconnect()

    def ping(self) -> bool:
        return bool(self.redis.ping())

    def _snapshot(
        self, hashes: Sequence[str], job_ids: Sequence[str]
    ) -> tuple[list[dict[str, str]], list[bool]]:
        """``hashes`` read whole and whether each of ``job_ids``' webhooks is owed, in one
        snapshot (_READ_JOBS: a MULTI would be refused at Redis's maxmemory)."""
        reply = cast(list[Any], self._read_jobs(keys=[WEBHOOKS_OWED_KEY, *hashes], args=job_ids))
        flats, scores = reply[: len(hashes)], reply[len(hashes) :]
        return [dict(zip(f[::2], f[1::2], strict=True)) for f in flats], [
            score is not None for score in scores
        ]

    def _status(self, key: str) -> JobStatus | None:
        value = cast(str | None, self.redis.hget(key, "status"))
        return JobStatus(value) if value else None

    def _finish(
        self, prefix: str, job_id: str, *, result: SearchResult | None, error: ErrorInfo | None
    ) -> bool:
        fields: dict[str, str] = {"finished_at": repr(_now())}
        if error is not None:
            status = JobStatus.FAILED
            fields["error"] = error.model_dump_json()
            if error.type == ERROR_TENANT_REMOVED:  # its webhook settles failed (_OWE_WEBHOOK)
                fields["tenant_removed"] = "1"
        else:
            assert result is not None
            status = JobStatus.SUCCEEDED
            fields["result"] = result.model_dump_json()
        return self._job(prefix, job_id, status, "queued,running", fields)

    def _job(
        self,
        prefix: str,
        job_id: str,
        to: JobStatus,
        allowed: str,
        fields: dict[str, str] | None = None,
        *,
        count: bool = True,
    ) -> bool:
        args = [to.value, allowed, str(self.result_ttl), repr(_now()), job_id, move_token()]
        for name, value in (fields or {}).items():
            args += [name, value]
        stats = STATS_KEY if count else STATS_UNTRACKED_KEY
        keys = [
            prefix + job_id,
            stats,
            ACTIVE_JOBS_KEY,
            WEBHOOKS_OWED_KEY,
            *[prefix + job_id for prefix in RE_DRIVE_KEYS],
        ]
        (code,) = self._transitions.call([(self._transition_job, keys, args)])
        if isinstance(code, Exception):
            raise code
        return int(code) == 1

    def _item(
        self,
        batch_id: str,
        query_id: str,
        to: JobStatus,
        allowed: str,
        payload: str,
        cancelable: str,
        tally: Sequence[str] = (),
        claimant: Claimant = ("", 0.0),
        script: Script | None = None,
    ) -> ItemTransition:
        (transition,) = self._items(
            [(batch_id, query_id, to, allowed, payload, cancelable)], tally, claimant, script
        )
        return transition

    def _held_here(self, key: str, field: str) -> str:
        """The tokens of the claim of ``field`` in ``key`` that this process's runs hold."""
        with self._running_lock:
            return ",".join(self._running.get(key + "|" + field, ()))

    def _items(
        self,
        moves: Sequence[_Move],
        tally: Sequence[str] = (),
        claimant: Claimant = ("", 0.0),
        script: Script | None = None,
    ) -> list[ItemTransition]:
        """Item transitions (batch id, query id, to, allowed-from, outcome JSON or '', and
        when the batch's cancel mark makes it a cancel), in order, in one round trip.
        ``tally``: what the first move's outcome adds to its batch's totals (field,
        increment pairs, :func:`~worker.queue.jobstore.batch_items.batch_tally`), added only if
        that move makes the item final with its outcome, so once. ``claimant``: the worker id
        and lease the item's run would claim with, by which a start judges its claim (as
        :data:`_CLAIM_RUN` would). ``script``: the transition script's flagged copy
        (:data:`_REQUEUE_ITEM`) for the move it is flagged for, else the script itself."""
        now = repr(_now())
        calls: list[_ScriptCall] = [
            (
                script or self._transition_item,
                [
                    BATCH_ITEMS_KEY + batch_id,
                    BATCH_RESULTS_KEY + batch_id,
                    BATCH_COUNTS_KEY + batch_id,
                    BATCH_KEY + batch_id,
                    STATS_KEY,
                    ACTIVE_JOBS_KEY,
                    BATCH_MOVES_KEY + batch_id,
                    BATCH_RUNS_KEY + batch_id,
                    WEBHOOKS_OWED_KEY,
                    ECONOMY_PREPARED_KEY + batch_id,
                    BATCH_ORDER_KEY + batch_id,
                    BATCH_SPECS_KEY + batch_id,
                    BATCH_LOST_KEY + batch_id,
                    BATCH_CHUNK_RUNS_KEY + batch_id,
                    ECONOMY_RUNS_KEY + batch_id,
                    ECONOMY_PROVIDERS_KEY + batch_id,
                    ECONOMY_STATE_KEY + batch_id,
                    *[prefix + batch_id for prefix in RE_DRIVE_KEYS],
                ],
                [
                    query_id,
                    to.value,
                    allowed,
                    payload,
                    now,
                    batch_id,
                    cancelable,
                    move_token(),
                    WORKER_HEARTBEAT_KEY,
                    repr(claimant[1]),
                    claimant[0],
                    self._held_here(BATCH_RUNS_KEY + batch_id, query_id),
                    str(self.result_ttl),
                    *(tally if n == 0 else ()),
                ],
            )
            for n, (batch_id, query_id, to, allowed, payload, cancelable) in enumerate(moves)
        ]
        first, *rest = self._transitions.call(calls)
        if isinstance(first, Exception):
            raise first
        # a later move that failed did not apply: the first one did, and is what counts
        replies = [first] + [[0, 0] if isinstance(reply, Exception) else reply for reply in rest]
        transitions = [
            ItemTransition(
                applied=int(code) >= 1,
                batch_completed=int(code) == 2,
                canceled=int(code) >= 1 and int(canceled) == 1,
            )
            for code, canceled in replies
        ]
        return transitions

    def _run_scripts(self, requests: list[list[_ScriptCall]]) -> list[list[Any]]:
        """Each request's script calls, all in one round trip; each call's reply, or its
        error, in its place. One the server no longer holds (a restart empties its script
        cache) runs again on its own, which loads it."""
        replies = self._evalsha_all([call for request in requests for call in request])
        answers: list[list[Any]] = []
        at = 0
        for request in requests:
            answers.append(
                [
                    _rerun(call) if isinstance(reply, NoScriptError) else reply
                    for call, reply in zip(request, replies[at : at + len(request)], strict=True)
                ]
            )
            at += len(request)
        return answers

    def _evalsha_all(self, calls: list[_ScriptCall]) -> list[Any]:
        """``EVALSHA`` of every call, written at once and read back on the store's own
        connection, retried the way the client's commands are. The coalescer makes one call
        at a time, so one connection serves it, with none of a pool checkout's checks."""
        commands = [
            ("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args in calls
        ]
        if self._own is None or self._own_pid != os.getpid():
            self._own, self._own_pid = self.redis.connection_pool.make_connection(), os.getpid()
        conn = self._own

        def send_and_read() -> list[Any]:
            conn.send_packed_command(conn.pack_commands(commands))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:  # the script's own error, or NOSCRIPT
                    replies.append(exc)
            return replies

        return cast(
            list[Any], conn.retry.call_with_retry(send_and_read, lambda _: conn.disconnect())
        )

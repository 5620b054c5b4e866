"""Search records: created atomically with their task messages and Idempotency-Key binding
(one script, shared with :class:`~worker.queue.jobstore.asyncstore.AsyncJobStore`), read,
and moved queued -> running -> final.
"""

from __future__ import annotations

from typing import Any

from worker.constants import (
    ACTIVE_JOBS_KEY,
    JOB_INDEX_RETENTIONS,
    SEARCH_ID_PREFIX,
    SEARCH_KEY,
    STATS_KEY,
)
from worker.contract import ErrorInfo, JobStatus, SearchResult, SearchSpec
from worker.queue.jobstore.idempotency import (
    IdempotencyKeyBound,
    IdempotencyRef,
    _claim_of,
    _idem_binding,
)
from worker.queue.jobstore.jobindex import KIND_SEARCH, job_index_key
from worker.queue.jobstore.records import (
    Enqueue,
    SearchJob,
    _new_id,
    _now,
    _opt_float,
    webhook_state,
)
from worker.queue.jobstore.store import _StoreCore


def _new_search(tenant: str, spec: SearchSpec, webhook_url: str | None) -> SearchJob:
    """A new search as its record will read: its webhook, if it has a URL, pending with no
    attempt (the gateway's 202 is built from this; it said none while the GET said pending)."""
    return SearchJob(
        id=_new_id(SEARCH_ID_PREFIX),
        tenant=tenant,
        status=JobStatus.QUEUED,
        spec=spec,
        created_at=_now(),
        webhook_url=webhook_url,
        webhook=webhook_state({"webhook_url": webhook_url or ""}, owed=False),
    )


def _create_search_call(
    job: SearchJob,
    ttl: int,
    enqueue: Enqueue | None,
    claim: IdempotencyRef | None,
    owed_bytes: int = 0,
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV of :data:`_CREATE_SEARCH` for a new search: its record, its task
    messages, and its Idempotency-Key's pending record; ``owed_bytes``, what its result will
    add to Redis as its admission priced it, kept in its record (``owed_bytes``) and owed in
    ``sift:stats:jobs`` until it ends."""
    fields = [
        "kind", "search", "tenant", job.tenant, "status", job.status.value,
        "spec", job.spec.model_dump_json(), "webhook_url", job.webhook_url or "",
        "created_at", repr(job.created_at),
    ]  # fmt: skip
    if owed_bytes > 0:
        fields += ["owed_bytes", str(owed_bytes)]
    messages = list(enqueue(job.id)) if enqueue is not None else []
    index = job_index_key(KIND_SEARCH, job.tenant)
    keys = [SEARCH_KEY + job.id, STATS_KEY, ACTIVE_JOBS_KEY, index, *(key for key, _ in messages)]
    args: list[str | int] = [len(messages), len(fields), job.id, repr(job.created_at)]
    args.append(ttl * JOB_INDEX_RETENTIONS)  # the record takes none until its end
    args += fields
    args += [raw for _, raw in messages]
    if claim is not None:
        name, value, expiry = _idem_binding(claim, job.id)
        keys.append(name)
        args += [value, expiry]
    return keys, args


def _search_created(job: SearchJob, reply: Any, claim: IdempotencyRef | None) -> SearchJob:
    """``job``, which :data:`_CREATE_SEARCH` answered ``reply`` to; raises
    :class:`IdempotencyKeyBound` when the key named another job and nothing was written."""
    if isinstance(reply, str) and claim is not None:
        earlier = _claim_of(reply, claim.fingerprint)
        if earlier.job_id != job.id:  # our own id: this call had run already (a retry)
            raise IdempotencyKeyBound(earlier)
    return job


def _search_of(job_id: str, raw: dict[str, str], *, owed: bool) -> SearchJob | None:
    """The search a record's fields make (``result`` only if read), None if it is none;
    ``owed``: whether its webhook is in ``sift:webhooks-owed`` (:func:`webhook_state`)."""
    if not raw or raw.get("kind") != "search":
        return None
    return SearchJob(
        id=job_id,
        tenant=raw["tenant"],
        status=JobStatus(raw["status"]),
        spec=SearchSpec.model_validate_json(raw["spec"]),
        created_at=float(raw["created_at"]),
        webhook_url=raw.get("webhook_url") or None,
        started_at=_opt_float(raw.get("started_at")),
        finished_at=_opt_float(raw.get("finished_at")),
        result=SearchResult.model_validate_json(raw["result"]) if raw.get("result") else None,
        error=ErrorInfo.model_validate_json(raw["error"]) if raw.get("error") else None,
        webhook=webhook_state(raw, owed=owed),
    )


class SearchRecords(_StoreCore):
    """One search job each: create, read, start, requeue, finish."""

    def create_search(
        self,
        tenant: str,
        spec: SearchSpec,
        *,
        webhook_url: str | None = None,
        enqueue: Enqueue | None = None,
        claim: IdempotencyRef | None = None,
        owed_bytes: int = 0,
    ) -> SearchJob:
        """Store a ``queued`` search atomically (one script), with its task messages from
        ``enqueue`` and, with ``claim``, the Idempotency-Key bound to it; raises
        :class:`IdempotencyKeyBound`, writing nothing, if that key names a job already.
        ``owed_bytes``: what its result will add, owed until it ends (the gateway's price of
        it: ``api_gateway.backpressure.results_bytes``)."""
        job = _new_search(tenant, spec, webhook_url)
        keys, args = _create_search_call(job, self.result_ttl, enqueue, claim, owed_bytes)
        return _search_created(job, self._create_search(keys=keys, args=args), claim)

    def get_search(self, job_id: str) -> SearchJob | None:
        # one snapshot: the script that settles a webhook writes the record and drops the
        # entry together, so a read between the two would find neither
        [raw], [owed] = self._snapshot([SEARCH_KEY + job_id], [job_id])
        return _search_of(job_id, raw, owed=owed)

    def get_search_status(self, job_id: str) -> JobStatus | None:
        return self._status(SEARCH_KEY + job_id)

    def start_search(self, job_id: str) -> bool:
        """queued (or running, on redelivery) -> running, ``started_at`` now. False if it is
        final or missing. Made by the run holding the search's run claim (claimed first: a
        copy that loses the claim writes no start)."""
        return self._job(
            SEARCH_KEY, job_id, JobStatus.RUNNING, "queued,running", {"started_at": repr(_now())}
        )

    def requeue_search(self, job_id: str) -> bool:
        """running -> queued, before a retry."""
        return self._job(SEARCH_KEY, job_id, JobStatus.QUEUED, "running")

    def finish_search(
        self, job_id: str, *, result: SearchResult | None = None, error: ErrorInfo | None = None
    ) -> bool:
        """-> succeeded (with ``result``) or failed (with ``error``), unless already final."""
        return self._finish(SEARCH_KEY, job_id, result=result, error=error)

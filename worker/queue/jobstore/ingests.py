"""Ingest records: documents to upsert into one index, held until the ingest task has run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import cast

import redis

from worker.constants import (
    ACTIVE_JOBS_KEY,
    BATCH_STAGING_TTL_SECONDS,
    INGEST_DOCS_KEY,
    INGEST_DOCS_TTL_SECONDS,
    INGEST_ID_PREFIX,
    INGEST_KEY,
    JOB_INDEX_RETENTIONS,
    LEGACY_WRITE_VERSION_WINDOW_SECONDS,
    STATS_UNTRACKED_KEY,
)
from worker.contract import DocumentIn, ErrorInfo, JobStatus
from worker.queue.jobstore.idempotency import (
    IdempotencyKeyBound,
    IdempotencyRef,
    _claim_of,
    _idem_binding,
)
from worker.queue.jobstore.jobindex import KIND_INGEST, job_index_key
from worker.queue.jobstore.records import (
    Enqueue,
    IngestJob,
    WriteOperation,
    _new_id,
    _now,
    _opt_float,
    write_operation,
)
from worker.queue.jobstore.store import _StoreCore, resending
from worker.write_versions import version_keys


def _create_write_call(
    job_id: str,
    tenant: str,
    index: str,
    operation: WriteOperation,
    documents: int,
    staged: bool,
    ttl: int,
    enqueue: Enqueue | None,
    claim: IdempotencyRef | None = None,
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV of :data:`~worker.queue.jobstore.scripts._CREATE_WRITE` for a new
    ingest-kind job: its record's fields but the version and the date (the script's), its
    documents' key (``staged``: written before), its task messages and, with ``claim``, its
    Idempotency-Key's binding."""
    fields = [
        "kind", "ingest", "tenant", tenant, "index", index, "status", JobStatus.QUEUED.value,
        "documents", str(documents), "operation", operation,
    ]  # fmt: skip
    messages = list(enqueue(job_id)) if enqueue is not None else []
    keys = [
        INGEST_KEY + job_id,
        INGEST_DOCS_KEY + job_id,
        ACTIVE_JOBS_KEY,  # watched by the re-drive
        STATS_UNTRACKED_KEY,  # its moves count from here
        job_index_key(KIND_INGEST, tenant),
        *version_keys(tenant),
        *(key for key, _ in messages),
    ]
    args: list[str | int] = ["1" if staged else "0", INGEST_DOCS_TTL_SECONDS]
    args += [ttl * JOB_INDEX_RETENTIONS, LEGACY_WRITE_VERSION_WINDOW_SECONDS, job_id, len(fields)]
    args += [len(messages), *fields, *(raw for _, raw in messages)]
    if claim is not None:
        name, value, expiry = _idem_binding(claim, job_id)
        keys.append(name)
        args += [value, expiry]
    return keys, args


def _ingest_of(job_id: str, raw: dict[str, str]) -> IngestJob | None:
    """The ingest job a record's fields make, None if it is none."""
    if not raw or raw.get("kind") != "ingest":
        return None
    return IngestJob(
        id=job_id,
        tenant=raw["tenant"],
        index=raw["index"],
        status=JobStatus(raw["status"]),
        documents=int(raw["documents"]),
        created_at=float(raw["created_at"]),
        started_at=_opt_float(raw.get("started_at")),
        finished_at=_opt_float(raw.get("finished_at")),
        upserted=int(raw["upserted"]) if raw.get("upserted") else None,
        error=ErrorInfo.model_validate_json(raw["error"]) if raw.get("error") else None,
        operation=write_operation(raw.get("operation")),
        version=int(raw["version"]) if raw.get("version") else None,
        deleted=int(raw["deleted"]) if raw.get("deleted") else None,
    )


class IngestRecords(_StoreCore):
    """One ingest job each, and its pending documents; ingests are not in the queued and
    running gauge, but counted apart (``STATS_UNTRACKED_KEY``)."""

    def create_ingest(
        self,
        tenant: str,
        index: str,
        documents: Sequence[DocumentIn],
        *,
        enqueue: Enqueue | None = None,
        claim: IdempotencyRef | None = None,
    ) -> IngestJob:
        """An upsert's job; with ``claim``, its Idempotency-Key bound to it in the same step,
        raising :class:`IdempotencyKeyBound` (nothing written) when the key names a job
        already."""
        payload = json.dumps([d.model_dump() for d in documents], separators=(",", ":"))
        return self._create_write(tenant, index, "upsert", payload, len(documents), enqueue, claim)

    def _create_write(
        self,
        tenant: str,
        index: str,
        operation: WriteOperation,
        payload: str | None,
        documents: int,
        enqueue: Enqueue | None,
        claim: IdempotencyRef | None = None,
    ) -> IngestJob:
        """An ingest-kind job (an upsert, a delete or a drop) with its write version: the
        order in which writes were accepted, which the backend keeps per id, so the write
        accepted last wins whichever worker runs it first (:mod:`worker.core.catalog`).

        Its documents (up to 32 MB) go first, on their own (:meth:`_stage_documents`); one
        small script then takes its version and dates it as it creates its record
        (:data:`~worker.queue.jobstore.scripts._CREATE_WRITE`). Dated before the documents
        went over the wire (tens of milliseconds), a job committed meanwhile was dated after
        it yet listed first, and a client paging through met the ingest on a page below;
        versioned before them, a job accepted meanwhile took the higher version, so its text
        won, yet was listed below the ingest it had overridden."""
        job_id = _new_id(INGEST_ID_PREFIX)
        if payload is not None:
            self._stage_documents(INGEST_DOCS_KEY + job_id, payload)
        keys, args = _create_write_call(
            job_id,
            tenant,
            index,
            operation,
            documents,
            payload is not None,
            self.result_ttl,
            enqueue,
            claim,
        )
        # a reply lost with the connection: redis-py sends the script again, which finds the
        # record and answers what it holds (sent again blindly, or answered 503, it made a
        # second job: the client retried). Redis away then: a few seconds of resending
        reply = resending()(self._create_write_script, keys=keys, args=args)
        if reply is None:  # Redis came back without them
            raise redis.ConnectionError(f"ingest {job_id}: its documents were lost")
        if isinstance(reply, str) and claim is not None:  # the key's earlier job
            raise IdempotencyKeyBound(_claim_of(reply, claim.fingerprint))
        version, created_at = cast(list[str], reply)
        return IngestJob(
            id=job_id,
            tenant=tenant,
            index=index,
            status=JobStatus.QUEUED,
            documents=documents,
            created_at=float(created_at),
            operation=operation,
            version=int(version),
        )

    def _stage_documents(self, docs_key: str, payload: str) -> None:
        """Write a new ingest's documents before its record, living
        ``BATCH_STAGING_TTL_SECONDS`` until the commit keeps them: nothing reads them before
        the record and its task message exist, and a gateway that dies in between leaves
        them for an hour at most. Sent again whole after a broken connection (a ``SET``)."""
        self.redis.set(docs_key, payload, ex=BATCH_STAGING_TTL_SECONDS)

    def get_ingest(self, job_id: str) -> IngestJob | None:
        return _ingest_of(job_id, cast(dict[str, str], self.redis.hgetall(INGEST_KEY + job_id)))

    def get_ingest_status(self, job_id: str) -> JobStatus | None:
        return self._status(INGEST_KEY + job_id)

    def ingest_documents(self, job_id: str) -> list[DocumentIn] | None:
        raw = cast(str | None, self.redis.get(INGEST_DOCS_KEY + job_id))
        if raw is None:
            return None
        return [DocumentIn.model_validate(d) for d in json.loads(raw)]

    def start_ingest(self, job_id: str) -> bool:
        return self._job(
            INGEST_KEY,
            job_id,
            JobStatus.RUNNING,
            "queued,running",
            {"started_at": repr(_now())},
            count=False,
        )

    def requeue_ingest(self, job_id: str) -> bool:
        return self._job(INGEST_KEY, job_id, JobStatus.QUEUED, "running", count=False)

    def finish_ingest(
        self,
        job_id: str,
        *,
        upserted: int | None = None,
        error: ErrorInfo | None = None,
        deleted: int | None = None,
    ) -> bool:
        fields: dict[str, str] = {"finished_at": repr(_now())}
        if error is not None:
            status = JobStatus.FAILED
            fields["error"] = error.model_dump_json()
        elif deleted is not None:
            status = JobStatus.SUCCEEDED
            fields["deleted"] = str(deleted)
        else:
            status = JobStatus.SUCCEEDED
            fields["upserted"] = str(upserted or 0)
        applied = self._job(INGEST_KEY, job_id, status, "queued,running", fields, count=False)
        if applied:
            self.redis.delete(INGEST_DOCS_KEY + job_id)
        return applied

"""Idempotency-Keys: what a claimed key means for a request, how a key is stored and bound to
the job it created (in that job's own write), and the fingerprint of a request's body.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

from worker.constants import (
    IDEMPOTENCY_KEY,
    IDEMPOTENCY_PENDING_TTL_SECONDS,
    IDEMPOTENCY_TTL_SECONDS,
)
from worker.queue.jobstore.store import _StoreCore, move_token, resending


class IdempotencyOutcome(StrEnum):
    """What a claimed Idempotency-Key means for this request."""

    NEW = "new"  # first use: go ahead and create the job
    REPLAY = "replay"  # same key, same body, a job was created: answer with that job
    MISMATCH = "mismatch"  # same key, different body: 422
    IN_PROGRESS = "in_progress"  # claimed by a request that has not created its job yet: 409


@dataclass(frozen=True, slots=True)
class IdempotencyClaim:
    outcome: IdempotencyOutcome
    job_id: str | None = None


@dataclass(frozen=True, slots=True)
class IdempotencyRef:
    """One request's Idempotency-Key: whose it is, and the fingerprint of its body."""

    tenant: str
    key: str
    fingerprint: str


class IdempotencyKeyBound(Exception):
    """A ``create_*`` with a claim found the key already bound to a job (another request
    with it created one first): nothing was written. ``claim`` says what to answer:
    ``REPLAY`` with that job, or ``MISMATCH`` (it was created for another body)."""

    def __init__(self, claim: IdempotencyClaim) -> None:
        super().__init__(f"Idempotency-Key already bound: {claim.outcome} {claim.job_id}")
        self.claim = claim


def _idem_key(tenant: str, key: str) -> str:
    return IDEMPOTENCY_KEY + tenant + ":" + hashlib.sha256(key.encode()).hexdigest()


def _idem_binding(ref: IdempotencyRef, job_id: str) -> tuple[str, str, int]:
    """(key, value, TTL) of a key bound to its job: written in the job's own transaction,
    kept for the key's full 24 hours whatever becomes of the request that created it."""
    record = {"fp": ref.fingerprint, "state": "created", "job": job_id}
    return _idem_key(ref.tenant, ref.key), json.dumps(record), IDEMPOTENCY_TTL_SECONDS


def _bound(raw: str | None, fingerprint: str) -> IdempotencyClaim | None:
    """The key's claim if its record ``raw`` names a job (``REPLAY`` or ``MISMATCH``); None
    if the key is free or only claimed (a pending marker, whoever's: go ahead)."""
    if raw is None or not isinstance(json.loads(raw).get("job"), str):
        return None
    return _claim_of(raw, fingerprint)


def _claim_of(raw: str, fingerprint: str) -> IdempotencyClaim:
    """What a key's stored record means for a request with this body's ``fingerprint``. A
    record names its job from the transaction that created the job on (records written
    before that change may say ``"state": "done"``; the job is what counts)."""
    earlier = json.loads(raw)
    job = earlier.get("job")
    if earlier.get("fp") != fingerprint:
        return IdempotencyClaim(IdempotencyOutcome.MISMATCH, job)
    if isinstance(job, str):
        return IdempotencyClaim(IdempotencyOutcome.REPLAY, job)
    return IdempotencyClaim(IdempotencyOutcome.IN_PROGRESS)


def fingerprint(*parts: Iterable[Any] | Any) -> str:
    """A stable hash of a request (its route and its canonical JSON body)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class IdempotencyRecords(_StoreCore):
    """Claim an Idempotency-Key before the job exists, and release a claim whose request
    failed before creating it."""

    def claim_idempotency(self, tenant: str, key: str, fingerprint: str) -> IdempotencyClaim:
        """Claim ``key`` for this request (a pending marker, ``IDEMPOTENCY_PENDING_TTL_SECONDS``),
        or say what an earlier request with it did: a key bound to a job replays that job,
        whether or not the request that created it is still being answered."""
        token = move_token()
        marker = json.dumps({"fp": fingerprint, "state": "pending", "job": None, "by": token})
        # sent again on a broken connection for a few seconds: a claim whose reply was lost
        # finds its own marker (its token) and goes on; it was a 503, then 409 "in progress"
        # for every resend of the key until the marker expired
        earlier = resending()(
            self._claim_idempotency,
            keys=[_idem_key(tenant, key)],
            args=[marker, IDEMPOTENCY_PENDING_TTL_SECONDS, token, IDEMPOTENCY_TTL_SECONDS],
        )
        if earlier is None:
            return IdempotencyClaim(IdempotencyOutcome.NEW)
        return _claim_of(cast(str, earlier), fingerprint)

    def release_idempotency(self, tenant: str, key: str) -> bool:
        """Forget the pending marker of a request that failed before creating its job, so a
        retry may go ahead; a key bound to a job stays bound (the reply may have been lost
        after the job was written)."""
        return bool(self._release_idempotency(keys=[_idem_key(tenant, key)]))

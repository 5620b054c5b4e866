"""The ``Idempotency-Key`` header and its handling around one job-creating request."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated

from fastapi import Header, Request
from pydantic import AfterValidator, BaseModel
from pydantic_core import PydanticCustomError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from api_gateway.deps import STORE_AWAY, off_loop
from api_gateway.errors import ApiError
from worker.constants import IDEMPOTENCY_PENDING_TTL_SECONDS, MAX_IDEMPOTENCY_KEY_CHARS
from worker.queue.jobstore import (
    IdempotencyClaim,
    IdempotencyKeyBound,
    IdempotencyOutcome,
    IdempotencyRef,
    JobStore,
    fingerprint,
)

# the 409 of a key whose first request has not made its job: that request makes it within
# moments (it is validating or writing), or it died and its claim lapses within
# IDEMPOTENCY_PENDING_TTL_SECONDS; a resend each second finds the job as soon as it exists
IN_PROGRESS_RETRY_AFTER_SECONDS = 1

# A release that met Redis away is sent again each second until this long before the
# claim's marker could lapse: it never reaches Redis after that, when the key may be
# another request's claim (a release deletes whatever pending marker the key holds).
RELEASE_MARGIN_SECONDS = 10.0

log = logging.getLogger(__package__)  # api_gateway.jobs: one logger for the job routes


def _within_bytes(key: str | None) -> str | None:
    """A key over :data:`MAX_IDEMPOTENCY_KEY_CHARS` refused in the unit it is counted in.
    The server reads a header's bytes one character each, so the key's length is its bytes as
    sent; pydantic's ``max_length`` said "at most 255 characters" of a key of 129 (127 of them
    ``é``), where docs/security.md says bytes."""
    if key is not None and len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        raise PydanticCustomError(
            "string_too_long",
            "should be at most {max_length} bytes as sent (ASCII is recommended: a character "
            "outside ASCII counts as each of its bytes)",
            {"max_length": MAX_IDEMPOTENCY_KEY_CHARS},
        )
    return key


IdemKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        json_schema_extra={"maxLength": MAX_IDEMPOTENCY_KEY_CHARS},  # checked by _within_bytes
        description="Same key and body: the same job. Different body: 422. "
        "While the first request has not made its job yet: 409, with `Retry-After: "
        f"{IN_PROGRESS_RETRY_AFTER_SECONDS}`. Its job erased: 410 `erased`; no longer kept "
        "(the job store lost it): 410 `idempotency_key_job_gone`, for the key's 24 hours: "
        "send the request with a new key to make the job again. At most 255 bytes as sent "
        "(the header's bytes are read one character each): ASCII is recommended.",
    ),
    AfterValidator(_within_bytes),
]


class _Idempotency:
    """Stripe-style Idempotency-Key handling around one job-creating request.

    The key is claimed first (a pending marker: a second request meanwhile gets 409), then
    bound to its job in the transaction that creates the job, for 24 hours. From then on a
    request with the key gets that job, whatever became of the first request: answered,
    still in its ``?wait``, or killed with its gateway. A marker that no job was bound to
    means nothing was created; it answers 409 until it expires (or its request fails and
    releases it), then the key is free. The create itself writes only if the key is bound to
    no job, so even a marker that expired under a live request cannot give a second job.
    """

    def __init__(self, store: JobStore, tenant: str, key: str | None, fp: str) -> None:
        self.store, self.tenant, self.key, self.fp = store, tenant, key, fp
        self.claimed_at = 0.0  # monotonic, just before the claim was sent

    @classmethod
    def of(
        cls, store: JobStore, tenant: str, key: str | None, route: str, body: BaseModel
    ) -> _Idempotency:
        """The key of a small body (a search): its fingerprint computed here."""
        # the body's fingerprint is only needed with a key (most requests have none)
        fp = "" if key is None else fingerprint(route, body.model_dump(mode="json"))
        return cls(store, tenant, key, fp)

    @property
    def ref(self) -> IdempotencyRef | None:
        """The key, to bind to the job in the job's own transaction; None without one."""
        return None if self.key is None else IdempotencyRef(self.tenant, self.key, self.fp)

    async def earlier_job(self) -> str | None:
        """The job of an earlier request with this key, None to go ahead; raises 409/422."""
        if self.key is None:
            return None
        self.claimed_at = time.monotonic()
        return self._answer(
            await off_loop(self.store.claim_idempotency, self.tenant, self.key, self.fp)
        )

    def bound_job(self, bound: IdempotencyKeyBound) -> str:
        """The job another request with this key created while this one was on its way."""
        job_id = self._answer(bound.claim)
        assert job_id is not None
        return job_id

    def _answer(self, claim: IdempotencyClaim) -> str | None:
        if claim.outcome is IdempotencyOutcome.MISMATCH:
            raise ApiError(
                422,
                "idempotency_key_reused",
                "Idempotency-Key: already used with a different request (another path or body)",
                field="Idempotency-Key",
            )
        if claim.outcome is IdempotencyOutcome.IN_PROGRESS:
            raise ApiError(
                409,
                "idempotency_key_in_progress",
                "Idempotency-Key: the first request with this key has not created its job "
                f"yet; retry after {IN_PROGRESS_RETRY_AFTER_SECONDS} s",
                field="Idempotency-Key",
                headers={"Retry-After": str(IN_PROGRESS_RETRY_AFTER_SECONDS)},
            )
        return claim.job_id if claim.outcome is IdempotencyOutcome.REPLAY else None

    async def failed(self, request: Request) -> None:
        """Free the key of a request that failed before its job was created (a key already
        bound to a job stays bound). With Redis away (the failure itself, often) the release
        is sent again each second in a task of the gateway's own (``app.state.retakes``, as a
        cancel's count take), not the request's: the request is answered ``503`` at once,
        and a resend once Redis is back finds the key free instead of a ``409`` "in
        progress" until the marker lapsed, 120 s after the claim, for a request that ended."""
        if self.key is None:
            return
        try:
            await off_loop(self.store.release_idempotency, self.tenant, self.key)
        except STORE_AWAY as exc:
            log.warning("Idempotency-Key claim: released again once Redis answers: %s", exc)
            retakes: set[asyncio.Task[None]] = request.app.state.retakes
            task = asyncio.create_task(self._release_again())
            retakes.add(task)
            task.add_done_callback(retakes.discard)

    async def _release_again(self) -> None:
        """The release sent again until it is answered, while the marker is surely this
        request's (:data:`RELEASE_MARGIN_SECONDS`); past that the marker lapses by itself."""
        assert self.key is not None
        left = self.claimed_at + IDEMPOTENCY_PENDING_TTL_SECONDS - RELEASE_MARGIN_SECONDS
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(STORE_AWAY),
                stop=stop_after_delay(max(0.0, left - time.monotonic())),
                wait=wait_fixed(1.0),
                reraise=True,
            ):
                with attempt:
                    await off_loop(self.store.release_idempotency, self.tenant, self.key)
        except STORE_AWAY as exc:
            log.warning("Idempotency-Key claim: not released; it lapses by itself: %s", exc)

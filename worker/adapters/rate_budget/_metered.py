"""The economy lane's Message Batches calls metered on its own bucket (:class:`MeteredBatches`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from worker.adapters.anthropic_batches import AnthropicMessageBatches, BatchLine, ProviderBatch
from worker.adapters.rate_budget._batches import QUEUE_RETRY_SECONDS, BatchQueue, BatchQueueFull
from worker.adapters.rate_budget._budget import RedisRateBudget
from worker.errors import AttemptOutcome, RerankAttemptError
from worker.observability import metrics

if TYPE_CHECKING:
    from worker.adapters.anthropic import AnthropicReranker


T = TypeVar("T")

# an economy lane call (a submission, a poll) waits at most this long for its bucket in its
# task's thread; beyond, it is rate_limited and the task retries later
ECONOMY_MAX_WAIT_SECONDS = 10.0


class MeteredBatches(AnthropicMessageBatches):
    """The economy lane's Message Batches calls, each drawing one request from the lane's
    own bucket (``budget``, ``lane="economy"``): the provider meters the Message Batches
    endpoints apart from the Messages API, so its polls and submissions neither take from
    the interactive searches' budget nor wait on it. A call the bucket frees only past
    :data:`ECONOMY_MAX_WAIT_SECONDS` is not sent: it is ``rate_limited``, with the wait as
    its ``retry_after``, and the task retries later. A 429 pauses the lane's bucket for its
    ``retry-after`` and counts in ``sift_provider_429_total{lane="economy"}``."""

    def __init__(
        self,
        reranker: AnthropicReranker,
        budget: RedisRateBudget,
        *,
        queue: BatchQueue | None = None,
        queue_retry: float = QUEUE_RETRY_SECONDS,
        max_wait: float = ECONOMY_MAX_WAIT_SECONDS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``queue``: the processing queue's cap (``"queued"``); a submission it has no room
        for raises :class:`BatchQueueFull` unsent, to be tried again ``queue_retry`` later."""
        super().__init__(reranker)
        self.budget = budget
        self.queue = queue
        self.queue_retry = queue_retry
        self.max_wait = max_wait
        self._sleep = sleep

    def _admit(self, what: str) -> None:
        grant = self.budget.reserve_call(self.max_wait)
        if not grant.admitted:
            raise RerankAttemptError(
                AttemptOutcome.RATE_LIMITED,
                f"batches.{what}: the economy lane's rate budget frees it in {grant.wait:.1f}s",
                retry_after=grant.wait,
            )
        if grant.wait > 0:
            self._sleep(grant.wait)

    def _told(self, error: RerankAttemptError) -> None:
        if error.outcome is AttemptOutcome.RATE_LIMITED:
            metrics.provider_429(self.model, self.budget.lane)
            self.budget.pause(error.retry_after or 1.0)

    def _metered(self, what: str, call: Callable[[], T]) -> T:
        self._admit(what)
        try:
            return call()
        except RerankAttemptError as error:
            self._told(error)
            raise

    def create(
        self, requests: Sequence[Mapping[str, Any]], before_write: Callable[[], None] | None = None
    ) -> ProviderBatch:
        create = super().create
        if self.queue is None:
            return self._metered("create", lambda: create(requests, before_write))
        placeholder = self.queue.take(len(requests))
        if placeholder is None:
            raise BatchQueueFull(
                f"batches.create: the provider's processing queue has no room for "
                f"{len(requests)} more requests (the cap is {self.queue.cap})",
                self.queue_retry,
            )
        try:
            batch = self._metered("create", lambda: create(requests, before_write))
        except BaseException:
            self.queue.drop(placeholder)
            raise
        self.queue.name(placeholder, batch.id)
        return batch

    def retrieve(self, batch_id: str) -> ProviderBatch:
        retrieve = super().retrieve
        batch = self._metered("retrieve", lambda: retrieve(batch_id))
        if batch.ended and self.queue is not None:
            self.queue.drop(batch_id)  # its requests have left the processing queue
        return batch

    def cancel(self, batch_id: str) -> ProviderBatch:
        cancel = super().cancel
        return self._metered("cancel", lambda: cancel(batch_id))

    def created_between(self, start: float, end: float) -> list[ProviderBatch]:
        created_between = super().created_between
        return self._metered("list", lambda: created_between(start, end))

    def results(self, batch_id: str) -> Iterator[BatchLine]:
        self._admit("results")
        try:
            yield from super().results(batch_id)
        except RerankAttemptError as error:
            self._told(error)
            raise

"""The economy lane's Message Batches calls metered on its own bucket
(:class:`MeteredBatches`), and its share of the provider's processing queue
(:class:`BatchQueue`, over :data:`QUEUE_SCRIPT`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from worker.adapters.anthropic_batches import AnthropicMessageBatches, BatchLine, ProviderBatch
from worker.adapters.rate_budget._budget import RedisRateBudget
from worker.constants import RATE_BUDGET_QUEUE_KEY
from worker.errors import AttemptOutcome, RerankAttemptError
from worker.observability import metrics

if TYPE_CHECKING:
    import redis

    from worker.adapters.anthropic import AnthropicReranker


T = TypeVar("T")


# an economy lane call (a submission, a poll) waits at most this long for its bucket in its
# task's thread; beyond, it is rate_limited and the task retries later
ECONOMY_MAX_WAIT_SECONDS = 10.0


# A provider batch ends within 24 hours (it expires then): its requests are surely out of the
# processing queue by this long after it was created, even if no poll saw it end.
QUEUE_ENTRY_SECONDS = 25 * 3600
# a submission the processing queue has no room for is tried again this long after, by default
QUEUE_RETRY_SECONDS = 30.0


# KEYS[1]: the lane's processing-queue hash: a provider batch id (or a submission's
# placeholder) -> "requests expiry". ARGV[1] 'take': ARGV[2] the placeholder, ARGV[3] its
# requests, ARGV[4] the cap, ARGV[5] seconds the entry lives; admitted when what the live
# entries hold plus these fits under the cap, or nothing is queued (a batch larger than the cap
# goes alone). 'name': ARGV[2] the placeholder becomes ARGV[3], the provider batch's id.
# 'drop': ARGV[2] leaves. Answers {admitted (1/0), requests queued before}. Expired entries
# (a batch whose end no poll saw) are dropped as they are met.
QUEUE_SCRIPT = """
local key = KEYS[1]
local op = ARGV[1]
if op == 'drop' then
  redis.call('HDEL', key, ARGV[2])
  return {1, 0}
end
if op == 'name' then
  local value = redis.call('HGET', key, ARGV[2])
  if value then
    redis.call('HDEL', key, ARGV[2])
    redis.call('HSET', key, ARGV[3], value)
  end
  return {1, 0}
end
local clock = redis.call('TIME')
local now = tonumber(clock[1])
local queued = 0
local entries = redis.call('HGETALL', key)
for i = 1, #entries, 2 do
  local n, expiry = string.match(entries[i + 1], '^(%d+) (%d+)$')
  if n == nil or tonumber(expiry) < now then
    redis.call('HDEL', key, entries[i])
  else
    queued = queued + tonumber(n)
  end
end
local want = tonumber(ARGV[3])
if queued > 0 and queued + want > tonumber(ARGV[4]) then
  return {0, queued}
end
local lives = tonumber(ARGV[5])
redis.call('HSET', key, ARGV[2], want .. ' ' .. (now + lives))
redis.call('EXPIRE', key, lives)
return {1, queued}
"""


class BatchQueueFull(RerankAttemptError):
    """The provider's processing queue has no room for a submission now: not sent. Not a
    failure of the batch: its submission waits (``retry_after``) for provider batches to end."""

    def __init__(self, message: str, retry_after: float = QUEUE_RETRY_SECONDS) -> None:
        super().__init__(AttemptOutcome.RATE_LIMITED, message, retry_after=retry_after)


class BatchQueue:
    """The economy lane's share of the provider's processing queue (the Message Batches
    API's cap on batch requests queued at once), shared by every process in one Redis hash:
    a submission takes its requests before it is sent, and they are given back when a poll
    sees its provider batch end (or when the submission failed)."""

    def __init__(self, client: redis.Redis, model: str, cap: int) -> None:
        self.key = f"{RATE_BUDGET_QUEUE_KEY}{model}"
        self.cap = cap
        self._client = client
        self._script = client.register_script(QUEUE_SCRIPT)

    def take(self, requests: int) -> str | None:
        """A placeholder holding ``requests`` places, or None when they do not fit now."""
        placeholder = f"pending-{uuid.uuid4().hex}"
        args: list[str | int] = ["take", placeholder, requests, self.cap, QUEUE_ENTRY_SECONDS]
        admitted, _ = self._script(keys=[self.key], args=args)
        return placeholder if int(admitted) else None

    def name(self, placeholder: str, batch_id: str) -> None:
        self._script(keys=[self.key], args=["name", placeholder, batch_id])

    def drop(self, entry: str) -> None:
        self._script(keys=[self.key], args=["drop", entry])

    def queued(self) -> int:
        """Requests the live entries hold (for tests and the CLI; expired ones counted too)."""
        values: Any = self._client.hvals(self.key)
        return sum(int(v.split()[0]) for v in values)


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

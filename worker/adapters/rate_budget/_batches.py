"""The economy lane's share of the provider's processing queue (:class:`BatchQueue`, over
:data:`QUEUE_SCRIPT`); its Message Batches calls are metered on its own bucket by
:class:`~worker.adapters.rate_budget._metered.MeteredBatches`."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from worker.constants import RATE_BUDGET_QUEUE_KEY
from worker.errors import AttemptOutcome, RerankAttemptError

if TYPE_CHECKING:
    import redis


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
# Flagged allow-oom: what it writes is bounded, whatever the calls. A 'take' adds one entry of
# a few dozen bytes, and only while the live entries' requests and its own (one at least) fit
# under the cap, or it goes alone: at most the cap's number of entries (in practice one per
# provider batch, of hundreds of requests), each gone when a poll sees its batch end, its
# create fails, or past QUEUE_ENTRY_SECONDS, the hash under that TTL too; 'name' and 'drop'
# add nothing. At Redis's maxmemory (noeviction) a submission reaches its 'take' only just
# after its items' runs wrote down the create (refused there, as every other write of the
# submission): it stopped that create unsent, the runs saying it was under way, and the next
# run had to settle it as a create in doubt (wait out the doubt window, list the provider's
# batches, and poll any of its size another client made then). Let through, the create is
# sent as its runs say; a record of it Redis then refuses is what that settling finds.
QUEUE_SCRIPT = """#!lua flags=allow-oom
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

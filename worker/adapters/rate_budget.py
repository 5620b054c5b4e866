"""One rate budget for every worker process: the provider's limits as token buckets in Redis.

Anthropic meters each organisation per model in requests, input tokens and output tokens per
minute, each a bucket that refills continuously, and answers 429 beyond it. Each worker process
throttling on its own cannot keep a cluster under that: they all fill the provider's bucket,
all get 429s, all back off together. Here every process draws on the same three buckets, kept
in one Redis hash per lane and model, through one Lua script (:data:`BUDGET_SCRIPT`) that
refills them by the time elapsed on Redis's own clock (``TIME``, so the processes' clocks do
not matter) and reserves, atomically, one request, the prompt's estimated input tokens and its
``max_tokens``::

    budget = RedisRateBudget(redis, "claude-haiku-4-5", RateLimit(rpm=4000, itpm=400_000))
    grant = budget.reserve(prompt, max_wait=12.0)   # admitted, or how long it would take
    time.sleep(grant.wait); reply = call()           # the reserved send time
    budget.settle(grant, reply.usage)                # give back what was not used

A reservation may take a bucket below zero: the caller then waits until the refill covers it
(the bucket's level is a queue of sends, spaced at exactly the limit's rate). One that would
wait longer than ``max_wait`` (the search's deadline) reserves nothing. A 429 pauses every
process: the pause's end is kept in the same hash and every reservation waits for it.

The limits come from ``SIFT_RATE_LIMITS``, or are learned from the provider's
``anthropic-ratelimit-*-limit`` response headers (:meth:`RedisRateBudget.learn`; what one
process learns, the script stores for all); with both, the lower one holds. The headers'
``-remaining`` (or, without it, ``-reset``: when the provider's bucket is full again) say how
much the provider's bucket holds: where that is less than Sift's bucket believes (another
client of the organisation draws on the same limit), the settlement of the call lowers
Sift's to match, in the same script call (never raising it). Input tokens are estimated from
the prompt's characters (:class:`TokenEstimator`), corrected by the ratio of reported to
estimated usage.

The economy lane (Message Batches) has limits of its own at the provider: its calls draw on
a bucket of their own (``lane="economy"``, :class:`MeteredBatches`), so a batch's polls and
submissions never take from the interactive searches' budget, nor theirs from it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from worker.adapters.anthropic_batches import AnthropicMessageBatches, BatchLine, ProviderBatch
from worker.constants import RATE_BUDGET_KEY, RATE_BUDGET_QUEUE_KEY
from worker.core.types import BudgetGrant, RerankPrompt, TokenUsage
from worker.errors import AttemptOutcome, RerankAttemptError
from worker.observability import metrics
from worker.settings import RateLimit

if TYPE_CHECKING:
    import redis

    from worker.adapters.anthropic import AnthropicReranker

log = logging.getLogger(__name__)

__all__ = [
    "BUDGET_SCRIPT",
    "BatchQueue",
    "BatchQueueFull",
    "MeteredBatches",
    "RedisRateBudget",
    "TokenEstimator",
    "limits_from_headers",
    "remaining_from_headers",
]

T = TypeVar("T")

# Sift's buckets hold this share of a minute's worth, the provider's a whole minute: the
# remaining tenth of the provider's bucket absorbs the jitter between a reservation and the
# request's arrival there, so a cluster at the limit's rate does not meet 429s.
BURST_FRACTION = 0.9
# The hash outlives its last use by this long (a day): it holds only levels and limits.
BUDGET_TTL_SECONDS = 86_400
MAX_PAUSE_SECONDS = 60.0
# one report moves the input-token correction at most this far (a prompt of images, say)
MIN_CORRECTION, MAX_CORRECTION = 0.1, 10.0
HEADER_BUCKETS = {"rpm": "requests", "itpm": "input-tokens", "otpm": "output-tokens"}
HEADER_LIMITS = {name: f"anthropic-ratelimit-{b}-limit" for name, b in HEADER_BUCKETS.items()}
# backlog() answers from the last reading this recent (a reservation's wait is one) rather
# than asking Redis: a batch paces every item on it
BACKLOG_REFRESH_SECONDS = 0.2
# an economy lane call (a submission, a poll) waits at most this long for its bucket in its
# task's thread; beyond, it is rate_limited and the task retries later
ECONOMY_MAX_WAIT_SECONDS = 10.0
NOT_STATED = -1.0  # a bucket the response says nothing about
# A provider batch ends within 24 hours (it expires then): its requests are surely out of the
# processing queue by this long after it was created, even if no poll saw it end.
QUEUE_ENTRY_SECONDS = 25 * 3600
# a submission the processing queue has no room for is tried again this long after, by default
QUEUE_RETRY_SECONDS = 30.0

# KEYS[1]: the budget's hash. ARGV: 1-3 the configured limits per minute (requests, input
# tokens, output tokens; 0: none), 4-6 the amounts to take (negative: give back), 7 the most the
# caller may wait in seconds (-1: take unconditionally, the settlement; -2: only answer the
# wait, taking nothing), 8 seconds to pause every caller for (a 429; 0: none), 9-11 learned
# limits to store (0: none), 12 the burst fraction, 13 the hash's TTL, 14-16 what the
# provider's buckets held by its response headers (-1: not stated), 17 the seconds since that
# call was sent (the provider's buckets have refilled since). A limit both configured and
# learned is the lower of the two. A stated level lowers Sift's bucket to it, less the
# provider's spare (1 - burst) share, when Sift's believes it holds more; never raises it.
# Answers {admitted (1/0), seconds to wait (a string: Lua numbers come back from Redis as
# integers)}. Numbers are stored with 17 digits (Lua's tostring keeps 14: a tenth of a
# millisecond of Redis's clock). Nothing but learned limits is written when the caller is not
# admitted.
BUDGET_SCRIPT = """
local function num(x) return string.format('%.17g', x) end
local key = KEYS[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', key, 'r', 'i', 'o', 'Lr', 'Li', 'Lo', 'at', 'pause')
local names = {'r', 'i', 'o'}
local at = tonumber(state[7]) or now
local pause = tonumber(state[8]) or 0
local max_wait = tonumber(ARGV[7])
local burst = tonumber(ARGV[12])
local age = tonumber(ARGV[17])
local writes = {}
for d = 1, 3 do
  local learned = tonumber(ARGV[8 + d])
  if learned > 0 and learned ~= tonumber(state[3 + d]) then
    state[3 + d] = learned
    table.insert(writes, 'L' .. names[d]); table.insert(writes, learned)
  end
end
local pause_for = tonumber(ARGV[8])
if pause_for > 0 and now + pause_for > pause then
  pause = now + pause_for
end
local wait = math.max(0, pause - now)
local levels = {}
for d = 1, 3 do
  local limit = tonumber(ARGV[d])
  local learned = tonumber(state[3 + d]) or 0
  if limit <= 0 then
    limit = learned
  elseif learned > 0 and learned < limit then
    limit = learned
  end
  if limit > 0 then
    local cap = limit * burst
    local rate = limit / 60
    local level = math.min(cap, (tonumber(state[d]) or cap) + (now - at) * rate)
    local cost = math.min(tonumber(ARGV[3 + d]), cap)
    if cost > 0 and level < cost then
      wait = math.max(wait, (cost - level) / rate)
    end
    level = math.min(cap, level - cost)
    local stated = tonumber(ARGV[13 + d])
    if stated >= 0 then
      local theirs = math.min(limit, stated + age * rate) - (limit - cap)
      if theirs < level then level = theirs end
    end
    levels[d] = level
  end
end
if max_wait == -2 then
  return {0, num(wait)}
end
if max_wait >= 0 and wait > max_wait then
  if #writes > 0 then redis.call('HSET', key, unpack(writes)) end
  return {0, num(wait)}
end
for d = 1, 3 do
  if levels[d] ~= nil then
    table.insert(writes, names[d]); table.insert(writes, num(levels[d]))
  end
end
table.insert(writes, 'at'); table.insert(writes, num(now))
table.insert(writes, 'pause'); table.insert(writes, num(pause))
redis.call('HSET', key, unpack(writes))
redis.call('EXPIRE', key, tonumber(ARGV[13]))
return {1, num(wait)}
"""


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


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def remaining_from_headers(
    headers: Mapping[str, str], now: float | None = None
) -> tuple[float, float, float]:
    """What the provider's request, input-token and output-token buckets held when it answered
    (:data:`NOT_STATED` for one the headers leave out): ``-remaining``, or else what
    ``-reset`` (RFC 3339, when the bucket is full again) and ``-limit`` imply at the refill
    rate of a minute's worth a minute.

    >>> remaining_from_headers({"anthropic-ratelimit-requests-remaining": "7"})
    (7.0, -1.0, -1.0)
    >>> remaining_from_headers({"anthropic-ratelimit-requests-limit": "60",
    ...     "anthropic-ratelimit-requests-reset": "2026-01-01T00:00:30Z"},
    ...     now=datetime.fromisoformat("2026-01-01T00:00:00+00:00").timestamp())
    (30.0, -1.0, -1.0)
    """
    found: list[float] = []
    for bucket in HEADER_BUCKETS.values():
        prefix = f"anthropic-ratelimit-{bucket}-"
        remaining = _number(headers.get(prefix + "remaining"))
        if remaining is None:
            remaining = _from_reset(headers.get(prefix + "reset"),
                                    _number(headers.get(prefix + "limit")), now)  # fmt: skip
        found.append(NOT_STATED if remaining is None else remaining)
    return found[0], found[1], found[2]


def _from_reset(reset: str | None, limit: float | None, now: float | None) -> float | None:
    if reset is None or not limit:
        return None
    try:
        full_at = datetime.fromisoformat(reset.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
    seconds = max(0.0, full_at - (time.time() if now is None else now))
    return max(0.0, limit - seconds * limit / 60.0)


def limits_from_headers(headers: Mapping[str, str]) -> RateLimit | None:
    """The limits a provider response states (``anthropic-ratelimit-*-limit``), or None.
    A value that is no number, or not a finite one of at least 1, is left out: the others
    are still learned.

    >>> limits_from_headers({"anthropic-ratelimit-requests-limit": "inf",
    ...                      "anthropic-ratelimit-input-tokens-limit": "400000"})
    RateLimit(rpm=None, itpm=400000, otpm=None, economy=None)
    """
    found: dict[str, int] = {}
    for name, header in HEADER_LIMITS.items():
        value = headers.get(header)
        if value is None:
            continue
        try:
            number = int(float(value))
        except (ValueError, OverflowError):  # OverflowError: "inf", "1e999"
            continue
        if number >= 1:
            found[name] = number
    if not found:
        return None
    return RateLimit(rpm=found.get("rpm"), itpm=found.get("itpm"), otpm=found.get("otpm"))


class TokenEstimator:
    """Input tokens of a prompt, before it is sent: characters over a chars-per-token figure,
    times a correction learned from what the provider reported (an exponential average of
    reported over estimated). It starts high (3 chars per token, about Claude's rate on English
    text and under it on code), so the first calls over-reserve rather than under."""

    def __init__(self, chars_per_token: float = 3.0, smoothing: float = 0.1) -> None:
        self.chars_per_token = chars_per_token
        self.smoothing = smoothing
        self.correction = 1.0
        self._lock = threading.Lock()

    def raw(self, prompt: RerankPrompt) -> float:
        chars = len(prompt.system) + len(prompt.user)
        chars += len(json.dumps(dict(prompt.output_schema), separators=(",", ":")))
        return chars / self.chars_per_token

    def estimate(self, prompt: RerankPrompt) -> int:
        return max(1, round(self.raw(prompt) * self.correction))

    def calibrate(self, raw_estimate: float, reported: int) -> None:
        """Move the correction toward ``reported / raw_estimate``."""
        if raw_estimate <= 0 or reported <= 0:
            return
        with self._lock:
            ratio = min(max(reported / raw_estimate, MIN_CORRECTION), MAX_CORRECTION)
            self.correction += self.smoothing * (ratio - self.correction)


class RedisRateBudget:
    """A :class:`~worker.core.ports.RateBudget` shared through Redis by every process.

    Off (every reservation admitted at once, no Redis call) until a limit is known: from
    ``limits`` (``SIFT_RATE_LIMITS``) or from response headers given to :meth:`learn`.
    A 429's pause is honoured even then.
    """

    def __init__(
        self,
        client: redis.Redis,
        model: str,
        limits: RateLimit | None = None,
        *,
        lane: str = "standard",
        estimator: TokenEstimator | None = None,
        burst_fraction: float = BURST_FRACTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.lane = lane
        self.key = f"{RATE_BUDGET_KEY}{lane}:{model}"
        self.limits = limits or RateLimit()
        self.learned = RateLimit()
        self.estimator = estimator or TokenEstimator()
        self.burst_fraction = burst_fraction
        self._clock = clock
        self.client = client
        self._script = client.register_script(BUDGET_SCRIPT)
        self._typical = (0.0, 0.0)  # the last call's input and output tokens, for backlog()
        self._paused = False
        self._backlog = (0.0, -math.inf)  # the last wait read, and when (this process's clock)
        # per thread: when its call was sent, and what the call's response headers stated
        self._call = threading.local()
        self.script_calls = 0  # Redis round trips made, for the benchmark

    @property
    def active(self) -> bool:
        """Whether a limit is known (set or learned), or a 429 paused the cluster."""
        known = (self.limits.rpm, self.limits.itpm, self.limits.otpm)
        learned = (self.learned.rpm, self.learned.itpm, self.learned.otpm)
        return self._paused or any(v is not None for v in (*known, *learned))

    def _run(
        self,
        take: tuple[float, float, float],
        max_wait: float,
        *,
        pause: float = 0.0,
        learn: RateLimit | None = None,
        stated: tuple[float, float, float] = (NOT_STATED, NOT_STATED, NOT_STATED),
        age: float = 0.0,
    ) -> tuple[bool, float]:
        limits = self.limits
        learned = learn or RateLimit()
        args = [
            limits.rpm or 0,
            limits.itpm or 0,
            limits.otpm or 0,
            *take,
            max_wait,
            pause,
            learned.rpm or 0,
            learned.itpm or 0,
            learned.otpm or 0,
            self.burst_fraction,
            BUDGET_TTL_SECONDS,
            *stated,
            max(0.0, age),
        ]
        self.script_calls += 1
        admitted, wait = self._script(keys=[self.key], args=args)
        return bool(int(admitted)), float(wait)

    def backlog(self) -> float:
        """Seconds a call like the last one would wait now (nothing is reserved). Answered
        from this process's last reading when it is under :data:`BACKLOG_REFRESH_SECONDS` old
        (every reservation is one): a batch asks before each item."""
        if not self.active:
            return 0.0
        wait, read_at = self._backlog
        now = self._clock()
        if now - read_at < BACKLOG_REFRESH_SECONDS:
            return wait
        wait = self._run((1, *self._typical), -2)[1]
        self._backlog = (wait, now)
        return wait

    def reserve(self, prompt: RerankPrompt, max_wait: float) -> BudgetGrant:
        if not self.active:
            return BudgetGrant(admitted=True, wait=0.0)
        raw = self.estimator.raw(prompt)
        estimate = self.estimator.estimate(prompt)
        self._typical = (float(estimate), float(prompt.max_tokens))
        admitted, wait = self._run((1, estimate, prompt.max_tokens), max(0.0, max_wait))
        now = self._clock()
        self._backlog = (wait, now)
        if not admitted:
            return BudgetGrant(admitted=False, wait=wait)
        self._call.sent_at = now + wait
        self._call.stated = None
        metrics.budget_waited(self.model, self.lane, wait)
        return BudgetGrant(True, wait, estimate, prompt.max_tokens, raw_input=raw)

    def settle(self, grant: BudgetGrant, usage: TokenUsage | None, *, sent: bool = True) -> None:
        """Give back the unused part of the reservation (and its request, for a call never
        ``sent``: the provider did not count it). Input tokens as the provider meters
        them: uncached plus cache writes (cache reads do not count against ITPM). What the
        call's response headers said the provider's buckets hold (:meth:`learn`) goes in the
        same script call."""
        stated = getattr(self._call, "stated", None)
        self._call.stated = None
        if usage is None or not grant.admitted or not (grant.input_tokens or grant.output_tokens):
            return
        used_input = usage.input_tokens + usage.cache_creation_input_tokens
        # against the raw estimate the grant carries: rebuilding it from the correction now,
        # which other threads move meanwhile, fed the correction back into itself
        self.estimator.calibrate(grant.raw_input, used_input)
        # what was used beyond the reservation is taken too: a negative amount gives back
        extra_input = float(used_input - grant.input_tokens)
        extra_output = float(usage.output_tokens - grant.output_tokens)
        # (requests, input, output): a call never sent gives its request back as well
        take = (0.0 if sent else -1.0, extra_input, extra_output)
        if stated is None:
            self._run(take, -1)
            return
        age = self._clock() - getattr(self._call, "sent_at", self._clock())
        self._run(take, -1, stated=stated, age=age)

    def pause(self, seconds: float) -> None:
        """Every process waits ``seconds`` (capped at a minute) before its next call."""
        self._paused = True
        self._run((0, 0, 0), -1, pause=min(max(seconds, 0.0), MAX_PAUSE_SECONDS))

    def learn(self, headers: Mapping[str, str]) -> None:
        """Take what a response's headers state: the limits, stored in Redis the first time
        they change; what the provider's buckets hold, kept for this thread's settlement
        (which writes it in its own script call: no round trip here)."""
        stated = remaining_from_headers(headers)
        if any(level != NOT_STATED for level in stated):
            self._call.stated = stated
        found = limits_from_headers(headers)
        if found is None or found == self.learned:
            return
        log.info("rate limits of %s learned from the provider: %s", self.model, found)
        self.learned = found
        self._run((0, 0, 0), -1, learn=found)

    def reserve_call(self, max_wait: float) -> BudgetGrant:
        """Reserve one request and no tokens (an economy lane call: a submission, a poll)."""
        if not self.active:
            return BudgetGrant(admitted=True, wait=0.0)
        admitted, wait = self._run((1, 0, 0), max(0.0, max_wait))
        if admitted:
            metrics.budget_waited(self.model, self.lane, wait)
        return BudgetGrant(admitted=admitted, wait=wait)


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

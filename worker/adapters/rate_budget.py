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
process learns, the script stores for all). Input tokens are estimated from the prompt's
characters (:class:`TokenEstimator`), corrected by the ratio of reported to estimated usage.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from worker.constants import RATE_BUDGET_KEY
from worker.core.types import BudgetGrant, RerankPrompt, TokenUsage
from worker.settings import RateLimit

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

__all__ = ["BUDGET_SCRIPT", "RedisRateBudget", "TokenEstimator", "limits_from_headers"]

# Sift's buckets hold this share of a minute's worth, the provider's a whole minute: the
# remaining tenth of the provider's bucket absorbs the jitter between a reservation and the
# request's arrival there, so a cluster at the limit's rate does not meet 429s.
BURST_FRACTION = 0.9
# The hash outlives its last use by this long (a day): it holds only levels and limits.
BUDGET_TTL_SECONDS = 86_400
MAX_PAUSE_SECONDS = 60.0
# one report moves the input-token correction at most this far (a prompt of images, say)
MIN_CORRECTION, MAX_CORRECTION = 0.1, 10.0
HEADER_LIMITS = {
    "rpm": "anthropic-ratelimit-requests-limit",
    "itpm": "anthropic-ratelimit-input-tokens-limit",
    "otpm": "anthropic-ratelimit-output-tokens-limit",
}

# KEYS[1]: the budget's hash. ARGV: 1-3 the limits per minute (requests, input tokens, output
# tokens; 0: use the learned one, if any), 4-6 the amounts to take (negative: give back),
# 7 the most the caller may wait in seconds (-1: take unconditionally, the settlement; -2:
# only answer the wait, taking nothing),
# 8 seconds to pause every caller for (a 429; 0: none), 9-11 learned limits to store (0: none),
# 12 the burst fraction, 13 the hash's TTL. Answers {admitted (1/0), seconds to wait (a
# string: Lua numbers come back from Redis as integers)}. Numbers are stored with 17 digits
# (Lua's tostring keeps 14: a tenth of a millisecond of Redis's clock). Nothing but learned
# limits is written when the caller is not admitted.
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
  if limit <= 0 then limit = tonumber(state[3 + d]) or 0 end
  if limit > 0 then
    local cap = limit * burst
    local rate = limit / 60
    local level = math.min(cap, (tonumber(state[d]) or cap) + (now - at) * rate)
    local cost = math.min(tonumber(ARGV[3 + d]), cap)
    if cost > 0 and level < cost then
      wait = math.max(wait, (cost - level) / rate)
    end
    levels[d] = math.min(cap, level - cost)
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


def limits_from_headers(headers: Mapping[str, str]) -> RateLimit | None:
    """The limits a provider response states (``anthropic-ratelimit-*-limit``), or None."""
    found: dict[str, int] = {}
    for name, header in HEADER_LIMITS.items():
        value = headers.get(header)
        if value is None:
            continue
        try:
            number = int(float(value))
        except ValueError:
            continue
        if number >= 1:
            found[name] = number
    return RateLimit(**found) if found else None


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
    ) -> None:
        self.model = model
        self.lane = lane
        self.key = f"{RATE_BUDGET_KEY}{lane}:{model}"
        self.limits = limits or RateLimit()
        self.learned = RateLimit()
        self.estimator = estimator or TokenEstimator()
        self.burst_fraction = burst_fraction
        self._script = client.register_script(BUDGET_SCRIPT)
        self._typical = (0.0, 0.0)  # the last call's input and output tokens, for backlog()
        self._paused = False

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
        ]
        admitted, wait = self._script(keys=[self.key], args=args)
        return bool(int(admitted)), float(wait)

    def backlog(self) -> float:
        """Seconds a call like the last one would wait now (nothing is reserved)."""
        if not self.active:
            return 0.0
        return self._run((1, *self._typical), -2)[1]

    def reserve(self, prompt: RerankPrompt, max_wait: float) -> BudgetGrant:
        if not self.active:
            return BudgetGrant(admitted=True, wait=0.0)
        raw = self.estimator.raw(prompt)
        estimate = self.estimator.estimate(prompt)
        self._typical = (float(estimate), float(prompt.max_tokens))
        admitted, wait = self._run((1, estimate, prompt.max_tokens), max(0.0, max_wait))
        if not admitted:
            return BudgetGrant(admitted=False, wait=wait)
        return BudgetGrant(True, wait, estimate, prompt.max_tokens, raw_input=raw)

    def settle(self, grant: BudgetGrant, usage: TokenUsage | None) -> None:
        """Give back the unused part of the reservation. Input tokens as the provider meters
        them: uncached plus cache writes (cache reads do not count against ITPM)."""
        if usage is None or not grant.admitted or not (grant.input_tokens or grant.output_tokens):
            return
        used_input = usage.input_tokens + usage.cache_creation_input_tokens
        # against the raw estimate the grant carries: rebuilding it from the correction now,
        # which other threads move meanwhile, fed the correction back into itself
        self.estimator.calibrate(grant.raw_input, used_input)
        # what was used beyond the reservation is taken too: a negative amount gives back
        extra_input = float(used_input - grant.input_tokens)
        extra_output = float(usage.output_tokens - grant.output_tokens)
        self._run((0.0, extra_input, extra_output), -1)

    def pause(self, seconds: float) -> None:
        """Every process waits ``seconds`` (capped at a minute) before its next call."""
        self._paused = True
        self._run((0, 0, 0), -1, pause=min(max(seconds, 0.0), MAX_PAUSE_SECONDS))

    def learn(self, headers: Mapping[str, str]) -> None:
        """Take the limits a response states; stored in Redis the first time they change."""
        found = limits_from_headers(headers)
        if found is None or found == self.learned:
            return
        log.info("rate limits of %s learned from the provider: %s", self.model, found)
        self.learned = found
        self._run((0, 0, 0), -1, learn=found)

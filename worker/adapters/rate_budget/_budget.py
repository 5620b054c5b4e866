"""The standard lane's budget: :class:`RedisRateBudget` over its Lua script
(:data:`BUDGET_SCRIPT`), and the :class:`TokenEstimator` of a prompt's input tokens."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping

import redis

from worker.adapters.rate_budget._headers import (
    NOT_STATED,
    limits_from_headers,
    remaining_from_headers,
)
from worker.constants import LANE_STANDARD, RATE_BUDGET_KEY
from worker.core.tokens import CHARS_PER_TOKEN, prompt_tokens
from worker.core.types import BudgetGrant, RerankPrompt, TokenUsage
from worker.observability import metrics
from worker.settings import RateLimit

log = logging.getLogger(__package__)  # worker.adapters.rate_budget: one logger for the budget

# Sift's buckets hold this share of a minute's worth, the provider's a whole minute: the
# remaining tenth of the provider's bucket absorbs the jitter between a reservation and the
# request's arrival there, so a cluster at the limit's rate does not meet 429s.
BURST_FRACTION = 0.9
# The hash outlives its last use by this long (a day): it holds only levels and limits.
BUDGET_TTL_SECONDS = 86_400
MAX_PAUSE_SECONDS = 60.0
# one report moves the input-token correction at most this far (a prompt of images, say)
MIN_CORRECTION, MAX_CORRECTION = 0.1, 10.0


# backlog() answers from the last reading this recent (a reservation's wait is one) rather
# than asking Redis: a batch paces every item on it
BACKLOG_REFRESH_SECONDS = 0.2
# an item let start (started()) counts in the readings until it reserves its call, or ends
# without one (ended(): its search ended, or none will run), or for this long at most: one
# whose run failed before its search is not counted for good
PENDING_SECONDS = 60.0
# what another process told of its items let start counts this long after it told it (Redis's
# clock): each process tells it at every reading and reservation, several times a second
# while it paces a batch, so only a process gone (killed, or done pacing) is past it
PENDING_STALE_SECONDS = 10.0
# and, while it knows no limit, reads the shared hash (limits other processes learned, a 429's
# pause, the breaker) at most this often: at every call it was a round trip per call against a
# provider that states no limits
OFF_REFRESH_SECONDS = 0.2

# The breaker. A call answered 5xx (529 overloaded included) opens it: no process sends for
# the answer's retry-after, or OUTAGE_FIRST_SECONDS doubled at each 5xx in a row up to
# OUTAGE_MAX_SECONDS (the calls in flight that fail while it is open, sent before it opened,
# are one failure: they keep it open that long after the last of them, and strike once);
# then one call, the probe, goes alone (its lease: PROBE_LEASE_SECONDS, an attempt's default
# timeout, should its process die), the others asking again every PROBE_POLL_SECONDS. The
# probe's answer that is neither a 5xx nor a 429 closes it (a call sent before it opened,
# answered since, leaves it: it says nothing of the provider now); another 5xx opens it
# again; a 429 (a pause) or no answer lets the next probe go. A search whose probe failed,
# or on its last attempt, waits PROBE_POLL_SECONDS past the opening's end before it may
# probe, the others asking meanwhile: the next probe is another search's (each probe is one
# of its search's attempts). While it is open, or its probe
# is out, the backlog a batch paces on reads OUTAGE_BACKLOG_SECONDS: no new batch item
# starts its search (and its deadline) against a provider that is down, nor one let start
# before that gets its CPU slot meanwhile (shut(): it paces again, SearchPipeline.search).
# Half open (the opening over, no probe out), it reads as usual for one item of a process, the
# would-be probe (backlog(): the first thread to ask then), and a day for its others until
# the probe is answered (closed: they go) or fails (open again: they wait). That item's claim
# ends at its reservation (the probe, or refused by another process's), at its search's end,
# or once it has not asked for HALF_OPEN_CLAIM_SECONDS before it started (its pacing stopped).
# The cap is the SDK's own longest back-off between retries (anthropic's MAX_RETRY_DELAY): one
# probe every 8 s at most while an outage lasts, so a search that met its first 5xx is
# answered within its deadline after an outage of two thirds of it (probes at 1, 3, 7, 15,
# 23 s; a 16 s cap would send the probe after a 20 s outage at 31 s, past a 30 s deadline).
OUTAGE_FIRST_SECONDS = 1.0
OUTAGE_MAX_SECONDS = 8.0
PROBE_LEASE_SECONDS = 20.0
PROBE_POLL_SECONDS = 1.0
OUTAGE_BACKLOG_SECONDS = 86_400.0
HALF_OPEN_CLAIM_SECONDS = 3.0  # twice a pacing's longest sleep between its readings

# Learning the limits. While no limit is known (none set, learned or stored in the hash), one
# call at a time goes out, the learner, whose answer's headers teach the limits to every
# process: its place is a key (:data:`LEARNER_SCRIPT`) held for LEARN_LEASE_SECONDS at most
# (an attempt's default timeout, should its process die). Meanwhile the other calls wait for
# the limits to appear in the hash (read every OFF_REFRESH_SECONDS), or for the place to be
# free, and the backlog a batch paces on reads OUTAGE_BACKLOG_SECONDS: a deployment's first
# batch starts its items once the limits can pace them, not all at once into the provider's
# 429s and past the deadlines the limits learned then hold them to. An answer that states no
# limit (a proxy that strips the headers) leaves the place as UNSTATED for UNSTATED_SECONDS:
# every call goes at once, unmetered, until then, and one call learns again after it.
LEARN_LEASE_SECONDS = round(PROBE_LEASE_SECONDS)  # whole seconds: a key's EX
UNSTATED = "unstated"
UNSTATED_SECONDS = 3_600

# KEYS[1]: the learner's place. ARGV[1]: the caller's token (its process and thread); ARGV[2]:
# 'take' (the place, if it is free: answers who holds it now, the caller included), 'drop'
# (the caller gives its place up: the next call may learn) or 'unstated' (the caller's answer
# stated no limit); ARGV[3]: how long what is set lasts, in seconds. 'drop' and 'unstated' act
# only while the place is the caller's; they answer who held it. Flagged allow-oom as
# BUDGET_SCRIPT is: it writes one short key at most.
LEARNER_SCRIPT = """#!lua flags=allow-oom
local held = redis.call('GET', KEYS[1])
if ARGV[2] == 'take' then
  if held then return held end
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
  return ARGV[1]
end
if held == ARGV[1] then
  if ARGV[2] == 'drop' then
    redis.call('DEL', KEYS[1])
  else
    redis.call('SET', KEYS[1], 'UNSTATED', 'EX', ARGV[3])
  end
end
return held or ''
""".replace("UNSTATED", UNSTATED)


# KEYS[1]: the budget's hash. ARGV: 1-3 the configured limits per minute (requests, input
# tokens, output tokens; 0: none), 4-6 the amounts to take (negative: give back), 7 the most the
# caller may wait in seconds (-1: take unconditionally, the settlement; -2: only answer the
# wait, taking nothing), 8 seconds to pause every caller for (a 429; 0: none), 9-11 learned
# limits to store (0: none), 12 the burst fraction, 13 the hash's TTL, 14-16 what the
# provider's buckets held by its response headers (-1: not stated), 17 the seconds since that
# call was sent (the provider's buckets have refilled since), 18 the seconds of queue this
# process's items let start but not yet reserved make (pending), 19 the process's id ('': it
# tells nothing), 20 how long another process's pending counts after it told it. KEYS[2]: the
# processes' pending, id -> "seconds instant" on Redis's clock. A limit both configured and
# learned is the lower of the two. A stated level lowers Sift's bucket to it, less the
# provider's spare (1 - burst) share, when Sift's believes it holds more; never raises it.
# ARGV 21: 1 when a call was answered 5xx (it opens the breaker, strikes + 1 unless it is
# open), 22 that answer's retry-after (0: none), 23: 1 when a call was answered otherwise (it
# closes the breaker if it is the probe, ARGV 29), 2 when a call got no answer (a timeout, a
# connection lost: its probe, if it is the one out, ends: ARGV 29), 24-27 the probe's lease,
# the first and the longest opening, and how soon a caller asks again while a probe is out
# (OUTAGE_*, PROBE_*). A reservation while the breaker is open, or a probe is out,
# is refused; one when it is half open (no probe out) is admitted as the probe. ARGV 28: 1 when
# the learned limits (9-11) are only to be stored where the hash holds none (a reservation
# restoring what its process learned, after the hash expired or Redis lost it), 0 when they
# are what an answer stated now (stored over any other). ARGV 29: a reservation's probe id,
# which the probe mark holds ('prober') when it is admitted as the probe; with ARGV 23 = 2, the
# probe a call that got no answer ends: only while the mark is still that one (a 429's pause
# ended it, and another's probe is out since: that one stays); '' ends whichever is out (a
# 429's pause). ARGV 30: 1 when the reservation's search yields the probe (it went as the
# probe before and it failed, or this is its last attempt): half open, it is refused (the
# breaker's) until the opening has been over ARGV 27's seconds, in which every other search
# waiting on the breaker asks again: the next probe is one of theirs, not another attempt of
# a search that already spent one on the outage, nor the last of one.
# Answers {admitted (1/0), seconds to wait, the backlog, 1 when the breaker refused it or,
# admitted, when it is the probe, 1 when the breaker is half open (the opening over, no probe
# out, this call not admitted as the probe)} (strings: Lua numbers come back from Redis as
# integers). The backlog is the reading a batch paces on: the seconds until a call like this
# one fits once it is taken (when admitted) and once every process's pending items have
# theirs; below zero, the bucket has room for that many seconds' worth more; a day while the
# breaker is open or its probe out (the call admitted as the probe included). Numbers are
# stored with 17 digits (Lua's tostring keeps 14: a tenth of a millisecond of Redis's clock).
# Nothing but learned limits and the caller's pending is written when it is not admitted.
# Flagged allow-oom: what it writes is bounded, whatever the calls: one hash per lane and model
# of a fixed set of fields (the three buckets and learned limits, the stamp, the pause, the
# breaker's strikes, opening and probe mark), and one field per process in the pending hash
# (its own, rewritten; a gone process's is dropped once stale), both under a TTL. Redis at its
# maxmemory (noeviction) refused it as a whole (at its first write that may grow): a search's
# reservation (one of a process with items let start), a billed call's settlement, a stop's or
# a cancel's give-back, a 429's pause, each raised OutOfMemoryError out of the search: the
# billed answer lost, the stop or cancel taken for a Redis failure, no process paused.
BUDGET_SCRIPT = """#!lua flags=allow-oom
local function num(x) return string.format('%.17g', x) end
local key = KEYS[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', key, 'r', 'i', 'o', 'Lr', 'Li', 'Lo', 'at', 'pause', 'strikes',
                         'open', 'probe', 'prober')
local names = {'r', 'i', 'o'}
local at = tonumber(state[7]) or now
local pause = tonumber(state[8]) or 0
local max_wait = tonumber(ARGV[7])
local burst = tonumber(ARGV[12])
local age = tonumber(ARGV[17])
local ttl = tonumber(ARGV[13])
local writes = {}
local strikes = tonumber(state[9]) or 0
local open = tonumber(state[10]) or 0
local probe = tonumber(state[11]) or 0
if tonumber(ARGV[23]) == 1 and strikes > 0 and ARGV[29] ~= '' and ARGV[29] == state[12] then
  -- the probe's answer: the provider is back (a call sent before it opened tells nothing)
  strikes, open, probe = 0, 0, 0
  redis.call('HDEL', key, 'strikes', 'open', 'probe', 'prober')
elseif tonumber(ARGV[23]) == 2 and probe > 0 and (ARGV[29] == '' or ARGV[29] == state[12]) then
  -- the probe got no answer (or was never sent): the next may go
  probe = 0
  redis.call('HSET', key, 'probe', 0)
end
if tonumber(ARGV[21]) > 0 then  -- a 5xx: no one sends for a while, longer at each in a row
  -- the calls in flight failing while it is open failed together: one strike, not one each
  if now >= open then strikes = strikes + 1 end
  local seconds = tonumber(ARGV[22])
  if seconds <= 0 then
    seconds = math.min(tonumber(ARGV[25]) * 2 ^ (strikes - 1), tonumber(ARGV[26]))
  end
  open = math.max(open, now + seconds)
  probe = 0
  redis.call('HSET', key, 'strikes', strikes, 'open', num(open), 'probe', 0)
  redis.call('EXPIRE', key, ttl)
end
local shut = 0  -- seconds until the breaker lets a call through: 0 closed, or half open
if strikes > 0 then
  if now < open then
    shut = open - now
  elseif probe > now then
    shut = math.min(probe - now, tonumber(ARGV[27]))
  end
end
local half = 0  -- half open: the opening over, no probe out
if strikes > 0 and shut == 0 then half = 1 end
-- a search whose probe failed, or on its last attempt, is the probe only once every other
-- search waiting on the breaker has asked since the opening ended (each asks within a
-- poll): the next is theirs
local held = shut
local turn = open + tonumber(ARGV[27])
if half == 1 and tonumber(ARGV[30]) == 1 and now < turn then held = turn - now end
local restore = tonumber(ARGV[28]) == 1
for d = 1, 3 do
  local learned = tonumber(ARGV[8 + d])
  local stored = tonumber(state[3 + d])
  if learned > 0 and learned ~= stored and not (restore and stored) then
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
local need_now, need_next = -math.huge, -math.huge  -- until a call like it fits: before, after
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
    -- no refill before the last stamp: Redis's clock stepped back
    local level = math.min(cap, (tonumber(state[d]) or cap) + math.max(0, now - at) * rate)
    local cost = math.min(tonumber(ARGV[3 + d]), cap)
    if cost > 0 and level < cost then
      wait = math.max(wait, (cost - level) / rate)
    end
    need_now = math.max(need_now, (cost - level) / rate)
    level = math.min(cap, level - cost)
    local stated = tonumber(ARGV[13 + d])
    if stated >= 0 then
      local theirs = math.min(limit, stated + age * rate) - (limit - cap)
      if theirs < level then level = theirs end
    end
    levels[d] = level
    need_next = math.max(need_next, (cost - level) / rate)
  end
end
local pending = 0
local me = ARGV[19]
if me ~= '' then
  local pkey = KEYS[2]
  local stale = tonumber(ARGV[20])
  local told = redis.call('HGETALL', pkey)
  for i = 1, #told, 2 do
    if told[i] ~= me then
      local seconds, instant = string.match(told[i + 1], '^(%S+) (%S+)$')
      if instant and now - tonumber(instant) <= stale then
        pending = pending + tonumber(seconds)
      else
        redis.call('HDEL', pkey, told[i])
      end
    end
  end
  local mine = tonumber(ARGV[18])
  pending = pending + mine
  if mine > 0 then
    redis.call('HSET', pkey, me, num(mine) .. ' ' .. num(now))
    redis.call('EXPIRE', pkey, tonumber(ARGV[13]))
  else
    redis.call('HDEL', pkey, me)
  end
end
local function backlog(need)
  if shut > 0 then return num(OUTAGE_BACKLOG) end
  if need == -math.huge then need = 0 end
  return num(math.max(pause - now, need + pending))
end
if max_wait == -2 then
  return {0, num(wait), backlog(need_now), 0, half}
end
if max_wait >= 0 and (held > 0 or wait > max_wait) then
  if #writes > 0 then
    redis.call('HSET', key, unpack(writes))
    redis.call('EXPIRE', key, ttl)
  end
  if held > 0 then
    return {0, num(held), backlog(need_now), 1, half}
  end
  return {0, num(wait), backlog(need_now), 0, half}
end
local probing = 0
if max_wait >= 0 and strikes > 0 then  -- half open: this call is the probe
  probing = 1
  table.insert(writes, 'probe'); table.insert(writes, num(now + tonumber(ARGV[24])))
  table.insert(writes, 'prober'); table.insert(writes, ARGV[29])
end
for d = 1, 3 do
  if levels[d] ~= nil then
    table.insert(writes, names[d]); table.insert(writes, num(levels[d]))
  end
end
table.insert(writes, 'at'); table.insert(writes, num(now))
table.insert(writes, 'pause'); table.insert(writes, num(pause))
redis.call('HSET', key, unpack(writes))
redis.call('EXPIRE', key, ttl)
if probing == 1 then  -- its probe is out now: the breaker holds the others
  return {1, num(wait), num(OUTAGE_BACKLOG), 1, 0}
end
return {1, num(wait), backlog(need_next), 0, half}
""".replace("OUTAGE_BACKLOG", repr(OUTAGE_BACKLOG_SECONDS))


class TokenEstimator:
    """Input tokens of a prompt, before it is sent: ASCII characters over a chars-per-token
    figure and a token for every other character, times a correction learned from what the
    provider reported (an exponential average of reported over estimated). It starts high (3
    chars per token, about Claude's rate on English text and under it on code; Japanese or
    Chinese text is about a token a character), so the first calls over-reserve rather than
    under, whatever the language."""

    def __init__(self, chars_per_token: float = CHARS_PER_TOKEN, smoothing: float = 0.1) -> None:
        self.chars_per_token = chars_per_token
        self.smoothing = smoothing
        self.correction = 1.0
        self._lock = threading.Lock()

    def raw(self, prompt: RerankPrompt) -> float:
        return prompt_tokens(prompt, self.chars_per_token)

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

    Off (nothing metered) until a limit is known: from ``limits`` (``SIFT_RATE_LIMITS``),
    from response headers given to :meth:`learn`, or from the shared hash, where another
    process stored the limits it learned or a 429's pause (:meth:`_turned_on`, read while off
    at most every :data:`OFF_REFRESH_SECONDS`). A 429's pause is honoured even then. While
    off, one call at a time goes out, the learner (:meth:`_may_send`), the others waiting
    for what its answer teaches, unless an answer stated no limit: then every call goes at
    once, nothing written to Redis.
    """

    def __init__(
        self,
        client: redis.Redis,
        model: str,
        limits: RateLimit | None = None,
        *,
        lane: str = LANE_STANDARD,
        estimator: TokenEstimator | None = None,
        burst_fraction: float = BURST_FRACTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.lane = lane
        self.key = f"{RATE_BUDGET_KEY}{lane}:{model}"
        self.process = uuid.uuid4().hex[:16]  # its field in the key's pending hash
        self.limits = limits or RateLimit()
        self.learned = RateLimit()
        self.estimator = estimator or TokenEstimator()
        self.burst_fraction = burst_fraction
        self._clock = clock
        self.client = client
        self._script = client.register_script(BUDGET_SCRIPT)
        self._learner_script = client.register_script(LEARNER_SCRIPT)
        self.learner_key = f"{self.key}:learner"
        self._learner: str | None = None  # who held the learner's place at the last reading
        # how many times a thread of this process gave the place up (_leave): a reading sent
        # before one is not applied after it (it would name the thread that just left)
        self._leaves = 0
        self._learner_lock = threading.Lock()  # the count and the holder change together
        self._typical = (0.0, 0.0)  # the last call's input and output tokens, for backlog()
        self._paused = False
        # the last reading (below zero: room left), and when (this process's clock)
        self._backlog = (0.0, -math.inf)
        self._backlog_lock = threading.Lock()  # started() adds to the reading
        # the last reading found the breaker half open; the item this process lets start
        # then, the would-be probe: its thread, its ticket once started, when it last asked
        self._half_open = False
        self._half_claim: tuple[int, int | None, float] | None = None
        # the items let start and not yet reserved, and when (this process's clock); each
        # thread knows its own (self._call.started)
        self._pending: dict[int, float] = {}
        self._tickets = itertools.count()
        self._off_read_at = -math.inf  # when the shared hash was last read while off
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
        tell: bool = False,
        trip: float | None = None,
        answered: bool | None = False,
        restore: bool = False,
        probe: str = "",
        yields_probe: bool = False,
    ) -> tuple[bool, float, float, bool, bool]:
        """One script call; answers (admitted, wait, backlog, the breaker's part: refused by
        it, or admitted as its probe; the breaker half open) as :data:`BUDGET_SCRIPT` does.
        ``tell``: the call tells the cluster this process's pending items, and its backlog
        counts every process's.
        ``trip``: a call was answered 5xx, with this retry-after (0: none); ``answered``: a
        call was answered otherwise (True), or got no answer at all (None). ``restore``:
        ``learn`` is stored only where the hash holds no limit. ``probe``: the reservation's
        probe id (its mark, admitted as the probe), or the probe a call with no answer ends
        ('' : whichever is out); ``yields_probe``: the reservation's search lets another
        waiting go as the next probe (:meth:`reserve`)."""
        limits = self.limits
        learned = learn or RateLimit()
        args: list[float | str] = [
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
            self._pending_seconds() if tell else 0.0,
            self.process if tell else "",
            PENDING_STALE_SECONDS,
            0 if trip is None else 1,
            max(0.0, trip or 0.0),
            2 if answered is None else 1 if answered else 0,
            PROBE_LEASE_SECONDS,
            OUTAGE_FIRST_SECONDS,
            OUTAGE_MAX_SECONDS,
            PROBE_POLL_SECONDS,
            1 if restore else 0,
            probe,
            1 if yields_probe else 0,
        ]
        self.script_calls += 1
        keys = [self.key, f"{self.key}:pending"]
        admitted, wait, backlog, shut, half = self._script(keys=keys, args=args)
        return bool(int(admitted)), float(wait), float(backlog), bool(int(shut)), bool(int(half))

    def _turned_on(self) -> bool:
        """Whether the budget is on (:attr:`active`), here or by what the shared hash holds:
        limits another process learned from the provider's headers (taken as learned here),
        or a 429's pause still on (it pauses this process too). While no limit is known in
        this process, that is read from Redis (one round trip, no write): a
        process that had no answer of its own yet (at the defaults, with no
        ``SIFT_RATE_LIMITS``, every process until its first answer) sent straight through
        the cluster's 429 pause, and unmetered, whatever limits the others had learned. Read
        at most every :data:`OFF_REFRESH_SECONDS` (its first call always reads), with who
        holds the learner's place (:meth:`_may_send`)."""
        if self.active:
            return True
        now = self._clock()
        if now - self._off_read_at < OFF_REFRESH_SECONDS:
            return False
        self._off_read_at = now
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.key, ["Lr", "Li", "Lo", "pause", "strikes"])
        pipe.time()
        pipe.get(self.learner_key)
        leaves = self._leaves
        (rpm, itpm, otpm, pause, strikes), (seconds, micros), held = pipe.execute()
        self._read_learner(held, leaves)
        stored = RateLimit(rpm=_limit(rpm), itpm=_limit(itpm), otpm=_limit(otpm))
        if stored != RateLimit():
            self.learned = stored
        if float(pause or 0) > float(seconds) + float(micros) / 1e6 or int(strikes or 0) > 0:
            self._paused = True  # a 429's pause, or the breaker (a 5xx): on from now
        return self.active

    def _may_send(self) -> bool:
        """The budget off (:meth:`_turned_on` said so): whether this thread's call may go now,
        unmetered. It may as the learner, whose answer teaches the limits: the place was free
        at the last reading, and it took it now, or it took it before (its batch item's
        pacing did); or when an answer stated no limit (:data:`UNSTATED`). Not while another
        call is out learning: one at a time goes, the others waiting for the limits it
        learns, so that a first batch at the defaults is metered from its second call, not
        sent at once into the provider's 429s and past the deadlines the limits learned then
        hold it to."""
        token = f"{self.process}:{threading.get_ident()}"
        if self._learner is None:  # free at the last reading: take it, if it still is
            args: list[str | int] = [token, "take", LEARN_LEASE_SECONDS]
            leaves = self._leaves
            self._read_learner(self._learner_script(keys=[self.learner_key], args=args), leaves)
        if self._learner == token:
            self._call.learning = True  # given up at its settlement, or its search's end
        return self._learner in (token, UNSTATED)

    def _read_learner(self, held: bytes | str | None, leaves: int) -> None:
        """Keep who holds the learner's place by a reading sent when this process had given
        it up ``leaves`` times: not if a thread gave it up since (:meth:`_leave`), which the
        reading may predate. Applied, a reading naming the thread that left made it the
        learner again in this process's eyes: its next call went without the place, beside
        the learner another process took meanwhile."""
        with self._learner_lock:
            if self._leaves == leaves:
                self._learner = _text(held) or None

    def _leave(self, unstated: bool = False) -> None:
        """This thread's call was the learner's, or its batch item took the place and ends
        without one: the place is given up, the next call may learn; or, its answer having
        stated no limit (``unstated``), left as :data:`UNSTATED`, every call sent unmetered.
        Never raises: it comes after what happened to the call, and the place's lease ends it."""
        self._call.learning = False
        what, seconds = ("unstated", UNSTATED_SECONDS) if unstated else ("drop", 1)
        token = f"{self.process}:{threading.get_ident()}"
        try:
            self._learner_script(keys=[self.learner_key], args=[token, what, seconds])
        except redis.RedisError as exc:
            log.warning(
                "the rate budget of %s could not give up its learner's place; it ends with "
                "its lease, in %.0f s at most: %s",
                self.model,
                LEARN_LEASE_SECONDS,
                exc,
            )
            return
        with self._learner_lock:
            self._leaves += 1
            self._learner = UNSTATED if unstated else None

    def backlog(self) -> float:
        """Seconds a call like the last one would wait now, once every process's items let
        start and not yet reserved have theirs (nothing is reserved). Answered from this
        process's last reading when it is under :data:`BACKLOG_REFRESH_SECONDS` old (every
        reservation is one): a batch asks before each item. While no limit is known, 0 for
        the item that goes as the learner (:meth:`_may_send`), or for every item once an
        answer stated no limit; a day for the others while the learner is out: they start
        their searches, and their deadlines, once the limits it learns can pace them. While
        the breaker is open or its probe out, a day; half open, a day for all but one thread
        of the process (:meth:`_may_probe`)."""
        if not self._turned_on():
            return 0.0 if self._may_send() else OUTAGE_BACKLOG_SECONDS
        reading, read_at = self._backlog
        now = self._clock()
        if now - read_at >= BACKLOG_REFRESH_SECONDS:
            _, _, reading, _, half = self._run((1, *self._typical), -2, tell=True)
            self._read(reading, half, now)
        if self._half_open and not self._may_probe(now):
            return OUTAGE_BACKLOG_SECONDS
        return max(0.0, reading)

    def _read(self, reading: float, half: bool, now: float) -> None:
        """Keep a reading (the backlog, the breaker half open), taken at ``now``: the claim of
        the item let start at a half opening ends with it, once the breaker is not."""
        with self._backlog_lock:
            self._backlog = (reading, now)
            self._half_open = half
            if not half:
                self._half_claim = None

    def _may_probe(self, now: float) -> bool:
        """The breaker half open: whether this thread's item may start, as the would-be probe.
        One item of the process may (the first to ask, until its claim ends), the others wait
        for the probe's answer: all started then, those beside the probe waited on the breaker
        within their deadline and, in an outage that outlasts the probe, ended
        ``budget_exhausted`` with no call sent."""
        me = threading.get_ident()
        with self._backlog_lock:
            claim = self._half_claim
            if claim is not None and claim[0] != me:
                ticket, asked = claim[1], claim[2]
                live = ticket in self._pending if ticket is not None else False
                if live or now - asked < HALF_OPEN_CLAIM_SECONDS:
                    return False
            self._half_claim = (me, getattr(self._call, "started", None), now)
            return True

    def _unclaim(self) -> None:
        """This thread's item, let start at a half opening, reserved its call (as the probe,
        or refused) or ended without one: another may start in its place."""
        with self._backlog_lock:
            if self._half_claim is not None and self._half_claim[0] == threading.get_ident():
                self._half_claim = None

    def shut(self) -> bool:
        """Whether the breaker holds every call now (open, or its probe out), by the reading
        :meth:`backlog` answers: a batch item that waited for its CPU slot meanwhile waits
        again before its search begins."""
        return self.backlog() >= OUTAGE_BACKLOG_SECONDS

    def started(self) -> None:
        """This thread's batch item, let start on the reading, goes on to reserve its call
        after its CPU slot and its retrieval (seconds, with a process's items queued for the
        slots). Until then it counts in the readings of every process (one typical call's
        refill time): counted only in this process's reading until that was read again, the
        items let start meanwhile made a queue no one saw, past their deadline."""
        if not self.active:
            return
        with self._backlog_lock:
            self._pending.pop(getattr(self._call, "started", -1), None)  # one run before
            self._call.started = ticket = next(self._tickets)
            self._pending[ticket] = now = self._clock()
            reading, read_at = self._backlog
            self._backlog = (reading + self._call_seconds(), read_at)
            if self._half_claim is not None and self._half_claim[0] == threading.get_ident():
                self._half_claim = (self._half_claim[0], ticket, now)  # held while it counts

    def ended(self) -> None:
        """This thread's item no longer counts as let start: it reserved its call, or its
        search ended without one. An item that took the learner's place for its call and
        ends without one gives it up (:meth:`_leave`); one let start at a half opening of the
        breaker, its claim (:meth:`_may_probe`)."""
        self._end_item()
        self._unclaim()

    def _end_item(self) -> None:
        """:meth:`ended` but for the claim at a half opening."""
        if getattr(self._call, "learning", False):
            self._leave()
        ticket = getattr(self._call, "started", None)
        if ticket is not None:
            self._call.started = None
            with self._backlog_lock:
                self._pending.pop(ticket, None)

    def _pending_seconds(self) -> float:
        """The queue this process's items let start and not yet reserved make, in seconds
        of the buckets' refill (those older than :data:`PENDING_SECONDS` left out)."""
        oldest = self._clock() - PENDING_SECONDS
        with self._backlog_lock:
            # kept in the order they started: the old ones are at the front
            while self._pending and next(iter(self._pending.values())) < oldest:
                del self._pending[next(iter(self._pending))]
            count = len(self._pending)
        return count * self._call_seconds() if count else 0.0

    def _call_seconds(self) -> float:
        """How long the buckets take to refill a typical call (the last one's tokens), at the
        limits the budget script holds to: the configured one, or a lower learned one."""
        estimate, max_tokens = self._typical
        seconds = 0.0
        for configured, learned, amount in (
            (self.limits.rpm, self.learned.rpm, 1.0),
            (self.limits.itpm, self.learned.itpm, estimate),
            (self.limits.otpm, self.learned.otpm, max_tokens),
        ):
            known = [limit for limit in (configured, learned) if limit]
            if known:
                seconds = max(seconds, amount * 60.0 / min(known))
        return seconds

    def reserve(
        self, prompt: RerankPrompt, max_wait: float, *, yields_probe: bool = False
    ) -> BudgetGrant:
        raw = self.estimator.raw(prompt)
        estimate = self.estimator.estimate(prompt)
        if not self._turned_on():
            if not self._may_send():  # another call is out learning the limits: ask again
                return BudgetGrant(False, OFF_REFRESH_SECONDS, shut=True, learning=True)
            self._typical = (float(estimate), float(prompt.max_tokens))
            return BudgetGrant(admitted=True, wait=0.0)
        self._typical = (float(estimate), float(prompt.max_tokens))
        self._end_item()  # its call is reserved now, or refused: in the bucket, or not at all
        take = (1, estimate, prompt.max_tokens)
        # what this process learned goes along, stored where the hash holds none: the hash
        # expired (a day without a call) or Redis lost it, and no call went out unmetered
        probe = uuid.uuid4().hex[:16]  # its probe mark's, should it be admitted as the probe
        admitted, wait, reading, breaker, half = self._run(
            take,
            max(0.0, max_wait),
            tell=True,
            learn=self.learned,
            restore=True,
            probe=probe,
            yields_probe=yields_probe,
        )
        now = self._clock()
        self._read(reading, half, now)
        self._unclaim()  # after the reading: the probe out (or another's) holds the others
        if not admitted:
            return BudgetGrant(admitted=False, wait=wait, shut=breaker)
        self._call.sent_at = now + wait
        self._call.stated = None
        probe = probe if breaker else ""
        return BudgetGrant(True, wait, estimate, prompt.max_tokens, raw_input=raw, probe=probe)

    def sent(self, waited: float) -> None:
        """Counted when the call went out, a budget off included (at 0: sent at once), not
        when it was reserved: the process's own limiter may hold it back, never sent."""
        metrics.budget_waited(self.model, self.lane, waited)

    def settle(
        self,
        grant: BudgetGrant,
        usage: TokenUsage | None,
        *,
        sent: bool = True,
        closes: bool = True,
        quiet: bool = True,
    ) -> None:
        """Give back the unused part of the reservation (and its request, for a call never
        ``sent``: the provider did not count it). Input tokens as the provider meters
        them: uncached plus cache writes (cache reads do not count against ITPM). What the
        call's response headers said the provider's buckets hold (:meth:`learn`) goes in the
        same script call. The breaker's probe never sent (a cancel, or the worker's stop,
        ended its wait) ends there, as one that got no answer does, if its mark is still the
        probe's: its lease held every process back for 20 s, sending nothing.

        ``quiet`` (the default) never raises: a settlement Redis fails (down, or silent, past
        the client's retries) is logged and counted (``sift_rate_budget_unsettled_total``)
        and dropped, the share left taken until the buckets refill it (and a probe given
        back, until its lease ends). It comes after what happened to the call (its answer
        billed, a cancel, the worker's stop): raised, it replaced that, the answer and its
        usage lost, the stop taken for a Redis failure. Not ``quiet`` (a failed attempt to
        be retried), the Redis error is raised, as the budget's other writes raise."""
        stated = getattr(self._call, "stated", None)
        found = getattr(self._call, "found", None)
        self._call.stated = self._call.found = None
        if getattr(self._call, "learning", False):  # its answer stated the limits, or none
            message = usage is not None and bool(usage.input_tokens or usage.output_tokens)
            self._leave(unstated=sent and closes and message and self.learned == RateLimit())
        if usage is None or not grant.admitted or not (grant.input_tokens or grant.output_tokens):
            return
        # an answer (the call reported usage; a 429 is not one, ``closes``): the provider is
        # back, the breaker closes; the probe not sent said nothing of it: the next may go
        answered: bool | None = None if grant.probe and not sent else sent and closes
        used_input = usage.input_tokens + usage.cache_creation_input_tokens
        # against the raw estimate the grant carries: rebuilding it from the correction now,
        # which other threads move meanwhile, fed the correction back into itself
        self.estimator.calibrate(grant.raw_input, used_input)
        # what was used beyond the reservation is taken too: a negative amount gives back
        extra_input = float(used_input - grant.input_tokens)
        extra_output = float(usage.output_tokens - grant.output_tokens)
        # (requests, input, output): a call never sent gives its request back as well
        take = (0.0 if sent else -1.0, extra_input, extra_output)
        # the limits the answer stated are stored over any other: a lower one a process
        # gone stored would otherwise hold the cluster there
        try:
            if stated is None:
                self._run(take, -1, answered=answered, learn=found, probe=grant.probe)
                return
            age = self._clock() - getattr(self._call, "sent_at", self._clock())
            self._run(
                take, -1, stated=stated, age=age, answered=answered, learn=found, probe=grant.probe
            )
        except redis.RedisError as exc:
            if not quiet:
                raise
            metrics.budget_unsettled(self.model, self.lane)
            log.warning(
                "the rate budget of %s could not be settled; its share stays taken until the "
                "bucket refills it: %s",
                self.model,
                exc,
            )

    def pause(self, seconds: float) -> None:
        """Every process waits ``seconds`` (capped at a minute) before its next call. A 429
        leaves the breaker as it is (an outage answers 429s among its 529s), but ends the
        probe out, whichever call met it (a 429 is an answer: the provider is up), so the next
        probe goes once the pause is over."""
        self._paused = True
        self._run((0, 0, 0), -1, pause=min(max(seconds, 0.0), MAX_PAUSE_SECONDS), answered=None)

    def paused_for(self) -> float:
        """Seconds left of a 429's pause (Redis's clock; one round trip, nothing written):
        a call granted with a wait looks again before it is sent, since a 429 another
        process met meanwhile pauses it too."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self.key, "pause")
        pipe.time()
        pause, (seconds, micros) = pipe.execute()
        return max(0.0, float(pause or 0) - (float(seconds) + float(micros) / 1e6))

    def breaker_shut(self, grant: BudgetGrant) -> bool:
        """Whether the breaker holds back ``grant``'s call, admitted with a wait (Redis's
        clock; one round trip, nothing written): it is not closed, and the grant is not the
        probe out, the probe mark its own and live (the probe goes alone). A 5xx another
        process met during the wait opened it, or a 429's pause or the lease's end ended the
        grant's probe and another may be out. The call looks before it is sent: sent, it went
        into the outage every other process was holding back from, or beside the probe."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.key, ["strikes", "probe", "prober"])
        pipe.time()
        (strikes, lease, prober), (seconds, micros) = pipe.execute()
        if not int(strikes or 0):
            return False  # closed
        now = float(seconds) + float(micros) / 1e6
        return not (grant.probe and _text(prober) == grant.probe and float(lease or 0) > now)

    def unanswered(self, grant: BudgetGrant) -> None:
        """``grant``'s call got no answer (a timeout, a connection lost or never made): if it
        was the breaker's probe, and its mark is still the probe's (a 429's pause had not
        ended it, another's probe out since), the next call may probe now, not once its lease
        ran out. Any call's no-answer ended whichever probe was out: two went at once."""
        if grant.probe:
            self._run((0, 0, 0), -1, answered=None, probe=grant.probe)

    def answered(self, grant: BudgetGrant) -> None:
        """``grant``'s call was answered, neither 5xx nor 429, with no usage to settle on (a
        body that is not a message): if it was the breaker's probe, the provider is back and
        the breaker closes."""
        if grant.probe and self._turned_on():
            self._run((0, 0, 0), -1, answered=True, probe=grant.probe)

    def trip(self, retry_after: float | None) -> None:
        """A call was answered 5xx (529 overloaded included): the breaker opens (again) for
        every process, for ``retry_after`` (capped at a minute) or the outage back-off."""
        self._paused = True
        self._run((0, 0, 0), -1, trip=min(max(retry_after or 0.0, 0.0), MAX_PAUSE_SECONDS))

    def learn(self, headers: Mapping[str, str]) -> None:
        """Take what a response's headers state: the limits, stored in Redis at once when
        they change, and again by this thread's settlement; what the provider's buckets hold,
        kept for that settlement (which writes both in its own script call)."""
        stated = remaining_from_headers(headers)
        if any(level != NOT_STATED for level in stated):
            self._call.stated = stated
        found = limits_from_headers(headers)
        self._call.found = found  # stored again by the settlement: the hash may have lost it
        if found is None or found == self.learned:
            return
        log.info("rate limits of %s learned from the provider: %s", self.model, found)
        self.learned = found
        self._run((0, 0, 0), -1, learn=found)

    def reserve_call(self, max_wait: float) -> BudgetGrant:
        """Reserve one request and no tokens (an economy lane call: a submission, a poll)."""
        if not self._turned_on():
            metrics.budget_waited(self.model, self.lane, 0.0)
            return BudgetGrant(admitted=True, wait=0.0)
        admitted, wait, *_ = self._run((1, 0, 0), max(0.0, max_wait))
        if admitted:
            metrics.budget_waited(self.model, self.lane, wait)
        return BudgetGrant(admitted=admitted, wait=wait)


def _text(value: bytes | str | None) -> str:
    """A field the shared hash stores (bytes, or str from a client that decodes) as text."""
    return value.decode() if isinstance(value, bytes) else value or ""


def _limit(value: bytes | str | None) -> int | None:
    """A limit the shared hash stores (``Lr``, ``Li``, ``Lo``; bytes, or str from a client
    that decodes), or None: none stored."""
    if value is None:
        return None
    number = int(float(value))
    return number if number >= 1 else None

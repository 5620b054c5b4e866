"""The job store's Lua scripts: every status change is one compare-and-set on the status that
also moves the counts, so a final record is never written again.

They are plain sources here; :class:`~worker.queue.jobstore.store._StoreCore` registers them.
"""

from __future__ import annotations

# KEYS: record, stats, active. ARGV: to, allowed-from (comma list), ttl, now, job id, then
# field/value pairs. Returns -1 when the record is missing, 0 when refused, 1 when applied.
_TRANSITION_JOB = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if cur == 'succeeded' or cur == 'failed' or cur == 'canceled' then return 0 end
local to = ARGV[1]
if not string.find(',' .. ARGV[2] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[1], 'status', to)
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if cur ~= to then
  if cur == 'queued' or cur == 'running' then redis.call('HINCRBY', KEYS[2], cur, -1) end
  if to == 'queued' or to == 'running' then redis.call('HINCRBY', KEYS[2], to, 1) end
end
if to == 'succeeded' or to == 'failed' or to == 'canceled' then
  redis.call('ZREM', KEYS[3], ARGV[5])
else
  redis.call('ZADD', KEYS[3], 'XX', ARGV[4], ARGV[5])
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""

# KEYS: items, results, counts, batch, stats, active.
# ARGV: query id, to, allowed-from (comma list), outcome JSON or '', now, batch id, and '1'
# when a cancel of the batch turns this move into a cancel (a start, or the check before the
# model call; the batch's cancel mark is read in the same script, so no round trip more).
# Returns {code, 1 if the move became a cancel}: code -1 missing, 0 refused, 1 applied,
# 2 applied and the batch just completed.
_TRANSITION_ITEM = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return {-1, 0} end
if cur == 'succeeded' or cur == 'failed' or cur == 'canceled' then return {0, 0} end
local to, outcome, canceled = ARGV[2], ARGV[4], 0
if not string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return {0, 0} end
if ARGV[7] == '1' and redis.call('HEXISTS', KEYS[4], 'canceled_at') == 1 then
  to, outcome, canceled = 'canceled', '', 1
end
redis.call('HSET', KEYS[1], ARGV[1], to)
if outcome ~= '' then redis.call('HSET', KEYS[2], ARGV[1], outcome) end
if cur ~= to then
  redis.call('HINCRBY', KEYS[3], cur, -1)
  redis.call('HINCRBY', KEYS[3], to, 1)
  if cur == 'queued' or cur == 'running' then redis.call('HINCRBY', KEYS[5], cur, -1) end
  if to == 'queued' or to == 'running' then redis.call('HINCRBY', KEYS[5], to, 1) end
end
if to == 'succeeded' or to == 'failed' or to == 'canceled' then
  local c = redis.call('HMGET', KEYS[3], 'succeeded', 'failed', 'canceled')
  local done = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0)
  local total = tonumber(redis.call('HGET', KEYS[4], 'total')) or -1
  if done >= total and redis.call('HSETNX', KEYS[4], 'finished_at', ARGV[5]) == 1 then
    redis.call('ZREM', KEYS[6], ARGV[6])
    return {2, canceled}
  end
end
redis.call('ZADD', KEYS[6], 'XX', ARGV[5], ARGV[6])
return {1, canceled}
"""

# KEYS: items, counts, batch, stats, active. ARGV: now, batch id.
# Returns {canceled count, 1 if the batch just completed}, {-1, 0} when missing, and
# {-2, 0} when the batch had already finished: then nothing is written (the check and the
# cancel are one script, so a cancel racing the last item's finish is decided by one side).
_CANCEL_BATCH = """
if redis.call('EXISTS', KEYS[3]) == 0 then return {-1, 0} end
if redis.call('HEXISTS', KEYS[3], 'finished_at') == 1 then return {-2, 0} end
redis.call('HSETNX', KEYS[3], 'canceled_at', ARGV[1])
local all = redis.call('HGETALL', KEYS[1])
local n = 0
for i = 1, #all, 2 do
  if all[i + 1] == 'queued' then
    redis.call('HSET', KEYS[1], all[i], 'canceled')
    n = n + 1
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[2], 'queued', -n)
  redis.call('HINCRBY', KEYS[2], 'canceled', n)
  redis.call('HINCRBY', KEYS[4], 'queued', -n)
end
local c = redis.call('HMGET', KEYS[2], 'succeeded', 'failed', 'canceled')
local done = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0)
local total = tonumber(redis.call('HGET', KEYS[3], 'total')) or -1
if done >= total and redis.call('HSETNX', KEYS[3], 'finished_at', ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[5], ARGV[2])
  return {n, 1}
end
return {n, 0}
"""


# A new search, atomically (one command where a MULTI would be seven round trips of parsing).
# KEYS: record, stats, the active set, the tenant's search index, one list per task message,
# then the Idempotency-Key's record if any. ARGV: ttl, message count m, record field count n,
# the job's id and its score (creation time) in the active set and the index, the index's TTL,
# n fields and values, m raw messages, then that key's binding to this job and its TTL.
# Returns 1 when it created the job; the key's record (JSON) when the key is already bound to
# a job, and nothing is written; 0 when the record exists already (this very call ran before:
# a retry after a lost reply), and nothing is written again.
_CREATE_SEARCH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local m, n = tonumber(ARGV[2]), tonumber(ARGV[3])
if #KEYS > 4 + m then
  local earlier = redis.call('GET', KEYS[5 + m])
  if earlier and type(cjson.decode(earlier)['job']) == 'string' then return earlier end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 7, 6 + n))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
redis.call('HINCRBY', KEYS[2], 'queued', 1)
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', tonumber(ARGV[5]) - tonumber(ARGV[6]))
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[6]))
for i = 1, m do redis.call('LPUSH', KEYS[4 + i], ARGV[6 + n + i]) end
if #KEYS > 4 + m then
  redis.call('SET', KEYS[5 + m], ARGV[7 + n + m], 'EX', tonumber(ARGV[8 + n + m]))
end
return 1
"""

# Claim an Idempotency-Key for one request. KEYS: the key's record. ARGV: the pending
# marker, its TTL. Returns the record already there (JSON), or nothing when it claimed.
_CLAIM_IDEMPOTENCY = """
local earlier = redis.call('GET', KEYS[1])
if earlier then return earlier end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
return false
"""

# Forget a pending marker, never a key bound to a job. KEYS: the key's record. Returns 1
# when it deleted the marker.
_RELEASE_IDEMPOTENCY = """
local earlier = redis.call('GET', KEYS[1])
if not earlier or type(cjson.decode(earlier)['job']) == 'string' then return 0 end
return redis.call('DEL', KEYS[1])
"""

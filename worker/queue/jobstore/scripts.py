"""The job store's Lua scripts: every status change is one compare-and-set on the status that
also moves the counts, so a final record is never written again.

They are plain sources here; :class:`~worker.queue.jobstore.store._StoreCore` registers them.
"""

from __future__ import annotations

from worker.write_versions import TAKE_VERSION

# Releases ``bytes`` of the results owed (the stats hash's ``owed_bytes``: what the searches and
# batch items queued or running will still write, each priced by the gateway that admitted it,
# added with its queued count) as a search or batch items end, in the script that moves their
# counts. Once nothing is queued or running nothing is owed, and the field goes: a release
# left unmade (a worker of an earlier release ending work a later gateway priced) is not
# counted for good.
_RELEASE_OWED = """
local function release_owed(stats, bytes)
  local left = redis.call('HINCRBY', stats, 'owed_bytes', -bytes)
  local c = redis.call('HMGET', stats, 'queued', 'running')
  if left <= 0 or ((tonumber(c[1]) or 0) <= 0 and (tonumber(c[2]) or 0) <= 0) then
    redis.call('HDEL', stats, 'owed_bytes')
  end
end
"""

# Records the webhook of a job (or batch) just made final owed in ``owed``, due ``now``; or,
# when its record says its tenant was removed (``tenant_removed``: the failure of a search
# that ended so, or a batch with an item that did), settles it ``failed`` after 0 attempts at
# once, in the script that makes the job final: no key is left to sign it. Returns true when
# it settled it so: then no webhook message is to be sent (a cancel's script pushes none; a
# worker's finish checks the record, SiftTask.send_webhook). (A job that ended before its
# tenant's removal is owed as any, and reads ``pending`` until a webhook task gives it up:
# worker/queue/webhook_task.py.)
_OWE_WEBHOOK = """
local function owe_webhook(record, owed, now, id)
  local hook = redis.call('HGET', record, 'webhook_url')
  if not hook or hook == '' then return false end
  if redis.call('HEXISTS', record, 'tenant_removed') == 1 then
    redis.call('HSET', record, 'webhook_settled', 'failed', 'webhook_attempts', '0')
    return true
  end
  redis.call('ZADD', owed, now, id)
  return false
end
"""

# KEYS: record, stats, active, webhooks owed, then the job's re-drive bookkeeping (its outage
# notes, its re-drive count, a batch's positions' counts: RE_DRIVE_KEYS in store.py). ARGV: to,
# allowed-from (comma list), ttl, now,
# job id, the move's token, then field/value pairs. Returns -1 when the record is missing, 0
# when refused, 1 when applied. A final move gives the record its retention (``ttl``); any
# other leaves it none (one an older release gave a TTL loses it): a job not final never
# expires, so the stats hash, which counts it, and its status stay true. The token makes the
# call safe to send again: the client sends it again when the connection breaks after the
# script ran (only its reply lost), and then the record already holds the token, so the
# answer is the first run's (1), not a refusal that would leave the finish unannounced (no
# webhook, no count). A final move drops the model's
# answer a search's run claim kept (its "run" field, _KEEP_ANSWER): no run comes after; of a
# job with a webhook it records the webhook owed, due ``now`` (worker/queue/redrive.py); and it
# deletes the job's re-drive bookkeeping (outage notes, _NOTE_OUTAGE; re-drive counts,
# _COUNT_REDRIVES): a final job is never re-driven, and a key that names the job and outlives
# its record is one an older release's erase or purge, whose key lists predate the notes,
# leaves behind (the counts lived their retention naming a finished or erased job).
_TRANSITION_JOB = (
    _RELEASE_OWED
    + _OWE_WEBHOOK
    + """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if ARGV[6] ~= '' and redis.call('HGET', KEYS[1], 'move') == ARGV[6] then return 1 end
if cur == 'succeeded' or cur == 'failed' or cur == 'canceled' then return 0 end
local to = ARGV[1]
if not string.find(',' .. ARGV[2] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[1], 'status', to, 'move', ARGV[6])
for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if cur ~= to then
  if cur == 'queued' or cur == 'running' then redis.call('HINCRBY', KEYS[2], cur, -1) end
  if to == 'queued' or to == 'running' then redis.call('HINCRBY', KEYS[2], to, 1) end
end
if to == 'succeeded' or to == 'failed' or to == 'canceled' then
  local owed = tonumber(redis.call('HGET', KEYS[1], 'owed_bytes'))
  if owed then release_owed(KEYS[2], owed) end
  redis.call('ZREM', KEYS[3], ARGV[5])
  owe_webhook(KEYS[1], KEYS[4], ARGV[4], ARGV[5])
  local run = redis.call('HGET', KEYS[1], 'run')
  local claim = run and string.match(run, '^([^|]*|[^|]*|[^|]*|[^|]*|[^|]*)|')
  if claim then redis.call('HSET', KEYS[1], 'run', claim) end
  redis.call('DEL', KEYS[5], KEYS[6], KEYS[7])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
else
  redis.call('ZADD', KEYS[3], 'XX', ARGV[4], ARGV[5])
  redis.call('PERSIST', KEYS[1])
end
return 1
"""
)

# Moves one batch item from a status in allowed-from to ``to``.
# KEYS: 1 items, 2 results, 3 counts, 4 batch, 5 stats, 6 active, 7 moves, 8 run claims,
#   9 webhooks owed, 10 the economy lane's prepared items, 11 order, 12 specs, 13 lost, 14 its
#   chunks' run claims, 15-17 the economy lane's runs, provider batches and state (with 1-4,
#   7 and 8, the batch's keys: none has a TTL while the batch runs, and a move that completes
#   it gives each the retention from now, in this script), 18-20 the batch's re-drive
#   bookkeeping: outage notes, re-drive count, positions' counts (a move that completes it
#   deletes them, as a job's final move does: _TRANSITION_JOB).
# ARGV:
#   1 query id, 2 to, 3 allowed-from (comma list), 4 outcome JSON or '', 5 now, 6 batch id;
#   7 '' (a plain move), '1' when a cancel of the batch turns this move into a cancel (the
#     check before the model call; the batch's cancel mark is read in the same script, so
#     no round trip more), or '2' when it does unless the item's run claim kept the model's
#     answer (a start: the item is past its paid model call, and its run finishes on that
#     answer). A start ('2') is refused, writing nothing, while another run holds the item's
#     claim as _CLAIM_RUN judges it, or once the item's economy first half is kept (KEYS[10],
#     waiting on its provider batch): a copy of its chunk neither moves nor cancels it;
#   8 the move's token (with '1', the outcome is the cancel's alone: the usage a dead run's
#     kept answer billed);
#   9 the heartbeat key prefix (for the run claim's owner);
#   10 the claimant's lease (seconds; a start judges a claim that kept none by it), 11 its
#     worker id, 12 the tokens of the item's claim its worker's runs hold (comma list): a
#     start judges the claim as _CLAIM_RUN does;
#   13 the retention (seconds);
#   14.. the batch's totals this outcome adds to (field, increment pairs: usage_cost_usd and
#     the seconds_ fields floats, every other an integer), added to the batch's record when
#     the move makes the item final with this outcome: once, as the move is.
# Returns {code, 1 if the move became a cancel}: code -1 missing, 0 refused, 1 applied,
# 2 applied and the batch just completed. A move that makes the item final keeps its token
# and answer in the moves hash (living as long as the results hash), so the same call sent
# again after its reply was lost (a broken connection, a Redis restart) answers what the first
# run did, and the batch's completion is not lost with that reply. A move that makes the
# item final drops the model's answer its run claim kept (_KEEP_ANSWER): no run comes after.
# The move that completes a batch with a webhook records the webhook owed, as a job's does.
_TRANSITION_ITEM = (
    _RELEASE_OWED
    + _OWE_WEBHOOK
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return {-1, 0} end
if ARGV[8] ~= '' then
  local last = redis.call('HGET', KEYS[7], ARGV[1])
  if last then
    local token, code, canceled = string.match(last, '^(%S+) (%d) (%d)$')
    if token == ARGV[8] then return {tonumber(code), tonumber(canceled)} end
  end
end
if cur == 'succeeded' or cur == 'failed' or cur == 'canceled' then return {0, 0} end
local to, outcome, canceled = ARGV[2], ARGV[4], 0
if not string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return {0, 0} end
if ARGV[7] == '2' then
  if redis.call('HEXISTS', KEYS[10], ARGV[1]) == 1 then return {0, 0} end
  -- the claim, _CLAIM_RUN's "<used>|<owner>|<claimed at>|<token>|<lease>[|<answer>]"
  local held = redis.call('HGET', KEYS[8], ARGV[1])
  local owner, since, token, lease =
    string.match(held or '', '^[^|]*|([^|]*)|([^|]*)|([^|]*)|?([^|]*)')
  -- the holder's own lease (a claim an older release wrote, with none: the claimant's)
  local limit = tonumber(lease) or tonumber(ARGV[10])
  local gone = owner == ARGV[11]
    and not string.find(',' .. ARGV[12] .. ',', ',' .. token .. ',', 1, true)
  if token and token ~= '' and owner ~= '' and not gone and limit
      and redis.call('EXISTS', ARGV[9] .. owner) == 1 then
    local t = redis.call('TIME')
    local ran = tonumber(t[1]) + tonumber(t[2]) / 1000000 - tonumber(since)
    if ran < limit then return {0, 0} end
  end
end
if ARGV[7] ~= '' and redis.call('HEXISTS', KEYS[4], 'canceled_at') == 1 then
  -- the claim's sixth field is the answer kept (_CLAIM_RUN's value)
  local run = ARGV[7] == '2' and redis.call('HGET', KEYS[8], ARGV[1]) or ''
  if not string.find(run, '^[^|]*|[^|]*|[^|]*|[^|]*|[^|]*|.') then
    to, canceled = 'canceled', 1
    if ARGV[7] ~= '1' then outcome = '' end
  end
end
if ARGV[7] == '1' and canceled == 0 then outcome = '' end
redis.call('HSET', KEYS[1], ARGV[1], to)
if outcome ~= '' then redis.call('HSET', KEYS[2], ARGV[1], outcome) end
if cur ~= to then
  redis.call('HINCRBY', KEYS[3], cur, -1)
  redis.call('HINCRBY', KEYS[3], to, 1)
  if cur == 'queued' or cur == 'running' then redis.call('HINCRBY', KEYS[5], cur, -1) end
  if to == 'queued' or to == 'running' then redis.call('HINCRBY', KEYS[5], to, 1) end
end
if to ~= 'succeeded' and to ~= 'failed' and to ~= 'canceled' then
  redis.call('ZADD', KEYS[6], 'XX', ARGV[5], ARGV[6])
  return {1, canceled}
end
local owed = tonumber(redis.call('HGET', KEYS[4], 'owed_item_bytes'))
if owed then release_owed(KEYS[5], owed) end
if outcome ~= '' then
  for i = 14, #ARGV, 2 do
    if ARGV[i] == 'usage_cost_usd' or string.sub(ARGV[i], 1, 8) == 'seconds_' then
      redis.call('HINCRBYFLOAT', KEYS[4], ARGV[i], ARGV[i + 1])
    else
      redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1])
    end
  end
end
local run = redis.call('HGET', KEYS[8], ARGV[1])
if run then
  local claim = string.match(run, '^([^|]*|[^|]*|[^|]*|[^|]*|[^|]*)|')
  if claim then redis.call('HSET', KEYS[8], ARGV[1], claim) end
end
local code = 1
local c = redis.call('HMGET', KEYS[3], 'succeeded', 'failed', 'canceled')
local done = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0)
local total = tonumber(redis.call('HGET', KEYS[4], 'total')) or -1
if done >= total and redis.call('HSETNX', KEYS[4], 'finished_at', ARGV[5]) == 1 then
  redis.call('ZREM', KEYS[6], ARGV[6])
  owe_webhook(KEYS[4], KEYS[9], ARGV[5], ARGV[6])
  for _, i in ipairs({1, 2, 3, 4, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17}) do
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[13]))
  end
  redis.call('DEL', KEYS[18], KEYS[19], KEYS[20])
  code = 2
else
  redis.call('ZADD', KEYS[6], 'XX', ARGV[5], ARGV[6])
end
if ARGV[8] ~= '' then
  redis.call('HSET', KEYS[7], ARGV[1], ARGV[8] .. ' ' .. code .. ' ' .. canceled)
  local ttl = redis.call('TTL', KEYS[2])
  if ttl > 0 and redis.call('TTL', KEYS[7]) == -1 then redis.call('EXPIRE', KEYS[7], ttl) end
end
return {code, canceled}
"""
)

# _TRANSITION_ITEM flagged allow-oom, for one move alone: running -> queued, the item a stopping
# worker hands back keeping no calls (BatchItemRecords.requeue_item). That move only rewrites
# the item's status and moves counters and a score that exist (it stops at its non-final
# return, before the moves hash), so it runs on a Redis at its maxmemory (noeviction); refused
# there, the item's chunk failed ("raised unexpected: OutOfMemoryError"), its message acked,
# and its items waited for the re-drive.
_REQUEUE_ITEM = "#!lua flags=allow-oom" + _TRANSITION_ITEM

# Cancels a batch: marks it canceled and cancels every item still queued.
# KEYS: 1 items, 2 counts, 3 batch, 4 stats, 5 active, 6 webhooks owed, 7 order, 8 specs,
#   9 results, 10 moves, 11 run claims, 12 lost, 13 chunks' run claims, 14-17 the economy
#   lane's prepared items, runs, provider batches and state (with 1-3, the batch's keys: none
#   has a TTL while the batch runs, and a cancel that completes the batch gives each the
#   retention from now), 18-20 the batch's re-drive bookkeeping: outage notes, re-drive count,
#   positions' counts (deleted by a cancel that completes it, as by a final move:
#   _TRANSITION_JOB), 21.. one list per message to push (in the order of the messages).
# ARGV: 1 now, 2 batch id, 3 the cancel's token, 4 two flags (each 0 or 1): whether the
#   messages start with the count's, then whether with the provider cancel's; 5 the
#   retention (seconds); 6.. the raw messages, in this order:
#   - the count's (pushed if the cancel ended any item; what it ended is added up in the
#     batch's record, "cancel_uncounted" items and "cancel_completed", for
#     _TAKE_CANCEL_COUNT: counted by the task even when this reply is lost);
#   - the provider cancel's (an economy batch's sift.economy_cancel: pushed if the cancel
#     leaves the batch running, so its provider batches are canceled even when this reply
#     is lost or its gateway dies);
#   - those pushed if the cancel completes the batch (its webhook), unless that completion
#     settled the webhook (a removed tenant's: _OWE_WEBHOOK), which has nothing to send.
# A cancel that completes the batch canceled at least one item (a running one would have
# kept it open), so the batch ends ``canceled``; it records the batch's webhook owed, as a
# final move does.
# Returns {canceled count, 1 if the batch just completed}, {-1, 0} when missing, and
# {-2, 0} when the batch had already finished: then nothing is written (the check and the
# cancel are one script, so a cancel racing the last item's finish is decided by one side).
# The batch keeps the last cancel's token and answer, so the same call sent again after its
# reply was lost answers what it did (not "already finished" for a cancel that finished it).
_CANCEL_BATCH = (
    _RELEASE_OWED
    + _OWE_WEBHOOK
    + """
if redis.call('EXISTS', KEYS[3]) == 0 then return {-1, 0} end
if ARGV[3] ~= '' then
  local last = redis.call('HGET', KEYS[3], 'cancel_move')
  if last then
    local token, n, completed = string.match(last, '^(%S+) (%d+) (%d)$')
    if token == ARGV[3] then return {tonumber(n), tonumber(completed)} end
  end
end
if redis.call('HEXISTS', KEYS[3], 'finished_at') == 1 then return {-2, 0} end
local counted = tonumber(string.sub(ARGV[4], 1, 1))
local provider = tonumber(string.sub(ARGV[4], 2, 2)) or 0
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
  local owed = tonumber(redis.call('HGET', KEYS[3], 'owed_item_bytes'))
  if owed then release_owed(KEYS[4], n * owed) end
end
local c = redis.call('HMGET', KEYS[2], 'succeeded', 'failed', 'canceled')
local done = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0)
local total = tonumber(redis.call('HGET', KEYS[3], 'total')) or -1
local completed = 0
if done >= total and redis.call('HSETNX', KEYS[3], 'finished_at', ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[5], ARGV[2])
  completed = 1
  local settled = owe_webhook(KEYS[3], KEYS[6], ARGV[1], ARGV[2])
  for _, i in ipairs({1, 2, 3, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}) do
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[5]))
  end
  redis.call('DEL', KEYS[18], KEYS[19], KEYS[20])
  if not settled then
    for i = 21 + counted + provider, #KEYS do redis.call('LPUSH', KEYS[i], ARGV[i - 15]) end
  end
end
if provider == 1 and completed == 0 then
  redis.call('LPUSH', KEYS[21 + counted], ARGV[6 + counted])
end
if counted == 1 and (n > 0 or completed == 1) then
  if n > 0 then redis.call('HINCRBY', KEYS[3], 'cancel_uncounted', n) end
  if completed == 1 then redis.call('HSET', KEYS[3], 'cancel_completed', '1') end
  redis.call('LPUSH', KEYS[21], ARGV[6])
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[3], 'cancel_move', ARGV[3] .. ' ' .. n .. ' ' .. completed)
end
return {n, completed}
"""
)


# A new search, atomically (one command where a MULTI would be seven round trips of parsing).
# KEYS: record, stats, the active set, the tenant's search index, one list per task message,
# then the Idempotency-Key's record if any. ARGV: message count m, record field count n,
# the job's id and its score (creation time) in the active set and the index, the index's TTL,
# n fields and values, m raw messages, then that key's binding to this job and its TTL. The
# record takes no TTL: its final move gives it its retention (_TRANSITION_JOB).
# Returns 1 when it created the job; the key's record (JSON) when the key is already bound to
# a job, and nothing is written; 0 when the record exists already (this very call ran before:
# a retry after a lost reply), and nothing is written again.
_CREATE_SEARCH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local m, n = tonumber(ARGV[1]), tonumber(ARGV[2])
if #KEYS > 4 + m then
  local earlier = redis.call('GET', KEYS[5 + m])
  if earlier and type(cjson.decode(earlier)['job']) == 'string' then return earlier end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 6, 5 + n))
redis.call('HINCRBY', KEYS[2], 'queued', 1)
local owed = redis.call('HGET', KEYS[1], 'owed_bytes')
if owed then redis.call('HINCRBY', KEYS[2], 'owed_bytes', owed) end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', tonumber(ARGV[4]) - tonumber(ARGV[5]))
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[5]))
for i = 1, m do redis.call('LPUSH', KEYS[4 + i], ARGV[5 + n + i]) end
if #KEYS > 4 + m then
  redis.call('SET', KEYS[5 + m], ARGV[6 + n + m], 'EX', tonumber(ARGV[7 + n + m]))
end
return 1
"""

# A new ingest-kind job (an upsert, a delete or a drop), its write version taken and its date
# read in this one step: the version orders the writes in the backend (the one accepted last
# wins, worker/core/catalog.py), the date orders GET /v1/ingestions, and taken apart (the
# version, then the documents sent, then the date) an ingest accepted while a big one's
# documents were on the wire took the higher version but the earlier date: listed below the
# write it overrode. The date is Redis's clock (the shared one, worker/clock.py), after the
# newest ingest the tenant's index lists (a clock stepped back, or two in one microsecond,
# must not list it below one it was accepted after).
# KEYS: 1 record, 2 its documents (staged before: ARGV[1] '1'; none for a drop), 3 the active
# set, 4 the ingests' counts (STATS_UNTRACKED_KEY), 5 the tenant's ingest index, 6-8 the
# tenant's version keys (write_versions.version_keys), then one list per task message, then
# an upsert's Idempotency-Key, if it has one.
# ARGV: 1 '1' when it has documents, 2 their TTL once kept, 3 the index's TTL, 4 the version
# window, 5 the job id, 6 the record's field count n, 7 the message count m, n fields and
# values, the m raw messages, then the key's binding and its TTL.
# The record takes no TTL: its final move gives it its retention (_TRANSITION_JOB).
# Returns {version, created_at}: the new job's; or, the record there already (this very call
# ran before: a retry after a lost reply), the ones it holds, nothing written again. False
# when its documents are gone (a Redis that came back without them), nothing written. The
# key's record when it names a job already (a resend of a request that made one), nothing
# written and the documents staged for this call let go.
_CREATE_WRITE = (
    TAKE_VERSION
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HMGET', KEYS[1], 'version', 'created_at')
end
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then return false end
local n, m = tonumber(ARGV[6]), tonumber(ARGV[7])
local bound = KEYS[9 + m]
if bound then
  local earlier = redis.call('GET', bound)
  if earlier and type(cjson.decode(earlier)['job']) == 'string' then
    redis.call('DEL', KEYS[2])
    return earlier
  end
end
local version = string.format('%d', take_version(KEYS[6], KEYS[7], KEYS[8], tonumber(ARGV[4])))
local t = redis.call('TIME')
local at = tonumber(t[1]) * 1000000 + tonumber(t[2])
local newest = redis.call('ZREVRANGE', KEYS[5], 0, 0, 'WITHSCORES')[2]
if newest then at = math.max(at, math.floor(tonumber(newest) * 1000000 + 0.5) + 1) end
local created = string.format('%d.%06d', math.floor(at / 1000000), at % 1000000)
redis.call('HSET', KEYS[1], 'created_at', created, 'version', version, unpack(ARGV, 8, 7 + n))
if ARGV[1] == '1' then redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2])) end
redis.call('ZADD', KEYS[3], created, ARGV[5])
redis.call('HINCRBY', KEYS[4], 'queued', 1)
redis.call('ZADD', KEYS[5], created, ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', tonumber(created) - tonumber(ARGV[3]))
redis.call('EXPIRE', KEYS[5], tonumber(ARGV[3]))
for i = 1, m do redis.call('LPUSH', KEYS[8 + i], ARGV[7 + n + i]) end
if bound then redis.call('SET', bound, ARGV[8 + n + m], 'EX', tonumber(ARGV[9 + n + m])) end
return {version, created}
"""
)

# Claim an Idempotency-Key for one request. KEYS: the key's record. ARGV: the pending
# marker, its TTL, the claim's token (in the marker as "by"), a bound key's TTL. Returns the
# record already there (JSON), or nothing when it claimed. The same call sent again after its
# reply was lost (the token its own marker holds) answers nothing again: claimed, not "in
# progress". A key bound to a job is kept its TTL again from this use (sift batch run again
# picks its batch up by it, for 24 hours from the run before).
_CLAIM_IDEMPOTENCY = """
local earlier = redis.call('GET', KEYS[1])
if earlier then
  local record = cjson.decode(earlier)
  if ARGV[3] and record['by'] == ARGV[3] then return false end
  if type(record['job']) == 'string' then redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4])) end
  return earlier
end
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

# Claim the run of a search or a batch item (worker/queue/jobstore/runs.py). KEYS: the hash
# holding the claim, the job record it lives as long as (the hash itself for a search; the
# batch's record for an item: the hash takes its TTL, as the batch's moves do; a missing
# record, expired, has nothing written). ARGV: its field, the claiming worker's id ('' :
# none), the run's token, its lease (seconds), the heartbeat key prefix, and, from a claimant
# that keeps them, the tokens (comma list) its worker's runs of this job hold now. The value is
# "<seconds used>|<owner>|<claimed at>|<token>|<lease>", in Redis's clock (one clock for every
# worker's runs): the seconds the runs that ended used, and the run holding it (token ''
# once let go) with its lease. Refused while another run holds it: its owner named, the
# owner's heartbeat alive and its own lease not over (the holder's, kept in the claim: every
# worker judges a claim alike, whatever its own SIFT_SEARCH_DEADLINE_SECONDS). A run that
# never let go (its worker died, or its lease is over) is taken over and its time not
# counted: how long it ran before it died is unknown, and counting it to now (the dead-worker
# check, then the queue behind the rest of the batch) failed a killed worker's in-flight
# items deadline_exceeded. A claim naming the claimant's own worker that none of its runs
# holds (ARGV[6]) is a run gone: it ended, and Redis lost that (its last writes, with a host
# crash); it is taken over, not waited for. The same call sent again (its reply lost on a broken
# connection) finds its own token and answers as it did, its run starting now: the run's deadline
# starts at the answer, so its record and lease do too (the outage between the two sends is not the
# run's time). A run sends it again, too, once it holds its CPU slot after a long wait, where its
# deadline starts (runs.py), with the seconds it has run already (ARGV[7]; none after its first
# wait): its time starts that far back. A run that holds the claim may append its model's answer
# ("|<answer>", _KEEP_ANSWER): a run taking the claim over carries it on, and is answered it (the
# dead run paid for that call; its result was never saved); so is the run after one that let go
# (_RELEASE_RUN carries it on). With KEYS[3] (a batch item's), the runs of the job lost so far
# are counted there (hash: field -> count), each run taken over from a dead worker one more: a
# batch item fails as poison by its own count, not its chunk message's deliveries. Returns
# {claimed (0/1), the seconds used by every run before this one (a string), the answer kept
# ('' : none), the runs lost (0 without KEYS[3])}.
_CLAIM_RUN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local used = 0
local answer = ''
local lost = 0
if KEYS[3] then lost = tonumber(redis.call('HGET', KEYS[3], ARGV[1])) or 0 end
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local taken = false
if cur then
  local u, owner, since, token, lease, kept =
    string.match(cur, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|?([^|]*)|?(.*)$')
  if u then
    if token == ARGV[3] then
      local start = now - (tonumber(ARGV[7]) or 0)
      redis.call('HSET', KEYS[1], ARGV[1], u .. '|' .. owner .. '|' .. string.format('%.6f', start)
        .. '|' .. token .. '|' .. ARGV[4] .. (kept ~= '' and '|' .. kept or ''))
      return {1, u, kept, lost}
    end
    used = tonumber(u)
    if token ~= '' then
      local ran = math.max(0, now - tonumber(since))
      local gone = ARGV[6] and owner == ARGV[2]
        and not string.find(',' .. ARGV[6] .. ',', ',' .. token .. ',', 1, true)
      local alive = owner ~= '' and redis.call('EXISTS', ARGV[5] .. owner) == 1
      -- the holder's own lease (a claim written before claims kept theirs: the claimant's)
      if not gone and ran < (tonumber(lease) or tonumber(ARGV[4])) and alive then
        return {0, string.format('%.6f', used + ran), '', lost}
      end
      -- taken over (its worker dead, or its lease over): its time is not counted; a run
      -- whose worker is dead was lost (one past its lease on a live worker was slow, and
      -- one gone ended: Redis lost its end)
      taken = not gone and not alive
    end
    -- its model's answer, if one was kept (by a run taken over, or carried on by a run that
    -- let go before reaching it: a task retry), is this run's
    answer = kept
  end
end
local spent = string.format('%.6f', used)
local life = redis.call('PTTL', KEYS[2])
if life == -2 then return {1, spent, '', lost} end
redis.call('HSET', KEYS[1], ARGV[1], spent .. '|' .. ARGV[2] .. '|' .. string.format('%.6f', now)
  .. '|' .. ARGV[3] .. '|' .. ARGV[4] .. (answer ~= '' and '|' .. answer or ''))
if KEYS[2] ~= KEYS[1] and life > 0 then redis.call('PEXPIRE', KEYS[1], life) end
if KEYS[3] and taken then
  lost = redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
  if life > 0 then redis.call('PEXPIRE', KEYS[3], life) end
end
return {1, spent, answer, lost}
"""

# Keep the model's answer of the run holding a claim (_CLAIM_RUN's value, "|<answer>"
# appended), just after its call returned. KEYS: the hash. ARGV: the field, the run's token,
# the answer. Returns 1 when that run still held the claim (else nothing is written: the
# run that took it over keeps its own). Flagged allow-oom: the answer is the only record of
# calls the provider was sent (a few hundred bytes, one a run, replacing the run's last), and
# Redis at its maxmemory (noeviction) refused it. An item a stopping worker handed back
# keeping its refused calls went back without them, and a run whose finish Redis refused was
# run again: either way the next run called the model again, and the usage it showed left
# out the calls before.
_KEEP_ANSWER = """#!lua flags=allow-oom
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local head, token, lease = string.match(cur, '^([^|]*|[^|]*|[^|]*)|([^|]*)|?([^|]*)')
if not head or token ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], head .. '|' .. token .. '|' .. lease .. '|' .. ARGV[3])
return 1
"""

# An owed webhook's next message is due at a later time, and (a retry's) the attempt it
# makes. KEYS: the webhooks owed, the job's record. ARGV: when, the job id, the attempt ('' :
# a re-send, no attempt of its own). Only while the webhook is owed; the due time moves later
# only, and so does the attempt, kept in the job's record ("webhook_attempt", living as long
# as it) for the re-drive: a message it sends again makes the attempt that was lost, the
# schedule goes on (it began again, so a webhook whose messages kept being lost was attempted
# without end). A retry whose attempt is not past the one kept is another copy's, which
# carries the schedule: nothing is written. Returns, for a retry, 1 when it carries the
# schedule (or the webhook is owed no more and its record does not say it was settled: a
# job an older release finished, as before), 0 for another copy's, or once the webhook was
# settled (_WEBHOOK_SETTLED: another copy delivered it, or spent its schedule); for a
# re-send, 1 when the due time moved.
_WEBHOOK_DUE = """
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  if ARGV[3] == '' or redis.call('HEXISTS', KEYS[2], 'webhook_settled') == 1 then return 0 end
  return 1
end
if ARGV[3] ~= '' and redis.call('EXISTS', KEYS[2]) == 1 then
  local cur = tonumber(redis.call('HGET', KEYS[2], 'webhook_attempt')) or 1
  if tonumber(ARGV[3]) <= cur then return 0 end
  redis.call('HSET', KEYS[2], 'webhook_attempt', ARGV[3])
end
local moved = redis.call('ZADD', KEYS[1], 'GT', 'CH', ARGV[1], ARGV[2])
if ARGV[3] ~= '' then return 1 end
return moved
"""

# A copy of a webhook's message claims the attempt it makes before it sends it, so two
# copies of one attempt (a redelivered task's, and the message it sent again) send it once.
# KEYS: 1 the job's record.
# ARGV: 1 the attempt, 2 the claimant's worker id ('' : none), 3 its lease (seconds), 4 the
#   heartbeat key prefix, 5 the claim's token.
# Returns {granted (0/1), seconds to wait (a string)}:
# - {0, '0'}, refused for good: the webhook was settled, or the attempt comes before the one
#   a retry recorded (made already: the schedule goes on without this copy);
# - {0, '<s>'}: another copy holds the same attempt, its worker's heartbeat alive (or it
#   named none) and its lease not over (wait the seconds left, then look again);
# - {1, '0'}, granted: the claim recorded ("webhook_claim": attempt|owner|until|token, in
#   Redis's clock). The same call sent again (its reply lost) finds its own token: granted,
#   as it was. A record already gone (expired) has nothing to claim on and none is made:
#   granted.
_CLAIM_WEBHOOK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {1, '0'} end
if redis.call('HEXISTS', KEYS[1], 'webhook_settled') == 1 then return {0, '0'} end
local attempt = tonumber(ARGV[1])
if attempt < (tonumber(redis.call('HGET', KEYS[1], 'webhook_attempt')) or 1) then
  return {0, '0'}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cur = redis.call('HGET', KEYS[1], 'webhook_claim')
if cur then
  local held, owner, till, token = string.match(cur, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  if token == ARGV[5] then return {1, '0'} end
  if tonumber(held) == attempt and now < tonumber(till)
      and (owner == '' or redis.call('EXISTS', ARGV[4] .. owner) == 1) then
    return {0, string.format('%.3f', tonumber(till) - now)}
  end
end
redis.call('HSET', KEYS[1], 'webhook_claim', attempt .. '|' .. ARGV[2] .. '|'
  .. string.format('%.6f', now + tonumber(ARGV[3])) .. '|' .. ARGV[5])
return {1, '0'}
"""

# A job's webhook is owed no more: delivered, refused, or its schedule spent. KEYS: the
# webhooks owed, the job's record. ARGV: the job id, the score before which entries are
# dropped (due before the retention window: their records have expired), how it ended
# ("delivered" or "failed") and the attempts made. The record (if it still exists: never a
# partial one made) says so, so a copy of the webhook failing after that starts no schedule
# of its own (_WEBHOOK_DUE), and its GET shows it. A copy's delivery is never overwritten
# by another copy's failure (a delivery after a give-up is shown: the receiver got it), and
# the attempts shown never go down: the most any copy counted, or its recorded retry did.
# An older release's "1" (delivered or not, it did not say) is left as it is.
_WEBHOOK_SETTLED = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 0 then return 1 end
local was = redis.call('HGET', KEYS[2], 'webhook_settled')
if was == '1' then return 1 end
local made = math.max(tonumber(ARGV[4]),
  tonumber(redis.call('HGET', KEYS[2], 'webhook_attempts')) or 0,
  (tonumber(redis.call('HGET', KEYS[2], 'webhook_attempt')) or 1) - 1)
local ended = ARGV[3]
if was == 'delivered' then ended = was end
redis.call('HSET', KEYS[2], 'webhook_settled', ended, 'webhook_attempts', made)
return 1
"""

# Take what batch cancels ended and no one has counted yet (_CANCEL_BATCH's count), once.
# KEYS: the batch. ARGV: the take's token. Returns {items canceled, 1 if a cancel completed
# the batch}. Each take that took something keeps its answer in the batch's record under its
# token ("cancel_taken:<token>": one per cancel that ended items, at most), so the same call
# sent again after its reply was lost answers what it took (not nothing), even after another
# cancel's take since (a gateway sends its take again after Redis came back).
_TAKE_CANCEL_COUNT = """
local last = redis.call('HGET', KEYS[1], 'cancel_taken:' .. ARGV[1])
if last then
  local n, completed = string.match(last, '^(%d+) (%d)$')
  return {tonumber(n), tonumber(completed)}
end
local got = redis.call('HMGET', KEYS[1], 'cancel_uncounted', 'cancel_completed')
local n, completed = tonumber(got[1]) or 0, tonumber(got[2]) or 0
if n == 0 and completed == 0 then return {0, 0} end
redis.call('HDEL', KEYS[1], 'cancel_uncounted', 'cancel_completed')
redis.call('HSET', KEYS[1], 'cancel_taken:' .. ARGV[1], n .. ' ' .. completed)
return {n, completed}
"""

# The batch chunks a live run holds by its claim (_CLAIM_RUN's value, a field "<start>-<stop>"
# of the batch's chunk claims), judged as _CLAIM_RUN judges a claim for another worker: a run
# named (its token set, its owner named), its owner's heartbeat alive and its own lease not
# over. The re-drive counts their positions covered: a copy of the chunk refused by that run
# was acked, and the run's own message may be gone with it (kombu's restore moved it to the
# copy). KEYS: the batch's chunk claims. ARGV: the heartbeat key prefix. Returns the fields.
_HELD_CHUNKS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local held = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local owner, since, token, lease =
    string.match(all[i + 1], '^[^|]*|([^|]*)|([^|]*)|([^|]*)|?([^|]*)')
  if token and token ~= '' and owner ~= '' and tonumber(lease) and tonumber(since)
      and now - tonumber(since) < tonumber(lease)
      and redis.call('EXISTS', ARGV[1] .. owner) == 1 then
    held[#held + 1] = all[i]
  end
end
return held
"""

# Let a run's claim go, adding the seconds it ran to those used, and carrying on the answer
# kept with it ("<used>||0|||<answer>": no owner, no token, no lease): a run lets go only to
# be retried (one that finishes its search need not, and the final move drops the answer),
# and a run retried before it reached a kept answer (its retrieval failed) left that answer
# to its retry: dropping it had the retry pay for the call again. KEYS: the hash. ARGV: the
# field, the run's token, and '0' when the run's seconds are not to be added (a batch item
# handed back by its stopping worker: its run starts again whole, as a run taken over does).
# Returns 1 when that run still held it. Flagged allow-oom: it only shortens the field, so it
# runs on a Redis at its maxmemory (noeviction), which refuses every other write. A chunk run
# that ended there (its items' finishes refused) held its claim on: the re-drive took the
# chunk's positions for a live run's for the claim's lease (25 search deadlines), and the
# items stayed running long after Redis had room again.
_RELEASE_RUN = """#!lua flags=allow-oom
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local u, since, token, kept = string.match(cur, '^([^|]*)|[^|]*|([^|]*)|([^|]*)|?[^|]*|?(.*)$')
if not u or token ~= ARGV[2] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local used = tonumber(u)
if ARGV[3] ~= '0' then used = used + math.max(0, now - tonumber(since)) end
redis.call('HSET', KEYS[1], ARGV[1],
  string.format('%.6f', used) .. '||0|' .. (kept ~= '' and '||' .. kept or ''))
return 1
"""

# Keep an economy item's prepared first half (HSETNX), only while its batch's record exists
# and the item is running: a cancel, a purge or a final move since (the first half ran
# meanwhile) leaves nothing to finish, and a purge's erasure must not be written back.
# KEYS: the prepared hash, the batch's record, its items. ARGV: the query id, the prepared
# state. No TTL: the hash lives as the record does (_ECONOMY_WRITE; the move or cancel that
# completes the batch gives it the retention). Returns 1 when written, 0 when the field was
# there already (kept as it was), -1 when refused (the record gone, or the item not running).
_SAVE_PREPARED = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('HGET', KEYS[3], ARGV[1]) ~= 'running' then return -1 end
return redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
"""

# Write one of a batch's economy hashes (HSET of field/value pairs, or one HSETNX), only while
# the batch's record exists, and give the hash its record's TTL: none while the batch runs (a
# batch waiting on its provider batches, or on workers stopped, longer than the retention keeps
# what it needs to finish), the record's remaining retention once it is final. A step of the
# economy lane still running when `sift tenant purge` deleted the batch (--force, or a worker
# not restarted yet) wrote its key back, named by no record a second purge could find.
# KEYS: the hash, the batch's record. ARGV: 'HSET' or 'HSETNX', then the fields and values.
# Returns {-1, ''} when refused (the record gone), else {HSETNX's answer (1 written, 0 there
# already), the field's value now} or {the fields HSET added, ''}.
_ECONOMY_WRITE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return {-1, ''} end
local n, held = 0, ''
if ARGV[1] == 'HSETNX' then
  n = redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3])
  held = redis.call('HGET', KEYS[1], ARGV[2])
else
  for i = 2, #ARGV, 2 do n = n + redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
local life = redis.call('PTTL', KEYS[2])
if life == -1 then redis.call('PERSIST', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], life) end
return {n, held}
"""

# Watch an economy task of a batch (ZADD to the shared watch), only while the batch's record
# exists: the member names the batch. KEYS: the watch, the batch's record. ARGV: the due
# time, the member. Returns -1 when refused.
_ECONOMY_EXPECT = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
return redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
"""

# Take or keep an economy task's lease (worker/queue/jobstore/lanes.py economy_lease, inside its
# transaction), and write its marks into the batch's state hash, only while the batch's record
# exists, as _ECONOMY_WRITE. KEYS: the lease, the state hash, the batch's record. ARGV: the
# holder, the lease's life (ms), then the state's fields and values. Returns 1 when taken, 0
# when refused (the record gone: nothing written).
_ECONOMY_LEASE = """
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
if #ARGV > 2 then
  for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
  local life = redis.call('PTTL', KEYS[3])
  if life == -1 then redis.call('PERSIST', KEYS[2]) else redis.call('PEXPIRE', KEYS[2], life) end
end
return 1
"""

# The provider batches of an economy batch that Sift made and recorded, of the hash at ``key``
# (the economy lane's provider batches): every one but a create in doubt's candidates
# ("doubt": true in its record, each maybe another client's) not proved ours by their
# results ("proven"), to be deleted at the provider. And the candidates not judged yet (no
# "proven" at all: still running, or being mapped), with their create's submission, as a flat
# list {id, submission, ...}: kept aside, and judged by the delete task once they end
# (worker/queue/economy/deletion.py); one judged another client's ("proven": false) is neither.
# One Lua function each, in the erase's script and the purge's (_KEEP_PROVIDER_DELETIONS), so
# the two read the fields alike (a record that is no JSON object is Sift's own: kept).
_MADE_PROVIDERS = """
local function made_providers(key)
  local made = {}
  local providers = redis.call('HGETALL', key)
  for i = 1, #providers, 2 do
    local ok, record = pcall(cjson.decode, providers[i + 1])
    if not (ok and type(record) == 'table' and record['doubt'] == true
            and record['proven'] ~= true) then
      table.insert(made, providers[i])
    end
  end
  return made
end
local function unjudged_candidates(key)
  local unjudged = {}
  local providers = redis.call('HGETALL', key)
  for i = 1, #providers, 2 do
    local ok, record = pcall(cjson.decode, providers[i + 1])
    if ok and type(record) == 'table' and record['doubt'] == true
       and (record['proven'] == nil or record['proven'] == cjson.null)
       and type(record['submission']) == 'string' then
      table.insert(unjudged, providers[i])
      table.insert(unjudged, record['submission'])
    end
  end
  return unjudged
end
"""

# ``sift tenant purge``'s keep of a batch's provider batches to delete (those
# :data:`_MADE_PROVIDERS` picks) and of its candidates not judged yet, before it deletes the
# state naming them, as an erase keeps them. KEYS: 1 the economy lane's provider batches, 2 the
# set of those to delete, 3 the candidates to judge. ARGV: 1 their TTL. Returns the ids kept
# to delete.
_KEEP_PROVIDER_DELETIONS = (
    _MADE_PROVIDERS
    + """
local made = made_providers(KEYS[1])
if #made > 0 then
  redis.call('SADD', KEYS[2], unpack(made))
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[1]))
end
local unjudged = unjudged_candidates(KEYS[1])
if #unjudged > 0 then
  redis.call('HSET', KEYS[3], unpack(unjudged))
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[1]))
end
return made
"""
)

# A candidate kept aside by an erase (KEYS[1], provider id -> submission) judged by the delete
# task: dropped from there and, if its results proved it ours (ARGV[2] '1'), added to the
# provider batches to delete (KEYS[2]), which then live at least as long as the candidates
# did. ARGV: 1 the candidate. Returns 1 when judged now, 0 when it was no longer kept.
_CANDIDATE_JUDGED = """
local life = redis.call('PTTL', KEYS[1])
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[2] == '1' then
  redis.call('SADD', KEYS[2], ARGV[1])
  if life > 0 and redis.call('PTTL', KEYS[2]) < life then redis.call('PEXPIRE', KEYS[2], life) end
end
return 1
"""

# A delete (or a candidate's judgement) the provider refused for the key (401, 403), which no
# retry changes until the key does: moved from the set it was in (KEYS[1]: the provider
# batches to delete, or the candidates to judge when ARGV[2] is a submission) to the batch's
# refused ones (KEYS[2], provider id -> submission, '' for one Sift made), which live at least
# as long as KEYS[1] did (ARGV[3] seconds if it had no TTL), and the batch named in the index
# of refusals (KEYS[3], ARGV[4]) for a starting worker to ask again. A delete's refusal (not a
# candidate's read) is noted in the batch's refusals counted (KEYS[4]), with the same life.
# ARGV: 1 the provider id. Returns 2 when moved and its delete refused for the first time (to
# count), 1 when moved, 0 when it was no longer there. Removed before it is recorded, though
# Lua rolls nothing back: at its maxmemory Redis refuses only a script's first growing write,
# so the removal going first lets the move be made whole there; recorded first, the script
# would be refused (test_a_delete_refused_at_a_full_redis_is_kept_aside_whole).
_DELETE_REFUSED = """
local life = redis.call('PTTL', KEYS[1])
local removed
if ARGV[2] == '' then
  removed = redis.call('SREM', KEYS[1], ARGV[1])
else
  removed = redis.call('HDEL', KEYS[1], ARGV[1])
end
if removed == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if life <= 0 then life = tonumber(ARGV[3]) * 1000 end
if redis.call('PTTL', KEYS[2]) < life then redis.call('PEXPIRE', KEYS[2], life) end
redis.call('HSETNX', KEYS[3], ARGV[4], '')
if ARGV[2] ~= '' then return 1 end
local first = redis.call('SADD', KEYS[4], ARGV[1])
if redis.call('PTTL', KEYS[4]) < life then redis.call('PEXPIRE', KEYS[4], life) end
return 1 + first
"""

# A starting worker's turn to ask a batch's refused deletes again: a new token (ARGV[2]) for
# the batch (ARGV[1]) in the index of refusals (KEYS[1]), which only the delete task sent with
# it may use (_TAKE_REFUSED); a batch whose refused ones expired (KEYS[2] gone) leaves the
# index. Returns 1 when the task is to be sent, else 0.
_ASK_REFUSED = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# The delete task sent with a batch's token (_ASK_REFUSED) takes its refused ones back (KEYS[2])
# into the provider batches to delete (KEYS[3]) and the candidates to judge (KEYS[4]), each of
# which then lives at least as long as they did, and the batch leaves the index (KEYS[1]).
# Another task (an older token, a retry, the erase's own) takes nothing: a refusal is asked
# again once per worker start, never at each poll. ARGV: 1 the batch, 2 the token. Returns how
# many it took.
_TAKE_REFUSED = """
if ARGV[2] == '' or redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local life = redis.call('PTTL', KEYS[2])
local refused = redis.call('HGETALL', KEYS[2])
for i = 1, #refused, 2 do
  if refused[i + 1] == '' then
    redis.call('SADD', KEYS[3], refused[i])
  else
    redis.call('HSET', KEYS[4], refused[i], refused[i + 1])
  end
end
for k = 3, 4 do
  if life > 0 and redis.call('EXISTS', KEYS[k]) == 1 and redis.call('PTTL', KEYS[k]) < life then
    redis.call('PEXPIRE', KEYS[k], life)
  end
end
redis.call('DEL', KEYS[2])
return #refused / 2
"""

# An erased batch's delete task (ARGV[1], its id, which Celery keeps across its retries) claims
# the batch's one retrying chain (KEYS[1], the lease): free or its own already, the lease is
# (re)set to it for ARGV[2] ms. Returns 1 when it holds the lease, 0 when another task's chain
# does (it reads the same sets: this task's work is handed to it).
_CLAIM_DELETE_CHAIN = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# A delete task's chain ended by an exception Celery does not retry (its message acked): the
# lease (KEYS[1]) is let go if it is still the task's (ARGV[1]), for the next message for the
# batch to take. Returns 1 when it was let go.
_LET_GO_DELETE_CHAIN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""

# The end of a delete task's run: whether it retries. Another's chain holds the lease (this
# one's lapsed): 0, it ends. Else, with work left to wait for (ARGV[3] '1') or anything in
# the provider batches to delete (KEYS[2]) or the candidates to judge (KEYS[3]) (a starting
# worker's task may have put refused ones back since this run read them), the lease is
# renewed to it for ARGV[2] ms: 1, it retries; with nothing left it is let go: 0, and with no
# refused one kept either (KEYS[4]), the refusals counted (KEYS[5]) go too. One script, so a
# task putting ids back either sees the lease let go (and takes it) or is seen here.
_END_DELETE_CHAIN = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
if ARGV[3] ~= '1' and redis.call('EXISTS', KEYS[2], KEYS[3]) == 0 then
  if owner then redis.call('DEL', KEYS[1]) end
  if redis.call('EXISTS', KEYS[4]) == 0 then redis.call('DEL', KEYS[5]) end
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# Erase one finished search or batch of a tenant (DELETE /v1/searches/{id}, DELETE
# /v1/batches/{id}/results): its record and every other key of it deleted, its members in
# the tenant's job list, the active set and the webhooks owed removed, and its erasure mark
# written, in one script, so no status change comes between the check and the delete (a job
# erased is final: a redelivered run's claim, start or finish, a webhook's claim or its end,
# an economy write, each writes only while the record exists, and so writes nothing after).
# An economy batch's provider batches that Sift made and recorded (not a create in doubt's
# candidates, unless their results proved them ours: _MADE_PROVIDERS) go into the set
# of those to delete at the provider, its candidates not judged yet into those to judge, and
# its delete task's message is written with them (the outbox): read before the delete of
# their hash, and deleted at the provider even if the caller never hears the answer.
# The erasure owes Redis a rewrite of its files (its AOF holds the writes that stored the job),
# marked here so that it stays owed even if the caller dies before asking for it (rewrite.py).
# KEYS: 1 the record, 2 the erasure mark, 3 the tenant's job list, 4 the active set, 5 the
#   webhooks owed, 6 the provider batches to delete, 7 the delete task's queue, 8 the economy
#   lane's provider batches, 9 the rewrite owed, 10 the candidates to judge, 11.. the job's
#   other keys.
# ARGV: 1 the tenant, 2 the job id, 3 its kind ('search' or 'batch'), 4 now, 5 the mark's TTL,
#   6 the delete task's message ('': none).
# Returns {1, now} when erased now, {2, when} when the tenant had erased it already (the same
# answer again; only the rewrite is owed again: an erase by a gateway older than its mark owed
# none, and the AOF kept the text until sent again), {0, status} when it has not finished
# (nothing written), {-1, ''} when there is no such job of the tenant's (missing, expired,
# or another's).
_ERASE_JOB = (
    _MADE_PROVIDERS
    + """
local mark = redis.call('HMGET', KEYS[2], 'tenant', 'erased_at')
if mark[1] then
  if mark[1] == ARGV[1] then
    redis.call('SET', KEYS[9], ARGV[4])
    return {2, mark[2]}
  end
  return {-1, ''}
end
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return {-1, ''} end
if ARGV[3] == 'search' then
  local status = redis.call('HGET', KEYS[1], 'status')
  if status ~= 'succeeded' and status ~= 'failed' and status ~= 'canceled' then
    return {0, status or ''}
  end
elseif redis.call('HEXISTS', KEYS[1], 'finished_at') == 0 then
  return {0, 'running'}
end
if ARGV[6] ~= '' then
  local made = made_providers(KEYS[8])
  if #made > 0 then
    redis.call('SADD', KEYS[6], unpack(made))
    redis.call('EXPIRE', KEYS[6], tonumber(ARGV[5]))
  end
  local unjudged = unjudged_candidates(KEYS[8])
  if #unjudged > 0 then
    redis.call('HSET', KEYS[10], unpack(unjudged))
    redis.call('EXPIRE', KEYS[10], tonumber(ARGV[5]))
  end
  if #made > 0 or #unjudged > 0 then redis.call('LPUSH', KEYS[7], ARGV[6]) end
end
redis.call('DEL', KEYS[1], unpack(KEYS, 11))
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
redis.call('ZREM', KEYS[5], ARGV[2])
redis.call('HSET', KEYS[2], 'tenant', ARGV[1], 'kind', ARGV[3], 'erased_at', ARGV[4])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[5]))
redis.call('SET', KEYS[9], ARGV[4])
return {1, ARGV[4]}
"""
)

# Count one more re-drive of each of a job's positions, but not of one whose run Redis
# unreachable ended (an outage noted by its run once Redis answered again,
# DeliveryRecords.note_outage): that note is used up instead, at most ARGV[3] per position (a
# run that met Redis unreachable that often is no outage it happened to overlap, and counts).
# KEYS: 1 the job's re-drive counts (a batch's: a hash, position -> count; a search's or an
# ingest's: a string, its one position's), 2 its outage notes (a hash, position -> runs noted
# and not yet re-driven nor come back, "<position>:freed" -> re-drives they made free,
# "m:<task id>:<retry>" -> the positions a message's note covers), 3 the job's record.
# ARGV: 1 the TTL (seconds), 2 'hash' or 'string' (KEYS[1]'s type), 3 the free re-drives a
# position may have, 4... the positions. Returns each position's re-drives counted, in
# ARGV's order. Nothing is written for a job whose record is gone (erased, purged, expired)
# or final, as for an outage's note (_NOTE_OUTAGE): its final move or erase deleted its
# counts, and a sweep that found its work lost just before counted them back for the
# retention; what is stored (0: nothing) is answered then.
_COUNT_REDRIVES = """
local hash = ARGV[2] == 'hash'
local counts = {}
local status = redis.call('HGET', KEYS[3], 'status')
if redis.call('EXISTS', KEYS[3]) == 0 or redis.call('HEXISTS', KEYS[3], 'finished_at') == 1
    or status == 'succeeded' or status == 'failed' or status == 'canceled' then
  for i = 4, #ARGV do
    local count
    if hash then
      count = redis.call('HGET', KEYS[1], ARGV[i])
    else
      count = redis.call('GET', KEYS[1])
    end
    counts[#counts + 1] = tonumber(count) or 0
  end
  return counts
end
for i = 4, #ARGV do
  local p = ARGV[i]
  local noted = tonumber(redis.call('HGET', KEYS[2], p)) or 0
  local freed = tonumber(redis.call('HGET', KEYS[2], p .. ':freed')) or 0
  if noted > 0 and freed < tonumber(ARGV[3]) then
    redis.call('HINCRBY', KEYS[2], p, -1)
    redis.call('HINCRBY', KEYS[2], p .. ':freed', 1)
    local count
    if hash then count = redis.call('HGET', KEYS[1], p) else count = redis.call('GET', KEYS[1]) end
    counts[#counts + 1] = tonumber(count) or 0
  elseif hash then
    counts[#counts + 1] = redis.call('HINCRBY', KEYS[1], p, 1)
  else
    counts[#counts + 1] = redis.call('INCR', KEYS[1])
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return counts
"""

# A run that Redis unreachable ended notes its outage once Redis answers
# (DeliveryRecords.note_outage): one more noted for each of its job's positions, and, when its
# message is named, which positions that message's note covers ("m:<task id>:<retry>"): the
# message may come back itself (left unacked, the orphan check puts it back) rather than by a
# re-drive, and :data:`_COUNT_DELIVERY` then uses the note up. Nothing is written for a job
# whose record is gone (erased, purged or expired: a late run's note would bring a key of it
# back, erasure.py) or final (a search's or an ingest's status, a batch's finished_at: nothing
# of it is sent again). KEYS: 1 the job's record, 2 its
# outage notes. ARGV: 1 the notes' TTL (seconds), 2 the message ("<task id>:<retry>", or
# ''), 3... the positions. Returns 1 when noted, else 0.
_NOTE_OUTAGE = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'finished_at') == 1 then
  return 0
end
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'succeeded' or status == 'failed' or status == 'canceled' then return 0 end
for i = 3, #ARGV do redis.call('HINCRBY', KEYS[2], ARGV[i], 1) end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[2], 'm:' .. ARGV[2], table.concat(ARGV, ',', 3))
end
redis.call('EXPIRE', KEYS[2], ARGV[1])
return 1
"""

# Count one more delivery of a task message (DeliveryRecords.count_delivery); when its job's
# outage notes (KEYS[2]) say that an outage ended this message's last run, this delivery is
# that outage's return: the note is used up (one off each of its positions still noted, so no
# re-drive is freed by it as well), and the delivery is not counted, as a hand-back's is, at
# most ARGV[3] times a message (KEYS[3], beside its counter: each of a batch's chunk messages
# back after one restart is uncounted, however many there are). A note a re-drive used up
# first (its positions no longer noted) frees nothing more. Only fields that exist are
# changed: the notes of an erased job stay gone. KEYS: 1 the message's delivery counter,
# 2 the deliveries of it left uncounted, 3 (optional) its job's outage notes. ARGV: 1 the
# counters' TTL (seconds), 2 the message ("<task id>:<retry>"), 3 the deliveries a message
# may have uncounted. Returns the deliveries counted.
_COUNT_DELIVERY = """
local count = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
if not KEYS[3] then return count end
local field = 'm:' .. ARGV[2]
local noted = redis.call('HGET', KEYS[3], field)
if not noted then return count end
redis.call('HDEL', KEYS[3], field)
local paid = false
for p in string.gmatch(noted, '[^,]+') do
  if (tonumber(redis.call('HGET', KEYS[3], p)) or 0) > 0 then
    redis.call('HINCRBY', KEYS[3], p, -1)
    paid = true
  end
end
if paid and (tonumber(redis.call('GET', KEYS[2])) or 0) < tonumber(ARGV[3]) then
  redis.call('INCR', KEYS[2])
  redis.call('EXPIRE', KEYS[2], ARGV[1])
  count = redis.call('DECR', KEYS[1])
end
return count
"""


# Start a message's delivery counter at ARGV[1] (DeliveryRecords.set_deliveries), with its TTL
# (ARGV[2] seconds). KEYS: the counter. Flagged allow-oom: it replaces a counter of a few bytes
# that the delivery's count wrote already, and a stopping worker's hand-back writes it before
# it puts its message back: a plain SET, refused at Redis's maxmemory (noeviction), failed the
# chunk's task instead, and its items not started waited for the re-drive.
_SET_DELIVERIES = """#!lua flags=allow-oom
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""

# KEYS: webhooks owed, then hashes. ARGV: job ids. Returns each hash's fields and values (a
# flat list, empty if none), then each job's score in the webhooks owed (false if none): one
# snapshot, so a read between the settle script's two writes (the record's how it ended, the
# entry dropped) cannot find neither. A script that only reads still runs at Redis's
# maxmemory, where every command queued in a MULTI is refused (OOM), reads included.
_READ_JOBS = """
local out = {}
for i = 2, #KEYS do
  out[#out + 1] = redis.call('HGETALL', KEYS[i])
end
for i = 1, #ARGV do
  out[#out + 1] = redis.call('ZSCORE', KEYS[1], ARGV[i])
end
return out
"""


# KEYS: a batch's record, its items, its results. ARGV: a byte budget, then query ids in the
# page's order. Returns whether the record exists, then the status and the outcome (false if
# none) of the first items whose outcomes' stored bytes stay within the budget (the first item
# always, however large: each page moves on): one snapshot, so an erase between the reads is
# seen. Each outcome's size is read (HSTRLEN) before the outcome itself, so none past the
# budget is copied into the reply. A script, not a MULTI: at Redis's maxmemory every command
# queued in a MULTI is refused, reads too, and a page of results was a 503 job_store_full.
_READ_RESULTS_PAGE = """
local budget, used = tonumber(ARGV[1]), 0
local statuses, outcomes = {}, {}
for i = 2, #ARGV do
  local size = redis.call('HSTRLEN', KEYS[3], ARGV[i])
  if i > 2 and used + size > budget then break end
  used = used + size
  statuses[i - 1] = redis.call('HGET', KEYS[2], ARGV[i])
  outcomes[i - 1] = redis.call('HGET', KEYS[3], ARGV[i])
end
return {redis.call('EXISTS', KEYS[1]), statuses, outcomes}
"""

"""Write versions: the order in which a tenant's writes were accepted, one counter per tenant.

Every write (an ingest, a delete, a drop, a settings change) takes the next version of its
tenant's counter when it is accepted, and the backends keep, per index, tenant and id (per
index and tenant for a drop and the settings), the version of the last write applied: the
write accepted last wins whichever worker runs it first. Nothing compares the versions of two
tenants, and each tenant reads its own back (a document's ``version``), so the counter is the
tenant's: one shared by every tenant told each of them how many writes the others made.

Earlier releases numbered every write from one counter for the deployment
(``sift:write-version``, ``INCR``). Each version is above it, so above any version the
tenant's documents hold from before, and above every write an earlier release's gateway or
worker accepted before it. A rolling upgrade (``deploy/k8s`` rolls the gateways one pod at a
time) runs both releases at once, so the other order happens too: a write an earlier release
accepts after an upgraded one (a delete of a document just ingested) must come after it,
and that release numbers it ``INCR`` of the shared counter. So while an earlier release may
still be running, each write also moves the shared counter up to its own version.

Whether one may be running is told by the shared counter itself: if it moved since this
release's last write left it there (the hash ``LEGACY_WRITE_VERSION_KEY``: ``mark``), an
earlier release wrote meanwhile (``seen``: when that was last noticed); a deployment that was
upgraded (the shared counter set) and has no ``mark`` yet counts as one seen now. For
:data:`~worker.constants.LEGACY_WRITE_VERSION_WINDOW_SECONDS` (a day) after one was last
seen, the shared counter keeps moving, and a tenant's versions count every tenant's writes
then, as they did before; after it, the tenant's own only. An earlier release's process that
writes nothing for a day, then writes right after an upgraded one, can still lose to it; that
write moves the shared counter off its ``mark`` and opens the window again.

A version is never below the Redis server's clock in microseconds, so a Redis that comes back
without the counters still numbers new writes above every one the backend applied (see
``TAKE_VERSION``).

A job's write (an upsert, a delete, a drop) takes its version in the very script that
creates and dates its record (the job store's ``_CREATE_WRITE``), so the order of their
versions is the order they are listed in; the other writes take theirs with
:func:`next_write_version`.
"""

from __future__ import annotations

from typing import cast

import redis

from worker.constants import (
    LEGACY_WRITE_VERSION_KEY,
    LEGACY_WRITE_VERSION_WINDOW_SECONDS,
    WRITE_VERSION_KEY,
    WRITE_VERSION_TENANT_KEY,
)

# The version, as a Lua function that a script taking one starts with (``_NEXT_VERSION``, and
# the job store's ``_CREATE_WRITE``, which creates and dates the job in the same step):
# ``tenant_key`` the tenant's counter, ``shared_key`` the shared counter of earlier releases,
# ``legacy_key`` the hash {mark: where this release last left the shared counter, seen: when
# an earlier release's write was last noticed}, ``window`` the window in seconds. The time is
# the server's (one clock for all). A version is never below the server's clock in
# microseconds: the counters live in Redis and the versions applied on disk in the backend, so
# a Redis that comes back without them (no persistence, or the last second of an AOF
# ``everysec`` lost with its machine) would number new writes from below what the backend
# holds, and they would be skipped as stale (an upsert of a version already held even
# reported as written). The clock has moved past every version handed out before the restart
# (a counter can lead it only by the writes of one microsecond), so those writes stay the
# newest.
TAKE_VERSION = """
local function take_version(tenant_key, shared_key, legacy_key, window)
  local last = tonumber(redis.call('GET', tenant_key) or '0')
  local shared = tonumber(redis.call('GET', shared_key) or '0')
  local state = redis.call('HMGET', legacy_key, 'mark', 'seen')
  local mark = tonumber(state[1] or '0')
  local seen = tonumber(state[2] or '0')
  local t = redis.call('TIME')
  local now = tonumber(t[1])
  if shared ~= mark then seen = now end
  local version = math.max(last + 1, shared + 1, now * 1000000 + tonumber(t[2]))
  redis.call('SET', tenant_key, string.format('%d', version))
  if now - seen < window then
    shared = version
    redis.call('SET', shared_key, string.format('%d', version))
  end
  redis.call('HSET', legacy_key, 'mark', string.format('%d', shared),
    'seen', string.format('%d', seen))
  return version
end
"""

# KEYS: the three of :func:`version_keys`. ARGV[1] the window in seconds.
_NEXT_VERSION = TAKE_VERSION + "return take_version(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[1]))"


def version_keys(tenant: str) -> list[str]:
    """The keys a version of ``tenant``'s is taken from, in ``take_version``'s order."""
    return [WRITE_VERSION_TENANT_KEY + tenant, WRITE_VERSION_KEY, LEGACY_WRITE_VERSION_KEY]


def next_write_version(client: redis.Redis, tenant: str) -> int:
    """The tenant's next write version, in one script (the read of the counters and the
    writes can't be split by another write, of this release or an earlier one)."""
    keys = version_keys(tenant)
    args = [LEGACY_WRITE_VERSION_WINDOW_SECONDS]
    return int(cast(int, client.eval(_NEXT_VERSION, len(keys), *keys, *args)))

"""Write versions: the order in which a tenant's writes were accepted, one counter per tenant.

Every write (an ingest, a delete, a drop, a settings change) takes the next version of its
tenant's counter when it is accepted, and the backends keep, per index, tenant and id (per
index and tenant for a drop and the settings), the version of the last write applied: the
write accepted last wins whichever worker runs it first. Nothing compares the versions of two
tenants, and each tenant reads its own back (a document's ``version``), so the counter is the
tenant's: one shared by every tenant told each of them how many writes the others made.

Each version is also above the deployment's shared counter of earlier releases
(``sift:write-version``, no longer moved once every gateway and worker is upgraded), so it is
above any version the tenant's documents hold from before, and, during a rolling upgrade, above
every write an earlier release's gateway or worker accepted before it. The one order a rolling
upgrade can still get wrong is the reverse: a write an earlier release accepts after an
upgraded one, for the same document or index, may lose to it; and while both run, a tenant's
versions jump by the earlier release's writes of every tenant.
"""

from __future__ import annotations

from typing import cast

import redis

from worker.constants import WRITE_VERSION_KEY, WRITE_VERSION_TENANT_KEY

# KEYS[1] the tenant's counter, KEYS[2] the shared counter of earlier releases: a floor
_NEXT_VERSION = """
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
local shared = tonumber(redis.call('GET', KEYS[2]) or '0')
local version = math.max(last, shared) + 1
redis.call('SET', KEYS[1], string.format('%d', version))
return version
"""


def next_write_version(client: redis.Redis, tenant: str) -> int:
    """The tenant's next write version, in one script (the read of both counters and the
    write can't be split by another write)."""
    keys = [WRITE_VERSION_TENANT_KEY + tenant, WRITE_VERSION_KEY]
    return int(cast(int, client.eval(_NEXT_VERSION, len(keys), *keys)))

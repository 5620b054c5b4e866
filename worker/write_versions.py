"""Write versions: the order in which a tenant's writes were accepted, one counter per tenant.

Every write (an ingest, a delete, a drop, a settings change) takes the next version of its
tenant's counter when it is accepted, and the backends keep, per index, tenant and id (per
index and tenant for a drop and the settings), the version of the last write applied: the
write accepted last wins whichever worker runs it first. Nothing compares the versions of two
tenants, and each tenant reads its own back (a document's ``version``), so the counter is the
tenant's: one shared by every tenant told each of them how many writes the others made.

A tenant's counter starts from the deployment's shared counter of earlier releases
(``sift:write-version``, no longer moved), so its first version is above any its documents
hold from before.
"""

from __future__ import annotations

from typing import cast

import redis

from worker.constants import WRITE_VERSION_KEY, WRITE_VERSION_TENANT_KEY

# KEYS[1] the tenant's counter, KEYS[2] the shared counter it starts from when it is new
_NEXT_VERSION = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  local shared = redis.call('GET', KEYS[2])
  if shared then redis.call('SET', KEYS[1], shared) end
end
return redis.call('INCR', KEYS[1])
"""


def next_write_version(client: redis.Redis, tenant: str) -> int:
    """The tenant's next write version, in one script (the start from the shared counter and
    the increment can't be split by another write)."""
    keys = [WRITE_VERSION_TENANT_KEY + tenant, WRITE_VERSION_KEY]
    return int(cast(int, client.eval(_NEXT_VERSION, len(keys), *keys)))

"""An index's own search settings in Redis: weighted RRF and the candidate window (issue 15).

Why Redis: the settings are Sift's, not a backend's, and must read the same on both
backends. Sift keeps no metadata of its own in an Elasticsearch index, while Redis
already holds Sift's durable state (AOF in ``deploy/`` and under ``sift up``). One key per
tenant and index, ``sift:index-settings:<tenant>:<index>``, holding
``{"settings": <only the fields set>, "version": <write version>}``, with no TTL.

Why a short cache: a search reads its index's settings once; each worker process keeps
what it read for ``INDEX_SETTINGS_TTL_SECONDS`` (2 s), so a busy index costs one ``GET``
per process every 2 s, not one per search. A change is seen at once by the process that
made it (it drops its copy), by the others within the TTL.

Ordering with a drop: every change takes a write version from the tenant's counter that its
upserts, deletes and drops share (:mod:`worker.write_versions`), and a drop clears the
settings only if they are older than it: a change accepted after a drop was accepted
survives the drop's task, whichever runs first.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis
from pydantic import ValidationError

from worker.constants import INDEX_SETTINGS_KEY, INDEX_SETTINGS_TTL_SECONDS
from worker.contract import FusionSpec
from worker.core.catalog import SearchSettings, merge_patch
from worker.errors import InvalidRequest
from worker.redis_client import QUICK_SOCKET_TIMEOUT, connect
from worker.write_versions import next_write_version

# Drop the settings only if they are no newer than the drop (ARGV[1]: its version).
_CLEAR = """
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
if tonumber(ARGV[1]) == nil or (cjson.decode(held)['version'] or 0) <= tonumber(ARGV[1]) then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def settings_key(index: str, tenant: str) -> str:
    return f"{INDEX_SETTINGS_KEY}{tenant}:{index}"


class RedisIndexSettings:
    """The :class:`~worker.core.ports.IndexSettingsSource` port, and the writes behind
    ``PATCH /v1/indexes/{index}`` and an index's drop. Thread-safe."""

    def __init__(
        self,
        client: redis.Redis,
        ttl_seconds: float = INDEX_SETTINGS_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = client
        self._ttl = ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], tuple[float, SearchSettings]] = {}
        self._forgotten = 0  # bumped by forget: a read that began before it is not cached
        self._clear = client.register_script(_CLEAR)

    @classmethod
    def from_url(cls, url: str, outage_seconds: float = 0.0) -> RedisIndexSettings:
        """Settings on ``url``; a worker's ride out a Redis restart (``outage_seconds``)."""
        return cls(connect(url, outage_seconds=outage_seconds, socket_timeout=QUICK_SOCKET_TIMEOUT))

    def get(self, index: str, tenant: str) -> SearchSettings:
        """The settings a search uses: at most ``ttl_seconds`` old."""
        key = (index, tenant)
        now = self._clock()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < self._ttl:
            return cached[1]
        forgotten = self._forgotten
        found = self.read(index, tenant)
        with self._lock:
            if len(self._cache) > 10_000:  # many indexes: start again rather than grow
                self._cache.clear()
            if forgotten == self._forgotten:  # else this process changed them meanwhile
                self._cache[key] = (now, found)
        return found

    def read(self, index: str, tenant: str) -> SearchSettings:
        """The settings as stored now (no cache): what the index's metadata shows."""
        return _parse(self._redis.get(settings_key(index, tenant)))

    def read_many(self, indexes: Sequence[str], tenant: str) -> list[SearchSettings]:
        """Each index's settings, in one ``MGET``."""
        if not indexes:
            return []
        raw = self._redis.mget([settings_key(i, tenant) for i in indexes])
        return [_parse(r) for r in raw]

    def update(self, index: str, tenant: str, patch: Mapping[str, Any]) -> SearchSettings:
        """Apply a JSON Merge Patch (``null`` clears a field) and store the result with a new
        write version; raises InvalidRequest when the result is not valid settings (every
        weight 0, say). The caller checks first that the tenant has the index."""
        key = settings_key(index, tenant)
        with self._redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]
                    merged = merge_patch(_parse(pipe.get(key)).stored, patch)
                    _check(merged)
                    version = next_write_version(self._redis, tenant)
                    pipe.multi()
                    if merged:
                        pipe.set(key, json.dumps({"settings": merged, "version": version}))
                    else:  # every field back to its default: nothing to keep
                        pipe.delete(key)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        self.forget(index, tenant)
        return SearchSettings(merged)

    def clear(self, index: str, tenant: str, version: int | None) -> None:
        """The tenant's index was dropped (at write ``version``): its settings go, unless a
        change accepted after the drop holds them."""
        self._clear(keys=[settings_key(index, tenant)], args=["" if version is None else version])
        self.forget(index, tenant)

    def forget(self, index: str, tenant: str) -> None:
        with self._lock:
            self._forgotten += 1
            self._cache.pop((index, tenant), None)


def _parse(raw: bytes | str | None) -> SearchSettings:
    if raw is None:
        return SearchSettings()
    return SearchSettings(json.loads(raw).get("settings") or {})


def _check(merged: Mapping[str, Any]) -> None:
    """Merged settings must still be valid (a patch is valid alone, not always with what it
    lands on: ``bm25: 0`` over a stored ``knn: 0``)."""
    try:
        FusionSpec.model_validate(merged.get("fusion") or {})
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(["fusion", *(str(p) for p in error["loc"])])
        raise InvalidRequest(field, error["msg"].removeprefix("Value error, ")) from exc

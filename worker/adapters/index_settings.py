"""An index's own search settings: weighted RRF and the candidate window (issue 15).

Where: in the backend, beside the index's documents (the embedded backend's SQLite file, an
Elasticsearch index of settings: :class:`~worker.core.ports.IndexSettingsStorage`), so they
last exactly as long as the index's data. Redis can come back empty (run without
persistence, or the last second of an AOF ``everysec`` lost with its machine); settings kept
there were lost with it, and the tenant's searches silently ran at the defaults. Redis still
gives each change its write version (:mod:`worker.write_versions`, never below the server's
clock, so above every version stored before a restart) and the lock that keeps two changes
of one index from reading the same settings. Settings an earlier release kept in Redis
(``sift:index-settings:<tenant>:<index>``) are read where the backend holds none, until the
next change or clear of the index.

Why a short cache: a search reads its index's settings once; each worker process keeps
what it read for ``INDEX_SETTINGS_TTL_SECONDS`` (2 s), so a busy index costs one backend read
per process every 2 s, not one per search. A change is seen at once by the process that
made it (it drops its copy), by the others within the TTL.

Ordering with a drop: every change takes a write version from the tenant's counter that its
upserts, deletes and drops share, the backend stores settings only over older ones, and a
drop clears them (a record of ``None`` at the drop's version) only if they are older than
it: a change accepted after a drop was accepted survives the drop's task, whichever runs
first. A change and a clear of one index hold a lock in Redis while they read and store (a
change reads the settings it merges into); a change that finds newer settings stored when it
stores (a clear that ran without the lock) reads them again, with a new version.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import redis
from pydantic import ValidationError
from redis.exceptions import LockError

from worker.clock import server_seconds
from worker.constants import (
    INDEX_SETTINGS_KEY,
    INDEX_SETTINGS_LOCK_KEY,
    INDEX_SETTINGS_LOCK_SECONDS,
    INDEX_SETTINGS_TTL_SECONDS,
)
from worker.contract import FusionSpec
from worker.core.catalog import SearchSettings, merge_patch
from worker.core.ports import IndexSettingsStorage
from worker.errors import BackendUnavailable, InvalidRequest, validation_message
from worker.redis_client import QUICK_SOCKET_TIMEOUT, connect
from worker.write_versions import next_write_version

#: How many times a change reads, merges and stores before it gives up (each store refused
#: means a newer clear landed meanwhile, which can happen once without the lock).
UPDATE_ATTEMPTS = 5
#: How long a change or clear waits for the index's settings lock before it gives up.
LOCK_WAIT_SECONDS = 10.0

# An earlier release's settings in Redis go only if no newer than the clear (ARGV[1]).
_CLEAR = """
local held = redis.call('GET', KEYS[1])
if not held then return 0 end
if tonumber(ARGV[1]) == nil or (cjson.decode(held)['version'] or 0) <= tonumber(ARGV[1]) then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def settings_key(index: str, tenant: str) -> str:
    """Where an earlier release kept the tenant's index's settings in Redis."""
    return f"{INDEX_SETTINGS_KEY}{tenant}:{index}"


class IndexSettingsStore:
    """The :class:`~worker.core.ports.IndexSettingsSource` port, and the writes behind
    ``PATCH /v1/indexes/{index}`` and an index's drop: the settings in ``storage`` (the
    backend), versions and the lock in Redis. Thread-safe."""

    def __init__(
        self,
        storage: IndexSettingsStorage,
        client: redis.Redis,
        ttl_seconds: float = INDEX_SETTINGS_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._storage = storage
        self._redis = client
        self._ttl = ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], tuple[float, SearchSettings]] = {}
        self._forgotten = 0  # bumped by forget: a read that began before it is not cached
        self._clear = client.register_script(_CLEAR)

    @classmethod
    def from_url(
        cls, storage: IndexSettingsStorage, url: str, outage_seconds: float = 0.0
    ) -> IndexSettingsStore:
        """Settings in ``storage``, versions on ``url``; a worker's ride out a Redis restart
        (``outage_seconds``)."""
        client = connect(url, outage_seconds=outage_seconds, socket_timeout=QUICK_SOCKET_TIMEOUT)
        return cls(storage, client)

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
        return self.read_many([index], tenant)[0]

    def read_many(self, indexes: Sequence[str], tenant: str) -> list[SearchSettings]:
        """Each index's settings, in one backend read (and one ``MGET`` for those it has
        none of)."""
        return [SearchSettings(settings or {}) for settings, _ in self._held(indexes, tenant)]

    def update(
        self, index: str, tenant: str, patch: Mapping[str, Any], *, lock_by: float = 0.0
    ) -> SearchSettings:
        """Apply a JSON Merge Patch (``null`` clears a field) and store the result with a new
        write version; raises InvalidRequest when the result is not valid settings (every
        weight 0, say). The caller checks first that the tenant has the index. ``lock_by``
        (epoch seconds on Redis's clock, 0: none): the lock not had by then, the change gives
        up unapplied (its gateway stops waiting soon after: the change must not land once it
        has)."""
        with self._locked(index, tenant, lock_by):
            for _ in range(UPDATE_ATTEMPTS):
                ((held, _),) = self._held([index], tenant)
                merged = merge_patch(held or {}, patch)
                _check(merged)
                version = next_write_version(self._redis, tenant)
                if self._storage.store_settings(index, tenant, merged, version):
                    break  # else a clear newer than this read ran meanwhile: read it
            else:  # the backend holds a version above the counter's (Redis's clock set back)
                raise BackendUnavailable(
                    f"index {index!r}: its settings hold a newer write version; try again"
                )
            self._redis.delete(settings_key(index, tenant))  # an earlier release's copy
        self.forget(index, tenant)
        return SearchSettings(merged)

    def clear(self, index: str, tenant: str, version: int | None) -> None:
        """The tenant's index was dropped (at write ``version``): its settings go, unless a
        change accepted after the drop holds them."""
        with self._locked(index, tenant):
            ((settings, held),) = self._held([index], tenant)
            at = next_write_version(self._redis, tenant) if version is None else version
            if settings is not None and held <= at:
                self._storage.store_settings(index, tenant, None, at)
            self._clear(keys=[settings_key(index, tenant)], args=[at])
        self.forget(index, tenant)

    def forget(self, index: str, tenant: str) -> None:
        with self._lock:
            self._forgotten += 1
            self._cache.pop((index, tenant), None)

    def _held(self, indexes: Sequence[str], tenant: str) -> list[tuple[dict[str, Any] | None, int]]:
        """For each index, the settings stored (None: none) and their version (0: never
        stored): the backend's, else an earlier release's in Redis."""
        if not indexes:
            return []
        stored = self._storage.stored_settings(indexes, tenant)
        missing = [index for index, found in zip(indexes, stored, strict=True) if found is None]
        raw = self._redis.mget([settings_key(i, tenant) for i in missing]) if missing else []
        earlier = dict(zip(missing, raw, strict=True))
        pairs = zip(indexes, stored, strict=True)
        return [found or _earlier(earlier.get(index)) for index, found in pairs]

    @contextmanager
    def _locked(self, index: str, tenant: str, by: float = 0.0) -> Iterator[None]:
        """The index's settings lock: one change or clear at a time reads and stores. Waited
        for at most ``LOCK_WAIT_SECONDS``, and never past ``by`` (epoch seconds on Redis's
        clock, the gateway's deadline: this host's own may be seconds off it) if given."""
        name = f"{INDEX_SETTINGS_LOCK_KEY}{tenant}:{index}"
        wait = LOCK_WAIT_SECONDS
        if by:
            now = server_seconds(self._redis.time())
            wait = min(LOCK_WAIT_SECONDS, max(0.0, by - now))
        lock = self._redis.lock(name, timeout=INDEX_SETTINGS_LOCK_SECONDS, blocking_timeout=wait)
        if not lock.acquire():
            raise BackendUnavailable(f"index {index!r}: its settings are being changed")
        try:
            yield
        finally:
            with suppress(LockError):  # held past its timeout: another may hold it now
                lock.release()


def _earlier(raw: bytes | str | None) -> tuple[dict[str, Any] | None, int]:
    """An earlier release's record in Redis, ``{"settings": ..., "version": ...}``."""
    if raw is None:
        return None, 0
    held = json.loads(raw)
    return held.get("settings") or None, int(held.get("version") or 0)


def _check(merged: Mapping[str, Any]) -> None:
    """Merged settings must still be valid (a patch is valid alone, not always with what it
    lands on: ``bm25: 0`` over a stored ``knn: 0``)."""
    try:
        FusionSpec.model_validate(merged.get("fusion") or {})
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(["fusion", *(str(p) for p in error["loc"])])
        raise InvalidRequest(field, validation_message(error["msg"])) from exc

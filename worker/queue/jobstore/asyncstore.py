"""The gateway's store on ``redis.asyncio``: a search's create, the in-flight gauge and the wait
for an index read's answer, with the same scripts and arguments as the threaded
:class:`~worker.queue.jobstore.JobStore`.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ConstantBackoff

from worker.clock import server_seconds
from worker.constants import (
    BACKLOG_HELD_KEY,
    BACKLOG_HOLDS_KEY,
    INDEX_REPLY_WAITS,
    RESULT_TTL_SECONDS,
    STATS_KEY,
)
from worker.contract import SearchSpec
from worker.queue.jobstore.idempotency import IdempotencyRef
from worker.queue.jobstore.lifecycle import (
    MIN_REPLY_SLICE_SECONDS,
    index_size_key,
    index_size_of,
    reply_slice_seconds,
)
from worker.queue.jobstore.records import Enqueue, SearchJob, _in_flight
from worker.queue.jobstore.scripts import _CREATE_SEARCH
from worker.queue.jobstore.searches import _create_search_call, _new_search, _search_created
from worker.queue.jobstore.store import resending_async
from worker.redis_client import CONNECTION_OPTIONS

# The backlog's admission, for every gateway at once: the queued count the store keeps plus
# what gateways admitted and are still storing (holds that lapse, a dead gateway's too),
# against the limit; within it, a hold of the items is added. Answers -1 (admitted) or the
# count that refused them.
_HOLD_BACKLOG = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms)
for _, token in ipairs(lapsed) do
  redis.call('ZREM', KEYS[2], token)
  redis.call('HDEL', KEYS[3], token)
end
local queued = math.max(0, tonumber(redis.call('HGET', KEYS[1], 'queued') or '0'))
for _, held in ipairs(redis.call('HVALS', KEYS[3])) do
  queued = queued + tonumber(held)
end
local items = tonumber(ARGV[2])
if queued + items > tonumber(ARGV[3]) then
  return queued
end
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[4]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], items)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return -1
"""

# what a command is tried again on, once (see from_url)
RETRIED: tuple[type[redis.RedisError], ...] = (redis.ConnectionError,)


class AsyncJobStore:
    """The gateway's hot path on ``redis.asyncio``: no thread per request. It runs the same
    scripts with the same arguments as :class:`JobStore` (``_create_search_call``).

    store = AsyncJobStore.from_url("redis://localhost:6379/0", max_connections=128)
    job = await store.create_search("acme", spec, enqueue=outbox.messages_for(...))
    answer = await store.await_reply(key, 10.0)  # an index read's, or None
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        result_ttl: int = RESULT_TTL_SECONDS,
        reply_waits: int = INDEX_REPLY_WAITS,
    ) -> None:
        self.redis = client
        self.result_ttl = result_ttl
        self._create_search = client.register_script(_CREATE_SEARCH)
        self._hold_backlog = client.register_script(_HOLD_BACKLOG)
        # the connections index reads' BLPOPs take at once; the rest stay the searches'
        self._reply_waits = asyncio.Semaphore(reply_waits)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        max_connections: int = 128,
        socket_timeout: float | None = None,
        result_ttl: int = RESULT_TTL_SECONDS,
    ) -> AsyncJobStore:
        """A store on ``url``; a request that finds every connection busy waits for one
        (up to 20 s), as :meth:`JobStore.from_url` with ``max_connections`` does.
        ``socket_timeout`` replaces the 30 s of ``CONNECTION_OPTIONS``.

        A command that meets a broken connection (a refused connect, a failed health check,
        a reset) is tried once more, on a new connection, 50 ms later. That is safe for what
        this store sends: the ``in_flight`` read, and the create script, which does nothing
        when its record exists (its first try ran; only the reply was lost), and which
        :meth:`create_search` sends again for
        :data:`~worker.queue.jobstore.store.RESEND_SECONDS`. A timeout is not tried again
        at once: a server that did not answer one connection in time answers no sooner on
        another (it made a stalled Redis's 503 wait two timeouts)."""
        options = dict(CONNECTION_OPTIONS)
        if socket_timeout is not None:
            options["socket_timeout"] = socket_timeout
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=20,
            retry=AsyncRetry(ConstantBackoff(0.05), retries=1, supported_errors=RETRIED),
            retry_on_error=list(RETRIED),
            **options,
        )
        return cls(redis.asyncio.Redis(connection_pool=pool), result_ttl=result_ttl)

    async def close(self) -> None:
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()

    async def create_search(
        self,
        tenant: str,
        spec: SearchSpec,
        *,
        webhook_url: str | None = None,
        enqueue: Enqueue | None = None,
        claim: IdempotencyRef | None = None,
        owed_bytes: int = 0,
    ) -> SearchJob:
        """:meth:`JobStore.create_search`, awaited."""
        job = _new_search(tenant, spec, webhook_url)
        keys, args = _create_search_call(job, self.result_ttl, enqueue, claim, owed_bytes)
        async for attempt in resending_async():
            with attempt:
                reply = await self._create_search(keys=keys, args=args)
        return _search_created(job, reply, claim)

    async def memory(self) -> tuple[int, int]:
        """What Redis holds and its ``maxmemory`` (0: no limit), in bytes."""
        info = await self.redis.info("memory")
        return int(info["used_memory"]), int(info.get("maxmemory", 0))

    async def server_time(self) -> float:
        """:meth:`JobStore.server_time`, awaited: Redis's clock, which the workers read too."""
        return server_seconds(await self.redis.time())

    async def in_flight(self) -> dict[str, int]:
        """:meth:`JobStore.in_flight`, awaited."""
        return _in_flight(cast(dict[str, str], await self.redis.hgetall(STATS_KEY)))

    async def hold_backlog(self, token: str, items: int, limit: int, seconds: float) -> int | None:
        """Hold ``items`` searches and batch items under ``token`` for at most ``seconds``
        (while their job is stored) if the queued ones, with every gateway's holds, leave room
        for them under ``limit``: None; else the count that refused them, holding nothing."""
        keys = [STATS_KEY, BACKLOG_HOLDS_KEY, BACKLOG_HELD_KEY]
        args: list[str | int] = [token, items, limit, max(1, int(seconds * 1000))]
        queued = int(await self._hold_backlog(keys=keys, args=args))
        return None if queued < 0 else queued

    async def release_backlog(self, token: str) -> None:
        """Drop the hold :meth:`hold_backlog` took under ``token`` (its job stored, or not)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrem(BACKLOG_HOLDS_KEY, token)
            pipe.hdel(BACKLOG_HELD_KEY, token)
            await pipe.execute()

    async def owed_bytes(self) -> int:
        """What the searches and batch items queued or running will still write, each priced
        as the gateway admitted it (``owed_bytes`` in ``sift:stats:jobs``)."""
        return max(0, int(await self.redis.hget(STATS_KEY, "owed_bytes") or 0))

    async def index_size(self, tenant: str, index: str) -> tuple[int, int] | None:
        """The documents of the tenant's index and their stored bytes, as a worker recorded
        them after its last write job (:meth:`JobStore.record_index_size`); None: unknown."""
        raw = await self.redis.hmget(index_size_key(tenant, index), ["documents", "bytes"])
        return index_size_of(cast(list[str | None], raw))

    async def await_reply(self, key: str, timeout: float) -> str | None:
        """The answer to one index read (:meth:`JobStore.reply`), or None if none came within
        ``timeout`` seconds, in ``BLPOP``s of :func:`reply_slice_seconds`. It holds no thread
        while it waits (a wait on a thread held one of the 40 that ``/readyz`` and every
        blocking call share), and a connection only for a slice, one of ``reply_waits`` at
        most; a slice waits its turn within ``timeout``."""
        kwargs = self.redis.connection_pool.connection_kwargs
        longest = reply_slice_seconds(kwargs.get("socket_timeout"))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                async with asyncio.timeout(left):
                    await self._reply_waits.acquire()
            except TimeoutError:
                return None
            try:
                left = deadline - time.monotonic()
                slice_ = max(MIN_REPLY_SLICE_SECONDS, min(left, longest))
                found = cast(list[str] | None, await self.redis.blpop([key], timeout=slice_))
            finally:
                self._reply_waits.release()
            if found is not None:
                return found[1]
        return None

"""How every worker-side Redis client connects: one set of options, and riding out a restart.

The job store, each index's settings and the shared rate budget all sit on the search path, so
each must survive what the store survives: a Redis restart under a running batch. With
``outage_seconds``, a command that meets a refused or broken connection is retried, backing
off from 50 ms to 1 s, for about that long, instead of failing the search it serves.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

# Text replies, and no call left hanging on a dead connection. Maintenance notifications (a
# Redis Enterprise/Cloud feature, on by default with RESP3 in redis-py 8) make the pool skip
# its check-out probe, so redis.asyncio 8.1 hands out a connection the server closed
# (redis/redis-py#4252; the sync pool with hiredis: #4128): the first command after a Redis
# restart failed. Off, a closed connection is replaced before anything is written to it.
CONNECTION_OPTIONS: dict[str, Any] = {
    "decode_responses": True,
    "socket_connect_timeout": 5,
    "socket_timeout": 30,
    "health_check_interval": 30,
    "maint_notifications_config": MaintNotificationsConfig(enabled=False),
}

# How long a worker's clients keep retrying a refused or broken connection (a restart).
OUTAGE_SECONDS = 30.0


def connect(
    url: str, *, max_connections: int | None = None, outage_seconds: float = 0.0
) -> redis.Redis:
    """A client on ``url``. With ``max_connections``, a thread that finds every connection
    busy waits for one (up to 20 s) instead of failing its job. With ``outage_seconds``,
    a refused or broken connection is retried for about that long (redis-py's default
    otherwise: 3 quick retries).

    >>> client = connect("redis://127.0.0.1:1/0", outage_seconds=2)
    >>> client.get_retry()._retries
    6
    """
    options: dict[str, Any] = dict(CONNECTION_OPTIONS)
    if outage_seconds > 0:
        # 0.05 + 0.1 + 0.2 + 0.4 + 0.8 s, then 1 s a retry
        options["retry"] = Retry(
            ExponentialBackoff(cap=1.0, base=0.05), retries=int(outage_seconds) + 4
        )
    if max_connections is None:
        return redis.Redis.from_url(url, **options)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=20, **options
    )
    return redis.Redis(connection_pool=pool)

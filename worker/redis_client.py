"""How every worker-side Redis client connects: one set of options, and riding out a restart.

The job store, each index's settings and the shared rate budget all sit on the search path, so
each must survive what the store survives: a Redis restart under a running batch. With
``outage_seconds``, a command that meets a refused, broken or silent connection is retried,
backing off from 50 ms to 1 s, until that much time has passed since its first try, instead of
failing the search it serves. The bound is on time, not on a count of tries: redis-py's own
``Retry`` counts tries, and a try against a server that accepts connections but never answers
waits a whole socket timeout (nested, as its connect retries its handshake too), so a count
sized for a restart would hold a call for hours there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

if TYPE_CHECKING:
    from worker.settings import Settings

T = TypeVar("T")

log = logging.getLogger(__name__)

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

# How long a worker's clients keep retrying a refused, broken or silent connection (a restart).
OUTAGE_SECONDS = 30.0
# The socket timeout of a client whose commands all answer in under a millisecond (an
# index's settings, a rate-budget reservation): a silent server is found out in 5 s, not 30.
QUICK_SOCKET_TIMEOUT = 5.0


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis unreachable (a refused, broken or silent connection: down,
    restarting, loading its data), not Redis answering with an error.

    >>> unreachable(redis.ConnectionError("refused")), unreachable(redis.ResponseError("OOM"))
    (True, False)
    """
    return isinstance(exc, redis.ConnectionError | redis.TimeoutError)


def worker_connections(settings: Settings) -> int:
    """How many connections a worker process's client may need at once: one for each of its
    threads (Celery's and the batch items'), and a few for its own loops. A thread that finds
    every one busy waits for one rather than failing its job (redis-py's default pool stops
    at 100)."""
    return settings.worker_concurrency + settings.batch_item_concurrency + 32


class OutageRetry(Retry):
    """redis-py's retry, bounded by time: tries until ``seconds`` have passed since the first
    (tenacity's loop; each failure goes to redis-py's ``fail`` handler, which drops the
    connection, as its own loop does).

    >>> calls = []
    >>> def down() -> None:
    ...     calls.append(1)
    ...     raise redis.ConnectionError("refused")
    >>> OutageRetry(0.2).call_with_retry(down, lambda error: None)
    Traceback (most recent call last):
    redis.exceptions.ConnectionError: refused
    >>> 2 <= len(calls) <= 5  # 50, 100 ms... backoff until 0.2 s had passed
    True
    """

    def __init__(self, seconds: float) -> None:
        super().__init__(NoBackoff(), retries=-1)
        self.seconds = seconds

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        failures = 0

        def once() -> T:
            nonlocal failures
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise _Final(error) from error
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                raise

        retrying = Retrying(
            retry=retry_if_exception_type(self._supported_errors),
            stop=stop_after_delay(self.seconds),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            reraise=True,
        )
        try:
            return retrying(once)
        except _Final as final:
            raise final.error from None


#: How Redis refuses the SELECT of a database it does not have (past its ``databases``)
DB_OUT_OF_RANGE = "DB index is out of range"

#: What the gateway and the workers say of a Redis refusing writes it cannot persist
CANNOT_PERSIST = "Redis cannot persist to its disk (MISCONF: its last AOF write or RDB save failed)"


def cannot_persist(exc: BaseException) -> bool:
    """Whether Redis refused a command because it cannot persist to its disk: its AOF
    write failed (the disk full, most often) or, with a save point set, its last RDB save
    did, and it refuses every write, and PING, until one succeeds (``MISCONF``). A passing
    state, as its ``maxmemory``, for which redis-py has a class where it has none for this:
    a plain ResponseError, known by its code.

    >>> cannot_persist(redis.ResponseError("MISCONF Errors writing to the AOF file: No space"))
    True
    >>> cannot_persist(redis.ResponseError("WRONGTYPE Operation against a key"))
    False
    """
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("MISCONF")


#: How Redis 7.0 and 7.1 word a command their ACL refuses a script (``ERR``); 7.2 says NOPERM
SCRIPT_ACL_REFUSAL = "The user executing the script "


def acl_refused(exc: BaseException) -> bool:
    """Whether Redis's ACL refused the URL's user a command or a key: ``NOPERM`` (redis-py's
    NoPermissionError), or in a script, on Redis 7.0 and 7.1, an ``ERR`` in their words.
    A deployment's setting, as a refused password is, not a bug.

    >>> acl_refused(redis.exceptions.NoPermissionError("User sift has no permissions"))
    True
    >>> acl_refused(redis.ResponseError("The user executing the script can't run this command"))
    True
    >>> acl_refused(redis.ResponseError("WRONGTYPE Operation against a key"))
    False
    """
    return isinstance(exc, redis.exceptions.NoPermissionError) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith(SCRIPT_ACL_REFUSAL)
    )


def refused_database(url: str) -> str | None:
    """Redis's refusal of the connection ``url`` describes: of its database (``DB index is
    out of range``, past the server's ``databases``; SELECT in cluster mode; an ACL's
    NOPERM), or None. One PING is sent, without waiting (redis-py's quick retries of a
    connect aside): a Redis that does not answer, or not yet, is no refusal
    (None), since a worker started before its Redis waits for it.

    >>> refused_database("redis://127.0.0.1:1/99") is None  # nothing listens there
    True
    """
    client = connect(url)
    try:
        client.ping()  # its connection's handshake: AUTH, then SELECT of any database but 0
    except redis.ResponseError as error:
        return str(error)
    except redis.RedisError:  # down, silent, a wrong password: Celery says so as it retries
        return None
    finally:
        client.close()
    return None


#: How long a start-up check waits on each reply: a Redis that accepts and never answers
#: (stopped) holds a gateway's or worker's start this long a try, not the 30 s of a job's
START_CHECK_TIMEOUT_SECONDS = 5.0


def unanswered(url: str) -> str | None:
    """Why the Redis of ``url`` gives the start checks no answer yet, or None once it does.
    Unanswered: a ``PING`` that cannot connect, goes unanswered for
    :data:`START_CHECK_TIMEOUT_SECONDS`, meets a Redis still loading its data, or is refused
    its password (a user not made yet, or a wrong password, which Celery would retry the
    same). Any other reply, a refusal included (a database Redis does not have), is an
    answer: the checks read it. They each take no answer for no refusal, so a gateway or worker
    that ran them before its Redis answered skipped them all (:func:`refused_channels`).

    >>> unanswered("redis://127.0.0.1:1/0") is not None  # nothing listens there
    True
    """
    client = connect(url, socket_timeout=START_CHECK_TIMEOUT_SECONDS)
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError) as error:  # auth and loading are these
        return str(error) or type(error).__name__
    except redis.RedisError:
        return None
    finally:
        client.close()
    return None


def refused_channels(url: str) -> str | None:
    """Redis's refusal of the Pub/Sub channel Celery's remote control subscribes to (kombu's
    fanout, ``/<db>.celery.pidbox``), or None: an ACL user without channels (no ``&*``; Redis
    7's ``acl-pubsub-default`` is ``resetchannels``) has each worker process die on its
    ``PSUBSCRIBE``. The probe is that ``PSUBSCRIBE`` itself, let go at once: a ``PUBLISH``
    would hand live workers a message, and ``ACL DRYRUN`` is often refused to such users.
    A Redis not answering is no refusal, as for :func:`refused_database`.

    >>> refused_channels("redis://127.0.0.1:1/0") is None  # nothing listens there
    True
    """
    client = connect(url, socket_timeout=START_CHECK_TIMEOUT_SECONDS)
    pubsub = client.pubsub()
    db = client.connection_pool.connection_kwargs.get("db", 0)
    try:
        pubsub.psubscribe(f"/{db}.celery.pidbox")
        pubsub.get_message(timeout=5)  # its reply: the refusal is raised here
    except redis.ResponseError as error:
        return str(error)
    except redis.RedisError:
        return None
    finally:
        pubsub.close()
        client.close()
    return None


#: The one ``maxmemory-policy`` Sift runs on: the job store and the broker keep every key
NOEVICTION = "noeviction"

#: What a gateway or worker says, once, of a Redis user that may not run ``INFO``
INFO_REFUSED_AT_START = (
    "this Redis user may not run INFO: its maxmemory-policy (must be noeviction) and its "
    "persistence (appendonly) go unchecked"
)

_info_refused_said = False


def info_at_start(url: str, section: str) -> dict[str, Any] | None:
    """Redis's ``INFO section``, read once as a gateway or worker starts, or None: Redis not
    answering (yet: a gateway or worker waits for it), or a user that may not run ``INFO``
    (said once at WARNING, :data:`INFO_REFUSED_AT_START`; a managed service's restricted
    role). INFO, not CONFIG GET: it answers where a managed service renames or refuses CONFIG.

    >>> info_at_start("redis://127.0.0.1:1/0", "memory") is None  # nothing listens there
    True
    """
    global _info_refused_said
    client = connect(url, socket_timeout=START_CHECK_TIMEOUT_SECONDS)
    try:
        return dict(client.info(section))
    except redis.exceptions.NoPermissionError:
        if not _info_refused_said:
            _info_refused_said = True
            log.warning(INFO_REFUSED_AT_START)
        return None
    except redis.RedisError:
        return None
    finally:
        client.close()


def evicting_policy(info: dict[str, Any] | None) -> str | None:
    """The ``maxmemory_policy`` of ``INFO memory``'s ``info`` when it is not ``noeviction``
    (Redis would drop keys when full: accepted jobs, results, a live worker's heartbeat),
    else None. Whether it drops any now is :func:`has_memory_limit`'s.

    >>> evicting_policy({"maxmemory_policy": "allkeys-lru"})
    'allkeys-lru'
    >>> evicting_policy({"maxmemory_policy": "noeviction"}) is None
    True
    >>> evicting_policy(None) is None  # INFO refused, or Redis not answering
    True
    """
    policy = (info or {}).get("maxmemory_policy")
    return None if policy in (None, NOEVICTION) else str(policy)


#: The oldest Redis Sift runs on: its scripts declare flags (``#!lua flags=allow-oom``: a run's
#: claim let go on a full Redis), which Redis 6 cannot load.
OLDEST_REDIS = (7, 0)


def too_old(info: dict[str, Any] | None) -> str | None:
    """The ``redis_version`` of ``INFO server``'s ``info`` when it is older than
    :data:`OLDEST_REDIS`, else None (unknown too: INFO refused, or Redis not answering).

    >>> too_old({"redis_version": "6.2.14"}), too_old({"redis_version": "7.0.15"})
    ('6.2.14', None)
    >>> too_old({"redis_version": "10.0.0"}), too_old(None)
    (None, None)
    """
    version = str((info or {}).get("redis_version", ""))
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    return version if len(parts) == 2 and parts < OLDEST_REDIS else None


def has_memory_limit(info: dict[str, Any] | None) -> bool:
    """Whether ``INFO memory``'s ``info`` gives Redis a ``maxmemory``: with none (0, Redis's
    default) it is never full, so no policy evicts anything (until one is set).

    >>> has_memory_limit({"maxmemory": 2147483648}), has_memory_limit({"maxmemory": 0})
    (True, False)
    >>> has_memory_limit(None)  # INFO refused, or Redis not answering: nothing known
    False
    """
    return int((info or {}).get("maxmemory", 0)) > 0


def keeps_no_aof(info: dict[str, Any] | None) -> bool:
    """Whether ``INFO persistence``'s ``info`` says Redis keeps no AOF (``appendonly no``): a
    restart of it loses what its last RDB snapshot missed, everything with none (``save ""``).
    Not refused (a dev Redis may run so), only said: see the caller.

    >>> keeps_no_aof({"aof_enabled": 0}), keeps_no_aof({"aof_enabled": 1})
    (True, False)
    >>> keeps_no_aof(None)  # INFO refused, or Redis not answering: nothing known
    False
    """
    return info is not None and not int(info.get("aof_enabled", 1))


class _Final(Exception):
    """An error redis-py's ``is_retryable`` refused: raised at once, as itself."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def connect(
    url: str,
    *,
    max_connections: int | None = None,
    outage_seconds: float = 0.0,
    socket_timeout: float | None = None,
) -> redis.Redis:
    """A client on ``url``. With ``max_connections``, a thread that finds every connection
    busy waits for one (up to 20 s) instead of failing its job. With ``outage_seconds``,
    a refused, broken or silent connection is retried for that long (redis-py's default
    otherwise: 3 quick retries). ``socket_timeout`` replaces the 30 s of
    :data:`CONNECTION_OPTIONS` (a client whose commands are all quick says so).

    >>> client = connect("redis://127.0.0.1:1/0", outage_seconds=2)
    >>> client.get_retry().seconds
    2
    """
    options: dict[str, Any] = dict(CONNECTION_OPTIONS)
    if outage_seconds > 0:
        options["retry"] = OutageRetry(outage_seconds)
    if socket_timeout is not None:
        options["socket_timeout"] = socket_timeout
    if max_connections is None:
        return redis.Redis.from_url(url, **options)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=20, **options
    )
    return redis.Redis(connection_pool=pool)

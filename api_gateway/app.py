"""The gateway's FastAPI app factory; clients are built in the lifespan, never at import.

`sift gateway` (``worker.cli.service``) runs :func:`serve` under uvicorn, with its start
checks of Redis (its version, ``maxmemory-policy``, AOF) and its wait for a Redis not up yet.
uvicorn run by hand serves the same routes with neither (no wait, nothing checked):

    uvicorn --factory api_gateway.app:create_app --port 8080 --timeout-keep-alive 75
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import redis
import redis.asyncio
from fastapi import APIRouter, FastAPI

from api_gateway.auth import KeyRing
from api_gateway.backpressure import Backlog, StoreMemory, with_results_owed
from api_gateway.bodies import document_bodies
from api_gateway.checks import EVERY_ROUTE
from api_gateway.docs import install_docs
from api_gateway.errors import install_error_handlers
from api_gateway.indexes import router as indexes_router
from api_gateway.jobs import router, stop_retakes
from api_gateway.listing import router as listing_router
from api_gateway.metrics import GatewayMetrics
from api_gateway.middleware import BodyLimitMiddleware, ForcedStopMiddleware, MetricsMiddleware
from api_gateway.ops import router as ops_router
from api_gateway.queue import OutboxSender
from api_gateway.routing import GetAnswersHead
from worker.clock import CLOCK, FIRST_READINGS, RECALIBRATE_SECONDS
from worker.constants import ALL_QUEUES
from worker.errors import ConfigError
from worker.observability.logcontext import configure_logging
from worker.observability.metrics import clock_skew, ensure_multiprocess_dir, preregister
from worker.queue.jobstore import AsyncJobStore, JobStore
from worker.settings import Settings, load_settings
from worker.webhooks.urlguard import LOOKUP_THREADS, LookupThreads

log = logging.getLogger(__name__)
REDIS_MAX_CONNECTIONS = 128
# how long the gateway waits for Redis's clock at its start before going on without it
CLOCK_READ_TIMEOUT_SECONDS = 2.0
# how long a /metrics scrape waits for each of its Redis reads (a few LLENs and counts, which
# answer in milliseconds), well inside Prometheus's default scrape timeout (10 s): at the
# gateway's own 10 s a silent Redis (stopped, cut off) would time every scrape out, `up` would
# read 0, and the NaN backlog SiftBacklogUnknown reads would never be scraped
METRICS_REDIS_TIMEOUT_SECONDS = 2.0


async def read_the_clock(store: AsyncJobStore, readings: int = 1) -> None:
    """Read Redis's clock into this process's shared clock (:mod:`worker.clock`), the
    surest of ``readings`` kept; a Redis down or slow leaves it as it was (the host's own
    clock before any reading)."""
    try:
        async with asyncio.timeout(CLOCK_READ_TIMEOUT_SECONDS):
            for _ in range(readings):
                clock_skew("gateway", await CLOCK.aread(store.redis.time))
    except (redis.RedisError, TimeoutError) as exc:
        log.debug("could not read Redis's clock: %s", exc)


async def keep_the_clock(store: AsyncJobStore) -> None:
    """Read Redis's clock again every :data:`~worker.clock.RECALIBRATE_SECONDS`, for as long
    as the gateway runs (the monotonic clock the reading is carried on drifts, slowly)."""
    while True:
        await asyncio.sleep(RECALIBRATE_SECONDS)
        await read_the_clock(store)


#: What ``/readyz`` answers (503) while ``sift gateway`` waits for its Redis and its start checks
STARTING = (
    "the gateway is starting: waiting for its Redis (SIFT_REDIS_URL) to answer and pass "
    "the start checks (its version, maxmemory-policy, AOF)"
)


async def ready_after(app: FastAPI, start_checks: Callable[[], bool], store: AsyncJobStore) -> None:
    """Keep ``/readyz`` at 503 (``app.state.starting``) until ``start_checks`` passes (true),
    then read Redis's clock and be ready. The checks wait for a Redis not answering, for as
    long as it takes, so they run on a daemon thread of their own: the gateway serves
    ``/healthz`` meanwhile, which an orchestrator's liveness and startup probes read (it
    served nothing, and was restarted past 120 s into a crash loop), and a stop meanwhile
    ends the process without waiting for them. A refusal (false) leaves it not ready: its
    caller has said why and stops it."""
    loop = asyncio.get_running_loop()
    passed: asyncio.Future[bool] = loop.create_future()

    def settle(ok: bool) -> None:
        if not passed.done():  # the task may be canceled: the gateway stopping
            passed.set_result(ok)

    def run() -> None:
        ok = start_checks()
        with contextlib.suppress(RuntimeError):  # the loop closed: the gateway stopped
            loop.call_soon_threadsafe(settle, ok)

    threading.Thread(target=run, name="sift-start-checks", daemon=True).start()
    if await passed:
        await read_the_clock(store, FIRST_READINGS)  # on the Redis that now answers
        app.state.starting = None


def create_app(
    settings: Settings | None = None,
    *,
    redis: redis.Redis | None = None,
    async_redis: redis.asyncio.Redis | None = None,
    start_checks: Callable[[], bool] | None = None,
) -> FastAPI:
    """Build the gateway. ``redis`` with ``async_redis`` (the same server; the submission
    hot path runs on the asyncio client) replace the real clients in tests. With
    ``start_checks`` (``sift gateway``'s wait for its Redis and its checks of it), the gateway
    is live at once and ready once they pass (:func:`ready_after`)."""
    settings = settings or load_settings()
    keyring = KeyRing(settings.all_api_keys())
    ensure_multiprocess_dir()  # deploy/k8s's emptyDir /tmp hides the image's folder
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not logging.getLogger().handlers:  # uvicorn sets up only its own loggers
            configure_logging(settings.log_level)
        store, async_store, metrics_store = _stores(settings, redis, async_redis)
        # the task messages go through the job store, in the record's MULTI
        sender = OutboxSender(store)
        if not len(keyring):
            log.warning(
                "no API keys configured (SIFT_API_KEYS, SIFT_API_KEYS_FILE): "
                "every request will be refused"
            )
        app.state.store = store
        app.state.metrics_store = metrics_store
        app.state.async_store = async_store
        app.state.backlog = Backlog(
            async_store.hold_backlog, async_store.release_backlog, settings.max_backlog
        )
        owed = with_results_owed(async_store.memory, async_store.owed_bytes)
        app.state.memory = StoreMemory(owed)
        app.state.sender = sender
        # cancel-count takes and Idempotency-Key releases sent again (api_gateway/jobs/)
        app.state.retakes = set()
        # webhook URLs' name lookups at registration, on threads of their own (api_gateway/jobs/)
        app.state.lookups = LookupThreads(LOOKUP_THREADS, "sift-gateway-dns")
        # a job's created_at on Redis's clock, which the workers time its start and end on
        checked = None
        if start_checks is None:
            await read_the_clock(async_store, FIRST_READINGS)
        else:
            checked = asyncio.create_task(ready_after(app, start_checks, async_store))
        clock_keeper = asyncio.create_task(keep_the_clock(async_store))
        try:
            yield
        finally:
            if checked is not None:
                checked.cancel()
            clock_keeper.cancel()
            await stop_retakes(app.state.retakes)
            app.state.lookups.close()
            sender.close()
            if redis is None:
                store.close()
                metrics_store.close()
                await async_store.close()

    app = FastAPI(
        title="Sift",
        version="1.0.0",
        summary="Queue-based hybrid search with a listwise LLM rerank",
        lifespan=lifespan,
        docs_url=None,  # served from local assets by install_docs
        redoc_url=None,
        # a path with a slash too many is a 404 naming it, not an empty 307 to the path
        # without it (which a client following redirects sent a DELETE on to)
        redirect_slashes=False,
        # a path with a last line break reached the route without it: a 404 instead (the
        # routers' routes have it among their own, api_gateway.checks)
        dependencies=EVERY_ROUTE,
    )
    app.router.route_class = GetAnswersHead  # the routers' own are too: HEAD wherever GET
    preregister(queues=ALL_QUEUES)
    app.state.settings = settings
    app.state.starting = None if start_checks is None else STARTING  # /readyz's 503 till then
    app.state.keyring = keyring
    app.state.metrics = metrics
    install_error_handlers(app)
    # the /v1 routes, each with the request checks (api_gateway.checks.V1_ROUTE)
    for routes in (router, listing_router, indexes_router):
        add_routes(app, routes)
    document_bodies(app)
    install_docs(app)
    add_routes(app, ops_router)  # /healthz, /readyz, /metrics: no request checks
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes, keyring=keyring)
    app.add_middleware(ForcedStopMiddleware)  # inside the metrics: its 503 is counted so
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    metrics.preregister((router, listing_router, indexes_router, ops_router))
    return app


def add_routes(app: FastAPI, router: APIRouter) -> None:
    """``router``'s routes onto ``app`` as they were built, each with its dependencies (its
    router's: :data:`~api_gateway.checks.V1_ROUTE` or
    :data:`~api_gateway.checks.EVERY_ROUTE`, the app's own among them). FastAPI's
    ``include_router`` builds every route included a second time, for the app, at its first
    request: about 60 ms of CPU in each gateway process, and in each app a test builds."""
    app.router.routes.extend(router.routes)


def serve(start_checks: Callable[[], bool] | None = None) -> FastAPI:
    """The app of a gateway process (``sift gateway``, which passes its ``start_checks``):
    :func:`create_app`, then what was built so far (the imports: some 80k objects) frozen out
    of the garbage collector's sight. A full collection then scans only what requests
    allocate, instead of stalling every request in flight for ~30 ms (the benchmark's p99
    went from 72 to 14 ms)."""
    app = create_app(start_checks=start_checks)
    gc.collect()
    gc.freeze()
    return app


def _stores(
    settings: Settings, redis: redis.Redis | None, async_redis: redis.asyncio.Redis | None
) -> tuple[JobStore, AsyncJobStore, JobStore]:
    """The gateway's job stores: on the clients a test passes, else on ``SIFT_REDIS_URL``; the
    third is the one ``/metrics`` reads, on a client of its own whose commands wait at most
    :data:`METRICS_REDIS_TIMEOUT_SECONDS` (a test's store, as it is)."""
    if redis is not None and async_redis is not None:
        kept = settings.result_retention_seconds
        store = JobStore(redis, result_ttl=kept)
        return store, AsyncJobStore(async_redis, result_ttl=kept), store
    if redis is not None or async_redis is not None:
        raise ConfigError("create_app: pass both redis and async_redis, or neither")
    if not settings.redis_url:
        raise ConfigError("SIFT_REDIS_URL is required to run the gateway")
    timeout = settings.gateway_redis_timeout_seconds
    kept, most = settings.result_retention_seconds, REDIS_MAX_CONNECTIONS
    store = JobStore.from_url(
        settings.redis_url, max_connections=most, socket_timeout=timeout, result_ttl=kept
    )
    async_store = AsyncJobStore.from_url(
        settings.redis_url, max_connections=most, socket_timeout=timeout, result_ttl=kept
    )
    scrape = min(timeout, METRICS_REDIS_TIMEOUT_SECONDS)
    metrics_store = JobStore.from_url(settings.redis_url, socket_timeout=scrape, result_ttl=kept)
    return store, async_store, metrics_store

"""The operations routes: ``/healthz`` (the process is up), ``/readyz`` (Redis answers, and
``sift gateway``'s start checks of it have passed) and ``/metrics`` (Prometheus), outside
``/v1`` and without the request checks."""

from __future__ import annotations

import logging

import redis
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from api_gateway.auth import require_metrics_token
from api_gateway.checks import EVERY_ROUTE
from api_gateway.errors import (
    UNAVAILABLE_RETRY_AFTER,
    ErrorBody,
    error_response,
    job_store_unavailable,
    public_unavailable_reason,
    unavailable_reason,
)
from api_gateway.metrics import GatewayMetrics
from api_gateway.routing import GetAnswersHead
from api_gateway.schemas import Health
from worker.constants import ALL_QUEUES, ERROR_STARTING
from worker.observability.metrics import (
    JOBS_IN_FLIGHT,
    job_store_unread,
    metrics_response,
    multiprocess_dir,
    provider_deletes_refused,
    update_backlog,
)
from worker.queue.jobstore import JobStore
from worker.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter(route_class=GetAnswersHead, dependencies=EVERY_ROUTE)

# Any failure of Redis, and a socket's own OSError: a probe answers "unavailable" and a scrape
# marks the store's gauges unread, whatever went wrong. Wider than deps.STORE_AWAY (a
# connection or timeout error only), which is what a request's read meets while Redis
# restarts and is answered 503; anything else there is a bug, left to the 500 handler.
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, OSError)


#: What the OpenAPI document says of ``/readyz``'s 503
READYZ_503 = (
    "Not ready, retry after `Retry-After` seconds, the message naming why: `starting`, "
    "`sift gateway` still waits for its Redis and its start checks; `unavailable`, Redis "
    "(the job store) is down, restarting, refused the URL's credentials or TLS handshake, "
    "or did not answer in time."
)


@router.get("/healthz", response_model=Health, tags=["ops"], summary="The process is up")
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Health,
    tags=["ops"],
    responses={503: {"model": ErrorBody, "description": READYZ_503}},
    summary="Redis answers",
)
async def readyz(request: Request) -> Response:
    if (starting := request.app.state.starting) is not None:  # sift gateway's start checks
        return error_response(503, ERROR_STARTING, starting, headers=UNAVAILABLE_RETRY_AFTER)
    store: JobStore = request.app.state.store
    try:
        await run_in_threadpool(store.ping)
    except REDIS_ERRORS as exc:
        log.warning("not ready: %s", unavailable_reason(request.app, exc))
        # the body its OpenAPI 503 declares, as every 503's: it was {"status": "unavailable"};
        # what Redis said stays in the log (the probe answers anyone)
        raise job_store_unavailable(public_unavailable_reason(request.app, exc)) from exc
    return Response(Health(status="ok").model_dump_json(), media_type="application/json")


@router.get(
    "/metrics",
    tags=["ops"],
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, 401: {"model": ErrorBody}},
    summary="Prometheus metrics (Bearer SIFT_METRICS_TOKEN when it is set)",
)
async def prometheus(request: Request) -> Response:
    settings: Settings = request.app.state.settings
    metrics: GatewayMetrics = request.app.state.metrics
    require_metrics_token(request, settings.metrics_token)
    store: JobStore = request.app.state.metrics_store

    def render() -> bytes:
        try:  # "queued", the backlog and the refused deletes are the store's to report
            JOBS_IN_FLIGHT.labels("queued").set(store.in_flight()["queued"])
            update_backlog(store.redis, ALL_QUEUES)
            provider_deletes_refused(store.refused_provider_batches())
        except REDIS_ERRORS as exc:
            log.warning("metrics: Redis unavailable: %s", exc)
            job_store_unread(ALL_QUEUES)  # unknown now, not the last values read
            provider_deletes_refused(None)
        shared, _ = metrics_response()
        if multiprocess_dir() is not None:
            # every value is in the files (its own HTTP metrics too): served once
            return shared
        return shared + generate_latest(metrics.registry)

    return Response(await run_in_threadpool(render), media_type=CONTENT_TYPE_LATEST)

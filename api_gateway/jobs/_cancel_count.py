"""Counting what a batch's cancel ended: the count's take, sent again while Redis is away."""

from __future__ import annotations

import asyncio
import logging
import os

import redis
from fastapi import Request
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from api_gateway.deps import job_store, off_loop
from worker.observability import metrics
from worker.queue.jobstore import JobStore

log = logging.getLogger(__package__)  # api_gateway.jobs: one logger for the job routes

# How long a gateway goes on sending a cancel's count take again, after the cancel's answer,
# when the take's own answer was not heard (Redis down past its 5 s): a Redis restart, or a
# failover, and then some. Past it, what that take took (if it ran) is never counted.
COUNT_RETAKE_SECONDS = 600.0


async def _count_cancel(request: Request, batch_id: str) -> None:
    """Count what the batch's cancels ended and no one has counted (this one's, and an
    earlier one's whose answer was lost). A take whose answer is not heard (Redis down past
    its 5 s of retries) may have run: then what it took is in no record, and the cancel's
    count message finds nothing. So it is sent again with its token until Redis answers it
    (:func:`_take_again`), in a task of the gateway's own (``app.state.retakes``), not the
    request's: the request is over (counted and timed) once answered, and a gateway told to
    stop does not wait for Redis (:func:`stop_retakes`)."""
    store, token = job_store(request), os.urandom(8).hex()
    try:
        items, completed = await off_loop(store.take_cancel_count, batch_id, token)
    except redis.RedisError as exc:
        log.warning("batch %s: the cancel's count is taken again later: %s", batch_id, exc)
        retakes: set[asyncio.Task[None]] = request.app.state.retakes
        task = asyncio.create_task(_take_again(store, batch_id, token))
        retakes.add(task)
        task.add_done_callback(retakes.discard)
        return
    metrics.cancel_counted(items, completed)


async def _take_again(store: JobStore, batch_id: str, token: str) -> None:
    """A take sent again with its token for :data:`COUNT_RETAKE_SECONDS`: answered what it
    took if it ran, and if it did not, it takes what the count message has not taken (that
    message's take, with a token of its own, then finds nothing): counted once either way."""
    try:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(redis.RedisError),
            stop=stop_after_delay(COUNT_RETAKE_SECONDS),
            wait=wait_fixed(1.0),
            reraise=True,
        ):
            with attempt:
                items, completed = await off_loop(store.take_cancel_count, batch_id, token)
    except redis.RedisError as exc:
        log.error("batch %s: what the cancel ended may be left uncounted: %s", batch_id, exc)
        return
    except asyncio.CancelledError:  # the gateway stops (stop_retakes)
        log.error(
            "batch %s: the gateway stops: what the cancel ended may be left uncounted", batch_id
        )
        raise
    metrics.cancel_counted(items, completed)


async def stop_retakes(retakes: set[asyncio.Task[None]]) -> None:
    """The gateway stops: give up the takes still sent again (each waits for the Redis call
    it has under way, at most its 5 s of retries), as a gateway dying gives them up."""
    for task in retakes:
        task.cancel()
    await asyncio.gather(*retakes, return_exceptions=True)

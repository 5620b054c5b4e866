"""Each economy task's message: sent anew to supersede any other still on its way, run by the
one it names, retried with backoff, and sent again by the re-drive's sweep when it was lost
(:func:`rewake`); and asked again on a worker that cannot reach the Message Batches API
(:func:`batches_client`)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.constants import BATCH_QUEUE, ECONOMY_POLL_TASK, ECONOMY_SUBMIT_TASK
from worker.errors import AttemptOutcome, RerankAttemptError
from worker.observability import metrics
from worker.queue.base import SiftTask
from worker.queue.economy.leases import WATCH_MARGIN_SECONDS, expect, give_back
from worker.queue.jobstore import BatchJob, JobStore

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches

log = logging.getLogger(__name__)


SUBMIT_CLAIM = "submit"


def send_anew(task: SiftTask, batch_id: str, what: str, countdown: float) -> None:
    """Send the economy task for ``what`` (a provider batch's poll, or the submission) as a
    new message, which supersedes any other of that task still on its way
    (:func:`message_taken`)."""
    task_id = f"eco-{uuid.uuid4().hex}"
    task.context.store.economy_hand_over(batch_id, what, task_id)
    expect(task, batch_id, what, countdown)
    give_back(task, batch_id, what)
    name, args = _task_of(batch_id, what)
    task.app.send_task(name, args=args, queue=BATCH_QUEUE, task_id=task_id,
                       countdown=countdown or None)  # fmt: skip


def send_poll(task: SiftTask, batch: BatchJob, provider_id: str) -> None:
    send_anew(task, batch.id, provider_id, task.context.settings.economy_poll_seconds)


def _task_of(batch_id: str, what: str) -> tuple[str, list[Any]]:
    if what == SUBMIT_CLAIM:
        return ECONOMY_SUBMIT_TASK, [batch_id]
    return ECONOMY_POLL_TASK, [batch_id, what]


def message_taken(task: SiftTask, batch_id: str, what: str) -> bool:
    """Whether this message is the one to run the economy task for ``what``. A message sent
    again by :func:`rewake`, or a poll sent again for a provider batch found recorded,
    supersedes the one before it, which may yet come (late, not lost: held by a worker
    killed during a long outage, behind a backlog of the batch queue): that one stops here,
    or two polls would each go on retrying and each map the results (a failed item
    resubmitted twice, paid twice), two submissions each create the same items' batches.
    A retry keeps its task id, so the chain it continues stays the one."""
    if task.context.store.economy_take(batch_id, what, str(task.request.id)):
        return True
    log.info("batch %s: its %s task was sent again since this message; it stops", batch_id, what)
    return False


def poll_countdown(task: SiftTask) -> float:
    settings = task.context.settings
    return float(
        min(
            settings.economy_poll_max_seconds,
            settings.economy_poll_seconds * 2 ** min(task.request.retries, 30),
        )
    )


def retry_countdown(task: SiftTask, exc: RerankAttemptError) -> float:
    """When a task whose call failed with ``exc`` tries again: at the poll's cadence, and not
    before the rate budget or the provider's ``retry-after`` (a 429's, a 529's) frees it."""
    return max(poll_countdown(task), exc.retry_after or 0.0)


NO_CLIENT = "the economy lane needs SIFT_GENERATION_MODEL"


def no_batches_client(task: SiftTask) -> RerankAttemptError | None:
    """Why this worker cannot reach the Message Batches API (it has no
    ``SIFT_GENERATION_MODEL``: rerank turned off since the batch ran, or a pool of mixed
    settings), or None when it can."""
    if task.context.batches is None:
        return RerankAttemptError(AttemptOutcome.HTTP_4XX, NO_CLIENT)
    return None


def batches_client(
    task: SiftTask, batch_id: str, what: str | None = None
) -> AnthropicMessageBatches:
    """This worker's Message Batches client; a worker without one asks the task again at the
    poll's cadence, for a worker with it to take a later try (``what``: the economy task's
    watch, a provider batch or the submission, moved to that retry, its lease given back).

    No call reached the provider, and the provider batches run on whatever this worker can
    do: nothing is failed here. The poll raised, its message acked, its items ``running``
    until the re-drive judged the message lost; the submission took it for a provider
    ``http_4xx`` and raised applying the failure policy (which needs the model) to every
    item not sent, its items ``running`` until the re-drive sent it again."""
    client = task.context.batches
    if client is not None:
        return client
    countdown = poll_countdown(task)
    log.error("batch %s: %s on this worker; %s asked again in %.0f s", batch_id, NO_CLIENT,
              what or "its task", countdown)  # fmt: skip
    if what is not None:
        expect(task, batch_id, what, countdown)
    raise task.retry(countdown=countdown) from no_batches_client(task)


def rewake(store: JobStore, send: Callable[[str, list[Any], str, str], None], now: float) -> int:
    """Send again every economy task that should have run by ``now`` and did not: its message
    was lost, and nothing else would bring it back (the economy lane's batches wait for hours
    by design, so the re-drive's stall test does not apply to them). A batch finished or gone
    needs none. Answers how many were sent. ``send`` is the re-drive's
    ``(task name, args, queue, task id)``."""
    sent = 0
    for batch_id, what in store.economy_overdue(now):
        batch = store.get_batch(batch_id)
        if batch is None or batch.finished_at is not None:
            store.economy_met(batch_id, what)
            continue
        name, args = _task_of(batch_id, what)
        task_id = f"rewake-{uuid.uuid4().hex}"
        store.economy_hand_over(batch_id, what, task_id)  # the late one, if it comes, stops
        store.economy_expect(batch_id, what, now + WATCH_MARGIN_SECONDS)
        send(name, args, BATCH_QUEUE, task_id)
        metrics.redriven("economy")  # a lost message, as the re-drive's others are counted
        log.warning("batch %s: its %s task did not run when due; sent again", batch_id, what)
        sent += 1
    return sent

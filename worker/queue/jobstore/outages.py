"""A run that Redis unreachable ended: what it settles once Redis answers again, before its
task ends.

Why. A search's, an ingest's or a batch item's run that meets Redis unreachable past its
client's retries (``OUTAGE_SECONDS``, 30 s) ends without a finish, its job left ``running``
for the re-drive's copy once Redis is back (:mod:`worker.queue.tasks`). That copy was
charged one of the job's ``SIFT_TASK_MAX_DELIVERIES`` re-drives, as for a message lost to a
crash: a search whose runs overlapped four outages failed ``delivery_limit_exceeded``, with
no fault of its own. And a model answer that came back during the outage could not be kept
in the run's claim (:class:`~worker.queue.jobstore.runs.ClaimAnswers`): the copy called the
model again, the search billed twice.

How. Before its task ends, the run waits for Redis to answer again (each try is one of the
client's calls, retried for its window; at most :data:`SETTLE_SECONDS` in all), keeps in
their claims the answers its runs hold unkept (the copy that takes a claim over finishes on
it, no second call), and notes the outage for the positions it leaves unfinished
(:meth:`DeliveryRecords.note_outage`): the re-drive that sends them again is then not
counted, or the next delivery of its message, which may come back itself instead (its ack lost
with the outage, the orphan check puts it back): one note pays for one return, whichever
comes first. The task's message is still in kombu's
``unacked`` hash until the task ends, so no sweep finds those positions lost, and sends the
copy, before the answers and the note are written. An outage past :data:`SETTLE_SECONDS`
gives the thread back with nothing kept or noted, and the copy calls the model again and is
counted, as before: a Redis that long gone is lost, not restarting. The answers held are the
runs' own (one each, a few hundred bytes), and no thread is made.

    if unreachable(exc):
        settle_outage(store, batch_id, [3, 4, 5], held_answers)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import redis

from worker.queue.jobstore.delivery import DeliveryRecords
from worker.queue.jobstore.runs import ClaimAnswers
from worker.redis_client import OUTAGE_SECONDS, unreachable

log = logging.getLogger(__name__)

# How long a run Redis unreachable ended waits for it to answer again, in all: ten of the
# client's windows. The run's thread waits (no new one), and while Redis is down its worker can
# run nothing else anyway.
SETTLE_SECONDS = 10 * OUTAGE_SECONDS


def settle_outage(
    store: DeliveryRecords,
    job_id: str,
    positions: Sequence[int],
    answers: Iterable[ClaimAnswers] = (),
    *,
    delivery: tuple[str, int] | None = None,
    seconds: float = SETTLE_SECONDS,
) -> bool:
    """Once Redis answers, keep in their claims the model's answers the runs hold unkept
    (``answers``), then note that the runs of the job's ``positions`` (a search's or an
    ingest's: ``[0]``) ended on its outage, under the task message ``delivery`` (task id,
    retry number; :meth:`DeliveryRecords.note_outage`); answers whether that was done within
    ``seconds``."""
    log.warning(
        "%s: Redis unreachable ended its run; waiting up to %.0f s for it to answer, to keep "
        "what the run holds and note the outage",
        job_id,
        seconds,
    )
    give_up = time.monotonic() + seconds
    while True:
        try:
            for held in answers:
                held.keep_unkept()
            store.note_outage(job_id, positions, delivery)
            return True
        except redis.RedisError as exc:
            if not unreachable(exc) or time.monotonic() >= give_up:
                log.warning(
                    "%s: its run's outage could not be noted (%s); its re-drive is counted",
                    job_id,
                    exc,
                )
                return False

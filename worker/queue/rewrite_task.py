"""The task that pays the Redis file rewrite an erase left owed (``sift.rewrite_owed``).

Why. An erase within :data:`~worker.constants.REWRITE_INTERVAL_SECONDS` of the last rewrite
asked leaves its own owed (:mod:`~worker.queue.jobstore.rewrite`: a burst of erases forks
Redis once). Only the re-drive's sweep paid it: with ``SIFT_REDRIVE_INTERVAL_SECONDS=0`` the
erased text stayed in Redis's AOF until the next erase past the interval, however long that
was. The erase now sends this task, due when the interval's latch expires; the worker that
takes it asks the rewrite then, and again at the next expiry while the latch is taken, a
rewrite runs or Redis does not answer.
"""

from __future__ import annotations

from celery import shared_task

from worker.constants import REWRITE_TASK
from worker.queue.base import SiftTask
from worker.queue.jobstore.rewrite import pay_owed


@shared_task(  # type: ignore[untyped-decorator]
    name=REWRITE_TASK, base=SiftTask, bind=True, max_retries=None, ignore_result=True
)
def rewrite_owed(self: SiftTask) -> None:
    """Ask Redis to rewrite its files if an erasure still owes it (:func:`pay_owed`)."""
    again = pay_owed(self.context.store.redis)
    if again is not None:
        raise self.retry(countdown=again)

"""Sift's Celery tasks: one search, one chunk of a batch, a batch cancel's count, one ingest
(an upsert, a delete or a drop), one index read or settings change. The webhook delivery is
:mod:`worker.queue.webhook_task`'s, the economy lane's tasks are :mod:`worker.queue.economy`'s.

Every task takes JSON ids, is idempotent (the job store's compare-and-set makes a
redelivered task a no-op for anything already final), and inherits
:class:`~worker.queue.base.SiftTask`, which times it, counts deliveries so a poison message is
failed instead of looping, and owns the retry decision: only errors marked
``retryable`` are retried, at most ``SIFT_TASK_MAX_RETRIES`` times, with
exponential backoff and jitter.
"""

from worker.queue.tasks.batches import batch_chunk, cancel_count
from worker.queue.tasks.index_reads import index_read, job_store_error
from worker.queue.tasks.ingests import ingest
from worker.queue.tasks.searches import search

__all__ = ["batch_chunk", "cancel_count", "index_read", "ingest", "job_store_error", "search"]

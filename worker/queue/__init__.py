"""The queue machinery: the Celery app and its tasks, a worker process's item queue, the index
lifecycle's jobs, the re-drive sweeper, dead-worker recovery, the economy lane, the broker
transport workaround, and the job store in Redis.

Nothing is imported here on purpose: the gateway imports :mod:`worker.queue.jobstore` and must
not pull Celery in with it.
"""

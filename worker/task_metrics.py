"""The queue's task metrics: how long each Celery task ran and how often it was retried.

The §9 metrics (queue wait, jobs in flight, webhook deliveries...) live in
:mod:`worker.metrics`; these two are extensions.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from worker.constants import METRIC_TASK_DURATION, METRIC_TASK_RETRIES

TASK_DURATION = Histogram(
    METRIC_TASK_DURATION,
    "Wall time of one Celery task run, by task and outcome (ok, retry, error).",
    ["task", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
TASK_RETRIES = Counter(
    METRIC_TASK_RETRIES, "Tasks put back for a retry after a retryable error.", ["task"]
)

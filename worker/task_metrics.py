"""The queue's worker-side Prometheus metrics: task timing, retries and queue wait."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from worker.constants import (
    METRIC_QUEUE_WAIT,
    METRIC_TASK_DURATION,
    METRIC_TASK_RETRIES,
    METRIC_WEBHOOK_DELIVERIES,
)

TASK_DURATION = Histogram(
    METRIC_TASK_DURATION,
    "Wall time of one Celery task run, by task and outcome (ok, retry, error).",
    ["task", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
TASK_RETRIES = Counter(
    METRIC_TASK_RETRIES, "Tasks put back for a retry after a retryable error.", ["task"]
)
QUEUE_WAIT = Histogram(
    METRIC_QUEUE_WAIT,
    "Seconds from a job's submission to a worker starting it.",
    ["queue"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600),
)
WEBHOOK_DELIVERIES = Counter(
    METRIC_WEBHOOK_DELIVERIES,
    "Webhook delivery attempts, by result (delivered, retry, failed).",
    ["result"],
)

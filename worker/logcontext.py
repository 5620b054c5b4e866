"""Logging: one configuration function, and the id of the job being worked on, on every record.

configure_logging("INFO")          # a process's entry point, once
with job_context("srch_123"):      # a task, around the work on one job
    log.info("running")            # ... [srch_123] running
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s [%(job_id)s] %(message)s"

_job_id: ContextVar[str] = ContextVar("sift_job_id", default="-")


class JobIdFilter(logging.Filter):
    """Puts the current job id on each record as ``job_id`` ("-" outside a job)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "job_id"):
            record.job_id = _job_id.get()
        return True


@contextmanager
def job_context(job_id: str) -> Iterator[None]:
    """Every record logged in this block (in this thread or task) carries ``job_id``."""
    token = _job_id.set(job_id)
    try:
        yield
    finally:
        _job_id.reset(token)


def install(handler: logging.Handler) -> None:
    """Give one handler the job id filter and Sift's format."""
    handler.addFilter(JobIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))


def configure_logging(level: str | int = "INFO", logger: logging.Logger | None = None) -> None:
    """Sift's one logging set-up: a stderr handler with the job id on every record."""
    target = logger or logging.getLogger()
    if not any(isinstance(f, JobIdFilter) for h in target.handlers for f in h.filters):
        handler = logging.StreamHandler()
        install(handler)
        target.addHandler(handler)
    target.setLevel(level)

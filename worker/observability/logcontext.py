"""Logging: one configuration function, and the id of the job being worked on, on every record.

configure_logging("INFO")          # a process's entry point, once
with job_context("srch_123"):      # a task, around the work on one job
    log.info("running")            # ... [srch_123] running

Even at DEBUG, no log carries an API key, a webhook secret or document text: the HTTP
libraries under the model SDK log whole request options (the prompt, so the candidates'
text) at DEBUG, so their loggers (:data:`WIRE_LOGGERS`) are held at WARNING and Sift's
handlers drop their DEBUG records. WARNING, not INFO: httpx logs one INFO line per request,
and with hundreds of reranks in flight the threads queue on the log handler's lock for it
(measured: a tenth of a worker's threads waiting there; metrics count the calls instead).
``tests/security/test_secrets_and_logs.py`` checks it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s [%(job_id)s] %(message)s"

# Loggers that write request bodies or options at DEBUG (``anthropic._base_client`` logs
# "Request options: {... json_data ...}", the whole prompt). The SDK's own ANTHROPIC_LOG=debug
# adds its own handler and bypasses this: never set it where documents are private.
WIRE_LOGGERS = ("anthropic", "httpx", "httpx2", "httpcore", "httpcore2")

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


_entered = threading.local()  # this thread's tokens of enter_job, innermost last


def enter_job(job_id: str) -> None:
    """:func:`job_context` split in two, for a start and an end that are two callbacks (Celery's
    ``task_prerun`` and ``task_postrun``); each :func:`leave_job` ends the innermost."""
    if not hasattr(_entered, "tokens"):
        _entered.tokens = []
    _entered.tokens.append(_job_id.set(job_id))


def leave_job() -> None:
    tokens = getattr(_entered, "tokens", None)
    if tokens:
        _job_id.reset(tokens.pop())


class WireDebugFilter(logging.Filter):
    """Drops the DEBUG records of :data:`WIRE_LOGGERS`: they carry request bodies."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.INFO:
            return True
        return not any(
            record.name == name or record.name.startswith(name + ".") for name in WIRE_LOGGERS
        )


def quiet_wire_loggers() -> None:
    """Hold :data:`WIRE_LOGGERS` at WARNING, or at the root's level when that is higher."""
    floor = max(logging.WARNING, logging.getLogger().getEffectiveLevel())
    for name in WIRE_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level < floor:
            logger.setLevel(floor)


def install(handler: logging.Handler) -> None:
    """Give one handler the job id filter, the wire filter and Sift's format."""
    handler.addFilter(JobIdFilter())
    handler.addFilter(WireDebugFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    quiet_wire_loggers()


def name_process(name: str) -> None:
    """Have every log record of this process say ``name`` as its ``processName`` (the format's
    ``%(processName)s``) where Python says ``MainProcess``, and ``name/…`` where a pool's child
    has its own (``worker-1/ForkPoolWorker-2``). Each process ``sift worker --processes N``
    runs is the main process of its own Python: every line of their shared log said
    ``MainProcess``, and none said which process wrote it."""
    make = logging.getLogRecordFactory()

    def named(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        own = record.processName
        record.processName = name if own in (None, "MainProcess") else f"{name}/{own}"
        return record

    logging.setLogRecordFactory(named)


def configure_logging(level: str | int = "INFO", logger: logging.Logger | None = None) -> None:
    """Sift's one logging set-up: a stderr handler with the job id on every record."""
    target = logger or logging.getLogger()
    if not any(isinstance(f, JobIdFilter) for h in target.handlers for f in h.filters):
        handler = logging.StreamHandler()
        install(handler)
        target.addHandler(handler)
    target.setLevel(level)
    quiet_wire_loggers()

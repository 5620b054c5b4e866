"""What the search, batch and ingest tasks share about a run: the poison error, the queue wait in
a result's trace, the model calls a dead run kept and billed, and whether a retry still fits."""

from __future__ import annotations

import json
import logging

from worker.contract import ErrorInfo, SearchResult, Usage
from worker.core.budget import MIN_ATTEMPT_SECONDS
from worker.core.pipeline import load_run
from worker.errors import SiftError
from worker.queue.base import SiftTask
from worker.queue.jobstore import RunClaim

log = logging.getLogger(__name__)


def poison_error(task: SiftTask) -> ErrorInfo:
    """The error of a job whose deliveries reached ``SIFT_TASK_MAX_DELIVERIES``: its worker
    was lost each time (a poison message), so it is failed instead of looping."""
    limit = task.context.settings.task_max_deliveries
    return ErrorInfo(
        type="delivery_limit_exceeded",
        message=f"the worker running this job was lost {limit} times; giving up",
    )


def unpace_runtime(runtime: object) -> None:
    """A batch item paced on the rate budget (the runtime's ``pace``) whose search will not
    run here counts no more in the budget's readings (the runtime's ``unpace``); a runtime
    factory's may have neither."""
    unpace = getattr(runtime, "unpace", None)
    if unpace is not None:
        unpace()


def with_queue_wait(result: SearchResult, seconds: float) -> SearchResult:
    """``result`` with its trace (when one was asked for) telling ``queue_wait_seconds``: from
    the job's submission (a search's, or its batch's) to the start of the run that made it;
    its batch's totals count it too."""
    if result.trace is not None:
        result.trace["queue_wait_seconds"] = max(0.0, seconds)
    result._stage_seconds["queue_wait"] = max(0.0, seconds)
    return result


def with_failed_queue_wait(exc: BaseException, seconds: float) -> None:
    """A failed search's trace (``error.trace``, when it asked for one) telling
    ``queue_wait_seconds`` as its result's would have (:func:`with_queue_wait`)."""
    if isinstance(exc, SiftError) and exc.job_trace is not None:
        exc.job_trace["queue_wait_seconds"] = max(0.0, seconds)
    if isinstance(exc, SiftError) and exc.job_seconds is not None:
        exc.job_seconds["queue_wait"] = max(0.0, seconds)


def kept_usage(answer: str) -> Usage | None:
    """The usage of a model answer a dead run kept in its claim (``answer``; '' : none; one
    that cannot be read is logged and shows none: the job still ends)."""
    if not answer:
        return None
    try:
        return load_run(json.loads(answer)).job_usage()
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("a kept model answer could not be read: %s", exc)
        return None


def billed_error(error: ErrorInfo, answer: str) -> ErrorInfo:
    """``error``, with the usage of the model answer a dead run kept (``answer``, its
    claim's) when it has none of its own: that call was billed, and this run failed before it
    could apply it (its retrieval), or none ran (the poison path), so the failure is the only
    record that can show it."""
    kept = kept_usage(answer)
    if error.usage is not None or kept is None:
        return error
    return error.model_copy(update={"usage": kept})


def unbilled(usage: Usage | None) -> bool:
    """Whether ``usage`` (a run's, or a dead run's kept) read no token: no call sent, or each
    refused (a 429, a 529: the provider bills nothing) or timed out unanswered (what the
    provider may bill for it no usage says either way: counted unread).

    >>> unbilled(None), unbilled(Usage(requests=2)), unbilled(Usage(requests=1, input_tokens=9))
    (True, True, False)
    """
    if usage is None:
        return True
    tokens = usage.input_tokens + usage.output_tokens
    return tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == 0


def retry_fits(claim: RunClaim, deadline: float) -> bool:
    """Whether a task retry would have any of the search's one deadline left to run in: a
    retry runs in what is left of it, never in a deadline of its own (the wait before the
    retry is not counted, as the queue wait before the first run is not)."""
    return deadline - claim.spent_now() >= MIN_ATTEMPT_SECONDS

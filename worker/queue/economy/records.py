"""What the economy lane keeps of a batch in Redis, and reads back: its prepared items, each
item's run (what the provider did for it, across rounds), the provider batches it made; and
the lane's pipeline."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from worker.constants import (
    BATCH_ITEMS_KEY,
    ECONOMY_PREPARED_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RUNS_KEY,
)
from worker.contract import JobStatus
from worker.core.pipeline import Prepared, RerankRun, SearchPipeline, dump_prepared
from worker.core.types import TokenUsage
from worker.errors import SiftError
from worker.queue.base import SiftTask
from worker.queue.jobstore import BatchJob, JobStore

PAGE = 500  # items read from Redis, or results mapped, at a time
DOUBT = "doubt:"  # a run's provider while its create is in doubt: "doubt:<submission>"


def new_run(position: int) -> dict[str, Any]:
    return {
        "pos": position,
        "provider": None,  # the provider batch the item is in now
        "submission": None,  # the token of the create that put it there
        "pending": None,  # a create under way: {"submission", "at", "requests"}
        "handled": None,  # the provider batch whose result was counted last
        "round": 0,
        "resubmit": False,
        "first_submitted_at": None,
        "submitted_at": None,
        "mapped_at": None,  # when the result of its last round was counted
        "attempts": [],
        "usage": [0, 0, 0, 0],
        "cost_usd": 0.0,
        "last_error": None,
    }


def rerank_run(record: dict[str, Any]) -> RerankRun:
    return RerankRun(
        attempts=list(record["attempts"]),
        usage=TokenUsage(*record["usage"]),
        cost_usd=None if record["cost_usd"] is None else float(record["cost_usd"]),
    )


def store_run(record: dict[str, Any], run: RerankRun) -> None:
    record["attempts"] = run.attempts
    record["usage"] = run.usage.counts()
    record["cost_usd"] = run.cost_usd


def record_sent(run: dict[str, Any], provider: str, submission: str, at: float) -> None:
    """A run's item went out at ``at`` in create ``submission``, and waits on ``provider`` now
    (a provider batch, or ``doubt:<submission>``): its next round, nothing pending."""
    run.update(
        provider=provider,
        submission=submission,
        pending=None,
        round=run["round"] + 1,
        resubmit=False,
        submitted_at=at,
        first_submitted_at=run["first_submitted_at"] or at,
    )


def backed_off(run: dict[str, Any], now: float) -> float:
    """What an item's attempt waited since the attempt before (the trace's
    ``backoff_wait_seconds``, as the standard lane's): from that one's result counted
    (``mapped_at``) to this one's request sent again (``submitted_at``), or to ``now`` if it
    was not sent again (its resubmission failed): its resubmission's create, and a create
    tried again at the poll's cadence or after a 429's pause. 0 for the first, whose wait
    before its provider batch is no part of the rerank. An attempt's ``seconds`` and the
    waits before it add up to the item's ``rerank_seconds``, its first send to its last
    result.

    >>> backed_off({"mapped_at": None, "submitted_at": 5.0}, 9.0)
    0.0
    >>> backed_off({"mapped_at": 10.0, "submitted_at": 12.5}, 20.0)
    2.5
    >>> backed_off({"mapped_at": 10.0, "submitted_at": 4.0}, 20.0)  # not sent again
    10.0
    """
    mapped = run.get("mapped_at")
    if mapped is None:
        return 0.0
    sent = run.get("submitted_at")
    return max(0.0, (sent if sent is not None and sent > mapped else now) - float(mapped))


def out_for(run: dict[str, Any], now: float) -> float:
    """How long an item's request has been out at ``now``, for an attempt that fails it
    there (its ``seconds``, as a mapped result's are its provider batch's): since it was
    sent (``submitted_at``: its create, or the create in doubt it waits on), if it went
    since its last result was counted; 0 if it is not out (never sent, or its resubmission
    not made). With :func:`backed_off`'s wait before it, the time from that result to
    ``now``.

    >>> out_for({"mapped_at": None, "submitted_at": None}, 9.0)  # never sent
    0.0
    >>> out_for({"mapped_at": None, "submitted_at": 5.0}, 9.0)
    4.0
    >>> out_for({"mapped_at": 10.0, "submitted_at": 4.0}, 20.0)  # not sent again
    0.0
    """
    sent, mapped = run.get("submitted_at"), run.get("mapped_at")
    if sent is None or (mapped is not None and sent <= mapped):
        return 0.0
    return max(0.0, now - float(sent))


def as_sent(prepared: Prepared, run: dict[str, Any]) -> Prepared:
    """``prepared`` as its item's last request was sent: to the model the run names (the
    worker finishing it may be of another model, after a deploy), with the prompt policy it
    names, which labels its answer. A run a release before this one sent names no policy:
    it sent the prompt of the policy the item was prepared under, which ``prepared`` keeps
    (:func:`~worker.core.pipeline.load_prepared`); the prompt rebuilt now is this
    release's. An item never sent keeps both as prepared."""
    if run.get("model"):
        prepared.trace["model"] = run["model"]
    if run.get("policy"):
        prepared.policy = run["policy"]
    return prepared


def economy_pipeline(task: SiftTask) -> SearchPipeline:
    """The runtime's pipeline at the Message Batches price, labelled ``lane="economy"``."""
    pipeline = getattr(task.context.runtime, "economy", None)
    if not isinstance(pipeline, SearchPipeline):
        raise SiftError("this worker's runtime has no economy pipeline")
    return pipeline


def is_prepared(store: JobStore, batch_id: str, query_id: str) -> bool:
    """Whether an item's first half ran already (a chunk delivered again need not, and must
    not, run it again: :func:`save_prepared`)."""
    return store.economy_get(batch_id, ECONOMY_PREPARED_KEY, [query_id])[0] is not None


def save_prepared(store: JobStore, batch_id: str, query_id: str, position: int,
                  prepared: Prepared) -> bool:  # fmt: skip
    """Keep a prepared item's state until its provider result comes back. The first one kept
    stays: its prompt may have gone out already, and the model's answer is positions in the
    candidates it listed. A chunk run again (delivered again, re-driven) prepares anew, and
    the index may have changed meanwhile: its candidates in another order, or others. True
    if this one was kept; False also once the item is no longer running (canceled, or its
    batch erased by a purge while this first half ran): nothing is written, and nothing is
    left to do. Kept as UTF-8, as a result is: escaped, a character of the candidates' texts
    outside ASCII took 6 bytes, or 12."""
    data = dump_prepared(prepared)
    data["pos"] = position
    raw = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return store.economy_save_prepared(batch_id, query_id, raw)


def running_items(
    task: SiftTask, batch: BatchJob, query_ids: Sequence[str]
) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """The items among ``query_ids`` still running, with their prepared state and run record,
    read a page at a time."""
    store = task.context.store
    for start in range(0, len(query_ids), PAGE):
        page = list(query_ids[start : start + PAGE])
        statuses = store.economy_get(batch.id, BATCH_ITEMS_KEY, page)
        prepared = store.economy_get(batch.id, ECONOMY_PREPARED_KEY, page)
        runs = store.economy_get(batch.id, ECONOMY_RUNS_KEY, page)
        for qid, status, raw, raw_run in zip(page, statuses, prepared, runs, strict=True):
            if status != JobStatus.RUNNING.value or raw is None:
                continue
            data = json.loads(raw)
            yield qid, data, json.loads(raw_run) if raw_run else new_run(int(data["pos"]))


def save_runs(task: SiftTask, batch: BatchJob, runs: Iterable[tuple[str, dict[str, Any]]]) -> bool:
    """Keep items' runs; False if the batch's record is gone (erased): nothing kept."""
    return task.context.store.economy_save(
        batch.id,
        ECONOMY_RUNS_KEY,
        {qid: json.dumps(run, separators=(",", ":")) for qid, run in runs},
    )


def provider_record(store: JobStore, batch_id: str, provider_id: str) -> dict[str, Any]:
    raw = store.economy_get(batch_id, ECONOMY_PROVIDERS_KEY, [provider_id])[0]
    record: dict[str, Any] = json.loads(raw) if raw else {}
    return record


def save_provider_record(
    store: JobStore, batch_id: str, provider_id: str, record: dict[str, Any]
) -> bool:
    """Keep one provider batch's record; False when the batch is gone (nothing written)."""
    return store.economy_save(batch_id, ECONOMY_PROVIDERS_KEY, {provider_id: json.dumps(record)})


def _waits_on(run: dict[str, Any], provider_id: str, submission: str | None) -> bool:
    """Whether an item waits on this provider batch (or on the create it answers)."""
    return run["provider"] == provider_id or (
        submission is not None and run["provider"] == DOUBT + submission
    )


def items_waiting(
    store: JobStore, batch_id: str, provider_id: str, submission: str | None
) -> list[str]:
    return [
        qid
        for qid, raw in store.economy_all(batch_id, ECONOMY_RUNS_KEY).items()
        if _waits_on(json.loads(raw), provider_id, submission)
    ]

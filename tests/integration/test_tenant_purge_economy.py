"""``sift tenant purge`` of a tenant whose economy batch has prompts with the provider: the
purge deleted the economy state that names its provider batches after canceling only the
Sift batch, so nothing could cancel them and they ran to their end, every request billed for
a tenant that was erased. It cancels them at the provider now, and stops, having erased
nothing, when the provider does not answer the cancel (a second run finishes). And a purge
during an item's first half is not undone by that first half's save, nor by any other step of
the economy lane still running for the tenant (``--force``, or a worker not restarted yet)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fake_anthropic import FakeAnthropic, status
from tests.integration.test_economy_doubts import (
    SPEC,
    _foreign_batch,
    _prepared,
    _submission,
    _Task,
    context,
    workers,
)
from tests.integration.test_erasure import _naming
from worker.adapters.embedded import EmbeddedBackend
from worker.constants import (
    BATCH_KEY,
    ECONOMY_DELETE_KEY,
    ECONOMY_DELETE_TASK,
    ECONOMY_PREPARED_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RESEND_CLAIM,
    ECONOMY_RUNS_KEY,
    ECONOMY_WATCH_KEY,
    SEARCH_QUEUE,
)
from worker.errors import AttemptOutcome, RerankAttemptError
from worker.processes.stack import child_env
from worker.queue import economy
from worker.queue.base import WorkerContext
from worker.queue.economy import cancel, deletion, leases, records, results, submission, watch
from worker.queue.jobstore import BatchJob, JobStore

__all__ = ["context", "workers"]  # fixtures (test_economy_doubts.py's)


@pytest.fixture
def model() -> Iterator[FakeAnthropic]:
    """A provider batch takes an hour: still in progress when the purge comes."""
    with FakeAnthropic(batch_processing_seconds=3600) as fake:
        yield fake


def _purge(redis_url: str, model: FakeAnthropic, data: Path) -> subprocess.CompletedProcess[str]:
    """``sift tenant purge acme`` as its own process, with the workers' model settings."""
    backend = EmbeddedBackend(data)  # the workers' data folder (the purge refuses another)
    backend.indexes("acme")  # made on first use
    backend.close()
    env = {
        "SIFT_REDIS_URL": redis_url,
        "SIFT_DATA_DIR": str(data),
        "SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5",
        "ANTHROPIC_BASE_URL": model.url,
        "ANTHROPIC_API_KEY": "sk-ant-test",
        "COLUMNS": "200",
        "NO_COLOR": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "tenant", "purge", "acme", "--yes"],
        env=child_env(env, inherit_sift=False), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_purge_cancels_the_tenants_provider_batches_and_stops_when_it_cannot(
    context: WorkerContext, model: FakeAnthropic, workers: None, redis_url: str, tmp_path: Path
) -> None:
    store = context.store
    batch, qids = _prepared(context, 3)
    _submission(context, batch, qids, "1")  # its prompts went out: one provider batch
    [made] = model.batches()
    assert made["status"] == "in_progress"

    model.script_batch_calls("cancel", [status(400, message="try later")])
    refused = _purge(redis_url, model, tmp_path / "data")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert made["id"] in refused.stderr and "nothing was erased" in refused.stderr
    assert "Traceback" not in refused.stderr
    [still] = model.batches()
    assert still["status"] == "in_progress"
    assert store.redis.exists(BATCH_KEY + batch.id, ECONOMY_PROVIDERS_KEY + batch.id) == 2

    purged = _purge(redis_url, model, tmp_path / "data")
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert f"batch {batch.id}: provider batch {made['id']} canceled" in purged.stdout
    assert re.search(r"provider batches canceled \(economy lane\)\s*│\s*1\s*│", purged.stdout)
    [canceled] = model.batches()
    assert canceled["status"] != "in_progress"
    # and handed to a worker to delete at the provider (its queries and candidates' text)
    assert re.search(r"provider batches handed to a worker to delete\s*│\s*1\s*│", purged.stdout)
    [message] = [json.loads(raw) for raw in store.redis.lrange(SEARCH_QUEUE, 0, -1)]
    assert message["headers"]["task"] == ECONOMY_DELETE_TASK, message
    assert json.loads(base64.b64decode(message["body"]))[0] == [batch.id]
    deletion.delete_erased(_Task(context, "delete"), batch.id)  # type: ignore[arg-type]
    assert model.batches() == []
    assert store.redis.keys("*" + batch.id + "*") == []


def test_what_a_purge_leaves_for_the_provider_deletes_holds_no_text_of_the_tenant(
    context: WorkerContext, model: FakeAnthropic, workers: None, redis_url: str, tmp_path: Path
) -> None:
    """The one key a purge leaves that names one of the tenant's jobs: the ids of the batch's
    provider batches that the worker is to delete at the provider (``sift:eco-delete:<id>``,
    its to-do list: deleted with the rest, they would stay at the provider, with the queries
    and candidates' text, for 29 days), and the task's message that names the batch. Neither
    holds the tenant's name or a query; the key goes once the worker has deleted them."""
    store = context.store
    batch, qids = _prepared(context, 3)
    _submission(context, batch, qids, "1")
    [made] = model.batches()
    purged = _purge(redis_url, model, tmp_path / "data")
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert _naming(store, "acme", SPEC.query) == []
    assert set(_naming(store, batch.id)) == {ECONOMY_DELETE_KEY + batch.id, SEARCH_QUEUE}
    assert store.redis.smembers(ECONOMY_DELETE_KEY + batch.id) == {made["id"]}
    assert 0 < store.redis.ttl(ECONOMY_DELETE_KEY + batch.id) <= store.result_ttl
    deletion.delete_erased(_Task(context, "delete"), batch.id)  # type: ignore[arg-type]
    assert model.batches() == []
    assert _naming(store, batch.id) == [SEARCH_QUEUE]  # the message, until a worker takes it


def _purge_records(store: JobStore) -> None:
    """``sift tenant purge acme``, its Redis part (nothing of acme's at the provider)."""
    jobs = store.tenant_jobs("acme")
    store.cancel_tenant_jobs(jobs)
    store.delete_tenant_jobs(jobs)
    store.delete_tenant_keys("acme")


def _named(store: JobStore, batch_id: str) -> list[str]:
    """Every key, and every member of the economy watch, that names the batch."""
    watched = [str(m) for m in store.redis.zrange(ECONOMY_WATCH_KEY, 0, -1) if batch_id in str(m)]
    return [str(k) for k in store.redis.keys("*" + batch_id + "*")] + watched


_Write = Callable[[_Task, BatchJob, str], object]
# each economy step of a run still under way for the tenant when the purge came that writes
# into the batch's economy state (the task, the batch, one of its provider batches)
AFTER_PURGE: dict[str, _Write] = {
    "its items' runs kept (records.save_runs)": lambda task, batch, provider_id: records.save_runs(
        task, batch, [("q0", records.new_run(0))]
    ),  # type: ignore[arg-type]
    "a candidate's end kept (results.candidate_ended)": lambda task, batch, provider_id: (
        results.candidate_ended(task, batch, provider_id, proven=True)  # type: ignore[arg-type]
    ),
    "a provider batch's record kept (results.map_results, submission)": (
        lambda task, batch, provider_id: task.context.store.economy_save(
            batch.id, ECONOMY_PROVIDERS_KEY, {provider_id: json.dumps({"ended_at": 1.0})}
        )
    ),
    "a cancel's mark (cancel.cancel_quietly)": lambda task, batch, provider_id: (
        cancel.cancel_quietly(task.context.store, batch.id, task.context.batches, provider_id)  # type: ignore[arg-type]
    ),
    "a create's sending mark (leases.expect)": lambda task, batch, provider_id: leases.expect(
        task, batch.id, "submit", 0.0, sending="sub"
    ),  # type: ignore[arg-type]
    "a poll's message sent anew (watch.send_anew)": lambda task, batch, provider_id: (
        watch.send_anew(task, batch.id, provider_id, 0.0)  # type: ignore[arg-type]
    ),
    "a poll's message taken (watch.message_taken)": lambda task, batch, provider_id: (
        watch.message_taken(task, batch.id, provider_id)  # type: ignore[arg-type]
    ),
    "a poll delivered after it, under its lease (leases.leased)": lambda task, batch, provider_id: (
        leases.leased(task, batch.id, provider_id, lambda: None)  # type: ignore[arg-type]
    ),
    "a resend's claim (results.candidate_ended)": lambda task, batch, provider_id: (
        task.context.store.economy_claim_for(batch.id, ECONOMY_RESEND_CLAIM + "sub", provider_id)
    ),
    "the submission's claim (submission.maybe_submit)": lambda task, batch, provider_id: (
        task.context.store.economy_claim(batch.id, watch.SUBMIT_CLAIM)
    ),
    "a task's watch (leases.expect)": lambda task, batch, provider_id: (
        task.context.store.economy_expect(batch.id, provider_id, time.time() + 60)
    ),
}


@pytest.mark.parametrize("step", list(AFTER_PURGE))
def test_a_purge_is_not_undone_by_an_economy_step_still_running(
    context: WorkerContext, model: FakeAnthropic, workers: None, step: str
) -> None:
    """Only the prepared item's save was guarded (``_SAVE_PREPARED``): every other write of
    the batch's economy state (its runs, its provider batches' records, its claims, marks,
    leases and watches) wrote the key back after the purge had deleted it, with the
    retention, naming one of the erased tenant's job ids where no second purge could find
    it (its record gone). Each writes nothing now: the batch's record is gone."""
    store = context.store
    batch, _ = _prepared(context, 1)
    provider_id = _foreign_batch(model, 1)  # one of its provider batches, in progress
    model.configure(batch_cancel_seconds=3600)  # a cancel leaves it canceling
    _purge_records(store)
    assert _named(store, batch.id) == []

    AFTER_PURGE[step](_Task(context, "late"), batch, provider_id)

    assert _named(store, batch.id) == []


def test_a_purge_during_an_items_first_half_is_not_undone_by_its_save(
    context: WorkerContext,
) -> None:
    """The purge (with ``--force``, or before every worker was restarted without the tenant's
    key) canceled the item and deleted every key of its batch while a chunk ran its first
    half; the chunk's save then wrote ``eco-prepared`` back, the tenant's query and its
    documents' texts, for the whole retention, where no second purge could find it."""
    store = context.store
    batch = store.create_batch("acme", "docs", [("q0", SPEC)], lane="economy")
    store.start_item(batch.id, "q0")  # the chunk started it; its retrieval is under way
    prepared = economy.economy_pipeline(_Task(context, "chunk")).prepare(SPEC, "acme")  # type: ignore[arg-type]
    _purge_records(store)

    assert not economy.save_prepared(store, batch.id, "q0", 0, prepared)  # the half returns

    assert store.redis.keys("*" + batch.id + "*") == []


def test_a_canceled_items_first_half_is_not_kept(context: WorkerContext) -> None:
    """The same guard without a purge: an item canceled while its first half ran (the batch's
    cancel reaches it by its worker's next check) has nothing kept to send."""
    store = context.store
    batch = store.create_batch("acme", "docs", [("q0", SPEC), ("q1", SPEC)], lane="economy")
    store.start_item(batch.id, "q0")
    store.start_item(batch.id, "q1")
    prepared = economy.economy_pipeline(_Task(context, "chunk")).prepare(SPEC, "acme")  # type: ignore[arg-type]
    assert store.cancel_item(batch.id, "q0").applied

    assert not economy.save_prepared(store, batch.id, "q0", 0, prepared)
    assert economy.save_prepared(store, batch.id, "q1", 1, prepared)
    assert not economy.save_prepared(store, batch.id, "q1", 1, prepared)  # the first one stays
    assert store.economy_fields(batch.id, ECONOMY_PREPARED_KEY) == ["q1"]
    assert store.redis.ttl(ECONOMY_PREPARED_KEY + batch.id) == -1  # as its running batch


def test_a_provider_batch_created_while_the_purge_ran_is_canceled(
    context: WorkerContext,
    model: FakeAnthropic,
    workers: None,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The purge (``--force``, or before every worker was restarted) read the batch's
    ``eco-providers`` while its submission's create was under way: the provider batch made
    then was in no record the purge could cancel, and the submission, finding its batch
    gone rather than canceled, did not cancel it either: it ran to its end, billed for an
    erased tenant, and its record came back; and it went on creating the next one, for
    items that no longer existed. The submission cancels it now, and creates no other."""
    store = context.store
    batch, qids = _prepared(context, 2)
    client = context.batches
    assert client is not None
    create = client.create
    purged: list[subprocess.CompletedProcess[str]] = []

    def purge_meanwhile(*args: Any, **kwargs: Any) -> Any:
        made = create(*args, **kwargs)  # made at the provider; its answer not read yet
        purged.append(_purge(redis_url, model, tmp_path / "data"))
        return made

    monkeypatch.setattr(client, "create", purge_meanwhile)
    # one request a provider batch: the second would be created after the purge
    monkeypatch.setattr(context.settings, "economy_max_requests_per_batch", 1)
    _submission(context, batch, qids, "1")

    [run] = purged
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"provider batches canceled \(economy lane\)\s*│\s*0\s*│", run.stdout)
    [made] = model.batches()  # one create only: nothing was sent after the batch was gone
    assert made["status"] != "in_progress"  # canceled by the submission that made it
    assert _named(store, batch.id) == []


def test_a_purge_names_the_provider_batches_of_a_create_in_doubt_it_leaves(
    context: WorkerContext, model: FakeAnthropic, workers: None, redis_url: str, tmp_path: Path
) -> None:
    """A create whose answer was lost may have made a provider batch: its candidates (the
    workspace's batches of as many requests made then) are never canceled, being maybe
    another client's, and one not looked for yet is known to no one but the runs the purge
    deletes. The purge said nothing of either: a provider batch of the erased tenant's could
    run on, billed, where no one would look. It prints each now, and cancels none. The
    candidate is handed to a worker to judge once it ends (its results tell whose it is):
    this one, another client's, is left there."""
    store = context.store
    batch, _ = _prepared(context, 2)
    at = time.time()
    candidate = _foreign_batch(model, 1)  # q0's create in doubt "sub": its one candidate
    record = {"round": 1, "requests": 1, "created_at": at, "ended_at": None,
              "submission": "sub", "doubt": True}  # fmt: skip
    store.economy_save(batch.id, ECONOMY_PROVIDERS_KEY, {candidate: json.dumps(record)})
    waiting, lost = records.new_run(0), records.new_run(1)
    records.record_sent(waiting, economy.DOUBT + "sub", "sub", at)
    lost["pending"] = {"submission": "lost", "at": at, "requests": 1, "answered": True}
    store.economy_save(batch.id, ECONOMY_RUNS_KEY, {"q0": json.dumps(waiting),
                                                    "q1": json.dumps(lost)})  # fmt: skip

    purged = _purge(redis_url, model, tmp_path / "data")

    assert purged.returncode == 0, purged.stdout + purged.stderr
    out = " ".join(purged.stdout.split())  # as one line (rich wraps at COLUMNS)
    assert f"batch {batch.id}: provider batch {candidate} not canceled" in out, out
    assert f"batch {batch.id}: create lost of 1 request(s)" in out, out
    assert re.search(r"provider batches of creates in doubt, not canceled\s*│\s*1\s*│", out)
    [left] = model.batches()
    assert left["status"] == "in_progress"  # maybe another client's: not canceled
    assert re.search(r"provider batches handed to a worker to delete\s*│\s*0\s*│", out)
    assert f"batch {batch.id}: candidate(s) {candidate} to be judged by a worker" in out, out
    assert store.redis.llen(SEARCH_QUEUE) == 1  # the delete task, to judge it
    assert store.provider_candidates(batch.id) == {candidate: "sub"}
    model.configure(batch_processing_seconds=0.0)  # it ends: no line of create "sub" in it
    deletion.delete_erased(_Task(context, "delete"), batch.id)  # type: ignore[arg-type]
    assert [b["id"] for b in model.batches()] == [candidate]  # not ours: not deleted
    assert _named(store, batch.id) == []


def test_a_create_whose_answer_is_lost_after_the_purge_is_logged(
    context: WorkerContext,
    model: FakeAnthropic,
    workers: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The purge came while a create ran, and the create's answer was lost: the provider
    batch it may have made is named by nothing once its runs are gone, and a candidate
    found by time and size may be another client's, so it is not canceled; the worker
    said nothing of it. It logs an error with the create's time and size now."""
    store = context.store
    batch, qids = _prepared(context, 1)
    client = context.batches
    assert client is not None
    create = client.create

    def lost_after_purge(*args: Any, **kwargs: Any) -> Any:
        create(*args, **kwargs)  # made at the provider
        _purge_records(store)
        raise RerankAttemptError(AttemptOutcome.CONNECTION, "Server disconnected")

    monkeypatch.setattr(client, "create", lost_after_purge)
    with pytest.raises(RerankAttemptError):
        _submission(context, batch, qids, "1")

    [made] = model.batches()
    assert made["status"] == "in_progress"  # not canceled: nothing says it is Sift's
    [error] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert f"batch {batch.id}: erased while its create" in error.getMessage()
    assert "of 1 requests" in error.getMessage()
    assert _named(store, batch.id) == []


# where the purge deletes the batch's records: each is another way out of the submission,
# after the first provider batch was recorded. The purge cancels the jobs and reads the
# provider batches to cancel while the first create runs (none recorded yet: it never saw
# the first) when the second chunk's mark is refused; otherwise just past the second chunk's
# check for a cancel (a purge coming earlier, the submission makes no create more)
SECOND_CHUNK_EXITS = [
    "the second chunk's runs refused (save_runs)",
    "the second chunk's mark refused (leases.expect, its lease gone)",
    "the second provider batch's record refused",
    "the second create's answer lost",
]


@pytest.mark.parametrize("exit_", SECOND_CHUNK_EXITS)
def test_every_provider_batch_made_before_the_purge_deleted_the_records_is_canceled(
    context: WorkerContext, model: FakeAnthropic, workers: None, monkeypatch: pytest.MonkeyPatch,
    exit_: str,
) -> None:  # fmt: skip
    """A submission of two provider batches whose records the purge deleted before it ended.
    Only the loop's normal end canceled what the submission had made: at every other exit (a
    save refused, its lease refused, the second record refused, the second create failing)
    the first provider batch ran on to its end, billed for an erased tenant and named by no
    record (the refused record's branch canceled only the newest). Every exit that finds
    the batch erased cancels all of them now."""
    store = context.store
    batch, qids = _prepared(context, 2)
    client = context.batches
    assert client is not None
    create, new_submission = client.create, submission.new_submission
    record_sent = submission.record_sent
    made: list[str] = []
    purge: dict[str, Any] = {}
    mark_refused = exit_ == SECOND_CHUNK_EXITS[1]

    def purge_reads() -> None:  # the purge cancels the jobs, reads the provider batches to cancel
        purge["jobs"] = store.tenant_jobs("acme")
        store.cancel_tenant_jobs(purge["jobs"])
        purge["read"] = cancel.open_provider_batches(store, batch.id)

    def erase() -> None:  # the purge, its indexes dropped, deletes the records
        store.delete_tenant_jobs(purge["jobs"])
        store.delete_tenant_keys("acme")

    def create_(*args: Any, **kwargs: Any) -> Any:
        provider = create(*args, **kwargs)
        made.append(provider.id)
        if len(made) == 1 and mark_refused:
            purge_reads()
        elif len(made) == 2:
            erase()
            if exit_ == SECOND_CHUNK_EXITS[3]:
                raise RerankAttemptError(AttemptOutcome.CONNECTION, "Server disconnected")
        return provider

    def new_submission_() -> str:
        if made and not purge:  # the second chunk's, past its check for a cancel
            purge_reads()
            if exit_ == SECOND_CHUNK_EXITS[0]:
                erase()
        return new_submission()

    def record_sent_(*args: Any, **kwargs: Any) -> None:
        if mark_refused and store.get_batch(batch.id) is not None:
            erase()  # the first chunk's runs are refused; the second chunk's mark next
        record_sent(*args, **kwargs)

    monkeypatch.setattr(client, "create", create_)
    monkeypatch.setattr(economy.submission, "new_submission", new_submission_)
    monkeypatch.setattr(economy.submission, "record_sent", record_sent_)
    monkeypatch.setattr(context.settings, "economy_max_requests_per_batch", 1)

    if exit_ == SECOND_CHUNK_EXITS[3]:
        with pytest.raises(RerankAttemptError):
            _submission(context, batch, qids, "1")
    else:
        _submission(context, batch, qids, "1")

    assert purge["read"] == ([] if mark_refused else made[:1])  # the second: never seen
    statuses = {b["id"]: b["status"] for b in model.batches()}
    assert statuses[made[0]] != "in_progress", "left running, billed for an erased tenant"
    if exit_ == SECOND_CHUNK_EXITS[2]:
        assert statuses[made[1]] != "in_progress"
    assert _named(store, batch.id) == []


def test_a_purge_during_the_first_create_gets_no_second_create(
    context: WorkerContext, model: FakeAnthropic, workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The purge cancels the jobs while the first of two creates runs (it reads no provider
    batch: none is recorded yet): the submission makes no second create, for items of an
    erased tenant, and cancels the first one it made. Before, it created the second one
    after the purge's cancel, canceling both only once both were made."""
    store = context.store
    batch, qids = _prepared(context, 2)
    client = context.batches
    assert client is not None
    create = client.create
    read: list[list[str]] = []

    def create_(*args: Any, **kwargs: Any) -> Any:
        provider = create(*args, **kwargs)
        jobs = store.tenant_jobs("acme")
        store.cancel_tenant_jobs(jobs)
        read.append(cancel.open_provider_batches(store, batch.id))
        return provider

    monkeypatch.setattr(client, "create", create_)
    monkeypatch.setattr(context.settings, "economy_max_requests_per_batch", 1)
    _submission(context, batch, qids, "1")
    _purge_records(store)

    assert read == [[]]  # one create only, the purge having read nothing to cancel
    [made] = model.batches()
    assert made["status"] != "in_progress"
    assert _named(store, batch.id) == []

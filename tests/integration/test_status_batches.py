"""``sift status``'s batches against a real redis-server: an economy batch that waits on its
provider batches is running, though it has left the active set.

Its items, once prepared, wait on provider batches (for hours, by design), not on a chunk:
the re-drive's sweep then drops the batch from ``sift:active``, and its submission and polls
are watched in ``sift:eco-watch`` instead. ``sift status`` read only the active set, so it
showed ``Batches running: 0`` while the batch's items ran (its own footer counting them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from worker.clock import server_seconds
from worker.constants import ACTIVE_JOBS_KEY, BATCH_KEY, ECONOMY_PREPARED_KEY, WEBHOOKS_OWED_KEY
from worker.contract import ErrorInfo, RerankInfo, SearchResult, SearchSpec
from worker.queue.jobstore import JobStore
from worker.queue.redrive import Sweeper


def _status(redis_url: str, *args: str, columns: int = 250) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SIFT_REDIS_URL": redis_url, "COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", "--no-inspect", *args],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_an_economy_batch_waiting_on_its_provider_batches_is_a_batch_running(
    store: JobStore, redis_url: str
) -> None:
    spec = SearchSpec(index="docs", query="q")
    items = [(f"q{i}", spec) for i in range(2)]
    economy = store.create_batch("acme", "docs", items, lane="economy").id
    standard = store.create_batch("acme", "docs", items).id
    for batch_id in (economy, standard):
        for qid, _ in items:
            store.start_item(batch_id, qid)
    # the economy items are prepared and sent in a provider batch, whose poll is watched
    store.economy_save(economy, ECONOMY_PREPARED_KEY, {qid: "{}" for qid, _ in items})
    store.economy_expect(economy, "msgbatch_01", time.time() + 60)
    Sweeper(store, lambda *_: None, interval_seconds=30, stall_seconds=0).sweep()
    assert store.redis.zscore(ACTIVE_JOBS_KEY, economy) is None  # what the re-drive does
    assert store.redis.zscore(ACTIVE_JOBS_KEY, standard) is not None

    run = _status(redis_url, "--json")
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    rows = {row["id"]: row for row in status["batches"]}
    assert set(rows) == {economy, standard}
    assert (rows[economy]["lane"], rows[standard]["lane"]) == ("economy", "standard")
    assert rows[economy]["counts"]["running"] == 2
    assert rows[economy]["idle_seconds"] is None  # not in the active set: unknown
    assert status["in_flight"]["running"] == 4  # the footer's count agrees with the rows

    table = _status(redis_url)
    assert table.returncode == 0, table.stderr
    assert "Batches running: 2" in table.stdout and economy in table.stdout

    # finished, it is no batch running, though its poll is still watched until it is met
    for qid, _ in items:
        store.finish_item(
            economy, qid, result=SearchResult(hits=[], rerank=RerankInfo(applied=False))
        )
    run = _status(redis_url, "--json")
    assert [row["id"] for row in json.loads(run.stdout)["batches"]] == [standard]


def test_a_batch_id_is_shown_whole_at_80_columns(store: JobStore, redis_url: str) -> None:
    """80 columns is the width when the output is not a terminal (a pipe, a log, ssh
    without a tty): every cell of the batches' table was cut, the id to ``bat_…``, which
    named no batch. Now columns are left out, and named, until the id and the counts fit."""
    spec = SearchSpec(index="docs", query="q")
    batch_id = store.create_batch("acme", "docs", [("q0", spec)]).id
    store.start_item(batch_id, "q0")
    run = _status(redis_url, columns=80)
    assert run.returncode == 0, run.stderr
    [line] = [line for line in run.stdout.splitlines() if "bat_" in line]
    assert batch_id in line and "0/1" in line, run.stdout  # the id, and done of total
    assert "left out at this width" in run.stdout


def test_no_inspect_says_the_inspection_was_skipped_not_unanswered(redis_url: str) -> None:
    """``--no-inspect`` never asks Celery: it said ``no worker answered (none running, or
    remote control off ...)`` and ``inspect_answered: false``, an answer it never sought. Now
    ``skipped``, and ``null`` in the JSON; asked of a Redis with no worker, still ``false``."""
    table = _status(redis_url)  # _status passes --no-inspect
    assert table.returncode == 0, table.stderr
    assert "Celery's inspection: skipped (--no-inspect)" in table.stdout, table.stdout
    assert "no worker answered" not in table.stdout
    run = _status(redis_url, "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["inspect_answered"] is None
    env = {**os.environ, "SIFT_REDIS_URL": redis_url}
    asked = subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", "--json", "--timeout", "0.2"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["inspect_answered"] is False


def test_a_batch_that_moves_during_the_inspection_s_wait_is_not_shown_moved_in_the_future(
    store: JobStore,
) -> None:
    """The batches' ages are measured against Redis's clock read after them: against the one
    read before the workers' inspection (which waits up to its timeout), a batch that moved
    meanwhile showed ``moved -1 s ago``."""
    from worker.cli.status import collect

    batch_id = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q"))]).id

    def inspect(timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
        time.sleep(1.5)  # the workers' answers come late; the batch moves meanwhile
        seconds, micros = store.redis.time()
        store.redis.zadd(ACTIVE_JOBS_KEY, {batch_id: seconds + micros / 1e6})
        return {}, {}

    (batch,) = collect(store, inspect, timeout=1.0).batches
    assert batch.idle_seconds is not None and batch.idle_seconds >= 0, batch.idle_seconds


def test_a_batch_canceled_while_an_item_runs_shows_its_canceled_items(
    store: JobStore, redis_url: str
) -> None:
    """A batch canceled while one of its items runs is still running (its items in flight
    end it): its row read ``done 2/3``, ``failed 0`` and nothing else, the two items the
    cancel ended taken for finished work. Now a ``canceled`` column says 2."""
    spec = SearchSpec(index="docs", query="q")
    batch_id = store.create_batch("acme", "docs", [(f"q{i}", spec) for i in range(3)]).id
    store.start_item(batch_id, "q0")
    store.cancel_batch(batch_id)
    run = _status(redis_url)
    assert run.returncode == 0, run.stderr
    header = next(line for line in run.stdout.splitlines() if " done " in line).split()
    [row] = [line.split() for line in run.stdout.splitlines() if batch_id in line]
    cells = dict(zip(header, row, strict=False))  # up to age, whose cells hold a space
    assert cells["done"] == "2/3" and cells["failed"] == "0" and cells["running"] == "1"
    assert cells["canceled"] == "2", run.stdout


def test_a_batch_s_failed_items_are_shown_by_kind_and_unknown_ones_as_nothing(
    store: JobStore, redis_url: str
) -> None:
    """A running batch's row said ``failed 3`` and not why: its record's ``failures`` (by
    error type) and ``rerank_failures`` (its ``rerank_failed`` items by class) were shown by
    ``GET /v1/batches/{id}`` and ``sift batch`` only. Now a ``failures`` column has them, as
    ``sift batch`` writes them, and ``--json`` each row's two; a batch of an older release,
    whose failures by kind are unknown (``null``), shows none."""
    spec = SearchSpec(index="docs", query="q")
    errors = [
        ErrorInfo(type="rerank_failed", message="m", reason="http_4xx"),
        ErrorInfo(type="rerank_failed", message="m", reason="malformed"),
        ErrorInfo(type="index_not_found", message="m"),
    ]
    items = [(f"q{i}", spec) for i in range(len(errors) + 1)]  # one left running
    failing, older = (store.create_batch("acme", "docs", items).id for _ in "ab")
    store.redis.hdel(BATCH_KEY + older, "totals_failures")  # as an older release wrote it
    for batch_id in (failing, older):
        for (qid, _), error in zip(items, [*errors, None], strict=True):
            assert store.start_item(batch_id, qid)
            if error is not None:
                assert store.finish_item(batch_id, qid, error=error).applied

    run = _status(redis_url, "--json")
    assert run.returncode == 0, run.stderr
    rows = {row["id"]: row for row in json.loads(run.stdout)["batches"]}
    assert rows[failing]["failures"] == {"rerank_failed": 2, "index_not_found": 1}
    assert rows[failing]["rerank_failures"] == {"http_4xx": 1, "malformed": 1}
    assert (rows[older]["failures"], rows[older]["rerank_failures"]) == (None, None)

    table = _status(redis_url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    [shown] = [line for line in lines if failing in line]
    why = "rerank_failed 2 (http_4xx 1, malformed 1), index_not_found 1"
    assert shown.rstrip().endswith(why), table.stdout
    [unknown] = [line for line in lines if older in line]
    header = next(line for line in lines if " done " in line)
    assert header.split()[-1] == "failures" and unknown.split()[-1] == "–", table.stdout


def test_the_webhooks_owed_are_counted_with_those_overdue_and_waiting_for_a_retry(
    store: JobStore, redis_url: str
) -> None:
    """``sift status`` showed the webhook queue's messages only: not how many webhooks are
    owed (``sift:webhooks-owed``), nor those stuck, due long ago and not sent (a lost message
    before the re-drive's grace, webhook workers away), nor those waiting out a retry's
    countdown. Now counts of all tenants' (no job named), and the oldest overdue's age on
    Redis's clock."""
    spec = SearchSpec(index="docs", query="q")
    ids = [store.create_search("acme", spec, webhook_url="https://h.example/x").id for _ in "abcd"]
    for job_id in ids:  # each final move records its webhook owed, due at once
        store.start_search(job_id)
        store.finish_search(job_id, result=SearchResult(hits=[], rerank=RerankInfo(applied=False)))
    before = server_seconds(store.redis.time())
    store.webhook_due(ids[0], before + 300, attempt=2)  # its first attempt failed
    # two stuck: due 10 and 2 minutes ago, and never sent
    store.redis.zadd(WEBHOOKS_OWED_KEY, {ids[1]: before - 600, ids[2]: before - 120}, xx=True)

    run = _status(redis_url, "--json")
    after = server_seconds(store.redis.time())
    assert run.returncode == 0, run.stderr
    webhooks = json.loads(run.stdout)["webhooks"]
    oldest = webhooks.pop("oldest_overdue_seconds")
    assert webhooks == {"owed": 4, "waiting_retry": 1, "overdue": 2}, webhooks
    assert 600 <= oldest <= after - before + 600, oldest  # the one due 10 minutes ago
    assert "acme" not in run.stdout.partition('"webhooks"')[2]  # counts, no tenant's data

    table = _status(redis_url, columns=80)
    assert table.returncode == 0, table.stderr
    [line] = [line for line in table.stdout.splitlines() if line.startswith("webhooks owed")]
    assert line.startswith("webhooks owed 4: 1 waiting for a retry, 2 overdue (oldest due 6")
    assert len(line) <= 80

    store.redis.delete(WEBHOOKS_OWED_KEY)  # none owed: no age to give
    webhooks = json.loads(_status(redis_url, "--json").stdout)["webhooks"]
    assert webhooks == {
        "owed": 0, "waiting_retry": 0, "overdue": 0, "oldest_overdue_seconds": None
    }  # fmt: skip

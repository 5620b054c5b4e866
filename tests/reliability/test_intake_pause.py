"""A worker process paused by a big batch still answers searches and index reads at once.

A real stack (redis-server, the gateway under uvicorn, one ``sift worker`` process at its
default settings) and the fake Messages API answering in 10 s, so a reranked batch of 1,000
queries keeps more than a pool's worth (``SIFT_BATCH_ITEM_CONCURRENCY``, 300) of items
waiting: the process stops reading the batch queue (:mod:`worker.queue.intake`), and the
rest of the batch's chunks stay in Redis. Unpaused it would have taken every chunk at once
(its prefetch count is 300 messages; the batch is 40 chunks).

While it is paused, an ``fts`` search and ``GET /v1/indexes/{index}`` (an index read the
gateway answers 503 when no worker takes it in 10 s) both answer, taken while the process
was not reading the batch queue (its log says so; it reads it again whenever half a pool's
worth of items has started, so a request landing in such a moment is asked again). Then
SIGTERM while paused: the worker exits on its own.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    DOWN_SECONDS,
    FINISH_TIMEOUT,
    INDEX,
    Stack,
    assert_batch_exactly_once,
    batch_counts,
    broker,
    broker_state,
    gateway_stack,
    ingest,
    stack_env,
    submit_batch,
    wait_for,
)
from tests.services import gateway
from worker.constants import ALL_QUEUES, BATCH_QUEUE, INDEX_READ_TASK, SEARCH_TASK
from worker.processes.stack import child_env, worker_process
from worker.settings import Settings

pytestmark = pytest.mark.integration

TOTAL = 1000  # queries: 40 chunks of 25


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with gateway_stack(tmp_path, model_delay=10.0) as running:
        yield running


def received_while_paused(log: str, task: str) -> list[bool]:
    """For each ``task`` the worker's log has received, in order: whether it came after the
    process stopped reading the batch queue and before it read it again."""
    paused, seen = False, []
    for line in log.splitlines():
        if f"stopped reading {BATCH_QUEUE}" in line:
            paused = True
        elif f"reading {BATCH_QUEUE} again" in line:
            paused = False
        elif f"Task {task}[" in line and line.endswith("received"):
            seen.append(paused)
    return seen


def test_a_paused_process_still_answers_searches_and_index_reads(
    stack: Stack, tmp_path: Path
) -> None:
    broker = redis.Redis.from_url(stack.redis_url)
    env = child_env(stack.env, inherit_sift=False)
    pool = Settings.model_fields["batch_item_concurrency"].default
    with worker_process(tmp_path / "w", env) as worker:
        ingest(stack.client)
        batch_id = submit_batch(stack.client, TOTAL)

        def paused_with_the_pool_full() -> bool:
            """Every thread on an item (none starts for 10 s: the model's latency) and
            chunks left in Redis, the same a second later."""
            before = int(broker.llen(BATCH_QUEUE))
            time.sleep(1.0)
            started = batch_counts(stack.client, batch_id)["counts"]["running"]
            return before == int(broker.llen(BATCH_QUEUE)) > 0 and started >= pool

        wait_for(paused_with_the_pool_full, "the process paused, its pool full", 120)
        log_file = tmp_path / "w" / "worker.log"

        def search() -> None:
            sent = stack.client.post(
                "/v1/searches",
                json={"index": INDEX, "query": "green tea", "mode": "fts", "rerank": False},
                headers=ACME,
            )
            assert sent.status_code == 202, sent.text
            search_id = sent.json()["id"]

            def search_done() -> bool:
                body = stack.client.get(f"/v1/searches/{search_id}", headers=ACME).json()
                return bool(body["status"] in ("succeeded", "failed"))

            wait_for(search_done, "the fts search answered")
            done = stack.client.get(f"/v1/searches/{search_id}", headers=ACME).json()
            assert done["status"] == "succeeded", done
            assert done["result"]["hits"] and done["result"]["rerank"]["applied"] is False

        def index_read() -> None:
            index = stack.client.get(f"/v1/indexes/{INDEX}", headers=ACME)
            assert index.status_code == 200, index.text
            assert index.json()["documents"] > 0, index.json()

        # Each is answered. The process pauses and reads the batch queue again as its items
        # start (half a pool's worth), so one may land in a moment it reads: ask again, up to
        # five times, until one was taken while paused.
        for ask, task in ((search, SEARCH_TASK), (index_read, INDEX_READ_TASK)):
            for _ in range(5):
                ask()
                if any(received_while_paused(log_file.read_text(errors="replace"), task)):
                    break
            log = log_file.read_text(errors="replace")
            assert any(received_while_paused(log, task)), log[-3000:]
        batch = batch_counts(stack.client, batch_id)
        assert batch["status"] == "running" and batch["counts"]["queued"] > 0, batch

        worker.send_signal(signal.SIGTERM)  # while paused: hands the batch back and exits
        assert worker.wait(120) == 0


def test_a_process_paused_when_redis_restarts_reads_the_batch_queue_again(tmp_path: Path) -> None:
    """Redis restarted (SIGTERM, AOF on) while the process is paused: the consumer after the
    reconnect starts on every queue and is paused again while items wait, then reads the
    batch queue again, so the batch ends with every item once and no chunk left in Redis.
    (Under load the paused items may all finish before the reconnect: the consumer then
    reads the queue from its start, with no second pause to lift.)"""
    with (
        FakeAnthropic(delay=3.0) as model,
        broker(tmp_path / "redis") as redis_broker,
    ):
        url = redis_broker.url + "/0"
        env = stack_env(url, model.url)
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            worker_process(tmp_path / "w", child_env(env, inherit_sift=False)) as worker,
        ):
            ingest(client)
            batch_id = submit_batch(client, TOTAL)
            log = tmp_path / "w" / "worker.log"
            wait_for(lambda: f"stopped reading {BATCH_QUEUE}" in log.read_text(), "a pause", 120)
            redis_broker.kill(signal.SIGTERM)
            time.sleep(DOWN_SECONDS)
            redis_broker.start_again()
            wait_for(
                lambda: batch_counts(client, batch_id)["status"] == "succeeded",
                "the batch finished after the restart",
                FINISH_TIMEOUT,
            )
            assert_batch_exactly_once(client, url, batch_id, TOTAL)
            assert not any(broker_state(url)[queue] for queue in ALL_QUEUES), broker_state(url)
            text = log.read_text(errors="replace")
            after = text[text.index("Connection to broker lost") :]
            # the consumer after the reconnect reads every queue and is paused again if a
            # pool's worth of items still waits (not if they finished during the outage, as
            # on a loaded machine): a pause after the reconnect is always lifted in the end
            # (and the batch finishing with this one worker proves the queue was read)
            if f"stopped reading {BATCH_QUEUE}" in after:
                last_stop = after.rindex(f"stopped reading {BATCH_QUEUE}")
                assert f"reading {BATCH_QUEUE} again" in after[last_stop:], text[-3000:]
            assert worker.poll() is None

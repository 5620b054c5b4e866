"""Index reads overtake a search backlog, and one nobody waits for any more is dropped unrun.

A real gateway under uvicorn, a real Redis and a real ``sift worker`` at its defaults (300
threads, a prefetch of one message a thread), frozen (SIGSTOP) while the backlog is queued, the
model holding every call. Each index read (``GET /v1/indexes...``) is a task on
``sift.search``: it was queued behind every search waiting there, so behind a backlog longer
than a worker's threads it waited out ``INDEX_READ_TIMEOUT_SECONDS`` and answered ``503
backend_unavailable`` ("no worker answered the index read within 10 s") while the workers were
healthy; and each read given up so still ran later, answering no one.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from tests.keys import ACME
from tests.reliability.support import INDEX, gateway_stack, ingest, sample_queries, wait_for
from tests.services import celery_worker
from worker.constants import INDEX_REPLY_KEY, SEARCH_KEY, SEARCH_QUEUE, kombu_queue_keys
from worker.settings import Settings

pytestmark = pytest.mark.integration

# more searches than a worker process at its defaults takes at once (one a thread)
BACKLOG = int(Settings.model_fields["worker_concurrency"].default) + 50


def _queued(broker: redis.Redis) -> int:
    return sum(int(broker.llen(key)) for key in kombu_queue_keys(SEARCH_QUEUE))


def _finished(broker: redis.Redis, ids: list[str]) -> int:
    pipe = broker.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(SEARCH_KEY + job_id, "status")
    return sum(s not in (b"queued", b"running") for s in pipe.execute())


def test_an_index_read_overtakes_queued_searches_and_a_late_one_is_dropped(
    tmp_path: Path,
) -> None:
    with gateway_stack(tmp_path, model_delay=0.0) as stack:
        assert stack.model is not None
        with celery_worker(tmp_path / "w0", stack.env, "w0"):
            ingest(stack.client)
        broker = redis.Redis.from_url(stack.redis_url)
        # no worker: a read waits its 10 s and is given up (503); its message stays queued
        given_up = stack.client.get(f"/v1/indexes/{INDEX}", headers=ACME)
        assert given_up.status_code == 503, given_up.text
        assert _queued(broker) == 1
        log = tmp_path / "w" / "w.log"
        with celery_worker(tmp_path / "w", stack.env, "w", concurrency=0, pool="") as worker:
            # the read given up is taken, and dropped unrun: no answer was ever written
            wait_for(lambda: "came after its gateway gave up; dropped" in log.read_text(),
                     "the read given up dropped")  # fmt: skip
            assert _queued(broker) == 0
            assert list(broker.scan_iter(INDEX_REPLY_KEY + "*")) == []
            # frozen while the backlog and the next read are queued, so the read's 10 s are
            # not spent on the worker's start (the first read's were, on a loaded machine);
            # once its warm-up has built its runtime and loaded the model: frozen midway, the
            # warm-up went on after SIGCONT and the read waited for the runtime it was building
            # (3 s idle, 21 s on a loaded host: the last CI's 503; now 0.06 s and 0.13 s)
            wait_for(lambda: "loaded embedding model" in log.read_text(), "the worker's warm-up")
            worker.send_signal(signal.SIGSTOP)
            try:
                stack.model.configure(hold_unscripted=True)  # every search's model call held
                queries = sample_queries()
                ids = [
                    stack.client.post(
                        "/v1/searches", json={"index": INDEX, "query": queries[i % len(queries)]},
                        headers=ACME,
                    ).json()["id"]
                    for i in range(BACKLOG)
                ]  # fmt: skip
                with ThreadPoolExecutor(1) as pool:
                    read = pool.submit(stack.client.get, f"/v1/indexes/{INDEX}", headers=ACME)
                    # the frozen worker's pending BRPOP may have taken the first search
                    wait_for(lambda: _queued(broker) >= BACKLOG, "the read queued with the backlog")
                    worker.send_signal(signal.SIGCONT)
                    answer = read.result()
            finally:
                worker.send_signal(signal.SIGCONT)
            # answered while the backlog waits: searches still in the broker, none done
            still_queued, done = _queued(broker), _finished(broker, ids)
            stack.model.configure(hold_unscripted=False)
            assert answer.status_code == 200, answer.text
            assert answer.json()["name"] == INDEX
            assert still_queued > 0 and done == 0, (still_queued, done)
            wait_for(lambda: _finished(broker, ids) == BACKLOG, "the backlog's searches", 180)
        assert _queued(broker) == 0
        assert list(broker.scan_iter(INDEX_REPLY_KEY + "*")) == []

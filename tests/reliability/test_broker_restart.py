"""Redis restarted under a running batch, five times in a row: the worker keeps consuming.

The broker as ``sift up`` and ``deploy/`` run it: AOF on, ``appendfsync everysec``. One
redis-server, one gateway and one ``sift worker`` at default settings (the threads pool, 300
threads, the derived visibility timeout, the re-drive every 30 s). Each round submits a small
reranked batch, SIGKILLs or SIGTERMs redis-server once some items are done, starts it again on
the same port and directory, and checks:

- the worker process is the same one, still running: no "Unrecoverable error" (kombu's close
  after a dropped connection, celery/celery#10205; :mod:`worker.queue.broker` holds the workaround);
- the gateway answers 503 while Redis is down, and its first request after the restart 200;
- the batch ends ``succeeded`` with every item final exactly once (the store's counts moved
  once per item, one result per query id), without restarting anything, and no message is
  left in a queue.

A killed redis-server loses nothing the OS already has (``everysec`` only delays the fsync), so
these runs see no lost write; a lost one would be the re-drive's to recover, which the
re-drive tests cover.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from subprocess import Popen

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    DOWN_SECONDS,
    FINISH_TIMEOUT,
    Broker,
    all_results,
    assert_batch_exactly_once,
    batch_counts,
    broker,
    broker_state,
    ingest,
    stack_env,
    submit_batch,
    wait_for,
)
from tests.services import gateway
from worker.constants import ALL_QUEUES
from worker.processes.stack import child_env, worker_process

pytestmark = pytest.mark.integration

RUNS = 5
TOTAL = 200  # items per batch: a few seconds of work, so each restart lands mid-batch


def _succeeded(client: httpx.Client, batch_id: str) -> int:
    return int(batch_counts(client, batch_id)["counts"]["succeeded"])


def _queues_empty(url: str) -> bool:
    state = broker_state(url)
    return not any(state[queue] for queue in ALL_QUEUES)


def _worker_alive(worker: Popen[bytes], log: Path) -> None:
    text = log.read_text(errors="replace")
    if "Unrecoverable error" in text:
        raise AssertionError(text[text.index("Unrecoverable error") :][:3000])
    assert worker.poll() is None, f"the worker exited ({worker.returncode}):\n{text[-3000:]}"


def _one_round(client: httpx.Client, redis_broker: Broker, signum: signal.Signals, run: int) -> int:
    """Submit a batch, restart Redis under it, see it finish exactly once; answer the status
    of the gateway's first request after the restart."""
    batch_id = submit_batch(client, TOTAL)
    wait_for(lambda: _succeeded(client, batch_id) >= TOTAL // 5, "a fifth done")
    redis_broker.kill(signum)
    time.sleep(DOWN_SECONDS / 2)
    down = client.get(f"/v1/batches/{batch_id}", headers=ACME)  # clients keep calling
    assert down.status_code == 503, down.text  # typed, not a 500
    time.sleep(DOWN_SECONDS / 2)
    redis_broker.start_again()
    first = client.get(f"/v1/batches/{batch_id}", headers=ACME).status_code
    started = time.monotonic()
    try:
        wait_for(
            lambda: batch_counts(client, batch_id)["status"] == "succeeded",
            f"run {run}: the batch finished",
            FINISH_TIMEOUT,
        )
    except AssertionError as exc:
        counts = batch_counts(client, batch_id)["counts"]
        raise AssertionError(f"{exc}; {counts}; {broker_state(redis_broker.url + '/0')}") from exc
    assert_batch_exactly_once(client, redis_broker.url + "/0", batch_id, TOTAL)
    # the batch's totals took each item's usage once: a finish sent again through the
    # restart added none twice (nor dropped one)
    usages = [r["result"]["usage"] for r in all_results(client, batch_id)]
    totals = batch_counts(client, batch_id)["usage"]
    for key in ("requests", "input_tokens", "output_tokens"):
        assert totals[key] == sum(u[key] for u in usages) > 0, (key, totals)
    assert totals["cost_usd"] == pytest.approx(sum(u["cost_usd"] for u in usages))
    # nothing left waiting in a queue: the worker consumed every message, the restored ones
    # included. Late acks of tasks that ran through the restart reach Redis too; only an ack
    # sent while Redis was down leaves its message in "unacked", to run again as a no-op
    # after the visibility timeout (printed, not asserted: it depends on the kill's timing).
    try:
        wait_for(lambda: _queues_empty(redis_broker.url + "/0"), f"run {run}: queues empty", 30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {broker_state(redis_broker.url + '/0')}") from exc
    finished = time.monotonic() - started
    with contextlib.suppress(AssertionError):  # the last acks follow the batch's end
        wait_for(lambda: broker_state(redis_broker.url + "/0")["unacked"] == 0, "acks", 10)
    print(
        f"\nrun {run} ({signum.name}): first request {first}, batch finished {finished:.1f} s "
        f"after the restart, {broker_state(redis_broker.url + '/0')['unacked']} message(s) "
        "still unacked (after up to 10 s)"
    )
    return first


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_redis_restarted_mid_batch_five_times_the_worker_keeps_consuming(
    tmp_path: Path, model: FakeAnthropic, signum: signal.Signals
) -> None:
    first_requests: list[int] = []
    with broker(tmp_path / "redis") as redis_broker:
        env = child_env(stack_env(redis_broker.url + "/0", model.url), inherit_sift=False)
        log = tmp_path / "w" / "worker.log"
        with (
            worker_process(tmp_path / "w", env) as worker,  # default pool and concurrency
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            ingest(client)
            for run in range(RUNS):
                first_requests.append(_one_round(client, redis_broker, signum, run))
                _worker_alive(worker, log)  # the same process consumed every batch
    # the gateway's first request after each restart (a closed pooled connection is replaced)
    assert first_requests == [200] * RUNS, first_requests

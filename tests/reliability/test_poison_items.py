"""A batch item fails as poison when its own runs were lost ``SIFT_TASK_MAX_DELIVERIES`` times,
not when its chunk's message was: at the defaults (300 item threads a worker process, chunks of
25), a worker holds far more chunks than it runs items, and each worker lost counts a delivery
of every chunk it held.

A 400-item batch whose every search holds (``holding_runtime``): each worker starts 300 items,
and 100 wait, never started, in its item queue. The worker is SIGKILLed three times; then a
fourth worker, the holds released, takes the chunks, every one past the delivery limit.
Before, all 400 items ended ``failed`` ``delivery_limit_exceeded`` ("the worker running this
job was lost 3 times"), the 50 never started, and those killed once or twice, with them: three
OOM kills in a 100,000-query batch failed every item its chunks held. Now an item fails so only
when three runs of it were lost; the others run and succeed.
"""

from __future__ import annotations

import re
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import ACME, INDEX, all_results, ingest, stack_env, wait_for
from tests.services import gateway, redis_server
from worker.processes.stack import child_env, worker_process

pytestmark = pytest.mark.integration

ITEMS = 400
KILLS = 3  # SIFT_TASK_MAX_DELIVERIES at its default
HIT = re.compile(r"hit-(q\d+)-(\d+)-\d+$")


def runs_lost(holds: Path) -> Counter[str]:
    """How many worker processes (each killed) started each item's search."""
    started = {m.groups() for f in holds.iterdir() if (m := HIT.match(f.name))}
    return Counter(item for item, _ in started)


@pytest.mark.timeout(900)
def test_only_an_item_whose_own_runs_were_lost_three_times_fails_as_poison(
    tmp_path: Path,
) -> None:
    holds = tmp_path / "holds"
    holds.mkdir()
    with (
        FakeAnthropic() as model,
        redis_server(tmp_path / "redis", appendonly=True) as redis_url,
    ):
        env = stack_env(
            redis_url + "/0",
            model.url,
            SIFT_RUNTIME_FACTORY="tests.reliability.holding_runtime:build_runtime",
            HOLD_DIR=str(holds),
        )
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")  # the default, as a user runs it
        with (
            gateway(tmp_path / "g", env) as url,
            httpx.Client(base_url=url, timeout=30) as client,
        ):
            batch_id = ""
            for kill in range(KILLS):
                name = f"w{kill}"
                with worker_process(tmp_path / "w", child_env(env, inherit_sift=False), name) as w:
                    if kill == 0:
                        ingest(client)
                        queries = [
                            {"id": f"q{i:03d}", "query": f"volcano hold-search q{i:03d}"}
                            for i in range(ITEMS)
                        ]
                        answer = client.post(
                            "/v1/batches",
                            json={"index": INDEX, "rerank": False, "queries": queries},
                            headers=ACME,
                        )
                        assert answer.status_code == 202, answer.text
                        batch_id = answer.json()["id"]
                    held = 300 * (kill + 1)  # every item thread of this worker holds one
                    wait_for(lambda n=held: len(list(holds.iterdir())) >= n, f"{held} held", 300)
                    time.sleep(1.0)  # its chunks' deliveries on record
                    w.send_signal(signal.SIGKILL)
                    assert w.wait(30) == -signal.SIGKILL
            lost = runs_lost(holds)
            (holds / "release").touch()
            with worker_process(tmp_path / "w", child_env(env, inherit_sift=False), "last"):

                def final() -> bool:
                    batch = client.get(f"/v1/batches/{batch_id}", headers=ACME).json()
                    return bool(batch["status"] in ("succeeded", "failed", "canceled"))

                wait_for(final, "the batch final", 400)
                results = {r["query_id"]: r for r in all_results(client, batch_id)}
            batch = client.get(f"/v1/batches/{batch_id}", headers=ACME).json()
    by_runs_lost = Counter(lost.get(q, 0) for q in results)
    print("items by runs lost:", dict(by_runs_lost), "batch:", batch["counts"])
    assert len(results) == ITEMS
    fewer = sum(n for runs, n in by_runs_lost.items() if runs < KILLS)
    assert fewer and by_runs_lost[KILLS], by_runs_lost  # the scenario arose
    for query_id, result in results.items():
        if lost.get(query_id, 0) >= KILLS:
            assert result["status"] == "failed", (query_id, result)
            assert result["error"]["type"] == "delivery_limit_exceeded", (query_id, result)
        else:
            assert result["status"] == "succeeded", (query_id, lost.get(query_id), result)
    poison = sum(1 for q in results if lost.get(q, 0) >= KILLS)
    assert batch["counts"]["failed"] == poison
    assert batch["counts"]["succeeded"] == ITEMS - poison

"""A single search overtakes the batch items waiting for its worker process's CPU slots.

A real gateway under uvicorn, a real Redis and a real ``sift worker`` at its defaults (one
process, its item pool of 300 threads, one CPU slot per core and one more). A batch's chunks
put every item on the item pool at once, and the items queue for the slots; a single search
sent then waited behind every one of them in one line (a median of 2 s, 7 s at worst, behind
a 20,000-item batch, for 5 ms of its own work), a wait its trace did not show. No clock is
read here: what is asserted is an order, how many of the items already waiting for a slot
when the search was sent finished before it did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.keys import ACME
from tests.reliability.support import (
    INDEX,
    Stack,
    batch_counts,
    gateway_stack,
    ingest,
    submit_batch,
    wait_for,
)
from tests.services import celery_worker
from worker.settings import Settings

pytestmark = pytest.mark.integration

ITEM_POOL = int(Settings.model_fields["batch_item_concurrency"].default)  # 300
BATCH = 20 * ITEM_POOL  # long enough that the item pool stays full throughout the test
SEARCHES = 5


def _search(stack: Stack) -> dict[str, Any]:
    response = stack.client.post(
        "/v1/searches",
        params={"wait": 30},
        json={"index": INDEX, "query": "volcano ash", "rerank": False, "include_trace": True},
        headers=ACME,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert body["status"] == "succeeded", body
    return body


def test_a_single_search_waits_for_its_cpu_slot_ahead_of_a_batch_s_items(tmp_path: Path) -> None:
    with gateway_stack(tmp_path, model_delay=0.0) as stack:
        client = stack.client
        with celery_worker(tmp_path / "w", stack.env, "w", concurrency=0, pool=""):
            ingest(client)
            batch_id = submit_batch(client, BATCH, rerank=False)
            # the item pool full: most of its items started and waiting for a slot
            wait_for(lambda: batch_counts(client, batch_id)["counts"]["running"]
                     >= ITEM_POOL * 2 // 3, "the item pool full")  # fmt: skip
            waiting = overtaken = 0
            traces = []
            for _ in range(SEARCHES):
                before = batch_counts(client, batch_id)["counts"]
                traces.append(_search(stack)["result"]["trace"])
                after = batch_counts(client, batch_id)["counts"]
                assert after["succeeded"] < BATCH, after  # the batch ran throughout
                waiting += before["running"]
                overtaken += after["succeeded"] - before["succeeded"]
            client.delete(f"/v1/batches/{batch_id}", headers=ACME)
        # In one line each search waited for the items running when it was sent (all but
        # those holding the slots were waiting for one; a semaphore's waiter may be passed by
        # a thread arriving as a slot is freed, so some searches were lucky): it finished after
        # them. Ahead of them, it has the next slot freed; the items finished meanwhile are
        # those ending while it travels to its worker and back.
        assert overtaken < waiting // 2, (overtaken, waiting)
        for trace in traces:  # its wait, told
            assert isinstance(trace["slot_wait_seconds"], float), trace
            assert trace["slot_wait_seconds"] >= 0.0

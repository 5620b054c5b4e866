"""Redis down past the worker's retries while searches run: no paid answer thrown away.

``test_redis_outage_past_retries`` keeps Redis down past the client's retries once, the held
calls answered ``529`` (billed nothing). A run that meets that ends without a finish, its job
left ``running`` for the re-drive's copy. Here the held calls of a batch's items and a search
are answered ``200`` (billed) once Redis is gone, and Redis stays down until every run has
given up (the worker's log says its task waits for Redis to settle them): its keep of the
answer in its run claim, then its job's finish, each past the client's ``OUTAGE_SECONDS``.
The answer was dropped with its run, and the copy paid the model again: every job billed
twice. ``test_redis_outage_redrives`` has one search meet more outages than its re-drives.

At the defaults, no setting shortened: the fake model holds each run's call, redis-server is
SIGKILLed and comes back on its AOF once the worker's log says the runs ended (a few minutes).
The shared rate budget is on (``SIFT_RATE_LIMITS``; a deployment's learns the provider's limits
from its headers): each answer's settlement with it meets Redis down too, past its retries, and
is dropped, the answer kept. Its ``ConnectionError`` lost the answer before it was kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.outages import ITEMS, outage_stack
from tests.reliability.support import (
    FINISH_TIMEOUT,
    all_results,
    assert_batch_exactly_once,
    batch_counts,
    submit_batch,
    submit_search,
    wait_for,
)
from worker.redis_client import OUTAGE_SECONDS

pytestmark = pytest.mark.integration


# the worker's log line of a task waiting for Redis to settle a run it ended
SETTLING = "Redis unreachable ended its run; waiting"
# the shared rate budget on: each call reserves, and each answer settles, its share in Redis
LIMITS = {"claude-haiku-4-5": {"rpm": 6_000, "itpm": 10_000_000, "otpm": 1_000_000}}


@pytest.mark.timeout(600)
def test_an_answer_that_comes_while_redis_is_down_past_the_retries_is_billed_once(
    tmp_path: Path,
) -> None:
    with outage_stack(tmp_path, SIFT_RATE_LIMITS=json.dumps(LIMITS)) as stack:
        model, client, url = stack.model, stack.client, stack.url
        batch_id = submit_batch(client, ITEMS)
        search_id = submit_search(client, "which engine beat the world champion")
        wait_for(lambda: model.counts()["received"] == ITEMS + 1, "every call held")
        stack.down_while_held()
        model.configure(hold_until_received=0)  # each run's answer, billed
        wait_for(lambda: model.counts()["statuses"].get("200") == ITEMS + 1, "the answers")
        # each run's keep of its answer, then its job's finish, retries for
        # OUTAGE_SECONDS each: Redis stays down until both tasks' runs have given up
        wait_for(lambda: stack.logged(SETTLING) == 2, "every run ended", 8 * OUTAGE_SECONDS)
        stack.broker.start_again()

        def finished() -> bool:
            done = batch_counts(client, batch_id)["finished_at"] is not None
            return done and stack.search(search_id)["status"] != "running"

        wait_for(finished, "the batch and the search final", FINISH_TIMEOUT)
        search = stack.search(search_id)
        errors = {r["query_id"]: r["error"] for r in all_results(client, batch_id) if "error" in r}
        assert (search["status"], errors) == ("succeeded", {}), (search.get("error"), errors)
        assert_batch_exactly_once(client, url, batch_id, ITEMS)
        # one answer paid per job: the copies finished on the answers their runs held
        assert model.counts()["statuses"] == {"200": ITEMS + 1}
        usages = [r["result"]["usage"] for r in all_results(client, batch_id)]
        assert [u["requests"] for u in usages] == [1] * ITEMS
        result = search["result"]
        assert isinstance(result, dict) and result["usage"]["requests"] == 1, result
        # the premise: each run's keep of its answer, and first its settlement with the
        # rate budget, met Redis down past its retries
        assert stack.logged("could not be kept with the run claim") == ITEMS + 1
        assert stack.logged("could not be settled") == ITEMS + 1

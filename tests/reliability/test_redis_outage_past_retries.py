"""Redis gone longer than the worker's clients retry it: what was mid-run is run again.

The worker's Redis clients (the job store, each index's settings, the shared rate budget)
retry a refused or broken connection for ``OUTAGE_SECONDS`` (30 s,
:mod:`worker.redis_client`) and then raise. ``test_broker_restart`` keeps Redis down 2 s;
here it stays down past that window. A batch item or a search that had taken its run claim
met the error there and ended ``failed`` ``internal_error``, its message Redis's own text
(``ConnectionError: Error 111 connecting to 127.0.0.1:<port>. Connection refused.``): the
job store's failure made the job's, and showed the tenant the Redis address (2 to 8 items
of 2,000 to 3,000 in each 45 to 60 s outage of a review, none in a 20 s one).

Made deterministic at the defaults: the fake model holds each call (a batch's items and one
search, all past their claims and inside their model call), redis-server is SIGKILLed, and
each call is then answered ``529``. The answer's bookkeeping opens the shared rate budget's
breaker in Redis, which is down: that call raises once the client's window is over, in every
run. Redis comes back on its AOF ``OUTAGE_SECONDS`` + 5 s after the answers (the test takes
about 70 s; no setting is shortened to make it quicker). Every item and the search must end
``succeeded``, each run again once Redis was back, and each billed for one model answer: the
529s were not billed, and the runs taken over made one call each.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fake_anthropic import status
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


@pytest.mark.timeout(600)
def test_runs_that_meet_redis_down_past_the_clients_retries_are_run_again_not_failed(
    tmp_path: Path,
) -> None:
    with outage_stack(tmp_path) as stack:
        model, client = stack.model, stack.client
        model.script([status(529)] * (ITEMS + 1))  # each held call's answer, once
        batch_id = submit_batch(client, ITEMS)
        search_id = submit_search(client, "which engine beat the world champion")
        wait_for(lambda: model.counts()["received"] == ITEMS + 1, "every call held")
        # each run has claimed its item (or search) and is in its model call: the claims
        # survive the kill
        stack.down_while_held()
        model.configure(hold_until_received=0)  # now the 529s
        wait_for(lambda: model.counts()["statuses"].get("529") == ITEMS + 1, "the 529s answered")
        # each run's next Redis call (the budget's breaker) retries for OUTAGE_SECONDS
        # from about now, then raises, with Redis still down
        time.sleep(OUTAGE_SECONDS + 5)
        stack.broker.start_again()

        def finished() -> bool:
            done = batch_counts(client, batch_id)["finished_at"] is not None
            return done and stack.search(search_id)["status"] != "running"

        wait_for(finished, "the batch and the search final", FINISH_TIMEOUT)
        search = stack.search(search_id)
        errors = {r["query_id"]: r["error"] for r in all_results(client, batch_id) if "error" in r}
        assert (search["status"], errors) == ("succeeded", {}), (search.get("error"), errors)
        assert_batch_exactly_once(client, stack.url, batch_id, ITEMS)
        # one billed answer per job: the runs taken over called the model once each
        # (the 529s bill nothing), and the records show that call once
        assert model.counts()["statuses"] == {"529": ITEMS + 1, "200": ITEMS + 1}
        usages = [r["result"]["usage"] for r in all_results(client, batch_id)]
        assert [u["requests"] for u in usages] == [1] * ITEMS
        assert batch_counts(client, batch_id)["usage"]["requests"] == ITEMS
        result = search["result"]
        assert isinstance(result, dict) and result["usage"]["requests"] == 1, result
        # the premise: each run met Redis down past its retries (Redis came back after
        # them, not in time for a call to get through), and was left for its redelivery
        log = stack.log.read_text(errors="replace")
        assert log.count("Redis failed during its run; left for a redelivery") == ITEMS + 1

"""Redis down past the worker's retries, again and again: no outage charged to a job's
re-drives.

One search's runs meet four outages in a row (each as in ``test_redis_outage_answers``: its
run in its model call when redis-server is SIGKILLed, its answer a ``529``, Redis back once
the run has given up). Each re-drive was counted against ``SIFT_TASK_MAX_DELIVERIES`` (3), so
the fourth was sent as poison, and the search failed ``delivery_limit_exceeded`` with no fault
of its own.

At the defaults, no setting shortened (several minutes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fake_anthropic import status
from tests.reliability.outages import HELD, outage_stack
from tests.reliability.support import FINISH_TIMEOUT, submit_search, wait_for
from worker.redis_client import OUTAGE_SECONDS
from worker.settings import Settings

pytestmark = pytest.mark.integration


# the worker's log line of a run that met Redis down past its retries and ended
LEFT = "Redis failed during its run; left for a redelivery"


@pytest.mark.timeout(900)
def test_a_search_that_meets_more_outages_than_its_redrives_still_succeeds(
    tmp_path: Path,
) -> None:
    outages = Settings.model_fields["task_max_deliveries"].default + 1  # one past its re-drives
    with outage_stack(tmp_path) as stack:
        model, client = stack.model, stack.client
        search_id = submit_search(client, "which engine beat the world champion")
        for outage in range(1, outages + 1):
            # the search's run (the first, or a re-drive's copy) is in its model call
            wait_for(
                lambda n=outage: model.counts()["received"] == n,
                f"run {outage} in its call",
                FINISH_TIMEOUT,
            )
            stack.down_while_held()
            model.script([status(529)])  # billed nothing; its bookkeeping meets Redis down
            model.configure(hold_until_received=0)
            wait_for(lambda n=outage: model.counts()["statuses"].get("529") == n, "the 529")
            model.configure(hold_until_received=HELD)  # the next run's call, held
            # the answer's bookkeeping retries for OUTAGE_SECONDS: Redis comes back once
            # the run has given up and ended
            wait_for(
                lambda n=outage: stack.logged(LEFT) == n, f"run {outage} ended", 6 * OUTAGE_SECONDS
            )
            stack.broker.start_again()

        def last_run_or_end() -> bool:
            received = model.counts()["received"]
            return received > outages or stack.search(search_id)["status"] != "running"

        wait_for(last_run_or_end, "another run, or the search's end", FINISH_TIMEOUT)
        model.configure(hold_until_received=0)
        wait_for(lambda: stack.search(search_id)["status"] != "running", "the search final")
        search = stack.search(search_id)
        assert search["status"] == "succeeded", search.get("error")
        assert model.counts()["statuses"] == {"529": outages, "200": 1}
        assert stack.logged(LEFT) == outages

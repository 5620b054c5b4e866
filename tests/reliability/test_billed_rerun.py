"""A worker killed between a billed model attempt and its retry's answer: the item runs again
on a new worker, and its record shows the attempt the dead run was billed for.

The first call is answered with malformed output (billed, retried), the retry is held at the
fake Messages API, and the worker is SIGKILLed. Before, the new worker's run showed one
request: the dead run kept its model's answer in its run claim only once its calls were
over, so the billed malformed attempt was on no record (and, with the dead process's
counters, in no metric). Now each billed attempt is kept in the claim as it is made, and the
run after it adds it (a call whose answer never came, the held retry, stays unknown).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.fake_anthropic import FakeAnthropic, malformed
from tests.reliability.economy import economy_stack, finished, worker
from tests.reliability.support import all_results, ingest, submit_batch, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_a_billed_attempt_of_a_killed_run_is_on_its_item_s_record(tmp_path: Path) -> None:
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        with worker(tmp_path / "w", env, "first") as first:
            ingest(client)
            model.configure(hold_unscripted=True)
            model.script([malformed("not json")])
            batch_id = submit_batch(client, 1, include_trace=True)
            wait_for(lambda: model.counts()["received"] >= 2, "the retry sent", 120)
            first.send_signal(signal.SIGKILL)
            assert first.wait(30) == -signal.SIGKILL
        model.configure(hold_unscripted=False)  # the held retry is answered, to no one
        with worker(tmp_path / "w", env, "second"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", 300)
        (line,) = all_results(client, batch_id)
        billed = model.usage()
    assert line["status"] == "succeeded", line
    result = line["result"]
    outcomes = [attempt["outcome"] for attempt in result["trace"]["attempts"]]
    assert outcomes == ["malformed", "ok"], result["trace"]["attempts"]
    assert result["usage"]["requests"] == 2, result["usage"]
    per_call = billed["input_tokens"] // billed["responses"]  # one prompt: every call alike
    assert billed["input_tokens"] == per_call * billed["responses"]
    assert result["usage"]["input_tokens"] == 2 * per_call, (result["usage"], billed)

"""An economy submission taken past its deadline by a worker without ``SIFT_GENERATION_MODEL``
while a worker with the model lives (a pool of mixed settings): the items never sent wait for
the worker with the model, which sends them; they are not ended ``no_generation_model``.

Before, the worker without the model ended them by the failure policy (``rerank_failed``
naming ``no_generation_model`` under ``fail_closed``) whenever it, and not a worker of the
model, took the submission's message past the deadline: the same batch was reranked or
failed by which worker took one message. That ending is for a pool with no worker of the
model at all (``tests/reliability/test_economy_no_model.py``).

A real stack at default settings but a short economy deadline (as in that file): the worker
with the model meets a scripted 429 at its create and is stopped, its retry held; the
worker without the model takes it before the deadline and asks again in 60 s, a message it
alone consumes then, so it holds it; a worker with the model starts before that try comes
due, past the deadline.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.fake_anthropic import FakeAnthropic, status
from tests.reliability.economy import (
    FINISH_WINDOW,
    economy_stack,
    finished,
    submit_economy,
    without_model,
    worker,
    worker_log,
)
from tests.reliability.support import (
    Receiver,
    all_results,
    batch_counts,
    ingest,
    wait_for,
    webhook_receiver,
)

pytestmark = pytest.mark.integration

ITEMS = 3

#: The economy deadline: long enough for the worker with the model to meet the scripted 429
#: well before it (as in test_economy_no_model.py), so that the first try of the worker
#: without the model comes before it and its next one, 60 s later, after it.
SHORT_DEADLINE_SECONDS = 60

_RETRY = re.compile(re.escape("sift.economy_submit") + r"\[[^\]]+\] retry")


@pytest.fixture
def hooks() -> Iterator[Receiver]:
    yield from webhook_receiver()


def _retries(directory: Path, name: str) -> int:
    """How many times worker ``name`` asked the submission again (Celery's ``retry`` line)."""
    return len(_RETRY.findall(worker_log(directory, name)))


@pytest.mark.timeout(900)
def test_items_never_sent_wait_past_the_deadline_for_a_live_worker_with_the_model(
    tmp_path: Path, hooks: Receiver
) -> None:
    logs = tmp_path / "w"
    with (
        FakeAnthropic() as model,
        economy_stack(
            tmp_path, model, SIFT_ECONOMY_DEADLINE_SECONDS=str(SHORT_DEADLINE_SECONDS)
        ) as (env, client),
    ):
        # the create refused as rate-limited (nothing made): the submission retries in 30 s
        model.script_batch_calls("create", [status(429)])
        with worker(logs, env, "model"):
            ingest(client)
            batch_id = submit_economy(client, ITEMS, webhook_url=hooks.url)
            wait_for(lambda: "submission failed, retrying" in worker_log(logs, "model"),
                     "the submission's retry", 120)  # fmt: skip
        with ExitStack() as nomodel:
            nomodel.enter_context(worker(logs, without_model(env), "nomodel"))
            # its first try, before the deadline: asked again in 60 s, on this worker (the
            # only one consuming), which holds that message until it is due
            wait_for(lambda: _retries(logs, "nomodel") >= 1, "the first try without the model",
                     180)  # fmt: skip
            assert not finished(client, batch_id), batch_counts(client, batch_id)
            with worker(logs, env, "model2"):
                assert _retries(logs, "nomodel") == 1, "the held try ran before model2 started"
                wait_for(lambda: _retries(logs, "nomodel") >= 2 or finished(client, batch_id),
                         "the held try, past the deadline", 180)  # fmt: skip
                counts = batch_counts(client, batch_id)["counts"]
                assert counts["failed"] == 0, counts  # not ended no_generation_model
                assert not finished(client, batch_id), counts
                assert model.batches() == []  # nothing sent yet: model2 has not had a try
                # stopped, it puts back its held try: the worker with the model takes it
                nomodel.close()
                wait_for(lambda: finished(client, batch_id), "the batch finished",
                         FINISH_WINDOW + 120)  # fmt: skip
                wait_for(lambda: bool(hooks.for_job(batch_id)), "the webhook", 60)
        results = all_results(client, batch_id)
        assert len(results) == ITEMS, results
        for line in results:
            assert line["status"] == "succeeded", line
            assert line["result"]["rerank"]["applied"] is True, line
        [delivery] = hooks.for_job(batch_id)
        assert delivery.body["type"] == "batch.completed", delivery.body
        assert delivery.body["data"]["status"] == "succeeded", delivery.body

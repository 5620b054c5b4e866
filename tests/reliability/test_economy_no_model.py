"""An economy batch's tasks taken by a worker without ``SIFT_GENERATION_MODEL`` (rerank turned
off since the batch ran, or a pool of mixed settings): the worker cannot reach the Message
Batches API, so it asks again at the poll's cadence, and a worker with the model takes a
later try. Nothing is failed, mislabelled or left waiting for the re-drive's sweep.

Before, the poll of a provider batch raised (the task failed, its message acked): the items
read ``running`` until the watch judged the poll lost, five minutes past its due time, and
the re-drive counted a lost message. The submission logged "failed for good", an
``http_4xx`` of the provider's though no request had gone out, then raised applying the
failure policy (its pricing needs the model), the items ``running`` until the re-drive sent
it again.

With no worker of the model left at all, the items never sent end by the failure policy
once the economy deadline has passed, as the standard lane answers a rerank asked of a
worker with no model; they stayed ``running`` for ever.

A real stack at default settings (the economy lane's first poll after 30 s; the last test's
economy deadline is short): the worker with the model is stopped with the task's next
message held (a poll due, or a submission's retry), which its shutdown puts back on the
queue; the worker without the model takes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_anthropic import FakeAnthropic, status
from tests.reliability.economy import (
    FINISH_WINDOW,
    batch_queue_control,
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

#: The economy deadline of the test about it: the default (24 h) is too long to wait for;
#: the mechanism is the same at any length. Long enough for the worker with the model to
#: meet the scripted 429 well before it (the batch comes in, its three items are prepared,
#: the create is refused), so that the deadline passes on the worker without the model.
SHORT_DEADLINE_SECONDS = 60


@pytest.fixture
def hooks() -> Iterator[Receiver]:
    yield from webhook_receiver()


def _took_and_asked_again(directory: Path, task: str) -> None:
    """The worker without the model took ``task`` and retried it (Celery logs ``<task>[<id>]
    retry``), failing nothing: waited for until it retried or failed, whichever came."""
    retried = re.compile(re.escape(task) + r"\[[^\]]+\] retry")
    failed = ("raised unexpected", "failed for good")
    wait_for(lambda: bool(retried.search(text := worker_log(directory, "nomodel")))
             or any(f in text for f in failed), "the worker without the model took " + task,
             180)  # fmt: skip
    text = worker_log(directory, "nomodel")
    assert "SIFT_GENERATION_MODEL" in text, text
    assert not any(f in text for f in failed), text


def _all_reranked(client: object, batch_id: str) -> None:
    results = all_results(client, batch_id)  # type: ignore[arg-type]
    assert len(results) == ITEMS, results
    for line in results:
        assert line["status"] == "succeeded", line
        assert line["result"]["rerank"]["applied"] is True, line


@pytest.mark.timeout(600)
def test_a_poll_taken_by_a_worker_without_the_model_is_asked_again_not_failed(
    tmp_path: Path,
) -> None:
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        with worker(tmp_path / "w", env, "model"):  # prepares and sends; its poll held
            ingest(client)
            batch_id = submit_economy(client, ITEMS)
            wait_for(lambda: bool(model.batches()), "the provider batch made", 120)
        with worker(tmp_path / "w", without_model(env), "nomodel"):
            _took_and_asked_again(tmp_path / "w", "sift.economy_poll")
        assert not finished(client, batch_id), batch_counts(client, batch_id)
        with worker(tmp_path / "w", env, "model2"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
        _all_reranked(client, batch_id)


@pytest.mark.timeout(600)
def test_a_submission_taken_by_a_worker_without_the_model_is_asked_again_not_failed(
    tmp_path: Path,
) -> None:
    with FakeAnthropic() as model, economy_stack(tmp_path, model) as (env, client):
        # the create refused as rate-limited (nothing made): the submission retries in 30 s
        model.script_batch_calls("create", [status(429)])
        with worker(tmp_path / "w", env, "model"):
            ingest(client)
            batch_id = submit_economy(client, ITEMS)
            wait_for(lambda: "submission failed, retrying" in worker_log(tmp_path / "w", "model"),
                     "the submission's retry", 120)  # fmt: skip
        with worker(tmp_path / "w", without_model(env), "nomodel"):
            _took_and_asked_again(tmp_path / "w", "sift.economy_submit")
        counts = batch_counts(client, batch_id)
        assert not finished(client, batch_id) and counts["counts"]["failed"] == 0, counts
        assert model.batches() == []
        with worker(tmp_path / "w", env, "model2"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", FINISH_WINDOW)
        _all_reranked(client, batch_id)


@pytest.mark.timeout(600)
def test_items_never_sent_end_by_the_failure_policy_once_the_deadline_passes_without_the_model(
    tmp_path: Path, hooks: Receiver
) -> None:
    """With no worker of the model left that can send (rerank turned off for good), an
    economy batch none of whose items was sent to the provider ends once its economy deadline
    passes, as the standard lane answers a rerank asked of a worker with no model: the failure
    policy (``fail_closed`` by default: each item ``failed``, ``rerank_failed`` naming
    ``no_generation_model``, nothing billed). It stayed ``running`` for ever: the submission
    was asked again at the poll's cadence, and the deadline never applied.

    A worker with the model told at run time to stop consuming the batch queue (``celery
    control cancel_consumer sift.batch``) lives throughout: it can send nothing, so it does
    not count. Before, its beats still said it could (the queues it was started with), and
    the items waited for it for ever.

    The economy deadline is short here (:data:`SHORT_DEADLINE_SECONDS`): the default is a
    day, and the submission past it takes the same path whatever its length."""
    with (
        FakeAnthropic() as model,
        economy_stack(
            tmp_path, model, SIFT_ECONOMY_DEADLINE_SECONDS=str(SHORT_DEADLINE_SECONDS)
        ) as (env, client),
        worker(tmp_path / "w", env, "cancelled"),
    ):
        batch_queue_control(env["SIFT_REDIS_URL"], tmp_path / "w", "cancelled", consume=False)
        # the create refused as rate-limited (nothing made): the submission retries in 30 s
        model.script_batch_calls("create", [status(429)])
        with worker(tmp_path / "w", env, "model"):
            ingest(client)
            batch_id = submit_economy(client, ITEMS, webhook_url=hooks.url)
            wait_for(lambda: "submission failed, retrying" in worker_log(tmp_path / "w", "model"),
                     "the submission's retry", 120)  # fmt: skip
        with worker(tmp_path / "w", without_model(env), "nomodel"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", 420)
            wait_for(lambda: bool(hooks.for_job(batch_id)), "the batch.completed webhook", 60)
        assert model.batches() == []  # nothing was ever sent, nor billed
        batch = batch_counts(client, batch_id)
        counts = batch["counts"]
        ended = {"total": ITEMS, "failed": ITEMS}
        assert counts == {"queued": 0, "running": 0, "succeeded": 0, "canceled": 0} | ended, batch
        results = all_results(client, batch_id)
        assert len(results) == ITEMS, results
        for line in results:
            assert line["status"] == "failed", line
            error = line["error"]
            assert error["type"] == "rerank_failed" and not error["retryable"], line
            assert "no generation model" in error["message"], line
            assert error["usage"] is None, line  # no call made: nothing billed
        [delivery] = hooks.for_job(batch_id)
        assert delivery.body["type"] == "batch.completed", delivery.body
        assert delivery.body["data"]["status"] == batch["status"], (delivery.body, batch)
        assert "failed for good" not in worker_log(tmp_path / "w", "nomodel")

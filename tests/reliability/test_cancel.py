"""Cancel tells the truth, on a real stack at default settings (:mod:`tests.reliability.canceling`):
a finished batch is ``409 already_finished`` and nothing about it changes (one a cancel
made ``canceled`` answers ``200``, as it is: the cancel repeated took effect); a cancel right
after submission cancels the items workers have taken but not run (they check the batch's
cancel mark before they start and before their model call) and the batch ends ``canceled``;
a cancel that cancels nothing leaves the status the batch would have had. The counts, the
results and the one ``batch.completed`` webhook agree with the status every time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.canceling import (
    CancelStack,
    cancel,
    cancel_stack,
    finished,
    script_model,
    submit_and_cancel,
)
from tests.reliability.support import Receiver, all_results, batch_counts, submit_batch, wait_for

pytestmark = pytest.mark.integration

FINAL = ("succeeded", "failed", "canceled")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CancelStack]:
    with cancel_stack(Path(tmp_path_factory.mktemp("cancel"))) as running:
        yield running


def _webhook_statuses(receiver: Receiver, batch_id: str) -> list[str]:
    """The status each ``batch.completed`` delivery for the batch said, in order."""
    deliveries = receiver.for_job(batch_id)
    assert {d.body["type"] for d in deliveries} <= {"batch.completed"}
    return [d.body["data"]["status"] for d in deliveries]


def _assert_accounted_for(stack: CancelStack, batch: dict[str, Any]) -> None:
    """Counts add up, match the results line by line, and the status follows from them."""
    counts = batch["counts"]
    assert counts["queued"] == counts["running"] == 0, counts
    assert sum(counts[s] for s in FINAL) == counts["total"], counts
    results = all_results(stack.client, batch["id"])
    assert len(results) == counts["total"]
    for status in FINAL:
        assert sum(r["status"] == status for r in results) == counts[status], status
    assert all("result" not in r for r in results if r["status"] == "canceled")
    assert batch["status"] == ("canceled" if counts["canceled"] else "succeeded")


def _one_webhook(receiver: Receiver, batch_id: str) -> list[str]:
    wait_for(lambda: bool(receiver.for_job(batch_id)), "the batch webhook", 30)
    time.sleep(1.0)  # a second delivery, if any, lands now
    return _webhook_statuses(receiver, batch_id)


DELIVERED = {"status": "delivered", "attempts": 1}


def _delivered(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    """The batch once its record says its webhook was delivered: the receiver's 2xx comes
    before the worker records it, so a batch read in between still says ``pending``."""
    wait_for(
        lambda: batch_counts(client, batch_id)["webhook"] == DELIVERED, "the webhook recorded", 30
    )
    return batch_counts(client, batch_id)


@pytest.mark.timeout(300)
def test_a_finished_batch_is_409_already_finished_and_nothing_changes(
    stack: CancelStack, receiver: Receiver
) -> None:
    script_model(stack.model, 40)
    batch_id = submit_batch(stack.client, 40, webhook_url=receiver.url)
    finished(stack.client, batch_id)
    assert _one_webhook(receiver, batch_id) == ["succeeded"]
    before = _delivered(stack.client, batch_id)
    assert before["status"] == "succeeded" and before["counts"]["succeeded"] == 40
    results = all_results(stack.client, batch_id)
    for _ in range(2):
        response = cancel(stack.client, batch_id)
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert error["type"] == "already_finished" and error["field"] == "id"
    assert finished(stack.client, batch_id) == before  # status, counts, canceled_at: as they were
    assert all_results(stack.client, batch_id) == results
    time.sleep(1.0)
    assert _webhook_statuses(receiver, batch_id) == ["succeeded"]  # no second webhook


@pytest.mark.timeout(300)
def test_a_cancel_right_after_submission_cancels_the_items_not_yet_run(
    stack: CancelStack, receiver: Receiver
) -> None:
    """The cancel comes as soon as the worker has started items: the items still queued are
    canceled by the cancel itself, and the ones taken and started but not yet at their
    model call by their own check; none of them calls the model."""
    total = 300
    run = submit_and_cancel(stack, total, once_running=True, webhook_url=receiver.url)
    at_cancel = run.cancel_body["counts"]
    print(f"\nat the cancel: {at_cancel}\nfinal: {run.counts}; model calls {run.model_calls}")
    assert run.cancel_status == 200, run.cancel_body
    counts = run.counts
    # the items the cancel found queued, and any started but not yet at their model call
    # (how many of those there are depends on the machine's speed: the deterministic check of
    # the latter is in tests/integration/test_items.py and test_tasks.py)
    assert counts["canceled"] >= at_cancel["canceled"] > 0, (at_cancel, counts)
    assert run.final["status"] == "canceled" and run.final["canceled_at"] is not None
    _assert_accounted_for(stack, run.final)
    # a canceled item never called the model: one call per item that ran (no faults)
    assert run.model_calls == counts["succeeded"] + counts["failed"] < total
    # and the batch's totals are those calls, as the model billed them: the items that
    # finished past the cancel add theirs, the canceled ones nothing
    billed, used = stack.model.usage(), run.final["usage"]
    assert used["requests"] == run.model_calls == billed["responses"], (used, billed)
    assert (used["input_tokens"], used["output_tokens"]) == (
        billed["input_tokens"],
        billed["output_tokens"],
    )
    assert _one_webhook(receiver, run.batch_id) == ["canceled"]
    # cancelling it again, once finished canceled, answers it as it is and changes nothing
    # (but its webhook's state, delivered since it finished)
    final = _delivered(stack.client, run.batch_id)
    assert final == {**run.final, "webhook": DELIVERED}
    again = cancel(stack.client, run.batch_id)
    assert again.status_code == 200 and again.json() == final, again.text
    assert finished(stack.client, run.batch_id) == final
    assert _webhook_statuses(receiver, run.batch_id) == ["canceled"]


@pytest.mark.timeout(300)
def test_a_cancel_after_every_item_ran_leaves_the_status_it_would_have_had(
    stack: CancelStack, receiver: Receiver
) -> None:
    """The cancel comes once every item is past its model call, so it cancels none: the
    batch ends ``succeeded``, and its webhook says so."""
    total = 20
    script_model(stack.model, total)
    batch_id = submit_batch(stack.client, total, webhook_url=receiver.url)

    def all_called() -> bool:  # every item has sent its model call
        return len(stack.model.requests()) >= total

    wait_for(all_called, "every item's model call sent")
    response = cancel(stack.client, batch_id)
    if response.status_code == 409:  # every item had also finished: also nothing canceled
        assert response.json()["error"]["type"] == "already_finished"
    else:
        assert response.status_code == 200, response.text
        assert response.json()["counts"]["canceled"] == 0
    done = finished(stack.client, batch_id)
    assert done["status"] == "succeeded" and done["counts"]["succeeded"] == total
    _assert_accounted_for(stack, done)
    assert _one_webhook(receiver, batch_id) == ["succeeded"]

"""The economy lane when the Message Batches endpoints themselves fail, through the real stack.

The same stack as ``test_economy.py`` (a real redis-server, Celery worker and gateway, the
real SDK against the fake Messages API over HTTP), with the fake's batch endpoints scripted
(:meth:`FakeAnthropic.script_batch_calls`): a create answered 529 or 400, an answer lost after
the provider batch was made, a results file with lines the SDK's shapes do not fit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anthropic
import pytest
import redis

from tests.e2e.conftest import ACME, ANTHROPIC_API_KEY, Stack
from tests.e2e.test_economy import (
    _items,
    _results,
    _submit,
    _told_once,
    _wait,
    _wait_for_provider_batches,
)
from tests.fake_anthropic import (
    Behaviour,
    drop,
    duplicated,
    errored,
    garbled,
    good,
    stale,
    status,
    succeeded,
)
from worker.constants import ECONOMY_PROVIDERS_KEY, ECONOMY_WATCH_KEY
from worker.queue.economy import position_of, submission_of
from worker.queue.economy.poll import CANDIDATE_UNREAD_SECONDS


@pytest.fixture(autouse=True)
def clean_fake(stack: Stack) -> Iterator[None]:
    stack.model.reset()
    stack.model.configure(batch_processing_seconds=0.0)
    yield
    stack.model.reset()
    stack.model.configure(batch_processing_seconds=0.0)


def test_a_provider_outage_at_submission_is_waited_out(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # more overloaded answers in a row than SIFT_TASK_MAX_RETRIES (3, the default): the
    # submission waits them out at the poll cadence instead of failing the batch
    stack.model.script_batch_calls("create", [status(529, retry_after=0.1)] * 5)
    batch_id = _submit(stack, _items(queries, 3), "economy")
    done = _wait(stack, batch_id)
    assert done["counts"]["succeeded"] == 3, done
    assert all(r["result"]["rerank"]["applied"] for r in _results(stack, batch_id).values())
    assert len(stack.model.batches()) == 1  # the refused creates made nothing


@pytest.mark.parametrize(
    "answer",
    [status(408), status(409), status(400, should_retry=True)],
    ids=["408", "409", "400-x-should-retry-true"],
)
def test_a_create_answered_a_4xx_the_provider_says_to_retry_is_sent_again(
    stack: Stack, corpus: object, queries: list[str], answer: Behaviour
) -> None:
    # the SDK's own policy retries a 408, a 409 and any answer with x-should-retry: true;
    # Sift failed the items for good (http_4xx) at the first one
    stack.model.script_batch_calls("create", [answer])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    _all_answered_once(stack, batch_id, _wait(stack, batch_id))


def test_a_create_answered_408_once_its_batch_was_made_is_found_not_made_twice(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # a 408 is the provider's request timeout: it may come after the batch was made, so the
    # create is in doubt (looked for among the batches made since) before it is sent again
    stack.model.configure(batch_processing_seconds=0.5)
    stack.model.script_batch_calls("create", [status(408, made=True)])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    _all_answered_once(stack, batch_id, _wait(stack, batch_id))


def test_a_create_refused_for_good_fails_only_the_items_it_would_have_sent(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # 6 items, provider batches of 4: the first goes through, the second is refused (400)
    stack.model.script_batch_calls("create", [good(), status(400, message="requests: bad")])
    batch_id = _submit(stack, _items(queries, 6), "economy", include_trace=True)
    done = _wait(stack, batch_id)
    [sent] = stack.model.batches()
    in_provider = {f"q{position_of(c)}" for c in sent["custom_ids"]}
    assert len(in_provider) == 4
    results = _results(stack, batch_id)
    for qid, item in results.items():
        if qid in in_provider:  # their provider batch ran: they have its answer
            assert item["status"] == "succeeded", item
            assert item["result"]["trace"]["attempts"][0]["provider_batch"] == sent["id"]
        else:
            assert item["status"] == "failed", item
            assert "http_4xx" in item["error"]["message"]
            # never sent: the failed create is its first attempt, nothing waited before it
            [attempt] = item["error"]["trace"]["attempts"]
            assert attempt["backoff_wait_seconds"] == 0.0, attempt
    assert done["counts"]["succeeded"] == 4 and done["counts"]["failed"] == 2, done


def test_results_lines_that_do_not_parse_cost_only_their_own_item(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    stack.model.script_batch(
        {
            "i0": [garbled("not json at all")],  # names no request: that item is left out
            "i1": [garbled('{"custom_id":"i1","result":{"type":"paused"}}')],  # unknown type
            "i2": [garbled('{"custom_id":"i2","result":{"type":"succeeded"}}')],  # no message
        }
    )
    batch_id = _submit(stack, _items(queries, 4), "economy", include_trace=True)
    done = _wait(stack, batch_id, timeout=30)
    results = _results(stack, batch_id)
    # an unreadable line is not a reason to stop reading: every other line is mapped
    assert results["q3"]["status"] == "succeeded"
    # a line of an unknown shape is a malformed result of its item (never a guess such as
    # canceled): resubmitted, and answered the second time
    for qid in ("q1", "q2"):
        attempts = results[qid]["result"]["trace"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["malformed", "ok"], attempts
        assert attempts[0]["provider_result"] == "malformed"
    # the line that names no request leaves its item without a result: a malformed result
    # too, resubmitted (it failed at once, its other attempts unused), and answered
    attempts = results["q0"]["result"]["trace"]["attempts"]
    assert [a["outcome"] for a in attempts] == ["malformed", "ok"], attempts
    assert done["counts"]["succeeded"] == 4 and done["counts"]["failed"] == 0, done


def test_a_results_download_cut_midway_is_read_again(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    stack.model.script_batch_calls("results", [drop()])  # half the file, then the cut
    batch_id = _submit(stack, _items(queries, 4), "economy", include_trace=True)
    done = _wait(stack, batch_id, timeout=30)
    assert done["counts"]["succeeded"] == 4, done
    for item in _results(stack, batch_id).values():  # each answer counted once
        assert [a["outcome"] for a in item["result"]["trace"]["attempts"]] == ["ok"]
    assert len(stack.model.batches()) == 1


def _all_answered_once(stack: Stack, batch_id: str, done: dict[str, object]) -> None:
    """Every item of a 3-item batch answered by the one provider batch, and its usage shown."""
    assert done["counts"] == {"total": 3, "queued": 0, "running": 0, "succeeded": 3,
                              "failed": 0, "canceled": 0}, done  # fmt: skip
    [made] = stack.model.batches()
    for item in _results(stack, batch_id).values():
        attempts = item["result"]["trace"]["attempts"]
        assert [(a["outcome"], a["provider_batch"]) for a in attempts] == [("ok", made["id"])]
    usage = done["usage"]
    assert isinstance(usage, dict) and usage["requests"] == 3 and usage["cost_usd"] > 0, usage


@pytest.mark.parametrize("code", [401, 404])
def test_one_status_error_on_a_poll_does_not_fail_items_the_provider_still_runs(
    stack: Stack, corpus: object, queries: list[str], code: int
) -> None:
    # one 401 (a key rotated) or 404 (the API's reads lag its writes) on a recorded provider
    # batch's retrieve: the provider runs it on and bills every request. It failed every
    # item at once (http_4xx), with no usage, and its results were never read.
    stack.model.configure(batch_processing_seconds=1.0)
    stack.model.script_batch_calls("retrieve", [status(code)])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    _all_answered_once(stack, batch_id, _wait(stack, batch_id))


def test_one_404_on_the_results_download_is_read_again(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # the batch ended: its results exist (29 days). One 404 on the download failed them all.
    stack.model.script_batch_calls("results", [status(404, message="not found")])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    _all_answered_once(stack, batch_id, _wait(stack, batch_id))


def test_an_ended_batch_read_back_without_its_results_url_is_read_again(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # the poll's retrieve says ended; the SDK's results() retrieves it again and meets a read
    # behind its writes (in_progress, no results_url): the SDK raises. That failed them all.
    stack.model.script_batch_calls("retrieve", [good(), stale()])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    _all_answered_once(stack, batch_id, _wait(stack, batch_id))


def _foreign_batch(stack: Stack, requests: int) -> str:
    """Another client's provider batch in the same workspace: ``requests`` requests, made now."""
    client = anthropic.Anthropic(base_url=stack.model.url, api_key=ANTHROPIC_API_KEY)
    params = {"model": "claude-haiku-4-5", "max_tokens": 16,
              "messages": [{"role": "user", "content": "[1] a\n[2] b"}]}  # fmt: skip
    batch = client.messages.batches.create(
        requests=[{"custom_id": f"i{i}", "params": params} for i in range(requests)]  # type: ignore[misc]
    )
    return batch.id


def test_a_create_whose_answer_was_lost_is_found_not_made_twice(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # the provider makes the batch, and the answer never reaches the worker (a timeout, a
    # cut connection: the SDK sees a connection error); the task retries
    stack.model.script_batch_calls("create", [drop()])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    done = _wait(stack, batch_id)
    assert done["counts"]["succeeded"] == 3, done
    [made] = stack.model.batches()  # one provider batch, paid once
    for item in _results(stack, batch_id).values():
        attempts = item["result"]["trace"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["ok"]
        assert attempts[0]["provider_batch"] == made["id"]
    # every submission and poll said it was done: nothing left for the watch to wake
    watched = redis.Redis.from_url(stack.redis_url + "/0", decode_responses=True).zrange(
        ECONOMY_WATCH_KEY, 0, -1
    )
    assert [m for m in watched if m.startswith(batch_id)] == []


def test_a_transient_404_on_a_lost_creates_own_batch_does_not_send_it_again(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # the create is made and its answer lost; the one candidate found, Sift's own batch,
    # answers its first retrieve 404 (the API does so for a while after a create:
    # anthropics/anthropic-sdk-python#1432). It was judged another client's on that one
    # answer and its requests sent again: two provider batches run and billed, one shown.
    stack.model.configure(batch_processing_seconds=1.0)
    stack.model.script_batch_calls("create", [drop()])
    stack.model.script_batch_calls("retrieve", [status(404, message="not found")])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    done = _wait(stack, batch_id)
    assert done["counts"]["succeeded"] == 3, done
    [made] = stack.model.batches()  # made once: polled again, and found Sift's by its lines
    for item in _results(stack, batch_id).values():
        attempts = item["result"]["trace"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["ok"], attempts
        assert attempts[0]["provider_batch"] == made["id"]
    assert done["usage"]["requests"] == 3, done["usage"]


def test_a_lost_create_is_told_from_another_clients_batch_by_its_results(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # another client's batch of the same size, created just before Sift's, whose answer is
    # lost: two candidates. Neither is canceled; only the lines of Sift's create are mapped.
    stack.model.configure(batch_processing_seconds=1.0)
    foreign = _foreign_batch(stack, 3)
    stack.model.script_batch_calls("create", [drop()])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    done = _wait(stack, batch_id)
    assert done["counts"]["succeeded"] == 3, done
    batches = {b["id"]: b for b in stack.model.batches()}
    assert len(batches) == 2 and batches[foreign]["status"] == "ended"
    assert batches[foreign]["outcomes"] == ["succeeded"] * 3  # run to its end, not canceled
    [ours] = [b for b in batches.values() if b["id"] != foreign]
    for item in _results(stack, batch_id).values():
        assert item["result"]["trace"]["attempts"][0]["provider_batch"] == ours["id"]


def test_a_create_that_made_nothing_is_sent_again_after_its_candidate_proves_foreign(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # a 500 may come after the provider made the batch: in doubt. The one candidate is
    # another client's; once it ended with no line of Sift's create, the items go again.
    stack.model.configure(batch_processing_seconds=0.5)
    foreign = _foreign_batch(stack, 3)
    stack.model.script_batch_calls("create", [status(500)])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    done = _wait(stack, batch_id)
    assert done["counts"]["succeeded"] == 3, done
    batches = stack.model.batches()
    assert len(batches) == 2 and batches[0]["id"] == foreign
    ours = batches[1]
    assert len({submission_of(c) for c in ours["custom_ids"]}) == 1
    for item in _results(stack, batch_id).values():
        attempts = item["result"]["trace"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["ok"]  # the foreign answers never counted
        assert attempts[0]["provider_batch"] == ours["id"]


def test_a_result_line_given_twice_is_counted_once(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    stack.model.script_batch(
        {"i0": [duplicated(errored("overloaded_error"))], "i1": [duplicated(succeeded())]}
    )
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    done = _wait(stack, batch_id, timeout=30)
    assert done["counts"]["succeeded"] == 3, done
    results = _results(stack, batch_id)
    outcomes = {q: [a["outcome"] for a in r["result"]["trace"]["attempts"]]
                for q, r in results.items()}  # fmt: skip
    # one errored result, one attempt: resent once, alone
    assert outcomes == {"q0": ["http_5xx", "ok"], "q1": ["ok"], "q2": ["ok"]}, outcomes
    assert [len(b["custom_ids"]) for b in stack.model.batches()] == [3, 1]
    _told_once(done, results)  # the line given twice added nothing to the batch's usage


def test_a_cancel_the_provider_refuses_never_fails_the_items(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # the provider refuses the cancels (as it does once a batch ended, say): Sift's cancel
    # and the poll's both meet a 400; the poll tries again, it never fails the items for it
    stack.model.configure(batch_processing_seconds=300.0)
    batch_id = _submit(stack, _items(queries, 3), "economy")
    _wait_for_provider_batches(stack, 1)
    stack.model.script_batch_calls("cancel", [status(400, message="batch ended")] * 2)
    assert stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME).status_code == 200
    done = _wait(stack, batch_id, timeout=30)
    assert done["status"] == "canceled" and done["counts"]["canceled"] == 3, done
    assert all(r["status"] == "canceled" for r in _results(stack, batch_id).values())


def test_a_candidate_answering_404_once_and_a_failed_resend_leave_no_item_waiting(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # a create in doubt (500) that made nothing; its one candidate, another client's batch,
    # answers its first retrieve 404. One answer settles nothing (the API answers 404 for a
    # while after a create): it is polled again, and judged by its results, which hold no
    # line of Sift's create, so the items are sent again; that create meets an overloaded
    # provider (529). The resend is tried again, as any failed create is: no item is left
    # running with nothing to run it.
    stack.model.configure(batch_processing_seconds=0.5)
    _foreign_batch(stack, 3)
    stack.model.script_batch_calls("create", [status(500), status(529)])
    stack.model.script_batch_calls("retrieve", [status(404, message="not found")])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    done = _wait(stack, batch_id, timeout=30)
    assert done["counts"]["succeeded"] == 3, done
    assert len(stack.model.batches()) == 2  # the foreign one, and the resend that went


def test_a_candidate_that_answers_no_read_for_an_hour_is_taken_for_another_clients(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # a create in doubt (500) that made nothing; its one candidate, another client's long
    # batch, is canceled and deleted by its owner, and answers every read 404. It held the
    # items until the poll's give-up (the economy deadline plus 24 h); an hour of status
    # errors in a row now judges it another client's. The hour is made to have passed by
    # dating its first error back.
    stack.model.configure(batch_processing_seconds=300.0)
    foreign = _foreign_batch(stack, 3)
    owner = anthropic.Anthropic(base_url=stack.model.url, api_key=ANTHROPIC_API_KEY)
    stack.model.script_batch_calls("create", [status(500)])
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    records = redis.Redis.from_url(stack.redis_url + "/0", decode_responses=True)
    key, deadline = ECONOMY_PROVIDERS_KEY + batch_id, time.monotonic() + 30
    while not records.hexists(key, foreign):  # found as a candidate
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # a poll between the owner's cancel and its delete would read it ended, and judge it by
    # its lines: it is read as still running until it is gone
    stack.model.script_batch_calls("retrieve", [stale(), stale()])
    owner.messages.batches.cancel(foreign)  # ended at once (the fake's cancel takes 0 s)
    owner.messages.batches.delete(foreign)
    stack.model.configure(batch_processing_seconds=0.5)  # the resend's
    while "unread_since" not in (record := json.loads(records.hget(key, foreign) or "{}")):
        assert time.monotonic() < deadline, record
        time.sleep(0.05)
    time.sleep(3)  # polled on, a few periods (SIFT_ECONOMY_POLL_MAX_SECONDS is 1 here)
    waiting = stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()
    assert waiting["finished_at"] is None and waiting["counts"]["running"] == 3, waiting
    record["unread_since"] = time.time() - CANDIDATE_UNREAD_SECONDS - 1
    records.hset(key, foreign, json.dumps(record))
    done = _wait(stack, batch_id, timeout=30)
    assert done["counts"]["succeeded"] == 3, done
    [resent] = stack.model.batches()  # the foreign one deleted; the items sent again
    for item in _results(stack, batch_id).values():
        assert item["result"]["trace"]["attempts"][-1]["provider_batch"] == resent["id"]


def test_a_cancel_while_a_create_is_in_doubt_ends_the_batch_without_waiting_on_its_candidate(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # a create in doubt (500) whose one candidate is another client's long batch: that one is
    # never canceled, and the items waiting to learn whether it is theirs are not in any
    # provider batch Sift may cancel. The user's cancel ends them now, not when it ends.
    stack.model.configure(batch_processing_seconds=300.0)
    foreign = _foreign_batch(stack, 3)
    stack.model.script_batch_calls("create", [status(500)])
    batch_id = _submit(stack, _items(queries, 3), "economy")
    watch = redis.Redis.from_url(stack.redis_url + "/0", decode_responses=True)
    deadline = time.monotonic() + 30
    while watch.zscore(ECONOMY_WATCH_KEY, f"{batch_id} {foreign}") is None:  # polled
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME).status_code == 200
    done = _wait(stack, batch_id, timeout=30)
    assert done["status"] == "canceled" and done["counts"]["canceled"] == 3, done
    [made] = stack.model.batches()  # the create made nothing, and the foreign batch ...
    assert made["id"] == foreign and made["status"] == "in_progress"  # ... runs on
    # and nothing polls it for the finished batch (for up to 24 hours): its poll, next due
    # within a second here, stops and leaves the watch
    deadline = time.monotonic() + 10
    while watch.zscore(ECONOMY_WATCH_KEY, f"{batch_id} {foreign}") is not None:
        assert time.monotonic() < deadline, "a finished batch's poll goes on"
        time.sleep(0.1)
    time.sleep(3)  # a few poll periods (SIFT_ECONOMY_POLL_MAX_SECONDS is 1 here)
    assert watch.zscore(ECONOMY_WATCH_KEY, f"{batch_id} {foreign}") is None


def test_an_answer_longer_than_max_tokens_allows_is_malformed_as_in_the_standard_lane(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # 20,000 positions: more than any request's max_tokens (a thinking allowance plus 8 a
    # position) lets a model write. The standard lane's parse_body calls that malformed; an
    # economy result line with the same answer is malformed too (resubmitted, answered the
    # second time), its round billed, never normalised into an applied rerank.
    text = json.dumps({"positions": list(range(1, 20_001))})
    message = {"id": "msg_long", "type": "message", "role": "assistant",
               "model": "claude-haiku-4-5", "content": [{"type": "text", "text": text}],
               "stop_reason": "end_turn", "stop_sequence": None,
               "usage": {"input_tokens": 10, "output_tokens": 20}}  # fmt: skip
    line = {"custom_id": "i0", "result": {"type": "succeeded", "message": message}}
    stack.model.script_batch({"i0": [garbled(json.dumps(line))]})
    batch_id = _submit(stack, _items(queries, 1), "economy", include_trace=True)
    done = _wait(stack, batch_id, timeout=30)
    [item] = _results(stack, batch_id).values()
    assert done["counts"]["succeeded"] == 1, done
    attempts = item["result"]["trace"]["attempts"]
    assert [a["outcome"] for a in attempts] == ["malformed", "ok"], attempts
    assert attempts[0]["provider_result"] == "succeeded"
    assert len(stack.model.batches()) == 2  # resubmitted once
    # the long answer's round is billed and shown: its 20 output tokens and the answer's
    assert item["result"]["usage"]["output_tokens"] == 20 + stack.model.usage()["output_tokens"]


def test_a_chunk_delivered_again_after_its_items_went_out_keeps_the_candidates_the_model_saw(
    stack: Stack, corpus: list[dict[str, object]], queries: list[str]
) -> None:
    # A chunk's message delivered again once its items are prepared and in a provider batch
    # (its worker killed before the ack; a re-drive's copy and a late original). Meanwhile a
    # document came in that the query now retrieves. The second run must not prepare the
    # items again: the model's answer is positions in the candidates its prompt listed, and
    # mapped onto a new list they would rank documents the model never saw.
    from worker.constants import BATCH_CHUNK_TASK, BATCH_QUEUE, ECONOMY_PREPARED_KEY
    from worker.queue.celery_app import create_celery_app
    from worker.settings import load_settings

    index = "chunk-again"
    ingest = stack.live.post(f"/v1/indexes/{index}/documents", params={"wait": 20},
                             json={"documents": corpus}, headers=ACME)  # fmt: skip
    assert ingest.status_code == 200 and ingest.json()["status"] == "succeeded", ingest.text
    stack.model.configure(batch_processing_seconds=5.0)
    body = {"index": index, "queries": _items(queries, 1), "rerank": True, "lane": "economy",
            "include_trace": True}  # fmt: skip
    response = stack.live.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    batch_id = response.json()["id"]
    _wait_for_provider_batches(stack, 1)
    broker = redis.Redis.from_url(stack.redis_url + "/0", decode_responses=True)
    prepared = broker.hgetall(ECONOMY_PREPARED_KEY + batch_id)
    assert list(prepared) == ["q0"]
    newcomer = {"id": "newcomer", "text": f"{queries[0]} " * 20, "title": queries[0]}
    ingest = stack.live.post(f"/v1/indexes/{index}/documents", params={"wait": 20},
                             json={"documents": [newcomer]}, headers=ACME)  # fmt: skip
    assert ingest.status_code == 200 and ingest.json()["status"] == "succeeded", ingest.text
    app = create_celery_app(load_settings(redis_url=stack.redis_url + "/0"))
    task_id = f"again-{batch_id}"
    try:
        app.send_task(BATCH_CHUNK_TASK, args=[batch_id, 0, 1], queue=BATCH_QUEUE, task_id=task_id)
    finally:
        app.close()
    deadline = time.monotonic() + 30
    while f"sift.batch_chunk[{task_id}] succeeded" not in stack.logs[0].read_text():
        assert time.monotonic() < deadline, "the chunk delivered again did not run"
        time.sleep(0.05)
    assert broker.hgetall(ECONOMY_PREPARED_KEY + batch_id) == prepared  # as the prompt was
    done = _wait(stack, batch_id)
    assert done["counts"]["succeeded"] == 1, done
    [item] = _results(stack, batch_id).values()
    # the answer's positions mapped onto the candidates the prompt listed (before: onto the
    # new list, the newcomer first and every other one a place down: each hit mislabelled)
    saw = [c["id"] for c in json.loads(prepared["q0"])["candidates"]]
    mapped = [c["id"] for c in item["result"]["trace"]["candidates"]]
    assert mapped == saw, (mapped, saw)
    assert "newcomer" not in [hit["id"] for hit in item["result"]["hits"]]


def test_a_provider_batch_canceled_outside_sift_is_resubmitted_not_canceled(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # someone cancels the provider batch in the Console: its lines come back ``canceled``,
    # though the user canceled nothing. Each is a failed attempt (http_5xx), resubmitted;
    # neither the items nor the batch end ``canceled``.
    stack.model.configure(batch_processing_seconds=300.0)
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    _wait_for_provider_batches(stack, 1)
    [first] = stack.model.batches()
    stack.model.cancel_batch(first["id"])  # nothing processed yet: every line canceled
    stack.model.configure(batch_processing_seconds=0.0)
    done = _wait(stack, batch_id, timeout=30)
    assert done["status"] != "canceled" and done["counts"]["succeeded"] == 3, done
    for item in _results(stack, batch_id).values():
        attempts = item["result"]["trace"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["http_5xx", "ok"], attempts
        assert attempts[0]["provider_batch"] == first["id"]
        assert attempts[0]["provider_result"] == "canceled"
    assert len(stack.model.batches()) == 2


def test_outside_cancels_past_the_retry_budget_end_in_the_failure_policy_as_http_5xx(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # each provider batch canceled from outside as soon as it is made, three times: the
    # items' three attempts (SIFT_GENERATION_MAX_REQUESTS) are spent, then they fail as
    # http_5xx (the batch's fail_closed policy), never canceled
    stack.model.configure(batch_processing_seconds=300.0)
    batch_id = _submit(stack, _items(queries, 2), "economy", include_trace=True)
    for made in range(1, 4):
        _wait_for_provider_batches(stack, made)
        stack.model.cancel_batch(stack.model.batches()[made - 1]["id"])
    done = _wait(stack, batch_id, timeout=30)
    assert done["status"] != "canceled" and done["counts"]["canceled"] == 0, done
    for item in _results(stack, batch_id).values():
        assert item["status"] == "failed" and "http_5xx" in item["error"]["message"], item
        attempts = item["error"]["trace"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["http_5xx"] * 3, attempts
        assert {a["provider_result"] for a in attempts} == {"canceled"}
    assert len(stack.model.batches()) == 3


def test_an_item_whose_resubmission_is_refused_for_good_keeps_its_rerank_seconds(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # the request errors (resubmitted), and its resubmission's create is refused (400): the
    # poll gives up on it and the item fails. Its first round was out (its provider batch's
    # seconds) and it waited after it; its rerank_seconds, its first send to its failure,
    # are those summed, as for an item whose last result was mapped. They were 0.
    stack.model.script_batch({"i0": [errored("overloaded_error")]})
    stack.model.script_batch_calls("create", [good(), status(400, message="requests: bad")])
    batch_id = _submit(stack, _items(queries, 1), "economy", include_trace=True)
    assert _wait(stack, batch_id)["counts"]["failed"] == 1
    trace = _results(stack, batch_id)["q0"]["error"]["trace"]
    first, refused = attempts = trace["attempts"]
    assert (first["outcome"], refused["outcome"]) == ("http_5xx", "http_4xx"), attempts
    assert first["seconds"] > 0 and refused["seconds"] == 0.0, attempts  # never out again
    waits = sum(a["seconds"] + a["backoff_wait_seconds"] for a in attempts)
    assert trace["rerank_seconds"] == pytest.approx(waits, abs=1e-6), trace


def test_an_item_failed_while_its_request_was_out_tells_the_time_it_was_out(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # a create in doubt (a 500, retry-after 1: settled no sooner) whose one candidate proves
    # another client's; the items' resend, sent by the poll's mapping, is refused (400) for
    # good: they fail at once, the resend not sent again (the poll, giving up, sent it a
    # second time). Their request was out from that create to the failure, a second at
    # least: the one attempt's seconds, and the item's rerank_seconds, say so. Both were 0,
    # as if it had never gone.
    stack.model.configure(batch_processing_seconds=0.5)
    foreign = _foreign_batch(stack, 2)
    refused = status(400, message="requests: bad")
    stack.model.script_batch_calls("create", [status(500, retry_after=1), refused])
    batch_id = _submit(stack, _items(queries, 2), "economy", include_trace=True)
    done = _wait(stack, batch_id)
    assert done["counts"]["failed"] == 2, done
    # the foreign batch's create, the one in doubt and the resend's: a 4th would have made one
    assert stack.model.batch_calls_made()["create"] == 3
    assert [b["id"] for b in stack.model.batches()] == [foreign]
    for item in _results(stack, batch_id).values():
        trace = item["error"]["trace"]
        [attempt] = trace["attempts"]
        assert attempt["outcome"] == "http_4xx" and attempt["backoff_wait_seconds"] == 0.0
        # the shared clock's readings err by half a round trip to Redis
        assert attempt["seconds"] >= 1.0 - 0.05, attempt
        assert trace["rerank_seconds"] == pytest.approx(attempt["seconds"], abs=1e-6), trace


def test_a_resubmission_s_create_answered_529_waits_out_its_retry_after(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # the request errors (resubmitted), and its resubmission's create is answered 529 with
    # retry-after 3: the poll sends it again no sooner, as the submission does, not at its own
    # cadence (a second at most here)
    stack.model.script_batch({"i0": [errored("overloaded_error")]})
    stack.model.script_batch_calls("create", [good(), status(529, retry_after=3)])
    batch_id = _submit(stack, _items(queries, 1), "economy", include_trace=True)
    assert _wait(stack, batch_id)["counts"]["succeeded"] == 1
    first, retry = attempts = _results(stack, batch_id)["q0"]["result"]["trace"]["attempts"]
    assert (first["outcome"], retry["outcome"]) == ("http_5xx", "ok"), attempts
    # its result counted before the 529, sent again after its retry-after
    assert retry["backoff_wait_seconds"] >= 3.0 - 0.05, attempts
    assert len(stack.model.batches()) == 2  # the refused create made nothing

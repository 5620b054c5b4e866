"""Erasing one finished job's stored record over the real stack: ``DELETE /v1/searches/{id}``
and ``DELETE /v1/batches/{id}/results`` (and ``sift erase``), read back over HTTP and in every
key Redis holds."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import redis
from typer.testing import CliRunner, Result

from api_gateway.queue import OutboxSender
from tests.e2e.conftest import ACME, GLOBEX, Stack, finished_batch
from tests.e2e.test_economy import _items, _submit, _wait, _wait_for_provider_batches
from tests.e2e.test_economy_faults import _foreign_batch
from tests.fake_anthropic import drop
from tests.services import webhook_inbox
from worker.cli import app
from worker.constants import (
    BATCH_CHUNK_TASK,
    BATCH_QUEUE,
    ECONOMY_DELETE_CHAIN_KEY,
    ECONOMY_DELETE_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_WATCH_KEY,
    SEARCH_QUEUE,
    SEARCH_TASK,
    WEBHOOK_EVENT_SEARCH_COMPLETED,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)
from worker.queue.jobstore import JobStore, webhook_event


def _marked_index(stack: Stack) -> tuple[str, str]:
    """A fresh index of acme's holding one document whose text is a word found nowhere else;
    answers the index and that word."""
    word = "zq" + uuid.uuid4().hex[:12]
    index = "erase-" + uuid.uuid4().hex[:8]
    response = stack.live.post(
        f"/v1/indexes/{index}/documents",
        params={"wait": 20},
        json={"documents": [{"id": "d1", "title": "erasable", "text": f"tea ceremony {word}"}]},
        headers=ACME,
    )
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text
    return index, word


def _values(url: str) -> list[str]:
    """Every key of the database and every value it holds (read by type, so no value is
    missed for being compressed as DUMP may), as text."""
    r = redis.Redis.from_url(url)
    seen: list[str] = []
    for key in r.scan_iter(count=1000):
        kind = r.type(key).decode()
        parts: list[Any] = [key]
        if kind == "string":
            parts.append(r.get(key))
        elif kind == "hash":
            for field, value in r.hgetall(key).items():
                parts += [field, value]
        elif kind == "list":
            parts += r.lrange(key, 0, -1)
        elif kind == "set":
            parts += list(r.smembers(key))
        elif kind == "zset":
            parts += [member for member, _ in r.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            parts += [json.dumps(str(entry)) for entry in r.xrange(key)]
        seen += [p.decode(errors="replace") if isinstance(p, bytes) else str(p) for p in parts]
    r.close()
    return seen


def _holding(stack: Stack, *texts: str) -> set[str]:
    """Which of ``texts`` some key or value of the live database holds."""
    values = _values(stack.redis_url + "/0")
    return {text for text in texts if any(text in value for value in values)}


def _listed(client: httpx.Client, path: str, key: str) -> set[str]:
    ids: set[str] = set()
    params: dict[str, Any] = {"page_size": 100}
    while True:
        body = client.get(path, params=params, headers=ACME).json()
        ids |= {job["id"] for job in body[key]}
        if body["next_page_token"] is None:
            return ids
        params["page_token"] = body["next_page_token"]


def _sift(stack: Stack, *args: str) -> Result:
    key = ACME["Authorization"].split()[1]
    env = {"SIFT_URL": stack.live_url, "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}
    return CliRunner().invoke(app, list(args), env=env)


def test_a_finished_search_is_erased_and_reads_as_erased(stack: Stack) -> None:
    index, word = _marked_index(stack)
    query = f"ceremony {word} " + uuid.uuid4().hex
    headers = {**ACME, "Idempotency-Key": "erase-" + uuid.uuid4().hex}
    body = {"index": index, "query": query, "include_trace": True}
    done = stack.live.post("/v1/searches", params={"wait": 10}, json=body, headers=headers)
    assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text
    job_id = done.json()["id"]
    assert done.json()["result"]["hits"][0]["text"].endswith(word)
    assert _holding(stack, query, word) == {query, word}  # the scan sees them before

    other = stack.live.delete(f"/v1/searches/{job_id}", headers=GLOBEX)
    assert other.status_code == 404 and other.json()["error"]["type"] == "not_found", other.text
    assert stack.live.get(f"/v1/searches/{job_id}", headers=ACME).status_code == 200

    erased = stack.live.delete(f"/v1/searches/{job_id}", headers=ACME)
    assert erased.status_code == 200, erased.text
    assert erased.json()["id"] == job_id and erased.json()["erased_at"]
    again = stack.live.delete(f"/v1/searches/{job_id}", headers=ACME)
    assert again.status_code == 200 and again.json() == erased.json(), again.text

    gone = stack.live.get(f"/v1/searches/{job_id}", headers=ACME)
    assert gone.status_code == 410, gone.text
    assert gone.json()["error"]["type"] == "erased" and gone.json()["error"]["field"] == "id"
    foreign = stack.live.get(f"/v1/searches/{job_id}", headers=GLOBEX)
    assert foreign.status_code == 404 and foreign.json()["error"]["type"] == "not_found"
    assert stack.live.delete(f"/v1/searches/{job_id}", headers=GLOBEX).status_code == 404
    # its Idempotency-Key stays bound to it: sent again, the request is told, not run again
    replay = stack.live.post("/v1/searches", json=body, headers=headers)
    assert replay.status_code == 410 and replay.json()["error"]["type"] == "erased", replay.text
    assert job_id not in _listed(stack.live, "/v1/searches", "searches")
    assert _holding(stack, query, word) == set()


def test_a_search_not_finished_is_not_erased(stack: Stack) -> None:
    queued = stack.idle.post("/v1/searches", json={"index": "docs", "query": "tea"}, headers=ACME)
    job_id = queued.json()["id"]
    refused = stack.idle.delete(f"/v1/searches/{job_id}", headers=ACME)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["type"] == "not_finished"
    assert refused.json()["error"]["field"] == "id"
    assert "queued" in refused.json()["error"]["message"]
    after = stack.idle.get(f"/v1/searches/{job_id}", headers=ACME)
    assert after.status_code == 200 and after.json()["status"] == "queued"
    missing = stack.idle.delete("/v1/searches/srch_" + "0" * 32, headers=ACME)
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "id"
    malformed = stack.idle.delete("/v1/searches/not-an-id", headers=ACME)
    assert malformed.status_code == 404 and malformed.json()["error"]["field"] == "id"


def test_a_finished_batch_is_erased_and_reads_as_erased(stack: Stack) -> None:
    index, word = _marked_index(stack)
    texts = [f"ceremony {word} " + uuid.uuid4().hex for _ in range(3)]
    query_ids = ["qid-" + uuid.uuid4().hex for _ in texts]
    queries = [{"id": q, "query": t} for q, t in zip(query_ids, texts, strict=True)]
    headers = {**ACME, "Idempotency-Key": "erase-" + uuid.uuid4().hex}
    body = {"index": index, "queries": queries}
    batch, page = finished_batch(stack.live, body, headers)
    assert batch["status"] == "succeeded", batch
    assert page["results"][0]["result"]["hits"][0]["text"].endswith(word)
    batch_id = batch["id"]
    assert _holding(stack, *texts, *query_ids, word) == {*texts, *query_ids, word}

    path = f"/v1/batches/{batch_id}/results"
    other = stack.live.delete(path, headers=GLOBEX)
    assert other.status_code == 404 and other.json()["error"]["type"] == "not_found", other.text
    erased = stack.live.delete(path, headers=ACME)
    assert erased.status_code == 200, erased.text
    assert erased.json()["id"] == batch_id and erased.json()["erased_at"]
    again = stack.live.delete(path, headers=ACME)
    assert again.status_code == 200 and again.json() == erased.json(), again.text

    for method, url in (("GET", f"/v1/batches/{batch_id}"), ("GET", path),
                        ("DELETE", f"/v1/batches/{batch_id}")):  # fmt: skip
        answer = stack.live.request(method, url, headers=ACME)
        assert answer.status_code == 410, (method, url, answer.text)
        assert answer.json()["error"]["type"] == "erased"
        foreign = stack.live.request(method, url, headers=GLOBEX)
        assert foreign.status_code == 404, (method, url, foreign.text)
    replay = stack.live.post("/v1/batches", json=body, headers=headers)
    assert replay.status_code == 410 and replay.json()["error"]["type"] == "erased", replay.text
    assert batch_id not in _listed(stack.live, "/v1/batches", "batches")
    assert _holding(stack, *texts, *query_ids, word) == set()


def _provider_batches(stack: Stack) -> set[str]:
    return {b["id"] for b in stack.model.batches()}


def test_an_economy_batch_is_erased_with_its_lane_state(stack: Stack) -> None:
    """And with its provider batches, which the provider keeps 29 days (the queries, the
    candidates' text): deleted there by a worker after the erase. Not a create in doubt's
    candidate, which may be another client's (here one is: put on the batch's record)."""
    stack.model.reset()
    stack.model.configure(batch_processing_seconds=0.0)
    index, word = _marked_index(stack)
    texts = [f"ceremony {word} " + uuid.uuid4().hex for _ in range(5)]
    queries = [{"id": f"e{i}", "query": t} for i, t in enumerate(texts)]
    body = {"index": index, "queries": queries, "rerank": True, "lane": "economy"}
    batch, page = finished_batch(stack.live, body)
    assert batch["counts"]["succeeded"] == 5, batch
    assert all(r["result"]["rerank"]["applied"] for r in page["results"]), page
    assert _holding(stack, *texts, word) == {*texts, word}
    ours = _provider_batches(stack)
    assert len(ours) == 2, ours  # 5 requests, 4 a provider batch
    foreign = _foreign_batch(stack, 1)
    candidate = {"round": 2, "requests": 1, "created_at": time.time(), "ended_at": None,
                 "submission": "s" + uuid.uuid4().hex, "doubt": True}  # fmt: skip
    with redis.Redis.from_url(stack.redis_url + "/0") as r:
        r.hset(ECONOMY_PROVIDERS_KEY + batch["id"], foreign, json.dumps(candidate))
    erased = stack.live.delete(f"/v1/batches/{batch['id']}/results", headers=ACME)
    assert erased.status_code == 200, erased.text
    assert _holding(stack, *texts, word) == set()
    deadline = time.monotonic() + 30
    with redis.Redis.from_url(stack.redis_url + "/0") as r:
        # until the task is done: each provider batch deleted, then dropped from its set, and
        # the task's run over (its lease on the batch's deletes let go after the set went)
        while r.exists(ECONOMY_DELETE_KEY + batch["id"], ECONOMY_DELETE_CHAIN_KEY + batch["id"]):
            assert time.monotonic() < deadline, stack.model.batches()
            time.sleep(0.05)
        marks = [key for key in r.scan_iter() if batch["id"].encode() in key]
    assert _provider_batches(stack) == {foreign}  # ours deleted; the candidate left alone
    assert marks == [b"sift:erased:" + batch["id"].encode()], marks  # no other key names it


def test_a_candidate_not_judged_at_the_erase_is_deleted_once_its_results_prove_it_ours(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    """A create whose answer was lost has two candidates, Sift's own batch and another
    client's of the same size; the user cancels the batch and erases it while both still
    run, so no poll has judged either (none is canceled: each may be another client's). Once
    they end, the one whose results hold the create's lines is deleted at the provider, and
    the other client's is left. Before, both stayed: the erase kept only the provider
    batches proved ours, and after it nothing read the candidates again."""
    stack.model.reset()
    stack.model.configure(batch_processing_seconds=300.0)
    try:
        foreign = _foreign_batch(stack, 3)
        stack.model.script_batch_calls("create", [drop()])
        batch_id = _submit(stack, _items(queries, 3), "economy")
        _wait_for_provider_batches(stack, 2)
        [ours] = _provider_batches(stack) - {foreign}
        deadline = time.monotonic() + 30  # a hang guard, not a speed check
        with redis.Redis.from_url(stack.redis_url + "/0") as r:
            while any(r.zscore(ECONOMY_WATCH_KEY, f"{batch_id} {p}") is None
                      for p in (ours, foreign)):  # fmt: skip  # both polled as candidates
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME).status_code == 200
        assert _wait(stack, batch_id, timeout=30)["status"] == "canceled"
        erased = stack.live.delete(f"/v1/batches/{batch_id}/results", headers=ACME)
        assert erased.status_code == 200, erased.text
        # the delete task looked at both while they ran, and will again (its retry)
        _logged(stack, f"batch {batch_id}: 2 provider batches left to judge or delete")
        assert {b["status"] for b in stack.model.batches()} == {"in_progress"}  # not canceled
        stack.model.configure(batch_processing_seconds=0.0)  # both end now
        deadline = time.monotonic() + 30
        while ours in _provider_batches(stack):
            assert time.monotonic() < deadline, stack.model.batches()
            time.sleep(0.05)
        with redis.Redis.from_url(stack.redis_url + "/0") as r:
            while [k for k in r.scan_iter() if batch_id.encode() in k] != [
                b"sift:erased:" + batch_id.encode()
            ]:  # the candidates judged, nothing left to do
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert _provider_batches(stack) == {foreign}  # another client's: left alone
    finally:
        stack.model.reset()
        stack.model.configure(batch_processing_seconds=0.0)


def test_a_batch_not_finished_is_erased_once_canceled(stack: Stack) -> None:
    """The refusal of a batch not finished names the status its ``GET`` shows: a batch
    whose items were all queued was said to be ``running``."""
    queries = [{"id": f"q{i}", "query": "tea"} for i in range(3)]
    batch = stack.idle.post("/v1/batches", json={"index": "docs", "queries": queries}, headers=ACME)
    batch_id = batch.json()["id"]
    path = f"/v1/batches/{batch_id}/results"
    refused = stack.idle.delete(path, headers=ACME)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["type"] == "not_finished" and error["field"] == "id"
    assert f"DELETE /v1/batches/{batch_id}" in error["message"]  # says how to end it
    assert stack.idle.get(f"/v1/batches/{batch_id}", headers=ACME).json()["status"] == "queued"
    assert error["message"].startswith(f"id: batch {batch_id!r} is queued, not finished")
    assert stack.idle.get(path, headers=ACME).json()["results"][0]["status"] == "queued"
    canceled = stack.idle.delete(f"/v1/batches/{batch_id}", headers=ACME)
    assert canceled.status_code == 200 and canceled.json()["status"] == "canceled", canceled.text
    assert stack.idle.delete(path, headers=ACME).status_code == 200
    assert stack.idle.get(f"/v1/batches/{batch_id}", headers=ACME).status_code == 410


def test_a_canceled_batch_whose_items_still_run_is_not_told_to_cancel_it(stack: Stack) -> None:
    """A batch canceled while a worker runs one of its items (past its model call: it
    finishes) is still running: its erase is ``409`` ``not_finished``, saying the cancel was
    made and to erase it once it finishes. It said ``cancel it first``, of a batch canceled
    already: a client that did so got the same 409 again."""
    queries = [{"id": f"q{i}", "query": "tea"} for i in range(3)]
    batch = stack.idle.post("/v1/batches", json={"index": "docs", "queries": queries}, headers=ACME)
    batch_id = batch.json()["id"]
    store = JobStore.from_url(stack.redis_url + "/1")  # the idle gateway's: no worker takes it
    assert store.start_item(batch_id, "q0")  # a worker took it, and runs it
    canceled = stack.idle.delete(f"/v1/batches/{batch_id}", headers=ACME).json()
    assert canceled["status"] == "running" and canceled["counts"]["running"] == 1, canceled
    refused = stack.idle.delete(f"/v1/batches/{batch_id}/results", headers=ACME)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["type"] == "not_finished" and error["field"] == "id"
    assert "cancel it first" not in error["message"], error["message"]
    assert "canceled at" in error["message"] and "once it has finished" in error["message"]


def test_sift_erase_erases_a_search_and_a_batch(stack: Stack) -> None:
    index, _ = _marked_index(stack)
    search = stack.live.post(
        "/v1/searches", params={"wait": 10}, json={"index": index, "query": "tea"}, headers=ACME
    ).json()
    batch, _ = finished_batch(
        stack.live, {"index": index, "queries": [{"id": "a", "query": "tea"}]}
    )
    said = _sift(stack, "erase", search["id"], "--json")
    assert said.exit_code == 0, said.output
    assert json.loads(said.stdout)["id"] == search["id"]
    told = _sift(stack, "erase", batch["id"])
    assert told.exit_code == 0 and f"erased batch {batch['id']}" in told.stdout, told.output
    assert stack.live.get(f"/v1/batches/{batch['id']}", headers=ACME).status_code == 410
    again = _sift(stack, "erase", search["id"])  # idempotent
    assert again.exit_code == 0 and f"erased search {search['id']}" in again.stdout
    missing = _sift(stack, "erase", "srch_" + "0" * 32)
    assert missing.exit_code == 1 and "no search" in missing.output, missing.output
    unknown = _sift(stack, "erase", "nothing-1")
    assert unknown.exit_code == 2 and "srch_" in unknown.output, unknown.output


def _logged(stack: Stack, *lines: str) -> None:
    """Until the worker's log holds each of ``lines`` (each a copy handled, as it says)."""
    deadline = time.monotonic() + 30  # a hang guard, not a speed check
    while True:
        text = stack.logs[0].read_text(errors="replace")
        missing = [line for line in lines if line not in text]
        if not missing:
            return
        assert time.monotonic() < deadline, missing
        time.sleep(0.1)


def test_copies_of_an_erased_jobs_messages_bring_nothing_back(stack: Stack) -> None:
    """A redelivered search, a batch chunk sent again and a webhook's copy, each run by the real
    worker after the erase: each finds nothing to run or announce, and writes nothing back."""
    index, word = _marked_index(stack)
    query = f"ceremony {word} " + uuid.uuid4().hex
    with webhook_inbox() as (url, inbox):
        search = stack.live.post(
            "/v1/searches",
            params={"wait": 10},
            json={"index": index, "query": query, "webhook_url": url},
            headers=ACME,
        ).json()
        assert search["status"] == "succeeded", search
        inbox.get(timeout=30)  # its webhook, delivered
        queries = [{"id": "r0", "query": query}, {"id": "r1", "query": query}]
        batch, _ = finished_batch(stack.live, {"index": index, "queries": queries})
        for path in (f"/v1/searches/{search['id']}", f"/v1/batches/{batch['id']}/results"):
            assert stack.live.delete(path, headers=ACME).status_code == 200
        store = JobStore.from_url(stack.redis_url + "/0")
        try:
            sender = OutboxSender(store)
            sender.send(SEARCH_TASK, [search["id"]], SEARCH_QUEUE)
            sender.send(BATCH_CHUNK_TASK, [batch["id"], 0, 2], BATCH_QUEUE)
            event = webhook_event(
                WEBHOOK_EVENT_SEARCH_COMPLETED, search["id"], "acme", url, "succeeded"
            )
            sender.send(WEBHOOK_TASK, [event], WEBHOOK_QUEUE)
        finally:
            store.close()
        _logged(
            stack,
            f"search {search['id']}: nothing to do (missing)",
            f"batch {batch['id']}: missing, chunk [0, 2) dropped",
            f"webhook {search['id']}: the job was erased; this copy is dropped",
        )
        assert inbox.empty()
    assert _holding(stack, query, word) == set()
    with redis.Redis.from_url(stack.redis_url + "/0") as r:
        named = {key for job in (search["id"], batch["id"])
                 for key in r.scan_iter() if job.encode() in key}  # fmt: skip
    marks = {b"sift:erased:" + job.encode() for job in (search["id"], batch["id"])}
    assert named == marks

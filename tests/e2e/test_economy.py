"""The economy lane over HTTP through the real stack: Message Batches on the fake provider.

The stack (``conftest.py``) polls provider batches every 0.2-1 s, puts at most 4 requests
in a provider batch (so every batch here spans several), and stops resubmitting
``ECONOMY_DEADLINE_SECONDS`` after a batch came in. The fake shuffles every results file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import ACME, ECONOMY_DEADLINE_SECONDS, INDEX, Stack, ingest, worker_usage
from tests.fake_anthropic import (
    errored,
    expired,
    good,
    malformed,
    missing,
    positions,
    refusal,
    status,
    succeeded,
)
from worker.constants import ECONOMY_PRICE_DISCOUNT
from worker.core.cost import cost_usd, price_for
from worker.core.types import TokenUsage
from worker.queue.economy import position_of, submission_of
from worker.settings import DEFAULT_PRICES

FINAL = {"succeeded", "failed", "canceled"}


@pytest.fixture(autouse=True)
def clean_fake(stack: Stack) -> Iterator[None]:
    stack.model.reset()
    stack.model.configure(batch_processing_seconds=0.0)
    yield
    stack.model.reset()
    stack.model.configure(batch_processing_seconds=0.0)


def _submit(stack: Stack, items: list[dict[str, Any]], lane: str, **extra: Any) -> str:
    body = {"index": INDEX, "queries": items, "rerank": True, "lane": lane, **extra}
    response = stack.live.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    assert response.json()["lane"] == lane
    return str(response.json()["id"])


def _wait(stack: Stack, batch_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        batch: dict[str, Any] = stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()
        if batch["finished_at"]:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)


def _wait_for_provider_batches(stack: Stack, count: int, timeout: float = 30.0) -> None:
    """Until the fake holds ``count`` provider batches (Sift's creates, and any foreign one)."""
    deadline = time.monotonic() + timeout
    while len(stack.model.batches()) < count:
        assert time.monotonic() < deadline, f"{len(stack.model.batches())} provider batches"
        time.sleep(0.02)


def _results(stack: Stack, batch_id: str) -> dict[str, dict[str, Any]]:
    page = stack.live.get(
        f"/v1/batches/{batch_id}/results", params={"page_size": 1000}, headers=ACME
    ).json()
    return {r["query_id"]: r for r in page["results"]}


def _told_once(done: dict[str, Any], results: dict[str, dict[str, Any]]) -> None:
    """The batch's usage is its final items' summed (results', failures', cancels'), each
    once: a resubmitted item's rounds added by its one final outcome, not per round."""
    usages = [(r.get("result") or r.get("error") or r).get("usage") or {} for r in results.values()]
    for key in ("requests", "input_tokens", "output_tokens", "cache_read_input_tokens"):
        assert done["usage"][key] == sum(u.get(key, 0) for u in usages), key
    assert done["usage"]["cost_usd"] == pytest.approx(sum(u.get("cost_usd", 0) for u in usages))
    assert sum(done["rerank_outcomes"].values()) == done["counts"]["succeeded"]


def _canonical(body: object) -> str:
    return json.dumps(body, sort_keys=True)


def _items(queries: list[str], n: int) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "query": queries[i % len(queries)], "limit": 5} for i in range(n)]


def test_economy_gives_the_standard_lanes_hits_at_half_the_cost(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    items = _items(queries, 10)
    standard_id = _submit(stack, items, "standard", include_trace=True)
    assert _wait(stack, standard_id)["counts"]["succeeded"] == 10
    messages = [r["body"] for r in stack.model.requests()]
    economy_id = _submit(stack, items, "economy", include_trace=True)
    done = _wait(stack, economy_id)
    assert done["status"] == "succeeded" and done["counts"]["succeeded"] == 10, done

    standard, economy = _results(stack, standard_id), _results(stack, economy_id)
    # each batch's record sums its items' usage: the economy one's tokens the same, half the cost
    standard_batch = stack.live.get(f"/v1/batches/{standard_id}", headers=ACME).json()
    summed = sum(r["result"]["usage"]["cost_usd"] for r in standard.values())
    assert standard_batch["usage"]["cost_usd"] == pytest.approx(summed, rel=1e-9)
    assert done["usage"]["cost_usd"] == pytest.approx(summed / 2, rel=1e-9)
    assert done["usage"]["input_tokens"] == standard_batch["usage"]["input_tokens"] > 0
    assert done["rerank_outcomes"] == {"applied": 10, "fallback": 0, "skipped": 0}
    traces = [r["result"]["trace"] for r in economy.values()]
    assert done["stage_seconds"] == pytest.approx(
        {
            "queue_wait": sum(t["queue_wait_seconds"] for t in traces),
            "slot_wait": sum(t["slot_wait_seconds"] for t in traces),
            **{
                stage: sum(t["retrieval_seconds"][stage] for t in traces)
                for stage in traces[0]["retrieval_seconds"]
            },
            "rerank": sum(t["rerank_seconds"] for t in traces),  # the provider batches' wait
        },
        abs=1e-5,
    )
    for item in items:
        s, e = standard[item["id"]]["result"], economy[item["id"]]["result"]
        assert [h["id"] for h in e["hits"]] == [h["id"] for h in s["hits"]]
        assert e["hits"] == s["hits"]  # ranks, scores, text: the same hit objects
        assert e["rerank"] == s["rerank"] and e["rerank"]["applied"] is True
        usage_s, usage_e = s["usage"], e["usage"]
        for field in ("requests", "input_tokens", "output_tokens"):
            assert usage_e[field] == usage_s[field] > 0
        assert usage_e["cost_usd"] == pytest.approx(usage_s["cost_usd"] / 2, rel=1e-9)
        assert e["trace"]["kept_positions"] == s["trace"]["kept_positions"]
        assert e["trace"]["attempts"][0]["provider_result"] == "succeeded"
        assert e["trace"]["queue_wait_seconds"] >= 0  # kept from the first half to the finish

    # 10 requests in provider batches of at most 4; params exactly the standard lane's bodies
    batches = stack.model.batches()
    assert [len(b["custom_ids"]) for b in batches] == [4, 4, 2]
    sent = [p for b in batches for p in b["params"]]
    assert sorted(map(_canonical, sent)) == sorted(map(_canonical, messages))
    assert all("effort" not in p["output_config"] for p in sent)  # the model takes none
    custom_ids = [c for b in batches for c in b["custom_ids"]]
    assert sorted(position_of(c) for c in custom_ids) == list(range(10))
    # each create's custom_ids name its own submission, one per provider batch
    submissions = [{submission_of(c) for c in b["custom_ids"]} for b in batches]
    assert all(len(s) == 1 for s in submissions) and len(set.union(*submissions)) == 3


def test_out_of_order_results_are_mapped_by_custom_id(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    items = [{"id": f"x{i}", "query": queries[0], "limit": 3} for i in range(8)]
    # the same query eight times, each item told to pick a different candidate
    stack.model.script_batch({f"i{i}": [succeeded(positions([i + 1]))] for i in range(8)})
    batch_id = _submit(stack, items, "economy", include_trace=True)
    assert _wait(stack, batch_id)["counts"]["succeeded"] == 8
    for b in stack.model.batches():
        assert b["result_order"] != b["custom_ids"]  # the fake really did shuffle
    results = _results(stack, batch_id)
    for i in range(8):
        result = results[f"x{i}"]["result"]
        assert [h["ranks"]["rrf"] for h in result["hits"]] == [i + 1]
        assert result["trace"]["kept_positions"] == [i + 1]


def test_errored_expired_and_malformed_requests_are_resubmitted_or_fail_by_policy(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    items = _items(queries, 6)
    stack.model.script_batch(
        {
            "i0": [errored("overloaded_error")],  # retryable: resubmitted, then succeeds
            "i1": [expired()],  # retryable (class timeout): resubmitted, then succeeds
            "i2": [succeeded(malformed("not json"))],  # malformed: resubmitted, then succeeds
            "i3": [errored("invalid_request_error")],  # http_4xx: permanent, fails at once
            "i4": [errored("api_error")] * 3,  # the attempt budget (3) runs out
            "i5": [succeeded(refusal("bio"))],  # refused: billed, final, never resubmitted
        }
    )
    batch_id = _submit(stack, items, "economy", include_trace=True)
    done = _wait(stack, batch_id)
    assert done["counts"] == {
        "total": 6, "queued": 0, "running": 0, "succeeded": 3, "failed": 3, "canceled": 0,
    }  # fmt: skip
    results = _results(stack, batch_id)
    refused = results["q5"]["error"]
    assert results["q5"]["status"] == "failed" and refused["type"] == "rerank_failed"
    assert "(refused)" in refused["message"] and "category=bio" in refused["message"]
    assert [a["outcome"] for a in refused["trace"]["attempts"]] == ["refused"]
    assert refused["usage"]["requests"] == 1 and refused["usage"]["input_tokens"] > 0
    for qid, first in (("q0", "http_5xx"), ("q1", "timeout"), ("q2", "malformed")):
        result = results[qid]["result"]
        assert result["rerank"]["applied"] is True
        assert [a["outcome"] for a in result["trace"]["attempts"]] == [first, "ok"]
        assert result["usage"]["requests"] == 2
    assert results["q1"]["result"]["trace"]["attempts"][0]["provider_result"] == "expired"
    assert results["q3"]["status"] == "failed"
    assert results["q3"]["error"]["type"] == "rerank_failed"
    assert "http_4xx" in results["q3"]["error"]["message"]
    assert results["q4"]["status"] == "failed"
    assert "http_5xx" in results["q4"]["error"]["message"]
    # the batch asked for traces: a failed item keeps its own, with each attempt's class
    trace = results["q4"]["error"]["trace"]
    assert [a["outcome"] for a in trace["attempts"]] == ["http_5xx"] * 3, trace
    assert trace["policy"] and trace["candidates"], trace
    # the failure named as one, no fallback's reason; the queue wait as a result's trace has it
    assert (trace["failure"], trace["fallback_reason"]) == ("http_5xx", None), trace
    assert trace["queue_wait_seconds"] >= 0, trace
    # three provider batches for the first round, then the resubmissions of q0, q1, q2, q4
    resubmitted = [position_of(c) for b in stack.model.batches()[2:] for c in b["custom_ids"]]
    assert sorted(resubmitted) == [0, 1, 2, 4, 4]
    # the batch tells why its items failed, each error's reason the class its message names
    assert [results[q]["error"]["reason"] for q in ("q3", "q4", "q5")] == [
        "http_4xx",
        "http_5xx",
        "refused",
    ]
    assert done["failures"] == {"rerank_failed": 3}
    assert done["rerank_failures"] == {"http_4xx": 1, "http_5xx": 1, "refused": 1}


def test_a_resubmitted_request_s_trace_tells_what_it_waited_to_be_sent_again(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    """An item whose request errored is resubmitted, and the resubmission's create is
    answered 429 (``retry-after: 1``): it goes again once the lane's pause is over. The retry's
    trace entry tells that wait as ``backoff_wait_seconds``, beside its ``seconds`` (its
    provider batch's), as the standard lane's attempts do: 0 for the first, the 429's second
    for the retry, and the item's ``rerank_seconds`` (its first send to its result) are the
    attempts' seconds and waits. Before, the economy lane's attempts had no such field, and
    the second was in no figure of the trace."""
    stack.model.script_batch({"i0": [errored("overloaded_error")]})
    stack.model.script_batch_calls("create", [good(), status(429, retry_after=1)])
    batch_id = _submit(stack, _items(queries, 1), "economy", include_trace=True)
    assert _wait(stack, batch_id)["counts"]["succeeded"] == 1
    trace = _results(stack, batch_id)["q0"]["result"]["trace"]
    first, retry = attempts = trace["attempts"]
    assert (first["outcome"], retry["outcome"]) == ("http_5xx", "ok"), attempts
    assert first["backoff_wait_seconds"] == 0.0
    # its result counted before the 429, sent again after its pause (the shared clock's
    # readings err by half a round trip to Redis)
    assert retry["backoff_wait_seconds"] >= 1.0 - 0.05, attempts
    waits = sum(a["seconds"] + a["backoff_wait_seconds"] for a in attempts)
    assert trace["rerank_seconds"] == pytest.approx(waits, abs=1e-6), trace
    assert len(stack.model.batches()) == 2  # the refused create made nothing


def test_once_the_economy_deadline_is_out_the_failure_policy_applies(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    # the provider batch ends after the economy deadline: an expired request is not resent
    stack.model.configure(batch_processing_seconds=ECONOMY_DEADLINE_SECONDS + 0.5)
    stack.model.script_batch({"i0": [expired()], "i1": [errored("overloaded_error")]})
    batch_id = _submit(stack, _items(queries, 3), "economy")
    done = _wait(stack, batch_id)
    assert done["counts"]["succeeded"] == 1 and done["counts"]["failed"] == 2
    results = _results(stack, batch_id)
    assert results["q0"]["error"]["type"] == "rerank_failed"
    assert "timeout" in results["q0"]["error"]["message"]
    assert "expired" in results["q0"]["error"]["message"]
    assert "http_5xx" in results["q1"]["error"]["message"]
    assert results["q2"]["result"]["rerank"]["applied"] is True
    assert len(stack.model.batches()) == 1  # nothing was resubmitted


def test_canceling_an_economy_batch_cancels_its_provider_batches(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    stack.model.configure(batch_processing_seconds=300.0)
    batch_id = _submit(stack, _items(queries, 6), "economy")
    _wait_for_provider_batches(stack, 2)  # 6 requests: two provider batches
    response = stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME)
    assert response.status_code == 200
    done = _wait(stack, batch_id)
    assert done["status"] == "canceled"
    assert done["counts"]["canceled"] == 6, done["counts"]
    results = _results(stack, batch_id)
    assert all(r["status"] == "canceled" and "result" not in r for r in results.values())
    assert all(b["status"] == "ended" for b in stack.model.batches())


def test_a_canceled_provider_batch_s_processed_requests_are_counted_and_shown_once(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    """The batch is canceled while its two provider batches are processing: the requests the
    provider had processed come back succeeded (billed), the rest canceled. However many
    that is, the succeeded items are the answers billed, and the batch's totals, its items'
    usage and the economy lane's counters all show those answers' tokens and dollars once."""
    stack.model.configure(batch_processing_seconds=300.0)
    before_fake, before_metrics = stack.model.usage(), worker_usage(stack, "economy")
    submitted = time.monotonic()
    batch_id = _submit(stack, _items(queries, 6), "economy")
    _wait_for_provider_batches(stack, 2)
    # the fake has processed the share of its time since creation: about three fifths now,
    # so the cancel most likely finds both provider batches part processed (the assertions
    # below hold whatever the share)
    time.sleep(1.0)
    stack.model.configure(batch_processing_seconds=(time.monotonic() - submitted) / 0.6)
    assert stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME).status_code == 200
    done = _wait(stack, batch_id)
    billed = {k: v - before_fake.get(k, 0) for k, v in stack.model.usage().items()}
    after = worker_usage(stack, "economy")
    counts = done["counts"]
    print(f"\nat the cancel: {counts['succeeded']} processed, {counts['canceled']} canceled")
    assert counts["succeeded"] + counts["canceled"] == 6 and counts["failed"] == 0, counts
    assert counts["succeeded"] == billed["responses"], (counts, billed)
    results = _results(stack, batch_id).values()
    shown = [r["result"]["usage"] for r in results if r["status"] == "succeeded"]
    assert all("usage" not in r for r in results if r["status"] == "canceled")
    for key, kind in (
        ("input_tokens", "input"),
        ("output_tokens", "output"),
        ("cache_read_input_tokens", "cache_read"),
        ("cache_creation_input_tokens", "cache_creation"),
    ):
        counted = after.get(kind, 0.0) - before_metrics.get(kind, 0.0)
        assert done["usage"][key] == sum(u[key] for u in shown) == billed[key] == counted, key
    expected = cost_usd(
        TokenUsage(
            billed["input_tokens"],
            billed["output_tokens"],
            billed["cache_read_input_tokens"],
            billed["cache_creation_input_tokens"],
        ),
        price_for("claude-haiku-4-5", DEFAULT_PRICES),
        ECONOMY_PRICE_DISCOUNT,
    )
    assert expected is not None
    assert done["usage"]["cost_usd"] == pytest.approx(expected)
    counted_cost = after.get("cost_usd", 0.0) - before_metrics.get("cost_usd", 0.0)
    assert counted_cost == pytest.approx(expected)


def test_a_billed_round_shows_in_the_metrics_though_its_item_is_then_canceled(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    """Round one's answer is malformed (billed), so the item is resubmitted; the batch is
    canceled while round two is in progress. The provider billed round one: the worker's
    token and cost counters must show it, though the item ends canceled, and so must the
    canceled item's record (its ``usage``: the job agrees with the counters and the bill)."""
    stack.model.configure(batch_processing_seconds=0.5)
    stack.model.script_batch({"i0": [succeeded(malformed("not json"))]})
    before = worker_usage(stack, "economy")
    batch_id = _submit(stack, _items(queries, 1), "economy")
    _wait_for_provider_batches(stack, 2)  # round two submitted
    stack.model.configure(batch_processing_seconds=300.0)  # round two stays in progress
    assert stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME).status_code == 200
    done = _wait(stack, batch_id)
    assert done["counts"]["canceled"] == 1, done["counts"]
    billed = stack.model.usage()
    assert billed["responses"] == 1 and billed["input_tokens"] > 0
    after = worker_usage(stack, "economy")
    for key, kind in (
        ("input_tokens", "input"),
        ("output_tokens", "output"),
        ("cache_read_input_tokens", "cache_read"),
        ("cache_creation_input_tokens", "cache_creation"),
    ):
        assert after.get(kind, 0.0) - before.get(kind, 0.0) == billed[key], kind
    price = price_for("claude-haiku-4-5", DEFAULT_PRICES)
    expected = cost_usd(
        TokenUsage(
            billed["input_tokens"],
            billed["output_tokens"],
            billed["cache_read_input_tokens"],
            billed["cache_creation_input_tokens"],
        ),
        price,
        ECONOMY_PRICE_DISCOUNT,
    )
    assert after["cost_usd"] - before.get("cost_usd", 0.0) == pytest.approx(expected)
    [item] = _results(stack, batch_id).values()
    assert item["status"] == "canceled" and "result" not in item, item
    shown = item.get("usage")
    assert shown is not None, item
    assert shown["requests"] == 1, shown
    for key in billed.keys() - {"responses"}:
        assert shown[key] == billed[key], key
    assert shown["cost_usd"] == pytest.approx(expected)
    # and the batch's record adds it to its usage, at the economy lane's discount
    assert done["lane"] == "economy"
    assert {key: done["usage"][key] for key in shown.keys() - {"cost_usd"}} == {
        key: shown[key] for key in shown.keys() - {"cost_usd"}
    }
    assert done["usage"]["cost_usd"] == pytest.approx(expected)


def test_an_economy_batch_with_rerank_off_finishes_without_the_provider(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    body = {"index": INDEX, "queries": _items(queries, 3), "rerank": False, "lane": "economy"}
    batch_id = stack.live.post("/v1/batches", json=body, headers=ACME).json()["id"]
    done = _wait(stack, batch_id)
    assert done["counts"]["succeeded"] == 3
    assert stack.model.batches() == []
    canceled = stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME)  # finished: 409
    assert canceled.status_code == 409
    assert canceled.json()["error"]["type"] == "already_finished"
    assert stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json() == done


def test_a_request_the_results_leave_out_is_sent_again_then_fails_not_waiting_forever(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    """A request the results file leaves out is a ``malformed`` result of its item, as an
    unreadable line is: sent again while its attempts last, then the failure policy. It
    failed at once, two of its three attempts unused, where the standard lane retries an
    unreadable answer: the economy lane failed items the standard lane answered."""
    stack.model.script_batch({"i1": [missing()], "i2": [missing()] * 3})
    batch_id = _submit(stack, _items(queries, 3), "economy", include_trace=True)
    done = _wait(stack, batch_id)
    assert done["counts"]["running"] == 0 and done["counts"]["succeeded"] == 2, done
    results = _results(stack, batch_id)
    assert results["q0"]["status"] == "succeeded"
    attempts = results["q1"]["result"]["trace"]["attempts"]
    assert [a["outcome"] for a in attempts] == ["malformed", "ok"], attempts
    assert results["q2"]["status"] == "failed"
    assert results["q2"]["error"]["type"] == "rerank_failed"
    assert "malformed" in results["q2"]["error"]["message"]
    # sent again (the e2e economy deadline, 4 s, may end it before its third attempt)
    assert results["q2"]["error"]["usage"]["requests"] >= 2, results["q2"]
    _told_once(done, results)
    # the log names the ones left out of the first provider batch, not those answered too
    log = stack.logs[0].read_text(errors="replace")
    made = {m["id"] for m in stack.model.batches()}
    assert any(f"provider batch {m}: 2 requests had no result" in log for m in made), made
    assert not any(f"provider batch {m}: 3 requests had no result" in log for m in made)


@pytest.mark.parametrize("removed", ["a document", "the index"])
def test_an_item_finished_after_a_delete_returns_nothing_the_delete_removed(
    stack: Stack, removed: str
) -> None:
    """An economy item is finished from the candidates kept when it was prepared, hours
    later at most (its provider batch's processing): a document deleted meanwhile, once the
    delete has finished, was still its hit, its text in the hits and the trace; an index
    dropped meanwhile still gave hits. Now the finish reads the candidates as stored: a
    deleted one is in no hit and not in the trace, and with the index gone the item is
    ``index_not_found``, its billed usage shown."""
    index = "eco-deletes-" + ("doc" if removed == "a document" else "drop")
    words = "apple banana cherry"
    documents = [{"id": f"d{i}", "text": f"{words} fruit number {i}"} for i in range(6)]
    ingest(stack, index, documents)
    stack.model.configure(batch_processing_seconds=3.0)
    body = {
        "index": index,
        "queries": [{"id": f"q{i}", "query": words, "limit": 6} for i in range(2)],
        "rerank": True,
        "lane": "economy",
        "include_trace": True,
    }
    response = stack.live.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    batch_id = response.json()["id"]
    _wait_for_provider_batches(stack, 1)  # both items prepared, their candidates kept
    if removed == "a document":
        target = f"/v1/indexes/{index}/documents/d0"
    else:
        target = f"/v1/indexes/{index}"
    deleted = stack.live.delete(target, params={"wait": 20}, headers=ACME)
    assert deleted.status_code == 200 and deleted.json()["status"] == "succeeded", deleted.text
    done = _wait(stack, batch_id)
    results = _results(stack, batch_id)
    assert len(results) == 2
    if removed == "a document":
        assert done["counts"]["succeeded"] == 2, done
        for item in results.values():
            hits = item["result"]["hits"]
            assert hits and "d0" not in [hit["id"] for hit in hits], item
            assert "d0" not in [c["id"] for c in item["result"]["trace"]["candidates"]]
            assert "fruit number 0" not in json.dumps(item)
    else:
        assert done["counts"]["failed"] == 2, done
        for item in results.values():
            assert item["error"]["type"] == "index_not_found", item
            assert item["error"]["usage"]["requests"] == 1, item
            assert "fruit number" not in json.dumps(item)


def test_an_item_returns_no_document_written_again_outside_its_filters(stack: Stack) -> None:
    """An economy item reads its candidates again as stored when it finishes (hours after
    its retrieval at most). A document written again meanwhile with metadata its search's
    filters no longer keep (``{"vis": "public"}``, rewritten ``private``, with new text) was
    still its hit, with its new metadata and text, and in the trace: the hard filters,
    applied inside the retrieval, were not applied to what the finish read, and a search
    asking for public documents returned a private one. Now it is in no hit, nor in the
    trace's candidates, which name it in ``filtered_out_since_retrieval`` (the model's pick
    of it dropped as ``filtered_out``); the others, and one written again still inside the
    filters, show as stored."""
    index = "eco-filters"
    words = "apple banana cherry"
    documents = [
        {"id": f"d{i}", "text": f"{words} fruit number {i}", "metadata": {"vis": "public"}}
        for i in range(6)
    ]
    ingest(stack, index, documents)
    stack.model.configure(batch_processing_seconds=3.0)
    body = {
        "index": index,
        "queries": [{"id": "q0", "query": words, "limit": 6, "filters": {"vis": "public"}}],
        "rerank": True,
        "lane": "economy",
        "include_trace": True,
    }
    response = stack.live.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    batch_id = response.json()["id"]
    _wait_for_provider_batches(stack, 1)  # the item prepared, its candidates kept
    ingest(stack, index, [
        {"id": "d0", "text": f"{words} now private", "metadata": {"vis": "private"}},
        {"id": "d1", "text": f"{words} still public", "metadata": {"vis": "public", "v": 2}},
    ])  # fmt: skip
    done = _wait(stack, batch_id)
    assert done["counts"]["succeeded"] == 1, done
    result = _results(stack, batch_id)["q0"]["result"]
    assert "now private" not in json.dumps(result), result
    assert sorted(hit["id"] for hit in result["hits"]) == ["d1", "d2", "d3", "d4", "d5"]
    assert all(hit["metadata"]["vis"] == "public" for hit in result["hits"]), result
    assert "still public" in json.dumps(result["hits"]), result
    trace = result["trace"]
    assert trace["filtered_out_since_retrieval"] == ["d0"], trace
    assert "deleted_since_retrieval" not in trace, trace
    assert "d0" not in [c["id"] for c in trace["candidates"]], trace
    # the model's pick of it dropped as what happened to it, not as deleted
    assert len(trace["returned_positions"]) == 6, trace  # the fake picks every candidate
    assert [d["reason"] for d in trace["dropped_positions"]] == ["filtered_out"], trace

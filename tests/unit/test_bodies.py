"""A batch's body parsed a slice at a time: the same model, the same errors, the same
fingerprint as the one-call parse (``api_gateway/bodies.py``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError

from api_gateway.bodies import VALIDATE_CHUNK, loads_in_pieces, parse_batch
from api_gateway.errors import problems_of
from api_gateway.schemas import BatchRequest
from worker.constants import MAX_BATCH_QUERIES
from worker.contract import SearchSpec
from worker.errors import InvalidRequest
from worker.queue.jobstore import fingerprint


def body(n: int, **extra: Any) -> dict[str, Any]:
    queries: list[dict[str, Any]] = [
        {"id": f"q{i}", "query": f"thé vert n°{i} \u2603"} for i in range(n)
    ]
    queries[1]["filters"] = {"lang": "fr", "year": 2024, "ok": True, "score": 0.5}
    queries[2]["limit"], queries[2]["mode"] = 3, "fts"
    return {"index": "docs", "queries": queries, **extra}


def fields_of(raw: bytes) -> list[str]:
    with pytest.raises(RequestValidationError) as error:
        parse_batch(raw)
    return [p.field for p in problems_of(error.value.errors())]


def test_a_repeated_query_id_is_named_after_the_validation_errors() -> None:
    repeated = body(2 * VALIDATE_CHUNK)
    repeated["queries"][VALIDATE_CHUNK + 1]["id"] = "q3"
    with pytest.raises(InvalidRequest) as error:
        parse_batch(json.dumps(repeated).encode())
    assert error.value.field == f"queries[{VALIDATE_CHUNK + 1}].id"
    assert "first at queries[3]" in error.value.message
    repeated["queries"][2 * VALIDATE_CHUNK - 1]["query"] = " "
    assert fields_of(json.dumps(repeated).encode()) == [f"queries[{2 * VALIDATE_CHUNK - 1}].query"]


def test_the_sliced_parse_gives_what_the_one_call_parse_gives() -> None:
    raw = json.dumps(body(2 * VALIDATE_CHUNK + 7, rerank=True, lane="economy")).encode()
    whole = BatchRequest.model_validate_json(raw)
    parsed = parse_batch(raw)
    assert parsed.head.model_dump(exclude={"queries"}) == whole.model_dump(exclude={"queries"})
    assert [qid for qid, _ in parsed.items] == [q.id for q in whole.queries]
    specs = [SearchSpec.model_validate_json(spec) for _, spec in parsed.items]
    assert specs[2] == SearchSpec(
        index="docs", query=whole.queries[2].query, limit=3, mode="fts", rerank=True
    )
    assert specs[1].filters == whole.queries[1].filters and specs[1].limit == 10
    assert parsed.fingerprint == ""


def test_the_sliced_fingerprint_is_the_one_call_fingerprint() -> None:
    """A key used before the change keeps matching its body (same hash, byte for byte)."""
    for extra in ({}, {"webhook_url": "https://example.com/h", "include_trace": True}):
        raw = json.dumps(body(2 * VALIDATE_CHUNK + 7, **extra)).encode()
        whole = BatchRequest.model_validate_json(raw).model_dump(mode="json")
        parsed = parse_batch(raw, "POST /v1/batches")
        assert parsed.fingerprint == fingerprint("POST /v1/batches", whole)
    other = parse_batch(json.dumps(body(2 * VALIDATE_CHUNK + 8)).encode(), "POST /v1/batches")
    assert other.fingerprint != parsed.fingerprint


def test_errors_name_the_field_at_its_place_in_the_whole_list() -> None:
    queries = body(3 * VALIDATE_CHUNK)
    queries["queries"][VALIDATE_CHUNK + 5]["query"] = ""
    queries["queries"][2 * VALIDATE_CHUNK + 1]["extra"] = 1
    queries["lane"] = "fast"
    assert fields_of(json.dumps(queries).encode()) == [
        "lane",
        f"queries[{VALIDATE_CHUNK + 5}].query",
        f"queries[{2 * VALIDATE_CHUNK + 1}].extra",
    ]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"", "body"),
        (b"{not json", "body"),
        (b"[1, 2]", "body"),
        (b'{"index": "docs"}', "queries"),
        (b'{"index": "docs", "queries": []}', "queries"),
        (b'{"index": "docs", "queries": {"id": "q"}}', "queries"),
        (json.dumps(body(MAX_BATCH_QUERIES + 1)).encode(), "queries"),
    ],
)
def test_malformed_bodies(raw: bytes, field: str) -> None:
    assert fields_of(raw) == [field]


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(body(50, rerank=None, webhook_url="https://e.com/h", lane="economy")),
        json.dumps(body(3), indent=2),
        ' \n{ "queries" : [ ] , "index":"a","index" : [1,[2,{"x":[3]}]] }\t',
        "{}",
        '{"a": [1, 2.5e3, true, null, "\\u00e9\\"", NaN]}',
        "[1, 2]",
        '"text"',
    ],
)
def test_the_piecewise_decoder_reads_what_json_loads_reads(text: str) -> None:
    assert repr(loads_in_pieces(text)) == repr(json.loads(text))


@pytest.mark.parametrize(
    "text",
    ['{"a": [1, 2,]}', '{"a": 1,}', '{"a" 1}', "{'a': 1}", '{"a": [1] } x', '{"a": [1', "", "{"],
)
def test_the_piecewise_decoder_fails_as_json_loads_fails(text: str) -> None:
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text)
    with pytest.raises(json.JSONDecodeError) as got:
        loads_in_pieces(text)
    assert (got.value.msg, got.value.pos) == (expected.value.msg, expected.value.pos)


def test_a_body_nested_too_deep_is_invalid_json_not_a_crash() -> None:
    assert fields_of(b'{"index": ' + b"[" * 100_000 + b"]" * 100_000 + b"}") == ["body"]


@pytest.mark.parametrize(
    ("text", "field", "times"),
    [
        ('{"index": "docs", "index": "other", "queries": [{"id": "a", "query": "t"}]}', "index", 2),
        ('{"queries": [], "index": "d", "queries": [{"id": "a", "query": "t"}]}', "queries", 2),
        (
            '{"index": "d", "queries": [{"id": "a", "query": "t", "query": "u"}]}',
            "queries[0].query",
            2,
        ),
        (
            '{"index": "d", "queries": [{"id": "a", "query": "t"},'
            ' {"id": "b", "query": "t", "filters": {"k": 1, "k": 2, "k": 3}}]}',
            "queries[1].filters.k",
            3,
        ),
        # outermost first, in the text's order
        (
            '{"index": "d", "queries": [{"id": "a", "id": "b", "query": "t"}], "index": "e"}',
            "index",
            2,
        ),
        # not an object, which the scanner leaves to json.loads: checked as well
        ('[{"a": 1, "a": 2}]', "[0].a", 2),
    ],
)
def test_a_member_given_twice_is_named_at_any_depth(text: str, field: str, times: int) -> None:
    """``json.loads`` keeps the last of a repeated member: ``{"limit": 3, "limit": 50}`` was
    a search of 50 whatever its writer meant."""
    with pytest.raises(InvalidRequest) as error:
        parse_batch(text.encode())
    assert error.value.field == field
    assert error.value.message == f"{field}: is given {times} times: give it once"


def test_a_body_without_a_repeated_member_is_read_as_before() -> None:
    raw = json.dumps(body(3, rerank=True)).encode()
    assert [qid for qid, _ in parse_batch(raw).items] == ["q0", "q1", "q2"]


def test_a_batch_whose_fusion_sets_nothing_has_the_fingerprint_of_one_without() -> None:
    """``fusion: {}`` means what no fusion means: the same key replays, not a 409."""
    without = parse_batch(json.dumps(body(3)).encode(), "POST /v1/batches")
    for empty in ({}, {"weights": {}}, None):
        raw = json.dumps(body(3, fusion=empty)).encode()
        assert parse_batch(raw, "POST /v1/batches").fingerprint == without.fingerprint


@pytest.mark.parametrize("default", [True, False])
def test_each_item_carries_the_gateways_rerank_default_where_the_batch_leaves_it_out(
    default: bool,
) -> None:
    """The worker runs what each item's spec says, so the gateway's default is written in
    (it read the worker's own, which may differ); the fingerprint is of the body as sent."""
    route = "POST /v1/batches"
    for asked in (None, True, False):
        extra = {} if asked is None else {"rerank": asked}
        raw = json.dumps(body(3, **extra)).encode()
        parsed = parse_batch(raw, route, rerank_default=default)
        specs = [SearchSpec.model_validate_json(spec) for _, spec in parsed.items]
        assert [s.rerank for s in specs] == [default if asked is None else asked] * 3
        assert parsed.fingerprint == parse_batch(raw, route).fingerprint


def test_a_batch_counts_the_candidates_its_traces_list() -> None:
    """A trace lists a reranked query's coarse window (its ``limit``, or the batch's
    ``candidate_limit``, else the deployment's, if larger), an unranked one's hits: what
    admission prices the traces by (a trace was 4 kB whatever it listed)."""

    def traced(**head: object) -> int:
        queries = [{"id": "a", "query": "q", "limit": 5}, {"id": "b", "query": "q", "limit": 40}]
        body = {"index": "docs", "queries": queries, "include_trace": True, **head}
        return parse_batch(json.dumps(body).encode(), window=30).traced

    assert traced(rerank=True) == 30 + 40
    assert traced(rerank=True, candidate_limit=50) == 50 + 50
    assert traced(rerank=False) == 5 + 40
    assert traced(rerank=True, include_trace=False) == 0


def test_an_economy_batch_counts_the_candidates_its_items_keep_while_they_wait() -> None:
    """A reranked economy item keeps its coarse window's candidates in Redis while it waits
    at the provider (their texts up to the prompt's cut), traced or not: what admission
    prices those records by (they were priced at nothing). A standard batch, or an
    unranked one, keeps none."""

    def waiting(**head: object) -> int:
        queries = [{"id": "a", "query": "q", "limit": 5}, {"id": "b", "query": "q", "limit": 40}]
        body = {"index": "docs", "queries": queries, "lane": "economy", **head}
        return parse_batch(json.dumps(body).encode(), window=30).waiting

    assert waiting(rerank=True) == 30 + 40
    assert waiting(rerank=True, candidate_limit=50, include_trace=True) == 50 + 50
    assert waiting(rerank=False) == 0
    assert waiting(rerank=True, lane="standard") == 0

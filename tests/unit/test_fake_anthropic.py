"""The fake Messages API itself: it refuses what the real API refuses and adds its usage up."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.fake_anthropic import (
    Behaviour,
    FakeAnthropic,
    RemoteFakeAnthropic,
    count_tokens,
    cut,
    delay,
    malformed,
    positions,
    status,
    trickle,
)
from worker.processes.stack import free_port

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
HEADERS = {"x-api-key": "sk-test", "anthropic-version": "2026-10-21"}
SCHEMA = {
    "type": "object",
    "properties": {"positions": {"type": "array", "items": {"type": "integer"}}},
    "required": ["positions"],
    "additionalProperties": False,
}


def body(n: int = 5, **extra: Any) -> dict[str, Any]:
    user = "Question: q\n" + "\n".join(f"[{i}] Title: text {i}" for i in range(1, n + 1))
    return {
        "model": "claude-haiku-4-5",
        "max_tokens": 512,
        "system": "rank them",
        "messages": [{"role": "user", "content": user}],
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        **extra,
    }


@pytest.fixture(scope="module")
def server() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as fake:
        yield fake


@pytest.fixture
def fake(server: FakeAnthropic) -> FakeAnthropic:
    server.reset()
    server.configure(delay=0.0, order="reverse", answer_limit=10, thinking_tokens=0)
    return server


@pytest.fixture
def http(fake: FakeAnthropic) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake.url, timeout=10.0) as client:
        yield client


def assert_api_error(response: httpx.Response, code: int, error_type: str) -> None:
    assert response.status_code == code
    assert response.headers["request-id"].startswith("req_")
    payload = response.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == error_type
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


# --- it refuses what the API refuses --------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 1.0}, {"top_p": 0.9}, {"top_k": 5}],
    ids=["temperature-0", "temperature-1.0", "top_p", "top_k"],
)
def test_refuses_sampling_parameters(
    fake: FakeAnthropic, http: httpx.Client, sampling: dict[str, float]
) -> None:
    fake.script([positions([1])])  # a refused request consumes no scripted behaviour
    response = http.post("/v1/messages", headers=HEADERS, json=body(**sampling))
    assert_api_error(response, 400, "invalid_request_error")
    assert next(iter(sampling)) in response.json()["error"]["message"]
    assert fake.pending() == 1
    assert fake.usage()["responses"] == 0


def test_the_sdk_sees_temperature_1_refused(fake: FakeAnthropic) -> None:
    with (
        anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0) as sdk,
        pytest.raises(anthropic.BadRequestError) as info,
    ):
        sdk.messages.create(
            model="claude-haiku-4-5",
            max_tokens=16,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"temperature": 1.0},
        )
    assert info.value.type == "invalid_request_error"
    assert info.value.request_id is not None


@pytest.mark.parametrize(
    ("headers", "payload", "code", "error_type"),
    [
        ({"anthropic-version": "2026-10-21"}, body(), 401, "authentication_error"),
        ({"x-api-key": "k"}, body(), 400, "invalid_request_error"),
        (HEADERS, {k: v for k, v in body().items() if k != "model"}, 400, "invalid_request_error"),
        (
            HEADERS,
            {k: v for k, v in body().items() if k != "max_tokens"},
            400,
            "invalid_request_error",
        ),
        (HEADERS, {**body(), "messages": []}, 400, "invalid_request_error"),
        (
            HEADERS,
            {**body(), "output_config": {"format": {"type": "xml"}}},
            400,
            "invalid_request_error",
        ),
        (  # the real API: Haiku 4.5 takes no effort parameter
            HEADERS,
            {**body(), "output_config": {**body()["output_config"], "effort": "low"}},
            400,
            "invalid_request_error",
        ),
    ],
    ids=[
        "no-key",
        "no-version",
        "no-model",
        "no-max-tokens",
        "no-messages",
        "bad-format",
        "effort-to-haiku-4-5",
    ],
)
def test_checks_requests_like_the_api(
    http: httpx.Client, headers: dict[str, str], payload: dict[str, Any], code: int, error_type: str
) -> None:
    assert_api_error(http.post("/v1/messages", headers=headers, json=payload), code, error_type)


# --- answers and usage ----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["claude-sonnet-4-6", "claude-opus-4-7", "claude-future-9"])
def test_effort_is_taken_from_a_model_that_has_it(http: httpx.Client, model: str) -> None:
    config = {**body()["output_config"], "effort": "low"}
    response = http.post(
        "/v1/messages", headers=HEADERS, json={**body(), "model": model, "output_config": config}
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("model", "effort", "code"),
    [
        ("claude-opus-4-5", "high", 200),
        ("claude-opus-4-5", "max", 400),  # Opus 4.5 predates max and xhigh
        ("claude-opus-4-5-20251101", "xhigh", 400),
        ("claude-opus-4-6", "max", 200),
        ("claude-sonnet-4-6", "xhigh", 400),  # xhigh came with Opus 4.7
        ("claude-opus-4-7", "xhigh", 200),
        ("claude-sonnet-5", "max", 200),
    ],
)
def test_effort_levels_a_model_does_not_take_are_refused(
    http: httpx.Client, model: str, effort: str, code: int
) -> None:
    config = {**body()["output_config"], "effort": effort}
    response = http.post(
        "/v1/messages", headers=HEADERS, json={**body(), "model": model, "output_config": config}
    )
    if code == 200:
        assert response.status_code == 200, response.text
    else:
        assert_api_error(response, code, "invalid_request_error")


@pytest.mark.parametrize(
    ("positions", "where"),
    [
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 10}, "maxItems"),
        ({"type": "array", "items": {"type": "integer", "minimum": 1}}, "minimum"),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 3}, "minItems"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ],
)
def test_a_schema_structured_outputs_do_not_support_is_refused(
    http: httpx.Client, positions: dict[str, Any], where: str
) -> None:
    # the real API refuses these with a 400 rather than ignore them: a schema cannot bound
    # the positions' count or range (DESIGN.md §7), and a schema that tried failed every call
    schema = {
        "type": "object",
        "properties": {"positions": positions},
        "required": ["positions"],
        "additionalProperties": False,
    }
    payload = {**body(), "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    response = http.post("/v1/messages", headers=HEADERS, json=payload)
    assert_api_error(response, 400, "invalid_request_error")
    assert where in response.json()["error"]["message"]


def test_sifts_own_schema_is_supported(http: httpx.Client) -> None:
    from worker.core.policy import OUTPUT_SCHEMA

    payload = {
        **body(),
        "output_config": {"format": {"type": "json_schema", "schema": OUTPUT_SCHEMA}},
    }
    assert http.post("/v1/messages", headers=HEADERS, json=payload).status_code == 200


def test_default_answer_shape(fake: FakeAnthropic, http: httpx.Client) -> None:
    response = http.post("/v1/messages", headers=HEADERS, json=body(12))
    assert response.status_code == 200
    message = response.json()
    assert message["id"].startswith("msg_")
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["model"] == "claude-haiku-4-5"
    assert message["stop_reason"] == "end_turn"
    assert [block["type"] for block in message["content"]] == ["text"]
    assert json.loads(message["content"][0]["text"]) == {"positions": list(range(12, 2, -1))}
    usage = message["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["cache_read_input_tokens"] == 0 and usage["cache_creation_input_tokens"] == 0
    assert usage["service_tier"] == "standard"


def test_default_order_and_limit_are_configurable(fake: FakeAnthropic, http: httpx.Client) -> None:
    fake.configure(order="identity", answer_limit=3)
    answer = http.post("/v1/messages", headers=HEADERS, json=body(8)).json()
    assert json.loads(answer["content"][0]["text"]) == {"positions": [1, 2, 3]}
    fake.configure(order=lambda ids: sorted(ids, key=lambda n: n % 3), answer_limit=None)
    answer = http.post("/v1/messages", headers=HEADERS, json=body(6)).json()
    assert json.loads(answer["content"][0]["text"]) == {"positions": [3, 6, 1, 4, 2, 5]}


def test_without_a_schema_it_answers_a_rankgpt_permutation(http: httpx.Client) -> None:
    payload = body(4)
    del payload["output_config"]
    payload["messages"] = [
        turn
        for i in range(1, 5)
        for turn in (
            {"role": "user", "content": f"[{i}] passage {i}"},
            {"role": "assistant", "content": f"Received passage [{i}]."},
        )
    ] + [{"role": "user", "content": "Rank the 4 passages."}]
    answer = http.post("/v1/messages", headers=HEADERS, json=payload).json()
    assert answer["content"][0]["text"] == "[4] > [3] > [2] > [1]"


def test_thinking_allowance_is_a_thinking_block_and_output_tokens(
    fake: FakeAnthropic, http: httpx.Client
) -> None:
    fake.configure(thinking_tokens=200)
    answer = http.post("/v1/messages", headers=HEADERS, json=body()).json()
    assert [block["type"] for block in answer["content"]] == ["thinking", "text"]
    text_tokens = count_tokens(answer["content"][1]["text"])
    assert answer["usage"]["output_tokens"] == 200 + text_tokens
    assert answer["usage"]["output_tokens_details"] == {"thinking_tokens": 200}


def test_input_tokens_follow_the_tokenizer(fake: FakeAnthropic, http: httpx.Client) -> None:
    short = http.post("/v1/messages", headers=HEADERS, json=body(2)).json()["usage"]
    long = http.post("/v1/messages", headers=HEADERS, json=body(40)).json()["usage"]
    assert long["input_tokens"] > short["input_tokens"] + 38 * 4
    assert fake.count_input_tokens(body(2)) == short["input_tokens"]


def test_cache_fields_are_disjoint_from_input(fake: FakeAnthropic, http: httpx.Client) -> None:
    full = http.post("/v1/messages", headers=HEADERS, json=body()).json()["usage"]
    fake.configure(cache_read_input_tokens=30, cache_creation_input_tokens=5)
    cached = http.post("/v1/messages", headers=HEADERS, json=body()).json()["usage"]
    fake.configure(cache_read_input_tokens=0, cache_creation_input_tokens=0)
    assert cached["input_tokens"] + 30 + 5 == full["input_tokens"]


def test_usage_sum_matches_what_it_answered(fake: FakeAnthropic, http: httpx.Client) -> None:
    fake.configure(thinking_tokens=64, cache_read_input_tokens=11)
    fake.script([status(500), positions([2, 2]), malformed("oops"), status(429, retry_after=1)])
    total = dict.fromkeys(
        ["input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"],
        0,
    )
    answered = 0
    for n in range(1, 9):
        response = http.post("/v1/messages", headers=HEADERS, json=body(n))
        if response.status_code == 200:
            answered += 1
            for name in total:
                total[name] += response.json()["usage"][name]
    fake.configure(thinking_tokens=0, cache_read_input_tokens=0)
    assert answered == 6
    assert fake.usage() == {**total, "responses": 6}
    assert http.get("/_fake/usage").json() == fake.usage()
    assert len(fake.requests()) == 8


def test_status_behaviours(http: httpx.Client, fake: FakeAnthropic) -> None:
    fake.script([status(529), status(429, retry_after=2), status(400)])
    overloaded = http.post("/v1/messages", headers=HEADERS, json=body())
    assert_api_error(overloaded, 529, "overloaded_error")
    limited = http.post("/v1/messages", headers=HEADERS, json=body())
    assert_api_error(limited, 429, "rate_limit_error")
    assert limited.headers["retry-after"] == "2"
    assert_api_error(
        http.post("/v1/messages", headers=HEADERS, json=body()), 400, "invalid_request_error"
    )


def test_a_trickled_body_comes_in_pieces_after_its_headers(
    http: httpx.Client, fake: FakeAnthropic
) -> None:
    """``trickle``: a whole, valid message, its length announced, sent a piece at a time."""
    fake.script([trickle(0.6)])
    with http.stream("POST", "/v1/messages", headers=HEADERS, json=body()) as response:
        assert response.status_code == 200
        announced = int(response.headers["content-length"])
        pieces = list(response.iter_raw())
    assert len(pieces) > 1
    data = b"".join(pieces)
    assert len(data) == announced
    assert json.loads(data)["type"] == "message"


def test_a_cut_body_stops_half_way_with_the_connection_closed(
    http: httpx.Client, fake: FakeAnthropic
) -> None:
    fake.script([cut()])
    with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
        http.post("/v1/messages", headers=HEADERS, json=body())
    assert http.post("/v1/messages", headers=HEADERS, json=body()).status_code == 200


def test_records_bodies_and_headers(fake: FakeAnthropic, http: httpx.Client) -> None:
    http.post("/v1/messages", headers=HEADERS, json=body(3))
    (request,) = fake.requests()
    assert request["body"] == body(3)
    assert request["headers"]["anthropic-version"] == "2026-10-21"


# --- scripted over HTTP, as another process would -------------------------------------------


def test_scripting_over_http(fake: FakeAnthropic, http: httpx.Client) -> None:
    remote = RemoteFakeAnthropic(fake.url)
    remote.script([positions([7, "3", 2.5]), malformed("not json"), status(503)])
    first = http.post("/v1/messages", headers=HEADERS, json=body()).json()
    assert json.loads(first["content"][0]["text"]) == {"positions": [7, "3", 2.5]}
    assert (
        http.post("/v1/messages", headers=HEADERS, json=body()).json()["content"][0]["text"]
        == "not json"
    )
    assert http.post("/v1/messages", headers=HEADERS, json=body()).status_code == 503
    assert len(remote.requests()) == 3
    assert remote.usage()["responses"] == 2
    remote.reset()
    assert remote.requests() == [] and remote.usage()["responses"] == 0
    bad = http.post("/_fake/script", json={"behaviours": [{"kind": "explode"}]})
    assert bad.status_code == 400


def test_behaviours_round_trip_as_json() -> None:
    for behaviour in (
        positions([1, True, "2"]),
        malformed(None),
        status(429, retry_after=2),
        delay(1.5),
        Behaviour("drop"),
    ):
        assert Behaviour.from_json(json.loads(json.dumps(behaviour.to_json()))) == behaviour


def test_hundreds_in_flight_with_a_one_second_delay(fake: FakeAnthropic) -> None:
    """No answer goes before all 300 requests are in (answered one at a time, the first
    would wait for the rest for ever: the client's timeout ends it as an error); then each
    waits its delay, concurrently (one after another, they would take 300 s: the same)."""
    fake.configure(delay=1.0, hold_until_received=300)

    async def burst(n: int) -> list[int]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=fake.url, timeout=20.0, limits=limits) as client:
            calls = [client.post("/v1/messages", headers=HEADERS, json=body()) for _ in range(n)]
            return [response.status_code for response in await asyncio.gather(*calls)]

    try:
        codes = asyncio.run(burst(300))
    finally:
        fake.configure(delay=0.0, hold_until_received=0)
    assert codes == [200] * 300
    assert fake.usage()["responses"] == 300
    assert fake.counts()["received"] == 300


def test_runs_as_its_own_process() -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_anthropic", "--port", str(port), "--delay", "0.2"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        remote = RemoteFakeAnthropic(f"http://127.0.0.1:{port}")
        remote.wait_ready(timeout=20.0)
        remote.script([positions([2, 1])])
        with anthropic.Anthropic(base_url=remote.url, api_key="k", max_retries=0) as sdk:
            message = sdk.messages.create(
                model="claude-haiku-4-5",
                max_tokens=64,
                messages=[{"role": "user", "content": "[1] a\n[2] b"}],
                output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
            )
        assert message.content[0].type == "text"
        assert json.loads(message.content[0].text) == {"positions": [2, 1]}
        assert remote.usage()["output_tokens"] == message.usage.output_tokens
    finally:
        process.terminate()
        # uvicorn shuts down gracefully, then re-raises SIGTERM, so -15 is a clean exit
        assert process.wait(timeout=20) in (0, -15)


def test_message_batches_create_retrieve_results_cancel() -> None:
    import time as _time

    from tests.fake_anthropic import RemoteFakeAnthropic, errored, expired, succeeded

    def params(text: str) -> dict[str, object]:
        return {
            "model": "claude-haiku-4-5",
            "max_tokens": 200,
            "messages": [{"role": "user", "content": text}],
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        }

    with FakeAnthropic(batch_processing_seconds=0.2) as fake:
        client = anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0)
        remote = RemoteFakeAnthropic(fake.url)
        remote.script_batch({"i1": [errored("overloaded_error")], "i2": [expired()]})
        fake.script_batch({"i3": [succeeded(positions([2, 2, 9]))]})
        requests = [{"custom_id": f"i{i}", "params": params("[1] a\n[2] b\n[3] c")}
                    for i in range(6)]  # fmt: skip
        batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        assert batch.processing_status == "in_progress"
        assert batch.request_counts.processing == 6 and batch.results_url is None
        while client.messages.batches.retrieve(batch.id).processing_status != "ended":
            _time.sleep(0.05)
        ended = client.messages.batches.retrieve(batch.id)
        counts = ended.request_counts
        assert (counts.succeeded, counts.errored, counts.expired, counts.processing) == (4, 1, 1, 0)
        lines = list(client.messages.batches.results(batch.id))
        assert [line.custom_id for line in lines] != [r["custom_id"] for r in requests]
        by_id = {line.custom_id: line.result for line in lines}
        assert by_id["i1"].type == "errored" and by_id["i2"].type == "expired"
        assert by_id["i1"].error.error.type == "overloaded_error"  # type: ignore[union-attr]
        answer = by_id["i3"].message.content[0].text  # type: ignore[union-attr]
        assert json.loads(answer) == {"positions": [2, 2, 9]}
        assert by_id["i0"].message.usage.input_tokens > 0  # type: ignore[union-attr]
        # a batch's requests run on the batch tier (the SDK's Usage.service_tier)
        assert by_id["i0"].message.usage.service_tier == "batch"  # type: ignore[union-attr]
        assert fake.usage()["responses"] == 4

        fake.configure(batch_processing_seconds=60.0)
        second = client.messages.batches.create(requests=requests[:2])  # type: ignore[arg-type]
        canceled = client.messages.batches.cancel(second.id)
        assert canceled.processing_status == "ended" and canceled.cancel_initiated_at
        assert {line.result.type for line in client.messages.batches.results(second.id)} == {
            "canceled"
        }
        assert [b["status"] for b in remote.batches()] == ["ended", "ended"]

        bad = [{"custom_id": "no spaces", "params": params("x")}]
        with pytest.raises(anthropic.BadRequestError):
            client.messages.batches.create(requests=bad)  # type: ignore[arg-type]


def test_a_stale_retrieve_answers_the_batch_as_before_it_ended_once() -> None:
    from tests.fake_anthropic import stale

    request = {"custom_id": "i0", "params": {"model": "claude-haiku-4-5", "max_tokens": 16,
               "messages": [{"role": "user", "content": "[1] a"}]}}  # fmt: skip
    with FakeAnthropic(batch_processing_seconds=0.0) as fake:
        client = anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0)
        batch = client.messages.batches.create(requests=[request])  # type: ignore[arg-type]
        fake.script_batch_calls("retrieve", [stale()])
        # the SDK's results() retrieves first: no results_url, so it raises
        with pytest.raises(anthropic.AnthropicError, match="results_url"):
            client.messages.batches.results(batch.id)
        assert [line.custom_id for line in client.messages.batches.results(batch.id)] == ["i0"]
        with pytest.raises(ValueError, match="retrieve"):
            fake.script_batch_calls("results", [stale()])


def test_a_batch_is_deleted_once_it_has_ended_and_then_answers_404() -> None:
    """As the API's ``DELETE /v1/messages/batches/{id}``: refused while the batch is in
    progress, then gone (retrieve, results, list), as an owner's delete leaves it to others."""
    request = {"custom_id": "i0", "params": {"model": "claude-haiku-4-5", "max_tokens": 16,
               "messages": [{"role": "user", "content": "[1] a"}]}}  # fmt: skip
    with FakeAnthropic(batch_processing_seconds=300.0) as fake:
        client = anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0)
        batch = client.messages.batches.create(requests=[request])  # type: ignore[arg-type]
        with pytest.raises(anthropic.BadRequestError):
            client.messages.batches.delete(batch.id)
        client.messages.batches.cancel(batch.id)
        client.messages.batches.retrieve(batch.id)  # ended, canceled
        deleted = client.messages.batches.delete(batch.id)
        assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
        with pytest.raises(anthropic.NotFoundError):
            client.messages.batches.retrieve(batch.id)
        with pytest.raises(anthropic.NotFoundError):
            client.messages.batches.delete(batch.id)
        assert [b.id for b in client.messages.batches.list()] == []
        assert fake.batches() == []


def test_a_batchs_ended_at_is_when_it_ended_not_when_it_was_first_seen() -> None:
    # the real API's ended_at is when processing_status became ended; Sift reads it to tell
    # a user's cancel from one made elsewhere, so a late first retrieve must not move it
    request = {"custom_id": "i0", "params": {"model": "claude-haiku-4-5", "max_tokens": 16,
               "messages": [{"role": "user", "content": "[1] a"}]}}  # fmt: skip
    with FakeAnthropic(batch_processing_seconds=0.05) as fake:
        client = anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0)
        made = client.messages.batches.create(requests=[request])  # type: ignore[arg-type]
        time.sleep(0.5)
        ended = client.messages.batches.retrieve(made.id)
        assert ended.processing_status == "ended" and ended.ended_at is not None
        assert (ended.ended_at - made.created_at).total_seconds() == pytest.approx(0.05, abs=1e-3)

        fake.configure(batch_processing_seconds=60.0)
        outside = client.messages.batches.create(requests=[request])  # type: ignore[arg-type]
        fake.cancel_batch(outside.id)  # from outside its client, as the Console would
        time.sleep(0.5)
        canceled = client.messages.batches.retrieve(outside.id)
        assert canceled.processing_status == "ended"
        assert canceled.ended_at == canceled.cancel_initiated_at
        assert [line.result.type for line in client.messages.batches.results(outside.id)] == [
            "canceled"
        ]


# --- rate limits ---------------------------------------------------------------------------


def test_without_limits_no_ratelimit_header_is_sent(fake: FakeAnthropic) -> None:
    response = httpx.post(f"{fake.url}/v1/messages", json=body(), headers=HEADERS)
    assert response.status_code == 200
    assert not [h for h in response.headers if h.startswith("anthropic-ratelimit-")]


def test_the_requests_bucket_admits_its_size_then_answers_429_with_retry_after() -> None:
    with FakeAnthropic(rpm=3) as limited, httpx.Client() as client:
        answers = [
            client.post(f"{limited.url}/v1/messages", json=body(), headers=HEADERS)
            for _ in range(4)
        ]
        assert [a.status_code for a in answers] == [200, 200, 200, 429]
        assert [a.headers["anthropic-ratelimit-requests-remaining"] for a in answers] == [
            "2",
            "1",
            "0",
            "0",
        ]
        for answer in answers:
            assert answer.headers["anthropic-ratelimit-requests-limit"] == "3"
            reset = answer.headers["anthropic-ratelimit-requests-reset"]
            assert datetime.fromisoformat(reset).tzinfo is not None  # RFC 3339
        refused = answers[-1]
        assert refused.json()["error"]["type"] == "rate_limit_error"
        # one request refills in 20 s at 3 per minute
        assert 1 <= int(refused.headers["retry-after"]) <= 20
        assert limited.rate_limited() == 1
        assert limited.usage()["responses"] == 3


def test_the_input_tokens_bucket_refuses_a_prompt_larger_than_what_is_left() -> None:
    with FakeAnthropic() as probe:
        tokens = probe.count_input_tokens(body())
    with FakeAnthropic(itpm=tokens * 2 + tokens // 2) as limited, httpx.Client() as client:
        codes = [
            client.post(f"{limited.url}/v1/messages", json=body(), headers=HEADERS)
            for _ in range(3)
        ]
        assert [c.status_code for c in codes] == [200, 200, 429]
        assert codes[0].headers["anthropic-ratelimit-input-tokens-limit"] == str(
            tokens * 2 + tokens // 2
        )
        assert int(codes[1].headers["anthropic-ratelimit-input-tokens-remaining"]) <= tokens
        assert "anthropic-ratelimit-requests-limit" not in codes[0].headers


def test_the_output_tokens_bucket_is_charged_what_was_answered() -> None:
    with FakeAnthropic(otpm=5) as limited, httpx.Client() as client:
        first = client.post(f"{limited.url}/v1/messages", json=body(), headers=HEADERS)
        assert first.status_code == 200 and first.json()["usage"]["output_tokens"] > 5
        assert first.headers["anthropic-ratelimit-output-tokens-remaining"] == "0"
        second = client.post(f"{limited.url}/v1/messages", json=body(), headers=HEADERS)
        assert second.status_code == 429
        assert second.json()["error"]["type"] == "rate_limit_error"


def test_a_bucket_refills_continuously_up_to_its_limit() -> None:
    from tests.fake_anthropic import _Bucket

    bucket = _Bucket(limit=600, level=0.0, at=100.0)  # 10 per second
    assert bucket.refill(100.5) == pytest.approx(5.0)
    assert bucket.seconds_until(15.0) == pytest.approx(1.0)
    assert bucket.refill(1000.0) == 600.0  # never above a minute's worth
    assert bucket.seconds_until(10_000.0) == 0.0  # more than it holds: capped at its size


def test_limits_are_set_over_http_and_429s_counted(fake: FakeAnthropic) -> None:
    remote = RemoteFakeAnthropic(fake.url)
    remote.configure(rpm=1)
    try:
        codes = [
            httpx.post(f"{fake.url}/v1/messages", json=body(), headers=HEADERS).status_code
            for _ in range(2)
        ]
        assert codes == [200, 429]
        assert remote.rate_limited() == 1
    finally:
        remote.configure(rpm=None)


def test_the_sdk_reads_the_429_as_a_rate_limit_error() -> None:
    with FakeAnthropic(rpm=1) as limited:
        client = anthropic.Anthropic(base_url=limited.url, api_key="sk-test", max_retries=0)
        client.messages.create(**body())
        with pytest.raises(anthropic.RateLimitError) as caught:
            client.messages.create(**body())
        assert float(caught.value.response.headers["retry-after"]) >= 1


# --- long runs: bounded records, exact counts, an outage window -----------------------------


def test_keeps_the_last_requests_but_counts_every_one(fake: FakeAnthropic) -> None:
    fake.configure(max_recorded=3)
    try:
        with httpx.Client(base_url=fake.url, timeout=10.0) as http:
            for n in (1, 2, 3, 4, 2):  # the prompt of 2 sent twice
                http.post("/v1/messages", headers=HEADERS, json=body(n))
            http.post("/v1/messages", headers=HEADERS, json=body(5, temperature=0))  # a 400
    finally:
        fake.configure(max_recorded=10_000)
    assert [len(r["body"]["messages"][0]["content"]) for r in fake.requests()] == [
        len(body(n)["messages"][0]["content"]) for n in (4, 2, 5)
    ]
    assert fake.usage()["responses"] == 5
    assert fake.counts() == {
        "received": 6,
        "statuses": {"200": 5, "400": 1},
        "prompts": 5,
        "prompts_sent_more_than_once": 1,
        "prompts_answered_more_than_once": 1,
    }


def test_an_outage_answers_its_statuses_in_turn_then_ends(fake: FakeAnthropic) -> None:
    remote = RemoteFakeAnthropic(fake.url)
    remote.outage(60, (529, 429), retry_after=2)  # ended below: no race with the clock
    with httpx.Client(base_url=fake.url, timeout=10.0) as http:
        during = [http.post("/v1/messages", headers=HEADERS, json=body()) for _ in range(3)]
        remote.outage(0, (529,))  # an outage of no seconds: the last one is over
        after = http.post("/v1/messages", headers=HEADERS, json=body())
    assert_api_error(during[0], 529, "overloaded_error")
    assert_api_error(during[1], 429, "rate_limit_error")
    assert_api_error(during[2], 529, "overloaded_error")
    assert {r.headers["retry-after"] for r in during} == {"2"}
    assert after.status_code == 200
    assert remote.counts()["statuses"] == {"200": 1, "429": 1, "529": 2}
    assert remote.counts()["prompts_sent_more_than_once"] == 1
    assert remote.counts()["prompts_answered_more_than_once"] == 0
    bad = httpx.post(f"{fake.url}/_fake/outage", json={"seconds": 1, "statuses": []})
    assert bad.status_code == 400 and "status" in bad.json()["error"]


def test_a_batch_is_billed_as_it_ends_whether_or_not_anyone_reads_it() -> None:
    """The API bills a Message Batch's requests as it processes them, not as its client
    reads them: a provider batch made twice (a create whose answer was lost, sent again) is
    paid twice though its client only ever polls one. The fake counted a batch's usage only
    once a call read it ended (a retrieve, its results, the list), so a batch no one read
    was free, and a deleted one unread too: a test comparing Sift's figures with the fake's
    bill could not see the second payment. Now ``usage()`` counts every batch that has
    ended, read or not, deleted or not, each once."""
    request = {
        "custom_id": "i0",
        "params": {
            "model": "claude-haiku-4-5",
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "[1] a\n[2] b"}],
        },
    }
    with FakeAnthropic(batch_processing_seconds=0.2) as fake:
        client = anthropic.Anthropic(base_url=fake.url, api_key="k", max_retries=0)
        unread = client.messages.batches.create(requests=[request])  # type: ignore[list-item]
        while [b["status"] for b in fake.batches()] != ["ended"]:  # the fake's own view
            time.sleep(0.05)
        assert fake.usage()["responses"] == 1  # ended, never read
        assert fake.usage()["responses"] == 1  # counted once
        fake.configure(batch_processing_seconds=0.0)
        read = client.messages.batches.create(requests=[request])  # type: ignore[list-item]
        assert len(list(client.messages.batches.results(read.id))) == 1
        client.messages.batches.delete(unread.id)
        fake.configure(batch_processing_seconds=60.0)
        deleted = client.messages.batches.create(requests=[request])  # type: ignore[list-item]
        fake.configure(batch_processing_seconds=0.0)
        client.messages.batches.delete(deleted.id)  # ended by the setting, never read
        assert [b["id"] for b in fake.batches()] == [read.id]
        billed = fake.usage()
        assert billed["responses"] == 3, billed
        assert billed["input_tokens"] == 3 * fake.count_input_tokens(request["params"])

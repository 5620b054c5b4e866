"""``sift search --trace``'s compact trace, from a real pipeline trace (fakes for the ports)."""

from __future__ import annotations

import json
from typing import Any

from tests.fakes import USAGE, fail, reply
from tests.unit.test_pipeline import make, spec
from worker.cli._output import trace_lines
from worker.constants import MAX_BM25_WORDS
from worker.errors import AttemptOutcome, RerankAttemptError


def _trace(steps: list[Any], **settings: Any) -> dict[str, Any]:
    pipeline, _, _ = make(steps, policy="fail_open", **settings)
    result = pipeline.search(spec(include_trace=True), "acme")
    assert result.trace is not None
    return json.loads(json.dumps(result.trace))  # as the CLI gets it: JSON


def test_the_compact_trace_says_what_was_kept_dropped_tried_and_used() -> None:
    trace = _trace(
        [fail(RerankAttemptError(AttemptOutcome.RATE_LIMITED, "slow")), reply([3, 3, 0, 1, 99])]
    )
    lines = trace_lines(trace)
    text = "\n".join(lines)
    ids = {c["position"]: c["id"] for c in trace["candidates"]}
    assert f"kept: 3 ({ids[3]}), 1 ({ids[1]})" in lines
    assert "dropped: 3 (duplicate), 0 (out_of_range), 99 (out_of_range)" in lines
    assert "returned: [3, 3, 0, 1, 99]" in lines
    assert "fallback: none" in lines
    [attempts] = [line for line in lines if line.startswith("attempts: ")]
    assert "#1 rate_limited" in attempts and "#2 ok" in attempts and "rerank " in attempts
    [usage] = [line for line in lines if line.startswith("usage: ")]
    assert f"2 request(s), {USAGE.input_tokens} input + {USAGE.output_tokens} output" in usage
    assert "$0.00" in usage
    assert "retrieval: mode hybrid, bm25 " in text and "30 candidate(s)" in text
    [timings] = [line for line in lines if line.startswith("timings: ")]
    assert "embed " in timings and "bm25 " in timings and "knn " in timings
    # the queue wait the worker adds to a job's trace comes first, then the wait for a CPU slot
    waited = {**trace, "queue_wait_seconds": 1.5, "slot_wait_seconds": 0.25}
    [timings] = [x for x in trace_lines(waited) if "timings" in x]
    assert timings.startswith("timings: queue wait 1.50 s, slot wait 250.0 ms, embed ")
    # compact: no candidate's text, and a handful of lines for 30 candidates
    assert all(c["text"] not in text for c in trace["candidates"])
    assert len(lines) <= 10


def test_the_compact_trace_says_which_attempts_were_never_sent() -> None:
    held = RerankAttemptError(AttemptOutcome.RATE_LIMITED, "held back", sent=False)
    lines = trace_lines(_trace([fail(held), reply([1])]))
    [attempts] = [line for line in lines if line.startswith("attempts: ")]
    assert "#1 rate_limited (not sent) " in attempts and "#2 ok " in attempts
    assert "not sent" not in attempts.split("#2", 1)[1]


def test_the_compact_trace_of_a_fallback_and_an_unpriced_model() -> None:
    failures = [fail(RerankAttemptError(AttemptOutcome.HTTP_5XX, "down"))] * 3
    lines = trace_lines(_trace(failures, prices={}))
    assert "fallback: error:http_5xx" in lines
    assert "returned: nothing" in lines
    assert not any(line.startswith("kept: ") for line in lines)
    unpriced = trace_lines(_trace([reply([1])], prices={}))
    assert any(line.startswith("usage: ") and "unpriced" in line for line in unpriced)


def test_no_rerank_is_one_line_after_retrieval() -> None:
    pipeline, _, _ = make()
    result = pipeline.search(spec(include_trace=True), "acme")
    assert result.trace is not None
    assert trace_lines(result.trace)[-1] == "rerank: not asked"
    assert len(trace_lines(result.trace)) == 3  # retrieval, timings, rerank


def test_the_compact_trace_says_when_bm25_searched_only_the_querys_first_words() -> None:
    pipeline, _, _ = make()
    long = " ".join(["ash"] * (MAX_BM25_WORDS + 1))
    cut = pipeline.search(spec(query=long, include_trace=True), "acme").trace
    assert cut is not None
    assert f"bm25 searched the query's first {MAX_BM25_WORDS} words" in trace_lines(cut)[0]
    whole = pipeline.search(spec(include_trace=True), "acme").trace
    assert whole is not None and "first" not in trace_lines(whole)[0]


def test_the_compact_trace_names_the_fusion_used_and_the_channels_depth() -> None:
    """A search fused by `linear` (a request's, or an index's after `sift eval --tune
    --apply`) was said to be "fused by rrf", and the channels' depth (120 for a reranked
    search at window 30) was printed as the "window", the name the docs and `sift eval
    --window` give the rerank's candidate window (30)."""
    from worker.contract import FusionSpec

    pipeline, _, _ = make([reply([1])], policy="fail_open")
    linear = spec(include_trace=True, fusion=FusionSpec(method="linear"))
    trace = json.loads(json.dumps(pipeline.search(linear, "acme").trace))
    [retrieval] = [line for line in trace_lines(trace) if line.startswith("retrieval: ")]
    assert "fused by linear;" in retrieval, retrieval
    assert f"(coarse limit 30, channels {trace['channel_window']} deep)" in retrieval, retrieval
    [retrieval] = [line for line in trace_lines(_trace([reply([1])])) if "retrieval" in line]
    assert "fused by rrf;" in retrieval and "window" not in retrieval, retrieval

"""The economy lane's pure parts: the pipeline's two halves, the JSON of a prepared search,
the chunking under the provider's limits, and the custom_id round trip."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from tests.fakes import USAGE, FakeClock, RecordingRecorder, fail, reply
from tests.unit.test_pipeline import make, with_busy_slots
from worker.contract import DocumentIn, SearchSpec
from worker.core.catalog import StoredDocument
from worker.core.pipeline import RerankRun, as_stored, dump_prepared, load_prepared
from worker.errors import AttemptOutcome, RerankAttemptError, RerankFailed
from worker.queue.economy import (
    chunk_requests,
    custom_id,
    new_submission,
    position_of,
    submission_of,
)
from worker.runtime.inprocess import Runtime

SPEC = SearchSpec(index="docs", query="volcano eruption ash", limit=3, include_trace=True)


def test_prepare_then_finish_is_the_standard_search() -> None:
    pipeline, _, _ = make([reply([2, 1, 2, 99])])
    standard = pipeline.search(SPEC, "acme")
    prepared = pipeline.prepare(SPEC, "acme")
    assert prepared.result is None and prepared.prompt is not None
    run = RerankRun()
    answer = reply([2, 1, 2, 99])(prepared.prompt, 1.0)
    pipeline.record_attempt(run, AttemptOutcome.OK, answer.usage, 0.5)
    run.reply, run.returned = answer, answer.positions
    economy = pipeline.finish(prepared, run)
    assert economy.hits == standard.hits
    assert economy.rerank == standard.rerank
    assert economy.usage == standard.usage
    assert economy.trace is not None and standard.trace is not None
    assert economy.trace["kept_positions"] == standard.trace["kept_positions"] == [2, 1]


def _answered(pipeline: Any, positions: list[object]) -> RerankRun:
    run = RerankRun()
    prepared = pipeline.prepare(SPEC, "acme")
    answer = reply(positions)(prepared.prompt, 1.0)
    pipeline.record_attempt(run, AttemptOutcome.OK, answer.usage, 0.5)
    run.reply, run.returned = answer, answer.positions
    return run


def _deleting(prepared: Any, *positions: int) -> Any:
    """``prepared`` as the index holds it once its candidates at ``positions`` were deleted."""
    gone = {prepared.candidates[p - 1].document.id for p in positions}
    stored = {
        c.document.id: StoredDocument(
            c.document.id, c.document.text, c.document.title, c.document.revision
        )
        for c in prepared.candidates
        if c.document.id not in gone
    }
    return as_stored(prepared, stored)


def test_a_pick_deleted_since_is_replaced_by_the_models_next_one() -> None:
    """A candidate deleted after the item was prepared is in no hit; the model's next pick
    takes its place (the answer was cut to the limit first, so a deleted pick cost the
    item a hit the model had ranked), and the trace names it dropped as deleted."""
    pipeline, _, _ = make([])
    prepared = pipeline.prepare(SPEC, "acme")
    assert len(prepared.candidates) >= 5
    run = _answered(pipeline, [2, 5, 1, 4, 3])
    result = pipeline.finish(_deleting(prepared, 5), run)
    ids = [c.document.id for c in prepared.candidates]
    assert [hit.id for hit in result.hits] == [ids[1], ids[0], ids[3]]
    assert result.trace is not None and result.trace["kept_positions"] == [2, 1, 4]
    assert {"value": 5, "reason": "deleted"} in result.trace["dropped_positions"]


def test_every_pick_deleted_since_falls_back_to_the_live_candidates() -> None:
    pipeline, _, _ = make([])
    prepared = pipeline.prepare(SPEC, "acme")
    run = _answered(pipeline, [2, 1])
    result = pipeline.finish(_deleting(prepared, 1, 2), run)
    ids = [c.document.id for c in prepared.candidates]
    assert result.rerank.applied is False
    assert result.rerank.fallback_reason == "no_valid_ranks"
    assert [hit.id for hit in result.hits] == ids[2:5]


def test_a_prepared_search_survives_its_json_form() -> None:
    """All but its candidates' metadata, which the finish reads again with their documents
    (:func:`as_stored`); their texts here are shorter than the prompt's cut: whole."""
    pipeline, _, _ = make([])
    prepared = pipeline.prepare(SPEC, "acme")
    data = json.loads(json.dumps(dump_prepared(prepared)))
    again = load_prepared(pipeline, data)
    assert again.prompt == prepared.prompt
    assert again.candidates == [
        replace(c, document=replace(c.document, metadata={})) for c in prepared.candidates
    ]
    assert again.trace == prepared.trace
    assert again.spec == prepared.spec


#: Texts longer and shorter than a cut of 300 characters, ASCII and not, with runs of
#: whitespace (a no-break and an ideographic space among them) and a bracketed number
TEXTS = {
    "long": "volcano ash [2] fell  on the\n\ntown, " * 200,
    "short": "volcano ash, a short note",
    "cjk": "volcano \u706b\u5c71\u7070\u3000\u5674\u706b " * 150,
    "mixed": "volcano \u00e9ruption \U0001f30b\xa0\xa0 ash\t\t" * 100,
    "spaces": "volcano" + " " * 5_000 + "ash " * 400,
}


def test_an_items_prompt_rebuilt_from_its_record_is_the_prompt_first_built() -> None:
    """The record an economy item keeps while it waits at the provider holds each
    candidate's text up to the prompt's cut (its :func:`~worker.core.policy.shown_head`),
    not whole: the prompt rebuilt from it is the one first built, byte for byte, the
    candidates' lines cut or not (texts longer and shorter than the cut, non-ASCII ones,
    long runs of whitespace) and their ``truncated`` flags; so is it on a worker whose
    ``SIFT_RERANK_CANDIDATE_MAX_CHARS`` differs (the cut the record names is the one its
    heads were kept for), and the trace's texts, cut there too."""
    pipeline, _, _ = make([], rerank_candidate_max_chars=300)
    Runtime(pipeline).ingest(
        "long", "acme", [DocumentIn(id=k, title=k, text=t) for k, t in TEXTS.items()]
    )
    spec = SearchSpec(index="long", query="volcano ash", limit=3, include_trace=True)
    prepared = pipeline.prepare(spec, "acme")
    assert prepared.prompt is not None and len(prepared.candidates) == len(TEXTS)
    assert prepared.prompt.truncated.count(True) == 4  # all but the short one
    data = json.loads(json.dumps(dump_prepared(prepared)))
    kept = {c["id"]: c["text"] for c in data["candidates"]}
    for key, text in TEXTS.items():
        assert text.startswith(kept[key])
        assert len(" ".join(kept[key].split())) <= 302, key  # the cut's, whole before
    assert kept["short"] == TEXTS["short"]
    assert len(" ".join(kept["long"].split())) == 301 and len(kept["spaces"]) > 5_000
    assert len(json.dumps(data)) < 10_000  # 151 kB whole
    other, _, _ = make([], rerank_candidate_max_chars=1_200)
    for loader in (pipeline, other):
        again = load_prepared(loader, data)
        assert again.prompt is not None
        assert again.prompt.user.encode() == prepared.prompt.user.encode()
        assert again.prompt == prepared.prompt
        assert again.trace == prepared.trace


def test_an_item_s_trace_cuts_its_candidates_texts_as_stored_now_as_the_prompt_does() -> None:
    """An economy item's trace is rebuilt from its candidates as its index holds them when it
    finishes (an upsert may have replaced them since): their texts are cut there as the
    prompt cuts them (``SIFT_RERANK_CANDIDATE_MAX_CHARS``), as a standard search's are, from
    its JSON form too."""
    pipeline, _, _ = make([], rerank_candidate_max_chars=50)
    prepared = pipeline.prepare(SPEC, "acme")
    again = load_prepared(pipeline, json.loads(json.dumps(dump_prepared(prepared))))
    text = "volcano ash " * 1_000
    stored = {
        c.document.id: StoredDocument(c.document.id, text, c.document.title, "2")
        for c in again.candidates
    }
    now = as_stored(again, stored)
    shown = now.trace["candidates"]
    assert len(shown) == len(again.candidates) >= 5
    assert [c["text"] for c in shown] == [text[:50]] * len(shown)
    assert now.candidates[0].document.text == text  # the hits', whole


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_finish_applies_the_failure_policy(policy: str) -> None:
    pipeline, _, recorder = make([], policy=policy)
    assert isinstance(recorder, RecordingRecorder)
    prepared = pipeline.prepare(SPEC, "acme")
    run = RerankRun()
    pipeline.record_attempt(run, AttemptOutcome.TIMEOUT, None, 1.0, provider_result="expired")
    run.failure = RerankAttemptError(AttemptOutcome.TIMEOUT, "expired")
    if policy == "fail_closed":
        with pytest.raises(RerankFailed) as caught:
            pipeline.finish(prepared, run)
        assert caught.value.reason == "timeout"
        return
    result = pipeline.finish(prepared, run)
    assert result.rerank.applied is False
    assert result.rerank.fallback_reason == "error:timeout"
    assert [h.ranks.rrf for h in result.hits] == [1, 2, 3]
    assert recorder.events["outcome", "fallback_error"] == 1


def test_a_first_half_s_deadline_starts_once_it_holds_its_cpu_slot() -> None:
    # an economy batch's chunks put every item's first half on the item pool at once, and
    # they queue for the slots: a wait past the deadline (10 s here), the item's own
    # retrieval taking no time, failed it deadline_exceeded ("ran out before the call")
    clock = FakeClock()
    made, _, recorder = make([], clock=clock)
    pipeline = with_busy_slots(made, recorder, clock)
    prepared = pipeline.prepare(SPEC, "acme")
    assert prepared.result is None and prepared.prompt is not None
    assert prepared.seconds == 0.0  # its own work's time, not the wait for a slot


def test_the_economy_pipeline_prices_at_half() -> None:
    from dataclasses import replace

    pipeline, _, _ = make([reply([1]), reply([1])])
    economy = pipeline.variant(config=replace(pipeline.config, price_discount=0.5), recorder=None)
    run_s, run_e = RerankRun(), RerankRun()
    pipeline.record_attempt(run_s, AttemptOutcome.OK, USAGE, 0.1)
    economy.record_attempt(run_e, AttemptOutcome.OK, USAGE, 0.1)
    assert run_s.cost_usd > 0
    assert run_e.cost_usd == pytest.approx(run_s.cost_usd / 2)
    assert run_e.usage == run_s.usage


def test_no_rerank_needs_no_second_half() -> None:
    pipeline, _, recorder = make([fail(RuntimeError("never called"))])
    prepared = pipeline.prepare(SPEC.model_copy(update={"rerank": False}), "acme")
    assert prepared.result is not None and prepared.prompt is None
    assert recorder.events["search", "ok"] == 1


def test_chunks_stay_under_both_limits() -> None:
    sizes = [10] * 25
    chunks = list(chunk_requests(sizes, lambda n: n, max_requests=10, max_bytes=10_000))
    assert [len(c) for c in chunks] == [10, 10, 5]
    # bytes: the body is {"requests":[...]} with a comma between requests
    chunks = list(chunk_requests(sizes, lambda n: n, max_requests=100, max_bytes=15 + 10 * 3 + 2))
    assert [len(c) for c in chunks] == [3] * 8 + [1]
    assert all(15 + sum(c) + len(c) - 1 <= 47 for c in chunks)
    # one request bigger than the limit still goes, alone (the provider then refuses it)
    assert [len(c) for c in chunk_requests([5, 500, 5], lambda n: n, max_requests=9,
                                           max_bytes=100)] == [1, 1, 1]  # fmt: skip


def test_custom_ids_name_positions() -> None:
    import re

    submission = new_submission()
    for position in (0, 7, 99_999):
        value = custom_id(position, submission)
        assert re.fullmatch(r"^[a-zA-Z0-9_-]{1,64}$", value)
        assert position_of(value) == position
        assert submission_of(value) == submission
    assert new_submission() != submission  # each create its own
    assert position_of("msg_other") is None and position_of("i") is None
    assert position_of("i3") == 3 and submission_of("i3") is None  # before submissions

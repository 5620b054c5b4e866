"""Weighted RRF through the pipeline: the defaults (``SIFT_FUSION_*``), an index's own settings
and a request's, field by field; the candidate window likewise; a hybrid channel weighted 0 is
not queried; the trace names what was used and where each value came from."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from tests.fakes import FakeEmbedder, InMemoryBackend
from worker.cli._http import Gateway
from worker.contract import DocumentIn, SearchSpec
from worker.core.catalog import SearchSettings
from worker.core.pipeline import SearchPipeline
from worker.errors import ConfigError, IndexNotFound, InvalidRequest
from worker.queue.jobstore import fingerprint
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.settings import load_settings

TOPICS = ["volcano eruption ash", "ash tree forest", "eruption of jazz", "river delta flooding"]


class CountingEmbedder(FakeEmbedder):
    def __init__(self) -> None:
        self.texts: list[str] = []

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.texts += texts
        return super().embed(texts)


class StoredSettings:
    """An IndexSettingsSource over a dict, recording who asked."""

    def __init__(self, stored: dict[tuple[str, str], dict[str, Any]] | None = None) -> None:
        self.stored = stored or {}
        self.asked: list[tuple[str, str]] = []

    def get(self, index: str, tenant: str) -> SearchSettings:
        self.asked.append((index, tenant))
        return SearchSettings(self.stored.get((index, tenant), {}))


def make(
    stored: dict[tuple[str, str], dict[str, Any]] | None = None, **settings: Any
) -> tuple[SearchPipeline, CountingEmbedder, InMemoryBackend, StoredSettings]:
    embedder, backend, source = CountingEmbedder(), InMemoryBackend(), StoredSettings(stored)
    pipeline = build_pipeline(
        load_settings(**settings), backend=backend, embedder=embedder, index_settings=source
    )
    docs = [DocumentIn(id=f"d{i}", text=f"{t} {i}") for i, t in enumerate(TOPICS * 5)]
    Runtime(pipeline).ingest("docs", "acme", docs)
    embedder.texts.clear()
    return pipeline, embedder, backend, source


def spec(**kw: Any) -> SearchSpec:
    return SearchSpec.model_validate(
        {"index": "docs", "query": "volcano ash eruption", "limit": 8, "include_trace": True, **kw}
    )


def test_request_over_index_over_default_field_by_field() -> None:
    index = {"fusion": {"weights": {"knn": 0.2}}, "candidate_limit": 12}
    pipeline, _, _, source = make(
        {("docs", "acme"): index}, fusion_weights='{"bm25": 1.5}', fusion_rank_constant=50
    )
    trace = pipeline.search(spec(), "acme").trace
    assert trace is not None
    assert trace["fusion"]["weights"] == {"bm25": 1.5, "knn": 0.2}
    assert trace["fusion"]["rank_constant"] == 50
    assert trace["fusion"]["from"] == {
        "method": "default",
        "weights": {"bm25": "default", "knn": "index"},
        "rank_constant": "default",
    }
    assert trace["candidate_limit"] == {"value": 12, "from": "index"}
    assert source.asked == [("docs", "acme")]

    asked = spec(fusion={"weights": {"bm25": 0.5}, "rank_constant": 7}, candidate_limit=9)
    trace = pipeline.search(asked, "acme").trace
    assert trace is not None
    assert trace["fusion"]["weights"] == {"bm25": 0.5, "knn": 0.2}
    assert trace["fusion"]["rank_constant"] == 7
    assert trace["fusion"]["from"] == {
        "method": "default",
        "weights": {"bm25": "request", "knn": "index"},
        "rank_constant": "request",
    }
    assert trace["candidate_limit"] == {"value": 9, "from": "request"}


def test_the_weights_used_change_the_fused_scores() -> None:
    pipeline, _, _, _ = make()
    plain = pipeline.search(spec(), "acme")
    tilted = pipeline.search(spec(fusion={"weights": {"knn": 3.0}, "rank_constant": 5}), "acme")
    top = tilted.hits[0]
    expected = sum(
        w / (5 + rank)
        for w, rank in ((1.0, top.ranks.bm25), (3.0, top.ranks.knn))
        if rank is not None
    )
    assert top.scores.rrf == pytest.approx(expected)
    assert [h.scores.rrf for h in plain.hits] != [h.scores.rrf for h in tilted.hits]


def test_the_method_comes_from_the_request_over_the_index_over_the_default() -> None:
    pipeline, _, _, _ = make(
        {("docs", "acme"): {"fusion": {"method": "rrf"}}}, fusion_method="linear"
    )
    trace = pipeline.search(spec(), "acme").trace
    assert trace is not None and trace["fusion"]["method"] == "rrf"
    assert trace["fusion"]["from"]["method"] == "index"
    trace = pipeline.search(spec(fusion={"method": "linear"}), "acme").trace
    assert trace is not None and trace["fusion"]["method"] == "linear"
    assert trace["fusion"]["from"]["method"] == "request"
    pipeline, _, _, _ = make(fusion_method="linear")
    trace = pipeline.search(spec(), "acme").trace
    assert trace is not None and trace["fusion"]["method"] == "linear"
    assert trace["fusion"]["from"]["method"] == "default"


def test_linear_fusion_scores_are_weighted_min_max_normalised_channel_scores() -> None:
    """Every channel returns all its matches here (20 documents, a window of 32), so each
    hit's channel scores, normalised over the whole run of that channel, rebuild its score."""
    pipeline, _, _, _ = make()
    weights = {"bm25": 1.0, "knn": 0.6}
    found = pipeline.search(spec(limit=20, fusion={"method": "linear", "weights": weights}), "acme")
    alone = {
        mode: pipeline.search(spec(limit=20, mode=mode), "acme").hits for mode in ("fts", "vector")
    }
    bounds = {
        "bm25": [h.scores.bm25 for h in alone["fts"]],
        "knn": [h.scores.knn for h in alone["vector"]],
    }
    assert found.hits and all(bounds.values())

    def expected(hit: Any) -> float:
        total = 0.0
        for channel, score in (("bm25", hit.scores.bm25), ("knn", hit.scores.knn)):
            if score is not None:
                low, high = min(bounds[channel]), max(bounds[channel])
                total += weights[channel] * (score - low) / (high - low)
        return total

    assert [h.scores.rrf for h in found.hits] == pytest.approx([expected(h) for h in found.hits])
    assert [h.scores.rrf for h in found.hits] == sorted(
        (h.scores.rrf for h in found.hits), reverse=True
    )
    assert [h.ranks.rrf for h in found.hits] == list(range(1, len(found.hits) + 1))
    # differs from RRF over the same lists: the scores, not only the ranks, decide
    rrf = pipeline.search(spec(limit=20, fusion={"weights": weights}), "acme")
    assert [h.scores.rrf for h in rrf.hits] != [h.scores.rrf for h in found.hits]


def test_a_bad_method_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"fusion\.method"):
        spec(fusion={"method": "sum"})


def test_hybrid_with_knn_weighted_zero_is_bm25_alone_without_an_embedding() -> None:
    pipeline, embedder, backend, _ = make({("docs", "acme"): {"fusion": {"weights": {"knn": 0}}}})
    hybrid = pipeline.search(spec(), "acme")
    assert embedder.texts == []  # the kNN channel was not even queried
    assert backend.calls[-1].channels == ("bm25",)
    fts = pipeline.search(spec(mode="fts"), "acme")
    assert [(h.id, h.ranks.bm25, h.scores.rrf) for h in hybrid.hits] == [
        (h.id, h.ranks.bm25, h.scores.rrf) for h in fts.hits
    ]
    assert hybrid.trace is not None and hybrid.trace["fusion"]["channels"] == ["bm25"]
    # a request's own knn weight puts the channel back
    pipeline.search(spec(fusion={"weights": {"knn": 1}}), "acme")
    assert embedder.texts == ["volcano ash eruption"]


def test_a_single_channel_mode_ignores_its_weight() -> None:
    pipeline, _, _, _ = make({("docs", "acme"): {"fusion": {"weights": {"bm25": 0}}}})
    fts = pipeline.search(spec(mode="fts"), "acme")
    assert fts.hits and all(h.ranks.bm25 is not None for h in fts.hits)


def test_every_channel_weighted_zero_is_an_invalid_request() -> None:
    pipeline, _, _, _ = make({("docs", "acme"): {"fusion": {"weights": {"bm25": 0}}}})
    with pytest.raises(InvalidRequest) as refused:
        pipeline.search(spec(fusion={"weights": {"knn": 0}}), "acme")
    assert refused.value.field == "fusion.weights"


def test_a_missing_index_is_not_found_before_any_settings_are_read() -> None:
    pipeline, _, _, source = make()
    with pytest.raises(IndexNotFound):
        pipeline.search(spec(), "globex")
    assert source.asked == []


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"fusion_weights": '{"bm25": 0, "knn": 0}'}, "SIFT_FUSION_WEIGHTS"),
        ({"fusion_weights": '{"bm25": -1}'}, "SIFT_FUSION_WEIGHTS"),
        ({"fusion_weights": '{"knn": 1e308}'}, "SIFT_FUSION_WEIGHTS"),
        ({"fusion_weights": '{"splade": 1}'}, "SIFT_FUSION_WEIGHTS"),
        ({"fusion_weights": "{nope"}, "SIFT_FUSION_WEIGHTS"),
        ({"fusion_rank_constant": 0}, "SIFT_FUSION_RANK_CONSTANT"),
        ({"fusion_method": "sum"}, "SIFT_FUSION_METHOD"),
    ],
)
def test_bad_default_settings_name_the_setting(env: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_settings(**env)


def test_a_spec_without_overrides_serializes_as_before_them() -> None:
    """So a worker of the previous release reads it, and a key's fingerprint is unchanged."""
    plain = SearchSpec(index="docs", query="q")
    assert set(plain.model_dump()) == {
        "index", "query", "limit", "mode", "rerank", "include_trace", "filters"
    }  # fmt: skip
    tuned = SearchSpec.model_validate({"index": "docs", "query": "q", "candidate_limit": 12})
    assert tuned.model_dump()["candidate_limit"] == 12
    assert SearchSpec.model_validate_json(tuned.model_dump_json()) == tuned
    # a fusion without a method serializes as before the method existed
    weighted = SearchSpec.model_validate(
        {"index": "docs", "query": "q", "fusion": {"weights": {"knn": 0.5}}}
    )
    assert weighted.model_dump()["fusion"] == {
        "weights": {"bm25": None, "knn": 0.5}, "rank_constant": None
    }  # fmt: skip
    linear = SearchSpec.model_validate(
        {"index": "docs", "query": "q", "fusion": {"method": "linear"}}
    )
    assert json.loads(linear.model_dump_json())["fusion"]["method"] == "linear"
    assert SearchSpec.model_validate_json(linear.model_dump_json()) == linear


def test_the_cli_client_patches_the_index() -> None:
    """``Gateway.update_index``: one PATCH of the body as given, the metadata answered."""
    seen: list[httpx.Request] = []
    answer = {"name": "docs", "settings": {"fusion": {}, "candidate_limit": 40}}

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer)

    client = Gateway("http://gateway.test", "key-12345678", transport=httpx.MockTransport(handle))
    body = {"fusion": {"weights": {"knn": 0.3}}, "candidate_limit": 40}
    assert client.update_index("docs", body) == answer
    (request,) = seen
    assert (request.method, request.url.path) == ("PATCH", "/v1/indexes/docs")
    assert json.loads(request.content) == body
    assert request.headers["authorization"] == "Bearer key-12345678"


@pytest.mark.parametrize(
    "empty", [{}, {"weights": {}}, {"weights": {"bm25": None}, "rank_constant": None}]
)
def test_a_fusion_that_sets_nothing_is_the_fusion_left_out(empty: dict[str, Any]) -> None:
    """It means the same (every field falls back to the index's and the defaults), so it is
    the same spec: a search sent again with the same Idempotency-Key and ``fusion: {}`` where
    the first had none replays the first, not a 409 for a different body."""
    plain = {"index": "docs", "query": "q"}
    spec = SearchSpec.model_validate({**plain, "fusion": empty})
    assert spec.model_dump() == SearchSpec.model_validate(plain).model_dump()
    assert fingerprint("POST /v1/searches", spec.model_dump(mode="json")) == fingerprint(
        "POST /v1/searches",
        SearchSpec.model_validate({**plain, "fusion": None}).model_dump(mode="json"),
    )

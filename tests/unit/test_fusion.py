"""RRF with constant 60, best-rank dedupe, deterministic ties, and channel admission; weighted
RRF, its settings' precedence (request over index over default) and their validation; linear
fusion of min-max normalised scores."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from worker.contract import Channel, FusionSpec
from worker.core.fusion import (
    Fusion,
    FusionOverride,
    admit,
    fuse,
    fusion_levels,
    linear_fuse,
    resolve_fusion,
    rrf_fuse,
)
from worker.core.types import ChannelHit, Document
from worker.errors import InvalidRequest


def hits(*ids: str, score: float = 1.0) -> list[ChannelHit]:
    return [ChannelHit(Document(i, f"text {i}"), score) for i in ids]


def test_scores_are_the_sum_of_reciprocal_ranks() -> None:
    fused = rrf_fuse({"bm25": hits("a", "b", "c"), "knn": hits("c", "a")}, limit=10)
    by_id = {c.document.id: c for c in fused}
    assert by_id["a"].rrf_score == pytest.approx(1 / 61 + 1 / 62)
    assert by_id["c"].rrf_score == pytest.approx(1 / 63 + 1 / 61)
    assert by_id["b"].rrf_score == pytest.approx(1 / 62)
    assert [c.document.id for c in fused] == ["a", "c", "b"]
    assert [c.rrf_rank for c in fused] == [1, 2, 3]
    assert by_id["c"].channel_ranks == {"bm25": 3, "knn": 1}
    assert by_id["b"].channel_ranks == {"bm25": 2}


def test_a_repeat_in_one_channel_keeps_its_best_rank() -> None:
    fused = rrf_fuse({"bm25": hits("a", "b", "a")}, limit=10)
    by_id = {c.document.id: c for c in fused}
    assert by_id["a"].channel_ranks == {"bm25": 1}
    assert by_id["a"].rrf_score == pytest.approx(1 / 61)
    assert len(fused) == 2


def test_ties_break_on_best_channel_rank_then_id() -> None:
    # x is 1st in bm25 and 4th in knn; y is 4th in bm25 and 1st in knn: equal scores and
    # equal best ranks, so the id decides. z ties with w on score but has a better best rank.
    fused = rrf_fuse({"bm25": hits("y", "p", "q", "x"), "knn": hits("x", "r", "s", "y")}, limit=10)
    order = [c.document.id for c in fused]
    assert order.index("x") < order.index("y")
    again = rrf_fuse({"knn": hits("x", "r", "s", "y"), "bm25": hits("y", "p", "q", "x")}, limit=10)
    assert [c.document.id for c in again] == order


def test_keeps_the_first_limit() -> None:
    fused = rrf_fuse({"bm25": hits(*"abcdefgh")}, limit=3)
    assert [c.document.id for c in fused] == ["a", "b", "c"]


def test_knn_floor_admits_only_hits_at_or_above_it() -> None:
    channel = {
        "knn": [ChannelHit(Document("a", "t"), 0.9), ChannelHit(Document("b", "t"), 0.2)],
        "bm25": hits("b"),
    }
    assert [h.document.id for h in admit(channel, 0.5)["knn"]] == ["a"]
    assert [h.document.id for h in admit(channel, None)["knn"]] == ["a", "b"]
    assert admit(channel, 0.5)["bm25"] == channel["bm25"]


# --- weighted RRF (issue 15) ----------------------------------------------------------------


def test_weights_scale_each_channels_share() -> None:
    fused = rrf_fuse(
        {"bm25": hits("a", "b"), "knn": hits("b", "a")},
        limit=10,
        fusion=Fusion({"bm25": 2.0, "knn": 0.5}, rank_constant=10),
    )
    by_id = {c.document.id: c for c in fused}
    assert by_id["a"].rrf_score == pytest.approx(2.0 / 11 + 0.5 / 12)
    assert by_id["b"].rrf_score == pytest.approx(2.0 / 12 + 0.5 / 11)
    assert [c.document.id for c in fused] == ["a", "b"]


@pytest.mark.parametrize("kept", ["bm25", "knn"])
def test_weights_one_and_zero_reduce_to_the_one_channel(kept: Channel) -> None:
    lists: dict[Channel, list[ChannelHit]] = {
        "bm25": hits("a", "b", "c", "d"),
        "knn": hits("d", "x", "c", "y"),
    }
    other: Channel = "knn" if kept == "bm25" else "bm25"
    fused = rrf_fuse(lists, limit=10, fusion=Fusion({kept: 1.0, other: 0.0}))
    alone = rrf_fuse({kept: lists[kept]}, limit=10)
    assert [c.document.id for c in fused] == [h.document.id for h in lists[kept]]
    assert [(c.document.id, c.rrf_score) for c in fused] == [
        (c.document.id, c.rrf_score) for c in alone
    ]
    # a channel weighted 0 is not fused at all: no rank from it, none of its own candidates
    assert all(other not in c.channel_ranks for c in fused)


def test_ties_stay_deterministic_under_weights() -> None:
    # equal weights, mirrored lists: every pair ties on score and on best rank; the id decides
    fusion = Fusion({"bm25": 0.7, "knn": 0.7}, rank_constant=5)
    lists = {"bm25": hits("q", "p"), "knn": hits("p", "q")}
    once = [c.document.id for c in rrf_fuse(lists, limit=10, fusion=fusion)]
    reversed_input = {"knn": lists["knn"], "bm25": lists["bm25"]}
    again = [c.document.id for c in rrf_fuse(reversed_input, limit=10, fusion=fusion)]
    assert once == again == ["p", "q"]


def test_precedence_is_request_over_index_over_default_field_by_field() -> None:
    default = Fusion({"bm25": 1.0, "knn": 1.0}, 60)
    index = FusionOverride({"bm25": 0.8, "knn": 0.3}, 30)
    request = FusionOverride({"knn": 0.9})
    fusion = resolve_fusion(default, request, index)
    assert fusion.weights == {"bm25": 0.8, "knn": 0.9} and fusion.rank_constant == 30
    assert fusion.method == "rrf"
    assert fusion_levels(request, index) == {
        "method": "default",
        "weights": {"bm25": "index", "knn": "request"},
        "rank_constant": "index",
    }
    only_rank = FusionOverride(rank_constant=5)
    assert resolve_fusion(default, only_rank, None) == Fusion({"bm25": 1.0, "knn": 1.0}, 5)
    assert fusion_levels(None, None) == {
        "method": "default",
        "weights": {"bm25": "default", "knn": "default"},
        "rank_constant": "default",
    }


def test_a_hybrid_search_drops_a_channel_weighted_zero_and_refuses_all_zero() -> None:
    assert Fusion({"bm25": 1.0, "knn": 0.0}).fused_channels(("bm25", "knn")) == ("bm25",)
    assert Fusion({"bm25": 0.0, "knn": 2.0}).fused_channels(("bm25", "knn")) == ("knn",)
    assert Fusion({"bm25": 0.0}).fused_channels(("bm25",)) == ("bm25",)  # fts stays BM25
    with pytest.raises(InvalidRequest) as refused:
        Fusion({"bm25": 0.0, "knn": 0.0}).fused_channels(("bm25", "knn"))
    assert refused.value.field == "fusion.weights"


def test_request_fusion_validation_names_the_field() -> None:
    with pytest.raises(ValidationError) as bad:
        FusionSpec.model_validate({"weights": {"bm25": -1}})
    assert bad.value.errors()[0]["loc"] == ("weights", "bm25")
    with pytest.raises(ValidationError) as unknown:
        FusionSpec.model_validate({"weights": {"splade": 1}})
    assert unknown.value.errors()[0]["loc"] == ("weights", "splade")
    with pytest.raises(ValidationError):
        FusionSpec.model_validate({"weights": {"bm25": 0, "knn": 0}})
    with pytest.raises(ValidationError):
        FusionSpec.model_validate({"weights": {"knn": float("inf")}})
    with pytest.raises(ValidationError):
        FusionSpec.model_validate({"rank_constant": 0})


def scored(*pairs: tuple[str, float]) -> list[ChannelHit]:
    return [ChannelHit(Document(i, f"text {i}"), score) for i, score in pairs]


def test_linear_sums_weighted_min_max_normalised_scores() -> None:
    lists = {
        "bm25": scored(("a", 30.0), ("b", 20.0), ("c", 10.0)),
        "knn": scored(("c", 0.9), ("d", 0.7), ("a", 0.5)),
    }
    fused = linear_fuse(lists, limit=10, fusion=Fusion({"bm25": 1.0, "knn": 0.5}))
    by_id = {c.document.id: c for c in fused}
    # bm25: a 1, b 0.5, c 0; knn: c 1, d 0.5, a 0; a channel not listing a document adds 0
    assert by_id["a"].rrf_score == pytest.approx(1.0)
    assert by_id["b"].rrf_score == pytest.approx(0.5)
    assert by_id["c"].rrf_score == pytest.approx(0.5)
    assert by_id["d"].rrf_score == pytest.approx(0.25)
    # b and c tie at 0.5: the best rank in a channel (c is kNN's first) decides, then the id
    assert [c.document.id for c in fused] == ["a", "c", "b", "d"]
    assert [c.rrf_rank for c in fused] == [1, 2, 3, 4]
    assert by_id["a"].channel_scores == {"bm25": 30.0, "knn": 0.5}  # the raw scores are kept
    assert fuse(lists, 10, Fusion({"bm25": 1.0, "knn": 0.5}, method="linear")) == fused


def test_linear_ignores_the_rank_constant_and_scales_with_the_weights() -> None:
    lists = {"bm25": scored(("a", 3.0), ("b", 1.0)), "knn": scored(("b", 0.8), ("a", 0.2))}
    one = linear_fuse(lists, 10, Fusion({"bm25": 1.0, "knn": 2.0}, rank_constant=1))
    other = linear_fuse(lists, 10, Fusion({"bm25": 1.0, "knn": 2.0}, rank_constant=100))
    assert [(c.document.id, c.rrf_score) for c in one] == [
        (c.document.id, c.rrf_score) for c in other
    ]
    assert [c.document.id for c in one] == ["b", "a"]
    tilted = linear_fuse(lists, 10, Fusion({"bm25": 3.0, "knn": 2.0}))
    assert [c.document.id for c in tilted] == ["a", "b"]


def test_linear_equal_scores_normalise_to_one_as_elasticsearch() -> None:
    """One hit, or every hit at the same score: each scores 1 (ES's ``minmax``), so the
    channel still counts at its full weight, and the order falls to rank, then id."""
    single = linear_fuse({"knn": scored(("z", 0.4))}, 10)
    assert single[0].rrf_score == 1.0
    flat = linear_fuse({"bm25": scored(("b", 2.0), ("a", 2.0)), "knn": scored(("c", 0.3))}, 10)
    assert [(c.document.id, c.rrf_score) for c in flat] == [("b", 1.0), ("c", 1.0), ("a", 1.0)]


@pytest.mark.parametrize("kept", ["bm25", "knn"])
def test_linear_with_a_channel_weighted_zero_is_that_channel_alone(kept: Channel) -> None:
    lists = {
        "bm25": scored(("a", 9.0), ("b", 4.0), ("c", 1.0)),
        "knn": scored(("c", 0.9), ("x", 0.5), ("a", 0.1)),
    }
    other: Channel = "knn" if kept == "bm25" else "bm25"
    fused = linear_fuse(lists, 10, Fusion({kept: 1.0, other: 0.0}))
    assert [c.document.id for c in fused] == [h.document.id for h in lists[kept]]
    assert all(other not in c.channel_ranks for c in fused)


def test_linear_ties_do_not_depend_on_the_input_order() -> None:
    lists = {"bm25": scored(("q", 2.0), ("p", 1.0)), "knn": scored(("p", 0.9), ("q", 0.1))}
    once = [c.document.id for c in linear_fuse(lists, 10)]
    again = [c.document.id for c in linear_fuse({"knn": lists["knn"], "bm25": lists["bm25"]}, 10)]
    assert once == again == ["p", "q"]


def test_a_bad_method_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError) as refused:
        FusionSpec.model_validate({"method": "sum"})
    assert refused.value.errors()[0]["loc"] == ("method",)

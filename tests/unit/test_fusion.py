"""RRF with constant 60, best-rank dedupe, deterministic ties, and channel admission."""

from __future__ import annotations

import pytest

from worker.core.fusion import admit, rrf_fuse
from worker.core.types import ChannelHit, Document


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

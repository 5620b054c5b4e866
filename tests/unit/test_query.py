"""Query normalisation, mode selection and the budget arithmetic (DESIGN.md §2-§3)."""

from __future__ import annotations

import pytest

from worker.core.query import channel_window, coarse_limit, normalise_query, select_channels
from worker.errors import IndexNotFound, InvalidRequest, ModeUnavailable


def test_normalise_trims_and_collapses() -> None:
    assert normalise_query("\t who  won \n the cup  ") == "who won the cup"


@pytest.mark.parametrize("blank", ["", "   ", "\n\t"])
def test_blank_query_is_an_error_naming_the_field(blank: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        normalise_query(blank)
    assert info.value.field == "query"


@pytest.mark.parametrize(
    ("k", "c", "reranking", "coarse", "window"),
    [
        (10, 30, True, 30, 120),  # the defaults: 4 * 30
        (10, 30, False, 10, 40),
        (5, 30, False, 5, 32),  # never below 32
        (50, 30, True, 50, 200),  # k above c wins
        (1, 1, True, 1, 32),
    ],
)
def test_budgets(k: int, c: int, reranking: bool, coarse: int, window: int) -> None:
    assert coarse_limit(k, c, reranking) == coarse
    assert channel_window(coarse) == window


def test_modes_select_channels() -> None:
    both = frozenset({"bm25", "knn"})
    assert select_channels("fts", "i", both) == ("bm25",)
    assert select_channels("vector", "i", both) == ("knn",)
    assert select_channels("hybrid", "i", both) == ("bm25", "knn")


def test_a_mode_the_index_cannot_serve_is_a_clear_error() -> None:
    with pytest.raises(ModeUnavailable, match="knn"):
        select_channels("hybrid", "docs", frozenset({"bm25"}))
    with pytest.raises(IndexNotFound, match="docs"):
        select_channels("fts", "docs", frozenset())

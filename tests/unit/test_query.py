"""Query normalisation, mode selection and the budget arithmetic (DESIGN.md §2-§3)."""

from __future__ import annotations

import pytest

from worker.constants import MAX_BM25_WORDS
from worker.core.query import (
    bm25_cut,
    channel_window,
    coarse_limit,
    normalise_query,
    select_channels,
)
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


def test_bm25_cut_keeps_the_query_up_to_its_last_searched_word() -> None:
    """Elasticsearch's BM25 query has one leaf clause per token and field, and a node refuses
    a search of more than ``max(1024, heap_MB * 64 / search_threads)`` leaves: 2,000 distinct
    ideographs (each one token) over title and text were 4,000, ``too_many_clauses``. A
    query's BM25 channel reads its first ``MAX_BM25_WORDS`` words, an ideograph, a kana or an
    emoji counting as one, on both backends."""
    assert bm25_cut("who won the cup?").text == "who won the cup?"
    words = " ".join(f"w{n}" for n in range(MAX_BM25_WORDS + 10))
    assert bm25_cut(words).text == " ".join(f"w{n}" for n in range(MAX_BM25_WORDS))
    ideographs = "".join(chr(0x4E00 + n) for n in range(2_000))
    assert bm25_cut(ideographs).text == ideographs[:MAX_BM25_WORDS]
    mixed = "東京タワー " * 200 + "ひらがな " * 200  # a katakana run is one word, a kana one each
    kept = bm25_cut(mixed).text
    assert mixed.startswith(kept) and len(kept) < len(mixed)
    assert bm25_cut("\U0001f525" * 2_000).text == "\U0001f525" * MAX_BM25_WORDS
    assert bm25_cut("x" * 2_000).text == "x" * 2_000  # one word, however long
    # symbols the tokenizer may make a token each, outside the emoji blocks, and the other
    # ideographic scripts (Tangut, Nüshu): never fewer words than tokens
    for text in ("⌚⌛⏩⏰⬛⬜⭐⭕©™↔" * 300, "\U00017000\U00017001" * 1_000, "\U0001b170" * 2_000):
        assert len(bm25_cut(text).text) == MAX_BM25_WORDS, text[:4]

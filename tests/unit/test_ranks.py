"""Rank normalisation over a table of adversarial model outputs (DESIGN.md §2 step 7)."""

from __future__ import annotations

import pytest

from worker.core.ranks import normalise_positions

CASES = [
    # raw answer, candidate_count, k, kept, dropped reasons
    ([3, 1, 2], 5, 10, (3, 1, 2), []),
    ([2, 2, 2, 4], 5, 10, (2, 4), ["duplicate", "duplicate"]),
    ([0, -1, 6, 99, 1], 5, 10, (1,), ["out_of_range"] * 4),
    ([5, 4, 3, 2, 1], 5, 2, (5, 4), ["over_limit"] * 3),
    ([], 5, 10, (), []),
    ([0, 6], 5, 10, (), ["out_of_range", "out_of_range"]),
    ([2.0, "3", True, None, [1], 4], 5, 10, (4,), ["not_an_integer"] * 5),
    ([1, 1, 1], 1, 10, (1,), ["duplicate", "duplicate"]),
    ([7, 7, 8], 30, 1, (7,), ["duplicate", "over_limit"]),
    ([10**30, -(10**30), 3], 5, 10, (3,), ["out_of_range", "out_of_range"]),
]


@pytest.mark.parametrize(("raw", "count", "k", "kept", "reasons"), CASES)
def test_normalisation_table(
    raw: list[object], count: int, k: int, kept: tuple[int, ...], reasons: list[str]
) -> None:
    result = normalise_positions(raw, count, k)
    assert result.kept == kept
    assert [d.reason for d in result.dropped] == reasons


def test_sparse_answer_is_never_padded() -> None:
    result = normalise_positions([4], candidate_count=30, k=10)
    assert result.kept == (4,)


def test_keeps_the_models_order_not_numeric_order() -> None:
    assert normalise_positions([9, 2, 30, 1], 30, 10).kept == (9, 2, 30, 1)


def test_every_input_value_is_accounted_for() -> None:
    raw: list[object] = [1, 1, 0, "x", 2, 3, 4]
    result = normalise_positions(raw, 3, 2)
    assert len(result.kept) + len(result.dropped) == len(raw)

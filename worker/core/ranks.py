"""Rank normalisation of a model's answer (DESIGN.md §2 step 7): never raises, never pads."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Dropped:
    """A position the model returned that was not kept, and why."""

    value: object
    reason: str  # not_an_integer | out_of_range | duplicate | deleted | over_limit


@dataclass(frozen=True, slots=True)
class Normalised:
    kept: tuple[int, ...]
    dropped: tuple[Dropped, ...]


def normalise_positions(
    raw: Sequence[object], candidate_count: int, k: int, deleted: Collection[int] = ()
) -> Normalised:
    """Keep the first occurrence of each integer in ``1..candidate_count``, in the model's order,
    up to ``k`` of them. Everything else is dropped with its reason; nothing is added. A
    position in ``deleted`` (its document deleted since the model was shown it) is dropped
    before the cut to ``k``, so the model's next pick takes its place.

    >>> normalise_positions([3, 3, 0, 9, 1, True, 2], candidate_count=5, k=2).kept
    (3, 1)
    >>> normalise_positions([3, 1, 2], candidate_count=5, k=2, deleted={3}).kept
    (1, 2)
    """
    kept: list[int] = []
    dropped: list[Dropped] = []
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int):
            dropped.append(Dropped(value, "not_an_integer"))
        elif not 1 <= value <= candidate_count:
            dropped.append(Dropped(value, "out_of_range"))
        elif value in kept:
            dropped.append(Dropped(value, "duplicate"))
        elif value in deleted:
            dropped.append(Dropped(value, "deleted"))
        elif len(kept) >= k:
            dropped.append(Dropped(value, "over_limit"))
        else:
            kept.append(value)
    return Normalised(tuple(kept), tuple(dropped))

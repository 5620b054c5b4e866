"""Rank normalisation of a model's answer (DESIGN.md §2 step 7): never raises, never pads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Dropped:
    """A position the model returned that was not kept, and why."""

    value: object
    reason: str  # not_an_integer | out_of_range | duplicate | deleted | filtered_out | over_limit


@dataclass(frozen=True, slots=True)
class Normalised:
    kept: tuple[int, ...]
    dropped: tuple[Dropped, ...]


def normalise_positions(
    raw: Sequence[object], candidate_count: int, k: int, gone: Mapping[int, str] | None = None
) -> Normalised:
    """Keep the first occurrence of each integer in ``1..candidate_count``, in the model's order,
    up to ``k`` of them. Everything else is dropped with its reason; nothing is added. A
    position in ``gone`` (its document deleted since the model was shown it, or written
    again outside the search's filters) is dropped with the reason ``gone`` gives it
    (``deleted``, ``filtered_out``) before the cut to ``k``, so the model's next pick takes
    its place.

    >>> normalise_positions([3, 3, 0, 9, 1, True, 2], candidate_count=5, k=2).kept
    (3, 1)
    >>> normalised = normalise_positions([3, 1, 2], candidate_count=5, k=2, gone={3: "deleted"})
    >>> normalised.kept, normalised.dropped
    ((1, 2), (Dropped(value=3, reason='deleted'),))
    """
    gone = gone or {}
    kept: list[int] = []
    dropped: list[Dropped] = []
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int):
            dropped.append(Dropped(value, "not_an_integer"))
        elif not 1 <= value <= candidate_count:
            dropped.append(Dropped(value, "out_of_range"))
        elif value in kept:
            dropped.append(Dropped(value, "duplicate"))
        elif value in gone:
            dropped.append(Dropped(value, gone[value]))
        elif len(kept) >= k:
            dropped.append(Dropped(value, "over_limit"))
        else:
            kept.append(value)
    return Normalised(tuple(kept), tuple(dropped))

"""Query normalisation, mode selection and the budget arithmetic of DESIGN.md §2-§3."""

from __future__ import annotations

from collections.abc import Set

from worker.constants import CHANNEL_WINDOW_FACTOR, MIN_CHANNEL_WINDOW
from worker.contract import Channel, Mode
from worker.core.fusion import Fusion
from worker.errors import IndexNotFound, InvalidRequest, ModeUnavailable

MODE_CHANNELS: dict[Mode, tuple[Channel, ...]] = {
    "fts": ("bm25",),
    "vector": ("knn",),
    "hybrid": ("bm25", "knn"),
}


def normalise_query(query: str) -> str:
    """Trim and collapse whitespace; an empty query is a validation error, not an empty result.

    >>> normalise_query("  who   wrote\\n it ")
    'who wrote it'
    """
    normalised = " ".join(query.split())
    if not normalised:
        raise InvalidRequest("query", "must contain at least one non-whitespace character")
    return normalised


def select_channels(
    mode: Mode, index: str, available: Set[Channel], fusion: Fusion | None = None
) -> tuple[Channel, ...]:
    """The channels ``mode`` needs, or a clear error when the index cannot serve them.

    ``available`` is what the backend answered for the caller's tenant: empty when the
    tenant holds no document in ``index``, whether or not another tenant does. With
    ``fusion``, a hybrid search leaves out a channel weighted 0 (:meth:`Fusion.fused_channels`):
    it is not queried, so it need not be available either.

    >>> select_channels("hybrid", "docs", {"bm25"}, Fusion({"knn": 0.0}))
    ('bm25',)
    """
    if not available:
        raise IndexNotFound(index)
    wanted = MODE_CHANNELS[mode] if fusion is None else fusion.fused_channels(MODE_CHANNELS[mode])
    missing = [channel for channel in wanted if channel not in available]
    if missing:
        raise ModeUnavailable(
            f"mode {mode!r} needs the {', '.join(missing)} channel, "
            f"which index {index!r} cannot serve (it has: {', '.join(sorted(available))})"
        )
    return wanted


def coarse_limit(limit: int, candidate_limit: int, reranking: bool) -> int:
    """How many fused candidates to keep: ``max(k, c)`` when a reranker applies, else ``k``."""
    return max(limit, candidate_limit) if reranking else limit


def channel_window(coarse: int) -> int:
    """How many candidates each channel returns: ``max(4 * coarse_limit, 32)``."""
    return max(CHANNEL_WINDOW_FACTOR * coarse, MIN_CHANNEL_WINDOW)

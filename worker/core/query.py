"""Query normalisation, mode selection and the budget arithmetic of DESIGN.md §2-§3."""

from __future__ import annotations

from collections.abc import Sequence, Set

from worker.constants import CHANNEL_WINDOW_FACTOR, MIN_CHANNEL_WINDOW
from worker.contract import Channel, Mode
from worker.core.fusion import Fusion
from worker.errors import EmbeddingModelMismatch, IndexNotFound, InvalidRequest, ModeUnavailable

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


def check_model(index: str, channels: Sequence[Channel], held: str | None, model: str) -> None:
    """Refuse a search whose ``knn`` channel would score the index's vectors, written by
    embedding model ``held``, against a query embedded by ``model``: another model's
    vectors live in another space, and the ranking would be noise with no error. A hybrid
    search fails too rather than quietly serving BM25 alone: the caller asked for both,
    and ``mode="fts"`` still serves the index as it is.

    >>> check_model("docs", ("bm25",), "model-a", "model-b")  # no knn: nothing compared
    >>> check_model("docs", ("bm25", "knn"), "model-a", "model-b")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    worker.errors.EmbeddingModelMismatch: index 'docs' holds vectors of embedding model ...
    """
    if "knn" in channels and held is not None and held != model:
        raise EmbeddingModelMismatch(index, held, model)


def coarse_limit(limit: int, candidate_limit: int, reranking: bool) -> int:
    """How many fused candidates to keep: ``max(k, c)`` when a reranker applies, else ``k``."""
    return max(limit, candidate_limit) if reranking else limit


def channel_window(coarse: int) -> int:
    """How many candidates each channel returns: ``max(4 * coarse_limit, 32)``."""
    return max(CHANNEL_WINDOW_FACTOR * coarse, MIN_CHANNEL_WINDOW)

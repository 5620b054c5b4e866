"""Query normalisation, mode selection and the budget arithmetic of DESIGN.md §2-§3."""

from __future__ import annotations

import re
from collections.abc import Sequence, Set
from dataclasses import dataclass

from worker.constants import CHANNEL_WINDOW_FACTOR, MAX_BM25_WORDS, MIN_CHANNEL_WINDOW
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


# Characters Elasticsearch's standard tokenizer makes a token each (UAX #29): ideographs (Han,
# Tangut, Nüshu), hiragana, and emoji; a run of any other word characters is one word at most,
# and so is every other character that is neither a word character nor a space (a symbol
# outside the emoji blocks may be a token: counted, never one word fewer than the tokens).
_ONE_EACH = (
    "\u3040-\u309f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003ffff"
    "\U00017000-\U00018cff\U0001b170-\U0001b2ff\u2600-\u27bf\U0001f000-\U0001faff"
)
_WORD = re.compile(f"[{_ONE_EACH}]|[^\\W{_ONE_EACH}]+|[^\\w\\s]")


@dataclass(frozen=True, slots=True)
class BM25Cut:
    """The part of a query its BM25 channel searches: the text, its words, and whether
    words past the limit were left out (the trace says so: the cut was silent)."""

    text: str
    words: int
    truncated: bool


def bm25_cut(query: str, limit: int = MAX_BM25_WORDS) -> BM25Cut:
    """The part of ``query`` its BM25 channel searches: the text up to its ``limit``-th word.

    Elasticsearch's BM25 query (``multi_match`` over title and text) is one leaf clause per
    token and field, and a node refuses a search of more leaves than ``max(1024, heap_MB *
    64 / search_threads)``: 2,000 distinct ideographs, a token each, were 4,000 leaves and
    ``too_many_clauses`` on a small node with many cores. A word here is a run of letters
    and digits, or one ideograph, kana, emoji or other symbol (a punctuation mark too: counted
    high, never low), as the tokenizer makes each of those a token: never fewer words than
    Elasticsearch's tokens. Both backends search the same
    words, so they answer alike; the kNN channel still reads the whole query.

    >>> bm25_cut("a b c d", limit=2), bm25_cut("東京タワー", limit=2)
    (BM25Cut(text='a b', words=2, truncated=True), BM25Cut(text='東京', words=2, truncated=True))
    >>> bm25_cut("a b", limit=2)
    BM25Cut(text='a b', words=2, truncated=False)
    """
    words = end = 0
    for word in _WORD.finditer(query):
        if words == limit:  # a word past the limit: the text ends with the one before
            return BM25Cut(query[:end], words, truncated=True)
        words, end = words + 1, word.end()
    return BM25Cut(query, words, truncated=False)


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

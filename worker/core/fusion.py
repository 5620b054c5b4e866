"""Reciprocal Rank Fusion with constant 60 and deterministic ties (DESIGN.md §2 step 4)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from worker.constants import RRF_K
from worker.contract import Channel
from worker.core.types import Candidate, ChannelHit


def rrf_fuse(
    channel_hits: Mapping[Channel, Sequence[ChannelHit]], limit: int, k: int = RRF_K
) -> list[Candidate]:
    """Fuse each channel's admitted hits; keep the first ``limit``.

    A document's rank in a channel is its 1-based place in that channel's list; a
    document listed twice keeps its best (first) rank. ``score = Σ 1 / (k + rank)``.
    Ties break on the best channel rank, then on the id, so equal input gives equal order.

    >>> from worker.core.types import Document
    >>> a, b = Document("a", "x"), Document("b", "y")
    >>> [c.document.id for c in rrf_fuse({"bm25": [ChannelHit(a, 2.0), ChannelHit(b, 1.0)],
    ...                                   "knn": [ChannelHit(b, 0.9)]}, limit=2)]
    ['b', 'a']
    """
    fused: dict[str, Candidate] = {}
    for channel, hits in channel_hits.items():
        for rank, hit in enumerate(hits, start=1):
            doc_id = hit.document.id
            candidate = fused.get(doc_id)
            if candidate is None:
                candidate = Candidate(hit.document, 0, 0.0, {}, {})
                fused[doc_id] = candidate
            elif channel in candidate.channel_ranks:
                continue  # a repeat within one channel keeps its best rank
            candidate.channel_ranks[channel] = rank
            candidate.channel_scores[channel] = hit.score
            candidate.rrf_score += 1.0 / (k + rank)

    ordered = sorted(
        fused.values(),
        key=lambda c: (-c.rrf_score, min(c.channel_ranks.values()), c.document.id),
    )[:limit]
    for position, candidate in enumerate(ordered, start=1):
        candidate.rrf_rank = position
    return ordered


def admit(
    channel_hits: Mapping[Channel, Sequence[ChannelHit]], min_similarity: float | None
) -> dict[Channel, list[ChannelHit]]:
    """Apply each channel's own floor: kNN hits below ``min_similarity`` are not admitted.

    BM25's floor (at least one matching term) holds by construction in every backend.
    """
    admitted = {channel: list(hits) for channel, hits in channel_hits.items()}
    if min_similarity is not None and "knn" in admitted:
        admitted["knn"] = [hit for hit in admitted["knn"] if hit.score >= min_similarity]
    return admitted

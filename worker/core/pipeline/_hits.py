"""How a result shows its candidates: each hit's data and metadata, the trace's candidates,
and each stage's seconds."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from worker.contract import StoredValue
from worker.core.types import Candidate, RerankPrompt


def stage_seconds(trace: dict[str, Any]) -> dict[str, float]:
    """Each stage's seconds in a trace: the queue wait (when the worker put it in), the wait
    for a CPU slot, retrieval's stages and the rerank.

    >>> stage_seconds({"slot_wait_seconds": 0.125, "retrieval_seconds": {"embed": 0.5},
    ...                "rerank_seconds": 2})
    {'slot_wait': 0.125, 'embed': 0.5, 'rerank': 2.0}
    """
    found = {
        "queue_wait": trace.get("queue_wait_seconds"),
        "slot_wait": trace.get("slot_wait_seconds"),
    }
    found |= trace.get("retrieval_seconds") or {}
    found["rerank"] = trace.get("rerank_seconds")
    return {stage: float(s) for stage, s in found.items() if isinstance(s, int | float)}


def shown_metadata(metadata: Mapping[str, StoredValue]) -> dict[str, StoredValue]:
    """Metadata as a hit or a document read shows it: as stored, any JSON value (a list, an
    object, a null: what another tool wrote into an index that already exists). A
    non-finite float (the gateway refuses them now; a document stored before may hold one),
    at any depth, goes by its name: JSON has no such number, and written as ``null`` the
    hit could not be read back, so every search returning the document was a 500 (a
    document read said ``null``).

    >>> shown_metadata({"a": float("nan"), "b": float("inf"), "c": -float("inf"), "d": 1.5})
    {'a': 'NaN', 'b': 'Infinity', 'c': '-Infinity', 'd': 1.5}
    >>> shown_metadata({"tags": ["x", float("nan")], "o": {"k": None}})
    {'tags': ['x', 'NaN'], 'o': {'k': None}}
    """
    return {key: _shown(value) for key, value in metadata.items()}


def _shown(value: StoredValue) -> StoredValue:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, list):
        return [_shown(inner) for inner in value]
    if isinstance(value, dict):
        return {key: _shown(inner) for key, inner in value.items()}
    return value


def _hit(candidate: Candidate, final: int) -> dict[str, Any]:
    """A candidate as a :class:`~worker.contract.Hit`'s data (every field given, as a
    ``Hit(...)`` built field by field had them: the same fields set), to validate with its
    result."""
    doc = candidate.document
    ranks, scores = candidate.channel_ranks, candidate.channel_scores
    return {
        "id": doc.id,
        "revision": doc.revision,
        "title": doc.title,
        "text": doc.text,
        "metadata": shown_metadata(doc.metadata),
        "ranks": {
            "final": final,
            "rrf": candidate.rrf_rank,
            "bm25": ranks.get("bm25"),
            "knn": ranks.get("knn"),
        },
        "scores": {
            "rrf": candidate.rrf_score,
            "bm25": scores.get("bm25"),
            "knn": scores.get("knn"),
        },
    }


def _trace_candidates(
    candidates: Sequence[Candidate], prompt: RerankPrompt | None, max_chars: int
) -> list[dict[str, Any]]:
    """The trace's candidates: each one's ids, ranks and scores, and its title and text, the
    text cut to its first ``max_chars`` characters (``SIFT_RERANK_CANDIDATE_MAX_CHARS``, the
    most of it the prompt shows the model: ``truncated`` says whether the prompt cut the
    candidate's line; its hit carries the text whole). Whole, the texts of 200 candidates
    of 100,000 characters made one trace of 20 MB, which admission cannot foresee.

    >>> from worker.core.types import Document
    >>> doc = Document("a", "word " * 1_000, "Tea", revision="1")
    >>> [shown] = _trace_candidates([Candidate(doc, 1, 0.1, {}, {})], None, 12)
    >>> shown["title"], shown["text"], shown["truncated"]
    ('Tea', 'word word wo', False)
    """
    return [
        {
            "position": candidate.rrf_rank,
            "id": candidate.document.id,
            "revision": candidate.document.revision,
            "title": candidate.document.title,
            "text": candidate.document.text[:max_chars],
            "rrf": {"rank": candidate.rrf_rank, "score": candidate.rrf_score},
            "channels": {
                channel: {"rank": rank, "score": candidate.channel_scores[channel]}
                for channel, rank in candidate.channel_ranks.items()
            },
            "truncated": prompt.truncated[i] if prompt else False,
        }
        for i, candidate in enumerate(candidates)
    ]

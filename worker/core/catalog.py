"""What the index lifecycle reads from a backend: a tenant's index, one stored document.

Writes carry a *version*: a number the gateway takes from one Redis counter when it
accepts the write (an upsert, a delete, an index drop). A backend applies a write only
if its version is newer than the one it holds for that id (a delete leaves a tombstone
with its version; a drop leaves a floor for the whole tenant's index), so the write
accepted last wins whichever worker runs it, and in whatever order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from worker.contract import FusionSpec, StoredValue
from worker.core.fusion import FusionOverride


@dataclass(frozen=True, slots=True)
class IndexInfo:
    """One tenant's part of one index."""

    name: str
    documents: int
    backend: str
    model: str | None = None
    dimension: int | None = None
    last_write: float | None = None  # epoch seconds of the tenant's last applied write


@dataclass(frozen=True, slots=True)
class IndexSize:
    """How much one tenant's index holds: its documents, and the UTF-8 bytes of their title,
    text and metadata (JSON) together, what each of its search hits carries into a result.
    A worker records it in Redis after each write job; the gateway prices a batch's hits by
    its mean (``api_gateway/backpressure.py``): a fixed size let a batch over long
    documents fill Redis."""

    documents: int
    stored_bytes: int


@dataclass(frozen=True, slots=True)
class StoredDocument:
    """A document as stored, without its vector."""

    id: str
    text: str
    title: str
    revision: str
    metadata: Mapping[str, StoredValue] = field(default_factory=dict)
    version: int | None = None  # the accepted write that put it there (None: unversioned)
    #: the keywords the backend's metadata filters match this document on, where it keeps
    #: them apart from the metadata (Elasticsearch's typed tokens, ``year=n:2020``); None
    #: where its filters read the metadata itself (:meth:`SearchBackend.holds_filters`).
    #: Not shown: a read of the document answers its metadata.
    terms: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class ListedDocument:
    """A document as a listing shows it: what a read shows, but the text only as its first
    ``preview`` characters and its length (a text runs to 100,000 characters, a page to
    1,000 documents); never the vector."""

    id: str
    title: str
    revision: str
    text_preview: str
    text_length: int  # characters (code points) of the whole text
    metadata: Mapping[str, StoredValue] = field(default_factory=dict)
    version: int | None = None


@dataclass(frozen=True, slots=True)
class SearchSettings:
    """One tenant's index's own search settings (``PATCH /v1/indexes/{index}``): its fusion
    (method, weights, rank constant) and its rerank candidate window. ``None`` (or no
    weight for a channel) defers to the defaults; a request's own settings override these,
    field by field.

    ``stored`` is the JSON as kept: only the fields set, as :func:`merge_patch` leaves them.
    """

    stored: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fusion(self) -> FusionOverride | None:
        raw = self.stored.get("fusion")
        return FusionOverride.from_spec(FusionSpec.model_validate(raw)) if raw else None

    @property
    def candidate_limit(self) -> int | None:
        value = self.stored.get("candidate_limit")
        return None if value is None else int(value)

    def shown(self) -> dict[str, Any]:
        """Every setting, ``None`` where unset, as the index's metadata shows it.

        >>> SearchSettings({"fusion": {"weights": {"knn": 0.5}}}).shown()["fusion"]
        {'method': None, 'weights': {'bm25': None, 'knn': 0.5}, 'rank_constant': None}
        """
        fusion = self.stored.get("fusion") or {}
        weights = fusion.get("weights") or {}
        return {
            "fusion": {
                "method": fusion.get("method"),
                "weights": {"bm25": weights.get("bm25"), "knn": weights.get("knn")},
                "rank_constant": fusion.get("rank_constant"),
            },
            "candidate_limit": self.candidate_limit,
        }


def merge_patch(stored: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON Merge Patch (RFC 7396) of ``patch`` onto ``stored``: an object merges field by
    field, ``null`` removes the field (back to the default), anything else replaces it.

    >>> stored = {"fusion": {"weights": {"bm25": 1.0, "knn": 0.4}}, "candidate_limit": 40}
    >>> merge_patch(stored, {"fusion": {"weights": {"knn": None}, "rank_constant": 20}})
    {'fusion': {'weights': {'bm25': 1.0}, 'rank_constant': 20}, 'candidate_limit': 40}
    >>> merge_patch(stored, {"fusion": None, "candidate_limit": None})
    {}
    """
    merged = dict(stored)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping):
            held = merged.get(key)
            merged[key] = merge_patch(held if isinstance(held, Mapping) else {}, value)
            if not merged[key]:
                merged.pop(key)
        else:
            merged[key] = value
    return merged

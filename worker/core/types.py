"""Plain domain types of the search, with no I/O."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from worker.constants import RRF_K
from worker.contract import Channel, FilterValue, FusionMethod, StoredValue


@dataclass(frozen=True, slots=True)
class Document:
    """One stored document, at one revision, owned by one tenant."""

    id: str
    text: str
    title: str = ""
    revision: str = "1"
    #: what Sift writes holds plain values (:data:`~worker.contract.FilterValue`); a
    #: document read from an index another tool wrote, any JSON value
    metadata: Mapping[str, StoredValue] = field(default_factory=dict)


def derive_revision(title: str, text: str, metadata: Mapping[str, StoredValue]) -> str:
    """A stable revision for a document that came without one: same content, same revision,
    on every backend.

    >>> derive_revision("", "volcano ash", {"year": 2020}) == derive_revision(
    ...     "", "volcano ash", {"year": 2020})
    True
    >>> derive_revision("", "volcano ash", {}) == derive_revision("", "volcano ash", {"a": 1})
    False
    """
    payload = json.dumps([title, text, dict(metadata)], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class HardFilters:
    """Filters applied inside every channel query, before any window: tenant, then caller's."""

    tenant: str
    fields: Mapping[str, FilterValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ChannelHit:
    """One candidate as one channel returned it; its rank is its 1-based place in the list."""

    document: Document
    score: float


@dataclass(frozen=True, slots=True)
class ChannelQuery:
    """What the backend is asked for: one or both channels, filtered, each up to ``size`` hits.

    ``method``, ``weights`` and ``rank_constant`` are the search's fusion, for a backend that
    fuses by itself (Elasticsearch's native ``rrf`` or ``linear`` retriever); Sift's own
    fusion reads its own.
    """

    index: str
    filters: HardFilters
    channels: tuple[Channel, ...]
    size: int
    text: str
    vector: Sequence[float] | None = None
    timeout_seconds: float | None = None
    weights: Mapping[Channel, float] = field(default_factory=dict)
    rank_constant: int = RRF_K
    method: FusionMethod = "rrf"


@dataclass(frozen=True, slots=True)
class IndexProbe:
    """What a search learns of the tenant's index before it runs: the channels it can serve
    (empty: no such index for the tenant) and the embedding model its vectors were written
    with (None: none recorded), from the same one request."""

    channels: frozenset[Channel]
    model: str | None = None


@dataclass(frozen=True, slots=True)
class ChannelResults:
    """Each channel's hits, best first, with the time the backend spent per channel.

    A backend that fuses by itself (Elasticsearch's native ``retriever.rrf``) returns
    ``fused`` instead: one list, best first, with no per-channel rank or score.
    """

    hits: Mapping[Channel, Sequence[ChannelHit]]
    seconds: Mapping[str, float] = field(default_factory=dict)
    fused: Sequence[ChannelHit] | None = None


@dataclass(slots=True)
class Candidate:
    """One fused candidate: the exact document plus every first-stage rank and score."""

    document: Document
    rrf_rank: int
    rrf_score: float
    channel_ranks: dict[Channel, int]
    channel_scores: dict[Channel, float]


@dataclass(frozen=True, slots=True)
class RerankPrompt:
    """A built listwise prompt: pure data, ready for any model adapter."""

    policy: str
    system: str
    user: str
    output_schema: Mapping[str, object]
    max_tokens: int
    candidate_count: int
    truncated: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """The usage one model response reported; token types are disjoint."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    def counts(self) -> list[int]:
        """The four counts in field order, as stored (``TokenUsage(*counts)`` reads them back).

        >>> TokenUsage(90, 7, 1, 2).counts()
        [90, 7, 1, 2]
        """
        return [
            self.input_tokens,
            self.output_tokens,
            self.cache_read_input_tokens,
            self.cache_creation_input_tokens,
        ]


@dataclass(frozen=True, slots=True)
class RerankReply:
    """One successful model answer: the raw positions (unvalidated values) and the usage."""

    positions: Sequence[object]
    usage: TokenUsage
    model: str


@dataclass(frozen=True, slots=True)
class BudgetGrant:
    """The rate budget's answer to one reservation.

    ``admitted``: the call's request and tokens are reserved, and it may be sent after
    ``wait`` seconds. Not admitted: nothing was reserved, because the budget frees the call's
    share only in ``wait`` seconds, past the most the caller said it could wait.
    ``input_tokens``/``output_tokens`` are what was reserved, for the settlement;
    ``raw_input`` the uncorrected estimate, which the settlement calibrates against.
    ``shut``: not admitted because the provider is failing (a 5xx opened the budget's
    breaker, or its one probe call is out), or, ``learning`` too, because no limit is known
    yet and another call is out learning them: ask again in ``wait`` seconds.
    ``probe``: admitted as the breaker's one probe (half open), the id its probe mark holds
    ('' : not the probe); given back unsent, or getting no answer, it lets the next call
    probe at once, and only while that mark is still its own.
    """

    admitted: bool
    wait: float
    input_tokens: int = 0
    output_tokens: int = 0
    raw_input: float = 0.0
    shut: bool = False
    probe: str = ""
    learning: bool = False

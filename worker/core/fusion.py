"""Fusion of the channels' lists with deterministic ties (DESIGN.md §2 step 4): weighted
Reciprocal Rank Fusion, or a linear combination of min-max normalised scores.

``rrf`` (the default): ``score(d) = Σ_c w_c / (rank_constant + rank_c(d))`` over the
channels ``c`` that list ``d``. With every weight 1 and ``rank_constant`` 60 it is plain RRF.
``linear``: ``score(d) = Σ_c w_c · minmax_c(score_c(d))``, each channel's scores rescaled
to [0, 1] over the list it returned (what Elasticsearch's ``linear`` retriever does with
``normalizer: minmax``); it reads the scores, not only the order, so a clear BM25 winner
keeps its lead where RRF would flatten it. The rank constant plays no part in it.
Either way a channel weighted 0 contributes nothing, not even candidates, so
``{"bm25": 1, "knn": 0}`` is BM25 alone. The settings come from the request, else the
index, else the defaults (:func:`resolve_fusion`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from worker.constants import RRF_K
from worker.contract import Channel, FusionMethod, FusionSpec, FusionWeights
from worker.core.types import Candidate, ChannelHit
from worker.errors import InvalidRequest

Level = Literal["request", "index", "default"]
Method = FusionMethod
METHODS: tuple[Method, ...] = ("rrf", "linear")
MINMAX_EPSILON = 1e-6  # a channel whose scores span less than this scores each hit 1 (as ES)
CHANNELS: tuple[Channel, ...] = ("bm25", "knn")


@dataclass(frozen=True, slots=True)
class Fusion:
    """How two ranked lists become one: the method, a weight per channel and the rank
    constant (read by ``rrf`` only)."""

    weights: Mapping[Channel, float] = field(default_factory=lambda: {"bm25": 1.0, "knn": 1.0})
    rank_constant: int = RRF_K
    method: Method = "rrf"

    def weight(self, channel: Channel) -> float:
        """A channel's weight; a channel the weights do not name counts 1."""
        return float(self.weights.get(channel, 1.0))

    def as_dict(self) -> dict[str, object]:
        """The settings as a trace or an index's metadata shows them."""
        return {
            "method": self.method,
            "weights": dict(self.weights),
            "rank_constant": self.rank_constant,
        }

    def fused_channels(self, wanted: Sequence[Channel]) -> tuple[Channel, ...]:
        """The channels of ``wanted`` a search queries and fuses: those weighted above 0.
        A mode of one channel keeps it whatever its weight (weights weigh channels against
        each other; ``fts`` is BM25 whatever ``bm25``'s weight is). Raises InvalidRequest
        when every channel of ``wanted`` is weighted 0.

        >>> Fusion({"bm25": 1.0, "knn": 0.0}).fused_channels(("bm25", "knn"))
        ('bm25',)
        >>> Fusion({"bm25": 0.0, "knn": 1.0}).fused_channels(("bm25",))
        ('bm25',)
        """
        if len(wanted) < 2:
            return tuple(wanted)
        kept = tuple(channel for channel in wanted if self.weight(channel) > 0.0)
        if not kept:
            raise InvalidRequest(
                "fusion.weights", "every channel is weighted 0 here: nothing is left to fuse"
            )
        return kept

    def over(self, channels: Sequence[Channel]) -> Fusion:
        """The fusion of ``channels`` alone: one channel is fused at weight 1, so a hybrid
        search with every other channel weighted 0 ranks and scores as that channel's mode.

        >>> Fusion({"bm25": 2.0, "knn": 0.0}, 20, "linear").over(("bm25",)).as_dict()
        {'method': 'linear', 'weights': {'bm25': 1.0}, 'rank_constant': 20}
        """
        if len(channels) == 1:
            return Fusion({channels[0]: 1.0}, self.rank_constant, self.method)
        return Fusion({c: self.weight(c) for c in channels}, self.rank_constant, self.method)


@dataclass(frozen=True, slots=True)
class FusionOverride:
    """Settings given at one level (a request or an index); ``None`` defers to the next."""

    weights: Mapping[Channel, float] | None = None
    rank_constant: int | None = None
    method: Method | None = None

    @classmethod
    def from_spec(cls, spec: FusionSpec | None) -> FusionOverride | None:
        """A request's (or an index's) ``fusion``; ``None`` when it sets nothing.

        >>> FusionOverride.from_spec(FusionSpec.model_validate({"weights": {"knn": 0.5}}))
        FusionOverride(weights={'knn': 0.5}, rank_constant=None, method=None)
        """
        if spec is None:
            return None
        return cls(weights_of(spec.weights) or None, spec.rank_constant, spec.method)


def weights_of(weights: FusionWeights | None) -> dict[Channel, float]:
    """The weights a ``fusion.weights`` object sets (those left out or null are not there).

    >>> weights_of(FusionWeights(knn=0.5))
    {'knn': 0.5}
    """
    if weights is None:
        return {}
    given = {channel: getattr(weights, channel) for channel in CHANNELS}
    return {channel: float(w) for channel, w in given.items() if w is not None}


def fusion_levels(
    request: FusionOverride | None, index: FusionOverride | None
) -> dict[str, object]:
    """Which level each setting of :func:`resolve_fusion` came from, for the trace.

    >>> fusion_levels(FusionOverride({"bm25": 2.0}), FusionOverride({"knn": 0.4}, 20, "linear"))
    {'method': 'index', 'weights': {'bm25': 'request', 'knn': 'index'}, 'rank_constant': 'index'}
    """

    levels: tuple[tuple[Level, FusionOverride | None], ...] = (
        ("request", request),
        ("index", index),
    )

    def level(setting: Channel | Literal["rank_constant", "method"]) -> Level:
        """Where ``setting`` (a channel: its weight) came from."""
        for name, override in levels:
            if override is None:
                continue
            if setting == "rank_constant":
                value: object = override.rank_constant
            elif setting == "method":
                value = override.method
            else:
                value = (override.weights or {}).get(setting)
            if value is not None:
                return name
        return "default"

    return {
        "method": level("method"),
        "weights": {c: level(c) for c in CHANNELS},
        "rank_constant": level("rank_constant"),
    }


def resolve_fusion(default: Fusion, *overrides: FusionOverride | None) -> Fusion:
    """The request's settings over the index's over the defaults, field by field:
    ``overrides`` come most specific first; a weight named at a level wins over the same
    channel's weight further down.

    >>> default = Fusion({"bm25": 1.0, "knn": 1.0}, 60)
    >>> index = FusionOverride({"knn": 0.4}, 20, "linear")
    >>> request = FusionOverride({"bm25": 2.0})
    >>> resolve_fusion(default, request, index).as_dict()
    {'method': 'linear', 'weights': {'bm25': 2.0, 'knn': 0.4}, 'rank_constant': 20}
    >>> resolve_fusion(default, FusionOverride(method="rrf"), index).method
    'rrf'
    >>> resolve_fusion(default, None, None) == default
    True
    """
    weights: dict[Channel, float] = dict(default.weights)
    rank_constant = default.rank_constant
    method = default.method
    for level in reversed([o for o in overrides if o is not None]):
        weights.update(level.weights or {})
        if level.rank_constant is not None:
            rank_constant = level.rank_constant
        if level.method is not None:
            method = level.method
    return Fusion(weights, rank_constant, method)


def fuse(
    channel_hits: Mapping[Channel, Sequence[ChannelHit]],
    limit: int,
    fusion: Fusion | None = None,
) -> list[Candidate]:
    """Fuse each channel's admitted hits by ``fusion.method``; keep the first ``limit``.

    A candidate's ``rrf_score`` and ``rrf_rank`` (names the API contract keeps) hold the
    fused score and place whatever the method: for ``linear`` the linear score.

    >>> from worker.core.types import Document
    >>> a, b = Document("a", "x"), Document("b", "y")
    >>> hits = {"bm25": [ChannelHit(a, 9.0), ChannelHit(b, 1.0)], "knn": [ChannelHit(b, 0.9)]}
    >>> [c.document.id for c in fuse(hits, 2, Fusion({"knn": 2.0}, method="linear"))]
    ['b', 'a']
    >>> [c.document.id for c in fuse(hits, 2, Fusion({"knn": 0.5}, method="linear"))]
    ['a', 'b']
    """
    fusion = fusion or Fusion()
    if fusion.method == "linear":
        return linear_fuse(channel_hits, limit, fusion)
    return rrf_fuse(channel_hits, limit, fusion)


def rrf_fuse(
    channel_hits: Mapping[Channel, Sequence[ChannelHit]],
    limit: int,
    fusion: Fusion | None = None,
) -> list[Candidate]:
    """Weighted RRF of each channel's admitted hits; keep the first ``limit``.

    A document's rank in a channel is its 1-based place in that channel's list; a
    document listed twice keeps its best (first) rank. ``score = Σ w / (k + rank)``.
    Ties break on the best rank in a weighted channel, then on the id, so equal input
    gives equal order.

    >>> from worker.core.types import Document
    >>> a, b = Document("a", "x"), Document("b", "y")
    >>> hits = {"bm25": [ChannelHit(a, 2.0), ChannelHit(b, 1.0)], "knn": [ChannelHit(b, 0.9)]}
    >>> [c.document.id for c in rrf_fuse(hits, limit=2)]
    ['b', 'a']
    >>> [c.document.id for c in rrf_fuse(hits, limit=2, fusion=Fusion({"knn": 0.0}))]
    ['a', 'b']
    >>> round(rrf_fuse(hits, 1, Fusion({"bm25": 1.0, "knn": 0.5}, 10))[0].rrf_score, 4)
    0.1288
    """
    fusion = fusion or Fusion()
    fused = _collect(channel_hits, fusion)
    # each channel's weight read once, not once per candidate: the same terms, in the same order
    weights = {channel: fusion.weight(channel) for channel in channel_hits}
    k = fusion.rank_constant
    for candidate in fused.values():
        candidate.rrf_score = math.fsum(
            [weights[channel] / (k + rank) for channel, rank in candidate.channel_ranks.items()]
        )
    return _ordered(fused, limit)


def linear_fuse(
    channel_hits: Mapping[Channel, Sequence[ChannelHit]],
    limit: int,
    fusion: Fusion | None = None,
) -> list[Candidate]:
    """Linear fusion: ``score = Σ w · minmax(score)`` over the channels that list the
    document (one that does not adds 0); keep the first ``limit``.

    Each weighted channel's scores (higher is better on every backend: FTS5's ``bm25()``
    is negated, kNN is cosine) are rescaled over the list it returned, its best hit to 1
    and its last to 0; a channel whose scores are all equal (one hit, say) scores each 1,
    as Elasticsearch's ``minmax`` normalizer does. Ties as :func:`rrf_fuse`'s.

    >>> from worker.core.types import Document
    >>> a, b, c = Document("a", ""), Document("b", ""), Document("c", "")
    >>> hits = {"bm25": [ChannelHit(a, 12.0), ChannelHit(b, 4.0), ChannelHit(c, 2.0)],
    ...         "knn": [ChannelHit(c, 0.8), ChannelHit(b, 0.6), ChannelHit(a, 0.3)]}
    >>> [(x.document.id, round(x.rrf_score, 6)) for x in linear_fuse(hits, 3)]
    [('a', 1.0), ('c', 1.0), ('b', 0.8)]
    >>> [x.document.id for x in linear_fuse(hits, 3, Fusion({"bm25": 0.0}))]
    ['c', 'b', 'a']
    >>> linear_fuse({"knn": [ChannelHit(a, 0.5), ChannelHit(b, 0.5)]}, 2)[1].rrf_score
    1.0
    """
    fusion = fusion or Fusion()
    fused = _collect(channel_hits, fusion)
    bounds = {
        channel: (min(scores), max(scores))
        for channel in channel_hits
        if (
            scores := [
                c.channel_scores[channel] for c in fused.values() if channel in c.channel_scores
            ]
        )
    }

    def normalised(channel: Channel, score: float) -> float:
        low, high = bounds[channel]
        return 1.0 if high - low < MINMAX_EPSILON else (score - low) / (high - low)

    for candidate in fused.values():
        candidate.rrf_score = math.fsum(
            fusion.weight(channel) * normalised(channel, score)
            for channel, score in candidate.channel_scores.items()
        )
    return _ordered(fused, limit)


def _collect(
    channel_hits: Mapping[Channel, Sequence[ChannelHit]], fusion: Fusion
) -> dict[str, Candidate]:
    """Each document of a weighted channel once, with its first rank and score in each
    channel that lists it (a repeat within one channel keeps its best place)."""
    fused: dict[str, Candidate] = {}
    for channel, hits in channel_hits.items():
        if fusion.weight(channel) <= 0.0:
            continue  # a channel weighted 0 is not fused at all
        for rank, hit in enumerate(hits, start=1):
            candidate = fused.get(hit.document.id)
            if candidate is None:  # built for a new document only (setdefault built one a hit)
                candidate = fused[hit.document.id] = Candidate(hit.document, 0, 0.0, {}, {})
            elif channel in candidate.channel_ranks:
                continue
            candidate.channel_ranks[channel] = rank
            candidate.channel_scores[channel] = hit.score
    return fused


def _ordered(fused: Mapping[str, Candidate], limit: int) -> list[Candidate]:
    """Best fused score first; ties on the best rank in a weighted channel, then the id."""
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

"""Tuning the fusion on the user's own judgments, with k-fold cross-validation (issue 15).

Each judged query's BM25 and kNN rankings, with their scores, are fetched once; every point
of a grid (the fusion method, the weight of each channel, RRF's rank constant, the
candidate window) is then fused here with :func:`~worker.core.fusion.fuse`, the function
the worker fuses with, truncated as the worker truncates when it reranks: each channel cut
at ``channel_window(coarse)`` and the fused list at ``coarse = max(10, window)``. So a
point scores what the service would fuse with those settings, as far as the fetched
rankings reach (a channel fetched 100 deep stands in for a deeper window; for ``linear``
the min-max bounds are then those of the first 100; :class:`TuneReport` says how deep it
was).

The objective is nDCG@10 of the fused list (no model is called); ties go to the higher
candidate recall at the window, then to the point closer to the defaults, and a channel
alone wins when the best fusion beats it by less than one standard error. A point is
chosen on k-1 folds and scored on the held-out one, so every figure reported is held out;
the values to apply are then chosen on all queries. Nothing here does I/O.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ir_measures
from ir_measures import nDCG

from worker.constants import RRF_K
from worker.contract import Channel
from worker.core.fusion import Fusion, Method, weights_of
from worker.core.fusion import fuse as fuse_hits
from worker.core.query import channel_window, coarse_limit
from worker.core.types import ChannelHit, Document
from worker.settings import Settings

CHANNELS: tuple[Channel, ...] = ("bm25", "knn")
LIMIT = 10  # the objective is nDCG@10
NDCG = nDCG @ LIMIT
DEFAULT_WINDOW: int = Settings.model_fields["rerank_candidate_limit"].default
DEFAULT_METHOD: Method = Settings.model_fields["fusion_method"].default
# One ranked document: its id, or its id and its channel score (``linear`` needs the score).
Ranked = str | tuple[str, float]
Rankings = Mapping[Channel, Mapping[str, Sequence[Ranked]]]  # channel -> query id -> ranked


@dataclass(frozen=True, slots=True)
class Point:
    """One setting of the fusion: the weights, the rank constant, the candidate window and
    the method (``linear`` points keep the default rank constant: it plays no part)."""

    bm25: float = 1.0
    knn: float = 1.0
    rank_constant: int = RRF_K
    window: int = DEFAULT_WINDOW
    method: Method = "rrf"

    @classmethod
    def of_ratio(cls, ratio: float, rank_constant: int, window: int) -> Point:
        """The point whose kNN weight is ``ratio`` times BM25's, the larger weight 1
        (``0`` is BM25 alone, ``inf`` kNN alone).

        >>> Point.of_ratio(0.5, 60, 30), Point.of_ratio(math.inf, 60, 30).knn
        (Point(bm25=1.0, knn=0.5, rank_constant=60, window=30, method='rrf'), 1.0)
        """
        if ratio <= 1.0:
            return cls(1.0, ratio, rank_constant, window)
        return cls(1.0 / ratio, 1.0, rank_constant, window)

    @classmethod
    def linear(cls, knn_share: float, window: int) -> Point:
        """The ``linear`` point weighting kNN ``knn_share`` and BM25 the rest.

        >>> Point.linear(0.4, 30)
        Point(bm25=0.6, knn=0.4, rank_constant=60, window=30, method='linear')
        """
        return cls(round(1.0 - knn_share, 6), knn_share, RRF_K, window, "linear")

    @classmethod
    def of_deployment(cls, settings: Settings) -> Point:
        """The point a worker on ``settings`` fuses an index with none of its own at: its
        ``SIFT_FUSION_*`` (a weight they leave out counts 1) and ``SIFT_RERANK_CANDIDATE_LIMIT``.

        >>> Point.of_deployment(Settings(fusion_weights={"knn": 0.5}, fusion_rank_constant=20))
        Point(bm25=1.0, knn=0.5, rank_constant=20, window=30, method='rrf')
        """
        weights = {"bm25": 1.0, "knn": 1.0, **weights_of(settings.fusion_weights)}
        return cls(
            weights["bm25"],
            weights["knn"],
            settings.fusion_rank_constant,
            settings.rerank_candidate_limit,
            settings.fusion_method,
        )

    @classmethod
    def of_settings(cls, settings: Mapping[str, Any] | None, default: Point | None = None) -> Point:
        """The point an index's stored settings (``GET /v1/indexes/{index}``'s ``settings``)
        stand for, each one left unset (``null``) at ``default``'s, as the worker resolves it:
        pass the deployment's (:meth:`of_deployment`); none is this code's defaults.

        >>> Point.of_settings({"fusion": {"weights": {"knn": 0.5}}, "candidate_limit": 20})
        Point(bm25=1.0, knn=0.5, rank_constant=60, window=20, method='rrf')
        >>> Point.of_settings(None) == Point()
        True
        >>> Point.of_settings({"candidate_limit": 20}, Point(knn=0.5, rank_constant=20))
        Point(bm25=1.0, knn=0.5, rank_constant=20, window=20, method='rrf')
        """
        settings = settings or {}
        fusion = settings.get("fusion") or {}
        weights = fusion.get("weights") or {}
        default = default or cls()

        def given(value: Any, default: Any) -> Any:
            return default if value is None else value

        return cls(
            float(given(weights.get("bm25"), default.bm25)),
            float(given(weights.get("knn"), default.knn)),
            int(given(fusion.get("rank_constant"), default.rank_constant)),
            int(given(settings.get("candidate_limit"), default.window)),
            given(fusion.get("method"), default.method),
        )

    @property
    def method_name(self) -> str:
        """The method as the reports name it: ``RRF`` or ``linear fusion``."""
        return "RRF" if self.method == "rrf" else "linear fusion"

    @property
    def single(self) -> Channel | None:
        """The one channel this point fuses, when the other is weighted 0."""
        return "bm25" if self.knn == 0 else "knn" if self.bm25 == 0 else None

    def fusion(self) -> Fusion:
        return Fusion({"bm25": self.bm25, "knn": self.knn}, self.rank_constant, self.method)

    def distance(self) -> float:
        """How far from the defaults (log scale), for the last tie-break; a single channel
        counts as far as a ratio of 1,024, the other method as a factor of 2.

        >>> Point().distance(), Point(1.0, 0.5, 30, 30).distance()
        (0.0, 2.0)
        >>> Point.linear(0.5, 30).distance()
        1.0
        """
        ratio = self.knn / self.bm25 if self.bm25 else math.inf
        weights = abs(math.log2(ratio)) if 0 < ratio < math.inf else 10.0
        return (
            weights
            + (1.0 if self.method != DEFAULT_METHOD else 0.0)
            + abs(math.log2(self.rank_constant / RRF_K))
            + abs(math.log2(self.window / DEFAULT_WINDOW))
        )

    def settings(self) -> dict[str, Any]:
        """The index settings this point stands for (the body ``PATCH /v1/indexes/{index}``
        takes); a ``linear`` point clears the rank constant it does not read.

        >>> Point.linear(0.5, 20).settings()["fusion"]
        {'method': 'linear', 'weights': {'bm25': 0.5, 'knn': 0.5}, 'rank_constant': None}
        """
        return {
            "fusion": {
                "method": self.method,
                "weights": {"bm25": self.bm25, "knn": self.knn},
                "rank_constant": self.rank_constant if self.method == "rrf" else None,
            },
            "candidate_limit": self.window,
        }


DEFAULT = Point()


@dataclass(frozen=True)
class Grid:
    """The points searched: for ``rrf``, every kNN/BM25 weight ratio (0 and ``inf`` are one
    channel alone) at every rank constant and window; a single channel's order does not
    depend on the rank constant, so it is taken at the default one only. For ``linear``,
    every kNN share of the weights strictly between 0 and 1 at every window (the shares 0
    and 1 are the channels alone again, and the rank constant plays no part)."""

    ratios: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 0.7, 1.0, 1.4, 2.0, 4.0, 8.0, math.inf)
    rank_constants: tuple[int, ...] = (1, 3, 5, 10, 20, 40, 60, 100)
    windows: tuple[int, ...] = (10, 20, 30, 50, 100)
    knn_shares: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    methods: tuple[Method, ...] = ("rrf", "linear")

    def points(self) -> list[Point]:
        """
        >>> len(Grid(ratios=(0.0, 1.0), rank_constants=(10, 60), windows=(30,)).points())
        12
        >>> len(Grid((0.0, 1.0), (10, 60), (30,), methods=("rrf",)).points())
        3
        """
        points = []
        for window in self.windows:
            for ratio in self.ratios if "rrf" in self.methods else ():
                single = ratio in (0.0, math.inf)
                for k in (RRF_K,) if single else self.rank_constants:
                    points.append(Point.of_ratio(ratio, k, window))
            for share in self.knn_shares if "linear" in self.methods else ():
                points.append(Point.linear(share, window))
        if DEFAULT not in points:
            points.append(DEFAULT)  # the baseline is always scored
        return points


@dataclass(frozen=True)
class Scores:
    """Per query: nDCG@10 of the fused list and its candidate recall at the window."""

    ndcg: dict[str, float]
    recall: dict[str, float]

    def mean(self, queries: Sequence[str]) -> Measured:
        return Measured(
            math.fsum(self.ndcg[q] for q in queries) / len(queries),
            math.fsum(self.recall[q] for q in queries) / len(queries),
        )


@dataclass(frozen=True)
class Measured:
    ndcg: float
    recall: float


def fuse(rankings: Mapping[Channel, Sequence[Ranked]], point: Point) -> list[str]:
    """The fused list the worker would rerank at ``point``: each channel cut at its window,
    fused with :func:`~worker.core.fusion.fuse`, cut at the coarse limit.

    >>> fuse({"bm25": ["a", "b"], "knn": ["b", "c"]}, Point(window=10))
    ['b', 'a', 'c']
    >>> fuse({"bm25": ["a", "b"], "knn": ["b", "c"]}, Point(1.0, 0.0, 60, 10))
    ['a', 'b']
    >>> scored = {"bm25": [("a", 20.0), ("b", 6.0), ("c", 5.0), ("d", 4.0)],
    ...           "knn": [("c", 0.8), ("b", 0.79), ("a", 0.7), ("d", 0.3)]}
    >>> fuse(scored, Point.linear(0.5, 10)), fuse(scored, Point(window=10))
    (['a', 'b', 'c', 'd'], ['a', 'c', 'b', 'd'])
    """
    hits = {c: _hits(listed, point.method) for c, listed in rankings.items()}
    return _fused(hits, point, _coarse(point))


def _hits(listed: Sequence[Ranked], method: Method) -> list[ChannelHit]:
    """A channel's ranking as the hits the worker fuses; ``linear`` needs every score."""
    hits = []
    for ranked in listed:
        if isinstance(ranked, str):
            if method == "linear":
                raise ValueError("linear fusion needs the channel scores, not only the ranks")
            ranked = (ranked, 0.0)
        hits.append(ChannelHit(Document(ranked[0], ""), float(ranked[1])))
    return hits


def _coarse(point: Point) -> int:
    return coarse_limit(LIMIT, point.window, reranking=True)


def _fused(hits: Mapping[Channel, Sequence[ChannelHit]], point: Point, limit: int) -> list[str]:
    depth = channel_window(_coarse(point))
    cut = {channel: listed[:depth] for channel, listed in hits.items()}
    return [c.document.id for c in fuse_hits(cut, limit, point.fusion())]


def score_grid(
    rankings: Rankings,
    qrels: Mapping[str, Mapping[str, int]],
    points: Sequence[Point],
    progress: Callable[[int], None] | None = None,
) -> dict[Point, Scores]:
    """Each point's per-query scores over the judged queries (those with qrels); a query a
    channel did not rank counts as an empty list there. ``progress(1)`` after each point.

    Points whose channel windows reach past every fetched ranking fuse the same lists:
    they are fused once, at the largest coarse limit, and each keeps its own prefix (the
    same list :func:`fuse` gives, since the fusion sorts, then cuts).
    """
    queries = sorted(qrels)
    evaluator = ir_measures.evaluator(
        [NDCG], [ir_measures.Qrel(q, d, r) for q in queries for d, r in qrels[q].items()]
    )
    methods = {point.method for point in points}
    hits = {
        method: {
            q: {c: _hits(rankings.get(c, {}).get(q, []), method) for c in CHANNELS} for q in queries
        }
        for method in methods
    }
    fetched = max(
        (len(rankings.get(c, {}).get(q, [])) for q in queries for c in CHANNELS), default=0
    )

    def shared(point: Point) -> tuple[str, float, float, int, int]:
        depth = min(channel_window(_coarse(point)), fetched)
        return (point.method, point.bm25, point.knn, point.rank_constant, depth)

    groups: dict[tuple[str, float, float, int, int], list[Point]] = {}
    for point in points:
        groups.setdefault(shared(point), []).append(point)
    scored: dict[Point, Scores] = {}
    for group in groups.values():
        longest = max(_coarse(p) for p in group)
        fused = {q: _fused(hits[group[0].method][q], group[0], longest) for q in queries}
        for point in group:
            scored[point] = _scores(evaluator, fused, qrels, point)
            if progress is not None:
                progress(1)
    return scored


def _scores(
    evaluator: Any,
    fused: Mapping[str, list[str]],
    qrels: Mapping[str, Mapping[str, int]],
    point: Point,
) -> Scores:
    run = [
        ir_measures.ScoredDoc(q, doc, float(LIMIT - i))
        for q, docs in fused.items()
        for i, doc in enumerate(docs[:LIMIT])
    ]
    ndcg = dict.fromkeys(fused, 0.0)
    ndcg.update({m.query_id: float(m.value) for m in evaluator.iter_calc(run)})
    recall = {
        q: len(set(docs[: point.window]) & qrels[q].keys()) / len(qrels[q])
        for q, docs in fused.items()
    }
    return Scores(ndcg, recall)


def split_folds(queries: Sequence[str], folds: int, seed: int) -> list[list[str]]:
    """Deal the queries into ``folds`` folds after a shuffle seeded by ``seed``: each query
    in exactly one fold, the sizes within one, the same split for the same input.

    >>> split_folds(["a", "b", "c", "d", "e"], 2, seed=0)
    [['c', 'a', 'd'], ['b', 'e']]
    """
    if not 2 <= folds <= len(queries):
        raise ValueError(f"folds: need 2 to {len(queries)} (the judged queries), got {folds}")
    order = sorted(queries)
    random.Random(seed).shuffle(order)
    return [order[i::folds] for i in range(folds)]


def choose(scored: Mapping[Point, Scores], queries: Sequence[str]) -> Point:
    """The point with the best mean nDCG@10 over ``queries`` (then the higher candidate
    recall, then the one closer to the defaults), unless a channel alone is within one
    standard error of it: then that channel.

    The one-standard-error rule (Breiman et al., 1984) guards the failure this tuning is
    for: with one channel useless, a small weight on it can win on the queries tuned on by
    chance and lose on the others. The error is that of the per-query differences.
    """

    def key(point: Point) -> tuple[float, float, float]:
        measured = scored[point].mean(queries)
        return (measured.ndcg, measured.recall, -point.distance())

    best = max(scored, key=key)
    singles = [point for point in scored if point.single]
    if best.single or not singles:
        return best
    single = max(singles, key=key)
    diffs = [scored[best].ndcg[q] - scored[single].ndcg[q] for q in queries]
    return single if statistics.fmean(diffs) <= _standard_error(diffs) else best


def _standard_error(values: Sequence[float]) -> float:
    """
    >>> round(_standard_error([0.0, 0.5, 0.5, 1.0]), 4)
    0.2041
    """
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


@dataclass(frozen=True)
class Fold:
    """One fold held out: the point chosen on the others, and each contender's score on it."""

    queries: int
    chosen: Point
    tuned: Measured
    default: Measured
    bm25: Measured
    knn: Measured


@dataclass(frozen=True)
class TuneReport:
    folds: list[Fold]
    held_out: dict[str, Measured]  # tuned, default, bm25, knn: every query held out once
    chosen: Point  # chosen on all queries: what --apply stores
    in_sample: Measured  # the chosen point on the queries it was chosen on (optimistic)
    points: int
    depth: dict[str, int] = field(default_factory=dict)  # the most docs a channel ranked
    current: Point = DEFAULT  # the index's settings before --apply (held_out["current"])
    default: Point = DEFAULT  # the deployment's fusion, what an index with none uses

    @property
    def best_single(self) -> tuple[Channel, float]:
        """The better channel alone and its nDCG@10 (a channel alone is not tuned: its
        held-out figure is its figure)."""
        channel = max(CHANNELS, key=lambda c: self.held_out[c].ndcg)
        return channel, self.held_out[channel].ndcg

    def folds_below_best_single(self) -> list[int]:
        """The (1-based) folds where the tuned fusion scored below the better channel."""
        return [
            n
            for n, fold in enumerate(self.folds, start=1)
            if fold.tuned.ndcg < max(fold.bm25.ndcg, fold.knn.ndcg)
        ]

    def refusal(self) -> str | None:
        """Why the chosen settings must not be applied, or None: the held-out nDCG@10 of the
        tuned fusion is below the better channel's alone, or below that of the settings the
        index has now (the defaults when it has none of its own), scored on the same
        queries: applying would replace them with settings the tuning itself measured as
        worse."""
        channel, best = self.best_single
        tuned = self.held_out["tuned"].ndcg
        if tuned < best:
            return (
                f"held-out nDCG@10 of the tuned fusion ({tuned:.4f}) is below {channel} alone "
                f"({best:.4f}): the settings are not applied"
            )
        current = self.held_out.get("current", self.held_out["default"]).ndcg
        if tuned < current:
            what = (
                f"the default {self.default.method_name} the index uses now"
                if self.current == self.default
                else "the index's current settings"
            )
            return (
                f"held-out nDCG@10 of the tuned fusion ({tuned:.4f}) is below {what} "
                f"({current:.4f}): the settings are not applied, the index keeps its own"
            )
        return None

    def as_dict(self) -> dict[str, Any]:
        def point(p: Point) -> dict[str, Any]:
            return p.settings()

        def measured(m: Measured) -> dict[str, float]:
            return {"ndcg@10": m.ndcg, "candidate_recall@window": m.recall}

        return {
            "objective": "nDCG@10 of the fused list (no rerank); ties: candidate recall@window",
            "points": self.points,
            "depth": self.depth,
            "folds": [
                {
                    "queries": f.queries,
                    "chosen": point(f.chosen),
                    **{
                        name: measured(getattr(f, name))
                        for name in ("tuned", "default", "bm25", "knn")
                    },
                }
                for f in self.folds
            ],
            "held_out": {name: measured(m) for name, m in self.held_out.items()},
            "folds_below_best_single": self.folds_below_best_single(),
            "chosen": point(self.chosen),
            "current": point(self.current),
            "default": point(self.default),
            "in_sample": measured(self.in_sample),
            "refusal": self.refusal(),
        }


def tune(
    rankings: Rankings,
    qrels: Mapping[str, Mapping[str, int]],
    grid: Grid | None = None,
    folds: int = 5,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    current: Point = DEFAULT,
    default: Point = DEFAULT,
) -> TuneReport:
    """Tune the fusion on ``qrels`` (only queries with a relevant document count) by k-fold
    cross-validation over ``grid``; ``progress(1)`` after each point scored. ``default`` is
    the deployment's fusion (:meth:`Point.of_deployment`), ``current`` the index's own over it.

    Single channels are scored at the default window, the window their recall is read at.
    """
    queries = sorted(q for q, docs in qrels.items() if docs)
    split = split_folds(queries, folds, seed)
    points = (grid or Grid()).points()
    scored = score_grid(rankings, {q: qrels[q] for q in queries}, points, progress)
    contenders = {
        "default": default,
        "bm25": Point(1.0, 0.0, RRF_K, DEFAULT_WINDOW),
        "knn": Point(0.0, 1.0, RRF_K, DEFAULT_WINDOW),
        "current": current,
    }
    missing = [p for p in contenders.values() if p not in scored]
    scored.update(score_grid(rankings, {q: qrels[q] for q in queries}, missing))

    results = []
    held_out_point: dict[str, Point] = {}
    for held in split:
        held_set = set(held)
        training = [q for q in queries if q not in held_set]
        chosen = choose(scored, training)
        held_out_point.update(dict.fromkeys(held, chosen))
        results.append(
            Fold(
                queries=len(held),
                chosen=chosen,
                tuned=scored[chosen].mean(held),
                default=scored[default].mean(held),
                bm25=scored[contenders["bm25"]].mean(held),
                knn=scored[contenders["knn"]].mean(held),
            )
        )
    tuned = Scores(
        {q: scored[held_out_point[q]].ndcg[q] for q in queries},
        {q: scored[held_out_point[q]].recall[q] for q in queries},
    )
    final = choose(scored, queries)
    return TuneReport(
        folds=results,
        held_out={
            "tuned": tuned.mean(queries),
            **{name: scored[p].mean(queries) for name, p in contenders.items()},
        },
        chosen=final,
        in_sample=scored[final].mean(queries),
        points=len(points),
        depth={
            c: max((len(rankings.get(c, {}).get(q, [])) for q in queries), default=0)
            for c in CHANNELS
        },
        current=current,
        default=default,
    )

"""The ``Recorder`` port in Prometheus metrics: what the pipeline reports of each search, its
retrieval and its rerank."""

from __future__ import annotations

from worker.constants import LANE_STANDARD, LANES
from worker.observability.metrics._recording import child, closed, never_raises
from worker.observability.metrics._rerank import (
    ATTEMPT_RESULTS,
    RERANK_ATTEMPTS,
    RERANK_COST,
    RERANK_DURATION,
    RERANK_DURATION_OUTCOMES,
    RERANK_OUTCOME_VALUES,
    RERANK_OUTCOMES,
    RERANK_TOKENS,
    RERANK_UNPRICED,
    RERANK_UNREAD,
    RERANK_UNREAD_INPUT,
    TOKEN_TYPES,
)
from worker.observability.metrics._search import (
    RETRIEVAL_CHANNELS,
    RETRIEVAL_DURATION,
    RETRIEVAL_HITS,
    SEARCH_DURATION,
    SEARCH_MODES,
    SEARCH_OUTCOMES,
)


class PrometheusRecorder:
    """The ``Recorder`` port in Prometheus metrics. ``lane`` labels the attempts, tokens, cost
    and the rerank duration (an economy rerank waits minutes to hours on the provider's batch).

    >>> build_pipeline(settings, recorder=PrometheusRecorder())  # doctest: +SKIP
    """

    def __init__(self, lane: str = LANE_STANDARD) -> None:
        self.lane = closed(lane, LANES, "lane")

    @never_raises
    def retrieval(self, backend: str, channel: str, seconds: float) -> None:
        channel = closed(channel, RETRIEVAL_CHANNELS, "channel")
        child(RETRIEVAL_DURATION, backend, channel).observe(seconds)

    @never_raises
    def retrieval_hits(self, backend: str, channel: str, hits: int) -> None:
        channel = closed(channel, RETRIEVAL_CHANNELS, "channel")
        child(RETRIEVAL_HITS, backend, channel).observe(hits)

    @never_raises
    def rerank_attempt(self, model: str, result: str) -> None:
        child(RERANK_ATTEMPTS, model, closed(result, ATTEMPT_RESULTS, "result"), self.lane).inc()

    @never_raises
    def rerank_usage(self, model: str, usage: dict[str, int], cost_usd: float | None) -> None:
        for token_type in TOKEN_TYPES:
            tokens = usage.get(token_type, 0)
            if tokens:
                child(RERANK_TOKENS, model, token_type, self.lane).inc(tokens)
        if cost_usd:  # None (no price) adds nothing: rerank_unpriced counted those calls
            child(RERANK_COST, model, self.lane).inc(cost_usd)

    @never_raises
    def rerank_done(self, model: str, outcome: str, seconds: float) -> None:
        outcome = closed(outcome, RERANK_DURATION_OUTCOMES, "outcome")
        child(RERANK_DURATION, model, outcome, self.lane).observe(seconds)

    @never_raises
    def rerank_unpriced(self, model: str) -> None:
        RERANK_UNPRICED.labels(model, self.lane).inc()

    @never_raises
    def rerank_unread(self, model: str, input_tokens: int) -> None:
        RERANK_UNREAD.labels(model, self.lane).inc()
        RERANK_UNREAD_INPUT.labels(model, self.lane).inc(input_tokens)

    @never_raises
    def rerank_outcome(self, policy: str, outcome: str) -> None:
        child(RERANK_OUTCOMES, policy, closed(outcome, RERANK_OUTCOME_VALUES, "outcome")).inc()

    @never_raises
    def search_done(self, mode: str, outcome: str, seconds: float) -> None:
        mode = closed(mode, SEARCH_MODES, "mode")
        outcome = closed(outcome, SEARCH_OUTCOMES, "outcome")
        child(SEARCH_DURATION, mode, outcome).observe(seconds)

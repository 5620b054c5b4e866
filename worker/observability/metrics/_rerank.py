"""What the rerank measures: each model call's class, tokens and cost, the whole rerank's time
and outcome, the calls in flight, and the waits the rate limits impose (the shared rate budget,
the provider's 429s), by model and lane."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Final

from prometheus_client import Counter, Gauge, Histogram

from worker.constants import (
    LANE_STANDARD,
    LANES,
    METRIC_PROVIDER_429,
    METRIC_PROVIDER_DELETES,
    METRIC_PROVIDER_DELETES_REFUSED,
    METRIC_RATE_BUDGET_UNSETTLED,
    METRIC_RATE_BUDGET_WAIT,
    METRIC_RERANK_ATTEMPTS,
    METRIC_RERANK_COST,
    METRIC_RERANK_DURATION,
    METRIC_RERANK_IN_FLIGHT,
    METRIC_RERANK_OUTCOMES,
    METRIC_RERANK_TOKENS,
    METRIC_RERANK_UNPRICED,
    METRIC_RERANK_UNREAD,
    METRIC_RERANK_UNREAD_INPUT,
)
from worker.observability.metrics._recording import child, closed, never_raises

if TYPE_CHECKING:
    from worker.core.ports import Reranker
    from worker.core.types import RerankPrompt, RerankReply

# --- closed label sets ---
ATTEMPT_RESULTS: Final = (
    "ok",
    "timeout",
    "http_5xx",
    "rate_limited",
    "connection",
    "http_4xx",
    "malformed",
    "refused",  # the model refused (stop_reason "refusal"): billed, not retried
    "budget_exhausted",  # not sent: the shared rate budget would free it past the deadline
)
RERANK_DURATION_OUTCOMES: Final = (*ATTEMPT_RESULTS, "deadline")  # the last attempt's class
RERANK_OUTCOME_VALUES: Final = (
    "applied",
    "fallback_no_valid_ranks",
    "fallback_error",
    "failed",
    "skipped",
)
TOKEN_TYPES: Final = ("input", "output", "cache_read", "cache_creation")

# --- buckets ---
# A standard-lane rerank takes 0.25-60 s (its deadline is 30 s: one the deadline cut ends a few
# milliseconds past it, read as 30-31 s, not as the 45 s of a bucket (30, 60]; the search's
# own buckets likewise). An economy-lane one is timed
# from the provider batch's submission to its answer: at least a poll (30 s), typically minutes,
# up to the economy deadline (a day); without the long buckets all of it fell in +Inf and every
# percentile of the lane read 60 s.
RERANK_BUCKETS: Final = (
    0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 31.0, 45.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 24 * 3600.0,
)  # fmt: skip
# a call's wait for the shared rate budget: none at all, up to the longest pause (a minute).
# Zero is a bucket of its own: a call sent at once waited exactly 0, and Prometheus's quantile
# of a first bucket reaching 1 ms interpolates from 0 (every call at once read p50 0.5 ms)
BUDGET_WAIT_BUCKETS: Final = (
    0.0, 0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip

# --- the metrics ---
RERANK_DURATION = Histogram(
    METRIC_RERANK_DURATION,
    "Seconds for the whole rerank of one search, every attempt and backoff included; in the "
    "economy lane, from the first provider batch submission to the answer.",
    ["model", "outcome", "lane"],
    buckets=RERANK_BUCKETS,
)
RERANK_TOKENS = Counter(
    METRIC_RERANK_TOKENS,
    "Tokens the provider reported, by disjoint type: their sum is what is billed.",
    ["model", "type", "lane"],
)
RERANK_ATTEMPTS = Counter(
    METRIC_RERANK_ATTEMPTS,
    "Model calls, by the one class each attempt falls in, and lane.",
    ["model", "result", "lane"],
)
RERANK_OUTCOMES = Counter(
    METRIC_RERANK_OUTCOMES,
    "Searches that asked for a rerank, by what became of it.",
    ["policy", "outcome"],
)
RERANK_COST = Counter(
    METRIC_RERANK_COST,
    "Estimated US dollars for rerank calls: the provider's usage times SIFT_PRICES.",
    ["model", "lane"],
)
RERANK_UNPRICED = Counter(
    METRIC_RERANK_UNPRICED,
    "Model calls that reported usage for a model with no price in SIFT_PRICES: their cost is "
    "unknown (null in the job's usage) and missing from the cost counter.",
    ["model", "lane"],
)
RERANK_UNREAD = Counter(
    METRIC_RERANK_UNREAD,
    "Model attempts sent that got no answer read (a timeout, a connection lost after the "
    "request went out): the provider may have finished and billed them, but no usage was "
    "read, so no token or cost counter holds them.",
    ["model", "lane"],
)
RERANK_UNREAD_INPUT = Counter(
    METRIC_RERANK_UNREAD_INPUT,
    "The estimated input tokens of the unread attempts (the rate budget's estimate of their "
    "prompts): what the provider may have billed them for input, at most about this.",
    ["model", "lane"],
)
RERANK_IN_FLIGHT = Gauge(
    METRIC_RERANK_IN_FLIGHT,
    "Model calls waiting for the provider right now.",
    ["model"],
    multiprocess_mode="livesum",
)
# The shared rate budget's metrics (extensions to §9; worker/adapters/rate_budget/).
BUDGET_WAIT = Histogram(
    METRIC_RATE_BUDGET_WAIT,
    "Seconds a model call waited for the shared rate budget before it was sent (0: none), "
    "by model and lane; a call the budget could not serve in time is not observed here but "
    "counted as a budget_exhausted attempt.",
    ["model", "lane"],
    buckets=BUDGET_WAIT_BUCKETS,
)
BUDGET_UNSETTLED = Counter(
    METRIC_RATE_BUDGET_UNSETTLED,
    "Settlements of a model call's reservation with the shared rate budget that Redis "
    "failed (down, or silent, past the client's retries): dropped, never raised over the "
    "call's outcome; the share they would have given back stays taken until the bucket "
    "refills it.",
    ["model", "lane"],
)
PROVIDER_429 = Counter(
    METRIC_PROVIDER_429,
    "HTTP 429 (rate limited) answers of the model provider, by model and lane: each paused "
    "every worker process for its retry-after.",
    ["model", "lane"],
)

# an erased economy batch's provider batches (sift.economy_delete): deleted at the provider
# (or gone there already), or refused (401, 403: the key may not delete it), counted once per
# provider batch however many worker starts ask it again, left there for its 29 days unless
# a start with a fixed key deletes it (then counted deleted) or it is deleted by hand
PROVIDER_DELETE_RESULTS: Final = ("deleted", "refused")
PROVIDER_DELETES = Counter(
    METRIC_PROVIDER_DELETES,
    "An erased batch's provider batches, by result: deleted at the provider (or gone "
    "already), or refused (HTTP 401 or 403; once per provider batch: asked again only "
    "when a worker starts, left at the provider until then).",
    ["result"],
)
# What the provider still holds of erasures because the key was refused, read from Redis at
# each scrape (sift:eco-delete-refused:<batch>): the counter's ``refused`` less ``deleted``
# needs every worker's counts since the refusal, which a worker's restart resets. ``delete``:
# provider batches Sift made; ``candidate``: a create in doubt's, whose read was refused
# (maybe another client's). Both wait for a worker start, which asks each again once.
PROVIDER_REFUSED_KINDS: Final = ("delete", "candidate")
PROVIDER_DELETES_REFUSED = Gauge(
    METRIC_PROVIDER_DELETES_REFUSED,
    "An erased batch's provider batches kept aside because the provider refused the key "
    "(HTTP 401 or 403), still held there until a worker starts and asks again, by kind "
    "(delete: Sift's own; candidate: a create in doubt's, not judged), as last read.",
    ["kind"],
    multiprocess_mode="livemostrecent",
)


@contextlib.contextmanager
def rerank_in_flight(model: str) -> Iterator[None]:
    """Counts one model call in ``sift_rerank_in_flight`` while the block runs."""
    gauge = child(RERANK_IN_FLIGHT, model)
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()


class InFlightReranker:
    """Wraps a ``Reranker`` so each call shows in ``sift_rerank_in_flight``.

    >>> reranker = InFlightReranker(AnthropicReranker("claude-haiku-4-5"))  # doctest: +SKIP
    """

    def __init__(self, inner: Reranker) -> None:
        self.inner = inner
        self.model = inner.model
        self.effort = inner.effort

    def rerank(self, prompt: RerankPrompt, timeout_seconds: float) -> RerankReply:
        with rerank_in_flight(self.model):
            try:
                return self.inner.rerank(prompt, timeout_seconds)
            except Exception as exc:
                # only the model adapter is inside: a rate_limited attempt here is a real 429
                # (AttemptOutcome is a StrEnum; compared by value, this module imports no core)
                if getattr(exc, "outcome", None) == "rate_limited":
                    provider_429(self.model)
                raise


@never_raises
def budget_waited(model: str, lane: str, seconds: float) -> None:
    """A model call of ``lane`` waited ``seconds`` for the shared rate budget (0: none)."""
    child(BUDGET_WAIT, model, closed(lane, LANES, "lane")).observe(max(0.0, seconds))


@never_raises
def budget_unsettled(model: str, lane: str) -> None:
    """A settlement with the shared rate budget of ``lane`` was dropped: Redis failed it."""
    BUDGET_UNSETTLED.labels(model, closed(lane, LANES, "lane")).inc()


@never_raises
def provider_429(model: str, lane: str = LANE_STANDARD) -> None:
    """The model provider answered a call of ``lane`` with HTTP 429."""
    PROVIDER_429.labels(model, closed(lane, LANES, "lane")).inc()


@never_raises
def provider_batch_delete(result: str) -> None:
    """An erased batch's provider batch was ``deleted`` at the provider, or ``refused`` for
    the key (for the first time)."""
    PROVIDER_DELETES.labels(closed(result, PROVIDER_DELETE_RESULTS, "result")).inc()


@never_raises
def provider_deletes_refused(counts: Mapping[str, int] | None) -> None:
    """Set ``sift_provider_batch_deletes_refused`` from the job store's ``counts`` by kind
    (:meth:`~worker.queue.jobstore.JobStore.refused_provider_batches`); None: the store could
    not be read, so NaN, not the last values read (as :func:`job_store_unread`)."""
    for kind in PROVIDER_REFUSED_KINDS:
        value = math.nan if counts is None else counts.get(kind, 0)
        PROVIDER_DELETES_REFUSED.labels(kind).set(value)

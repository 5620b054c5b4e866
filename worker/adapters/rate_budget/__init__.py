"""One rate budget for every worker process: the provider's limits as token buckets in Redis.

Anthropic meters each organisation per model in requests, input tokens and output tokens per
minute, each a bucket that refills continuously, and answers 429 beyond it. Each worker process
throttling on its own cannot keep a cluster under that: they all fill the provider's bucket,
all get 429s, all back off together. Here every process draws on the same three buckets, kept
in one Redis hash per lane and model, through one Lua script (:data:`BUDGET_SCRIPT`) that
refills them by the time elapsed on Redis's own clock (``TIME``, so the processes' clocks do
not matter) and reserves, atomically, one request, the prompt's estimated input tokens and its
``max_tokens``::

    budget = RedisRateBudget(redis, "claude-haiku-4-5", RateLimit(rpm=4000, itpm=400_000))
    grant = budget.reserve(prompt, max_wait=12.0)   # admitted, or how long it would take
    time.sleep(grant.wait); reply = call()           # the reserved send time
    budget.settle(grant, reply.usage)                # give back what was not used

A reservation may take a bucket below zero: the caller then waits until the refill covers it
(the bucket's level is a queue of sends, spaced at exactly the limit's rate). One that would
wait longer than ``max_wait`` (the search's deadline) reserves nothing. A 429 pauses every
process: the pause's end is kept in the same hash and every reservation waits for it.

A batch paces its items on the queue's length (:meth:`RedisRateBudget.backlog`): an item
starts while a call would be sent within a third of its deadline. Each item let start counts
in that reading until it reserves its call or its search ends (``started``, ``ended``): its
own process adds it at once, and tells the others at its next reading or reservation, in
a second hash beside the buckets (``<key>:pending``: each process's pending seconds, dated
on Redis's clock).

The limits come from ``SIFT_RATE_LIMITS``, or are learned from the provider's
``anthropic-ratelimit-*-limit`` response headers (:meth:`RedisRateBudget.learn`; what one
process learns, the script stores for all); with both, the lower one holds. While none is
known, one call at a time goes out, cluster-wide, to learn them (its place a key of its own,
``<key>:learner``), the others waiting for its answer; one that states no limit lets every
call go unmetered for an hour. The headers' ``-remaining`` (or, without it, ``-reset``:
when the provider's bucket is full again) say how much the provider's bucket holds: where
that is less than Sift's bucket believes (another client of the organisation draws on the
same limit), the settlement of the call lowers Sift's to match, in the same script call
(never raising it). Input tokens are estimated from the prompt's characters
(:class:`TokenEstimator`), corrected by the ratio of reported to estimated usage.

The economy lane (Message Batches) has limits of its own at the provider: its calls draw on
a bucket of their own (``lane="economy"``, :class:`MeteredBatches`), so a batch's polls and
submissions never take from the interactive searches' budget, nor theirs from it.

Its modules, by what they hold: ``_budget``: :class:`RedisRateBudget`, its script and the
:class:`TokenEstimator`; ``_headers``: what the provider's response headers say;
``_batches``: the economy lane's :class:`MeteredBatches` and :class:`BatchQueue`. Import the
names from here: ``from worker.adapters.rate_budget import RedisRateBudget``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.adapters.rate_budget._batches import BatchQueue, BatchQueueFull
from worker.adapters.rate_budget._budget import BACKLOG_REFRESH_SECONDS as BACKLOG_REFRESH_SECONDS
from worker.adapters.rate_budget._budget import BUDGET_SCRIPT, RedisRateBudget, TokenEstimator
from worker.adapters.rate_budget._budget import BURST_FRACTION as BURST_FRACTION
from worker.adapters.rate_budget._budget import LEARN_LEASE_SECONDS as LEARN_LEASE_SECONDS
from worker.adapters.rate_budget._budget import OFF_REFRESH_SECONDS as OFF_REFRESH_SECONDS
from worker.adapters.rate_budget._budget import OUTAGE_BACKLOG_SECONDS as OUTAGE_BACKLOG_SECONDS
from worker.adapters.rate_budget._budget import OUTAGE_FIRST_SECONDS as OUTAGE_FIRST_SECONDS
from worker.adapters.rate_budget._budget import OUTAGE_MAX_SECONDS as OUTAGE_MAX_SECONDS
from worker.adapters.rate_budget._budget import PENDING_SECONDS as PENDING_SECONDS
from worker.adapters.rate_budget._budget import PENDING_STALE_SECONDS as PENDING_STALE_SECONDS
from worker.adapters.rate_budget._budget import PROBE_POLL_SECONDS as PROBE_POLL_SECONDS
from worker.adapters.rate_budget._budget import UNSTATED_SECONDS as UNSTATED_SECONDS
from worker.adapters.rate_budget._headers import limits_from_headers, remaining_from_headers

if TYPE_CHECKING:
    from worker.adapters.rate_budget._metered import MeteredBatches

__all__ = [
    "BUDGET_SCRIPT",
    "BatchQueue",
    "BatchQueueFull",
    "MeteredBatches",
    "RedisRateBudget",
    "TokenEstimator",
    "limits_from_headers",
    "remaining_from_headers",
]


def __getattr__(name: str) -> Any:
    """:class:`MeteredBatches` is imported on first use: it subclasses the SDK's Message
    Batches adapter, and ``import anthropic`` costs about a second of CPU, half a worker's
    start, that a worker without ``SIFT_GENERATION_MODEL`` never needs."""
    if name == "MeteredBatches":
        from worker.adapters.rate_budget._metered import MeteredBatches

        return MeteredBatches
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

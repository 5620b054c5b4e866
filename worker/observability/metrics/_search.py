"""What a search's own stages measure: the whole search by mode and outcome, its wait for a
CPU slot, and each retrieval channel's time and hits (the rerank's are :mod:`._rerank`'s)."""

from __future__ import annotations

from typing import Final

from prometheus_client import Histogram

from worker.constants import (
    METRIC_CPU_SLOT_WAIT,
    METRIC_RETRIEVAL_DURATION,
    METRIC_RETRIEVAL_HITS,
    METRIC_SEARCH_DURATION,
)
from worker.observability.metrics._recording import child, closed, never_raises

# --- closed label sets ---
SEARCH_MODES: Final = ("fts", "vector", "hybrid")
SEARCH_OUTCOMES: Final = ("ok", "fallback", "error")
# embed, fuse: Sift's own stages; rrf: a backend's own fusion of both channels in one request
# (Elasticsearch's retriever, SIFT_ELASTICSEARCH_NATIVE_RRF), whose time is the channels' too
RETRIEVAL_CHANNELS: Final = ("bm25", "knn", "embed", "fuse", "rrf")
NATIVE_FUSION_CHANNEL: Final = "rrf"
# the two lines of a process's CPU slots' waiters (worker/runtime/slots.py): a batch item's
# waits behind every search's
SLOT_LINES: Final = ("search", "batch")

# --- buckets ---
SEARCH_LATENCY_GOAL_SECONDS: Final = 2.5
"""The interactive search latency goal; ``sift_search_duration_seconds`` has a bucket at it."""
# From a quarter of a millisecond: at the defaults (no rerank) a search is its retrieval alone,
# about 1 ms in fts mode and 3-5 ms with the query's embedding. Starting at 10 ms, every such
# search fell in the first bucket, where Prometheus can only interpolate from zero: each
# quantile read q times 10 ms (p50 5 ms for every mode), whatever the searches took. A search
# the 30 s deadline cut ends just past it: in (30, 31], not read as 45-59 s in (30, 60].
SEARCH_BUCKETS: Final = (
    0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 20.0, 30.0, 31.0, 45.0, 60.0,
)  # fmt: skip
# Sift's fusion takes some 0.1 ms, and the embedded backend answers a channel in a fraction of
# a millisecond to a few (below 1 ms, the first bucket was, every quantile read q times 1 ms);
# Elasticsearch over the network in tens to hundreds, and seconds when it is slow (the search
# deadline is 30 s): those must not all read as +Inf.
RETRIEVAL_BUCKETS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# A search's wait for its slot is nothing or a holder's first half, a few ms; a batch item's
# is the item pool's queue ahead of it, seconds behind 300 items: no two bounds more than 2.5
# times apart, as the queue waits'.
SLOT_WAIT_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip
# hits one channel returned for one search (its window is max(4 * coarse limit, 32): 120 at
# the defaults), or the candidates fusion kept (the coarse limit); 0 is an empty channel
HITS_BUCKETS: Final = (0, 1, 5, 10, 20, 32, 50, 100, 120, 250, 500, 1000, 2500, 10000)

# --- the metrics ---
SEARCH_DURATION = Histogram(
    METRIC_SEARCH_DURATION,
    "Seconds for one search, retrieval to final hits, by mode and outcome (ok, fallback, "
    "error); an economy-lane search's own work, without the provider batch's wait (that is "
    'sift_rerank_duration_seconds{lane="economy"}).',
    ["mode", "outcome"],
    buckets=SEARCH_BUCKETS,
)
RETRIEVAL_DURATION = Histogram(
    METRIC_RETRIEVAL_DURATION,
    "Seconds one backend spent on one channel of one search (embed: the query embedding; "
    "fuse: admission and fusion of the channels' hits; rrf: both channels fused by the "
    "backend itself, in one request).",
    ["backend", "channel"],
    buckets=RETRIEVAL_BUCKETS,
)
RETRIEVAL_HITS = Histogram(
    METRIC_RETRIEVAL_HITS,
    "Hits one channel of one search returned (bm25, knn), and the candidates fusion kept "
    'of them (fuse); an empty channel is the le="0.0" bucket.',
    ["backend", "channel"],
    buckets=HITS_BUCKETS,
)
CPU_SLOT_WAIT = Histogram(
    METRIC_CPU_SLOT_WAIT,
    "Seconds a worker process's thread waited for a CPU slot (0: one was free), by line: "
    "search (a search, or anything else holding one) or batch (a batch item, which waits "
    "behind every search); no part of the search's deadline.",
    ["line"],
    buckets=SLOT_WAIT_BUCKETS,
)


@never_raises
def slot_waited(line: str, seconds: float) -> None:
    """A thread of ``line`` (:data:`SLOT_LINES`) held a CPU slot after ``seconds``."""
    child(CPU_SLOT_WAIT, closed(line, SLOT_LINES, "line")).observe(max(0.0, seconds))

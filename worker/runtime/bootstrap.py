"""Builds every dependency of the pipeline from the settings; each one can be passed in instead.

pipeline = build_pipeline(load_settings())                    # real adapters
pipeline = build_pipeline(settings, backend=InMemoryBackend())  # a test's fake
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast

from worker.constants import LANE_ECONOMY, LANE_STANDARD
from worker.core.cost import price_for
from worker.core.fusion import Fusion, weights_of
from worker.core.pipeline import PipelineConfig, SearchPipeline
from worker.core.ports import (
    Embedder,
    IndexSettingsSource,
    IndexSettingsStorage,
    RateBudget,
    Recorder,
    Reranker,
    SearchBackend,
)
from worker.errors import ConfigError
from worker.runtime.slots import Slots, SlottedEmbedder, Waited, cpu_slots
from worker.settings import RateLimit, Settings

if TYPE_CHECKING:
    from worker.adapters.anthropic_batches import AnthropicMessageBatches
    from worker.adapters.rate_budget import RedisRateBudget

log = logging.getLogger(__name__)
_warned_unpriced: set[str] = set()


def warn_if_unpriced(settings: Settings) -> bool:
    """Warn, once per process and model, that the generation model has no price: its
    searches will show ``cost_usd: null`` and count in ``sift_rerank_unpriced_calls_total``.
    Answers whether the model is unpriced. A worker calls it at start-up."""
    model = settings.generation_model_id
    if model is None or price_for(model, settings.prices) is not None:
        return False
    if model not in _warned_unpriced:
        _warned_unpriced.add(model)
        log.warning(
            "no price for the generation model %r: reranks will show cost_usd null and count in "
            "sift_rerank_unpriced_calls_total; add its price per million tokens to SIFT_PRICES, "
            'e.g. SIFT_PRICES=\'{"%s": {"input": 1, "output": 5, "cache_read": 0.1, '
            '"cache_creation": 1.25}}\' (this replaces the built-in table: list every model)',
            model,
            model,
        )
    return True


def warn_if_unused_rate_limits(settings: Settings) -> list[str]:
    """Warn of each model ``SIFT_RATE_LIMITS`` names that this worker calls none of: its
    limits meter nothing, and a typo (``claude-haiku-45``) left the model meant unmetered,
    silently. Both lanes call SIFT_GENERATION_MODEL (the economy lane's limits are its
    ``economy`` entry). A worker calls it at start-up; answers the unused names."""
    model = settings.generation_model_id
    unused = sorted(name for name in settings.rate_limits if name != model)
    if unused:
        used = f"its model is {model!r} (SIFT_GENERATION_MODEL)" if model else "it has no model"
        log.warning(
            "SIFT_RATE_LIMITS names %s, which this worker does not call: %s, in both lanes; "
            "those limits meter nothing (a misspelled model's name?)",
            ", ".join(repr(name) for name in unused),
            used,
        )
    return unused


def warn_if_no_generation_model(settings: Settings) -> bool:
    """Warn that this worker has no generation model: a search or batch asking for a rerank
    (``rerank: true``), which a gateway given one accepts, fails here ``rerank_failed``
    (``no_generation_model``), or falls back to the fused order under ``fail_open``. A
    worker calls it at start-up: a model set on the gateways and not on the workers was
    found only by the failed jobs. Answers whether the worker has none."""
    if settings.generation_model is not None:
        return False
    log.warning(
        "no generation model (SIFT_GENERATION_MODEL): this worker reranks nothing; a search "
        "or batch asking for a rerank (accepted by a gateway that has a model) fails "
        "rerank_failed (no_generation_model), or falls back to the fused order under "
        "SIFT_RERANK_FAILURE_POLICY=fail_open; give the gateways and the workers the same "
        "SIFT_GENERATION_MODEL"
    )
    return True


def pipeline_config(settings: Settings, *, price_discount: float = 1.0) -> PipelineConfig:
    """The pipeline's config; the economy lane passes the Message Batches discount."""
    return PipelineConfig(
        rerank_enabled=settings.rerank_enabled,
        candidate_limit=settings.rerank_candidate_limit,
        fusion=default_fusion(settings),
        candidate_max_chars=settings.rerank_candidate_max_chars,
        failure_policy=settings.rerank_failure_policy,
        deadline_seconds=settings.search_deadline_seconds,
        attempt_timeout_seconds=settings.generation_timeout_seconds,
        max_requests=settings.generation_max_requests,
        thinking_tokens=settings.generation_thinking_tokens,
        tokens_per_position=settings.generation_tokens_per_position,
        vector_min_similarity=settings.vector_min_similarity,
        prices=settings.prices,
        price_discount=price_discount,
    )


def default_fusion(settings: Settings) -> Fusion:
    """``SIFT_FUSION_WEIGHTS`` (a channel it leaves out counts 1), the rank constant and
    ``SIFT_FUSION_METHOD``."""
    weights = weights_of(settings.fusion_weights)
    return Fusion(
        {"bm25": 1.0, "knn": 1.0, **weights},
        settings.fusion_rank_constant,
        settings.fusion_method,
    )


def build_index_settings(settings: Settings, backend: object) -> IndexSettingsSource | None:
    """Each index's own settings, kept by ``backend`` with versions from Redis (none without
    Redis, or with a backend that keeps none: the defaults apply)."""
    if not settings.redis_url or not hasattr(backend, "store_settings"):
        return None
    from worker.adapters.index_settings import IndexSettingsStore
    from worker.redis_client import OUTAGE_SECONDS

    storage = cast(IndexSettingsStorage, backend)
    return IndexSettingsStore.from_url(storage, settings.redis_url, OUTAGE_SECONDS)


def build_backend(settings: Settings) -> SearchBackend:
    if settings.search_backend == "elasticsearch":
        from worker.adapters.elasticsearch import ElasticsearchBackend

        if not settings.elasticsearch_url:
            raise ConfigError("SIFT_SEARCH_BACKEND=elasticsearch needs SIFT_ELASTICSEARCH_URL")
        backend: SearchBackend = ElasticsearchBackend.from_settings(settings)
        return backend
    from worker.adapters.embedded import EmbeddedBackend

    return EmbeddedBackend(
        settings.data_dir,
        max_indexes_per_tenant=settings.max_indexes_per_tenant,
        # a delete's tombstone lasts as long on either backend (warned if too short)
        tombstone_seconds=settings.elasticsearch_gc_deletes_seconds,
    )


def build_embedder(settings: Settings, cpu_slots: Slots | None = None) -> Embedder:
    """The local MiniLM, each model call holding one of ``cpu_slots``. With fp32 products,
    concurrent searches' queries run through it together; the int8-compute graph embeds one
    text per call (see its class)."""
    from worker.adapters.embedder import CoalescingEmbedder, OnnxMiniLMEmbedder

    threads = settings.embedding_threads or None
    if settings.embedding_int8_compute:
        model = OnnxMiniLMEmbedder(threads=threads, int8_cache_dir=settings.model_cache_dir)
    else:
        model = OnnxMiniLMEmbedder(threads=threads)
    slotted: Embedder = model if cpu_slots is None else SlottedEmbedder(model, cpu_slots)
    return slotted if settings.embedding_int8_compute else CoalescingEmbedder(slotted)


def build_reranker(
    settings: Settings, on_headers: Callable[[Mapping[str, str]], None] | None = None
) -> Reranker | None:
    """The configured model, or None: a model alone does not enable rerank by default.
    ``on_headers`` sees every response's headers (the rate budget learns limits there)."""
    model = settings.generation_model_id
    if model is None:
        return None
    from worker.adapters.anthropic import AnthropicReranker

    warn_if_unpriced(settings)
    return AnthropicReranker(model, effort=settings.generation_effort, on_headers=on_headers)


def build_rate_budget(settings: Settings, lane: str = LANE_STANDARD) -> RedisRateBudget | None:
    """A lane's budget shared through Redis, or None without a model or Redis (or with
    ``SIFT_RATE_BUDGET_ENABLED=false``). It meters calls once a limit is known:
    ``SIFT_RATE_LIMITS`` (the model's ``economy`` entry for the economy lane) or, in the
    standard lane, learned from headers."""
    model = settings.generation_model_id
    if model is None or not settings.redis_url or not settings.rate_budget_enabled:
        return None
    from worker.adapters.rate_budget import RedisRateBudget
    from worker.redis_client import (
        OUTAGE_SECONDS,
        QUICK_SOCKET_TIMEOUT,
        connect,
        worker_connections,
    )

    limits = settings.rate_limits.get(model)
    if lane == LANE_ECONOMY:  # a few calls a minute: a small pool
        economy = limits.economy if limits is not None else None
        client = connect(
            settings.redis_url, outage_seconds=OUTAGE_SECONDS, socket_timeout=QUICK_SOCKET_TIMEOUT
        )
        lane_limits = RateLimit(rpm=economy.rpm) if economy is not None else None
        return RedisRateBudget(client, model, lane_limits, lane=LANE_ECONOMY)
    client = connect(  # every thread of the process may reserve at once
        settings.redis_url,
        max_connections=worker_connections(settings),
        outage_seconds=OUTAGE_SECONDS,
        socket_timeout=QUICK_SOCKET_TIMEOUT,
    )
    return RedisRateBudget(client, model, limits)


def build_batch_client(settings: Settings) -> AnthropicMessageBatches | None:
    """The Message Batches client of the economy lane, or None without a generation model;
    metered by the lane's own rate budget when there is one."""
    model = settings.generation_model_id
    if model is None:
        return None
    from worker.adapters.anthropic import AnthropicReranker
    from worker.adapters.anthropic_batches import AnthropicMessageBatches

    reranker = AnthropicReranker(model, effort=settings.generation_effort)
    budget = build_rate_budget(settings, LANE_ECONOMY)
    if budget is None:
        return AnthropicMessageBatches(reranker)
    from worker.adapters.rate_budget import BatchQueue, MeteredBatches

    limits = settings.rate_limits.get(model)
    cap = limits.economy.queued if limits is not None and limits.economy is not None else None
    queue = BatchQueue(budget.client, model, cap) if cap is not None else None
    # a submission the queue has no room for is tried again when a poll may have freed some
    return MeteredBatches(reranker, budget, queue=queue, queue_retry=settings.economy_poll_seconds)


def build_pipeline(
    settings: Settings,
    *,
    backend: SearchBackend | None = None,
    embedder: Embedder | None = None,
    reranker: Reranker | None = None,
    recorder: Recorder | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    rate_budget: RateBudget | None = None,
    index_settings: IndexSettingsSource | None = None,
    slot_waited: Waited | None = None,
) -> SearchPipeline:
    # ``slot_waited`` hears of each wait for a CPU slot (the queue's worker: the metrics').
    # The embedded backend computes in this process: a CPU slot is held through each whole
    # first half. Elasticsearch's retrieval waits on the network: only embedding holds one.
    slots = cpu_slots(settings.cpu_slots, slot_waited)
    local = backend is None and settings.search_backend == "embedded"
    backend = backend or build_backend(settings)
    return SearchPipeline(
        backend=backend,
        embedder=embedder or build_embedder(settings, None if local else slots),
        reranker=reranker or build_reranker(settings),
        config=pipeline_config(settings),
        recorder=recorder,
        clock=clock,
        sleep=sleep,
        cpu_slots=slots if local else None,
        rate_budget=rate_budget,
        index_settings=index_settings or build_index_settings(settings, backend),
    )

"""The pipeline's settings as plain values: :class:`PipelineConfig` and its failure policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from worker.core.fusion import Fusion
from worker.prices import Price

FailurePolicy = Literal["fail_closed", "fail_open"]


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """The settings the pipeline reads, as plain values."""

    rerank_enabled: bool = False
    candidate_limit: int = 30
    fusion: Fusion = field(default_factory=Fusion)
    candidate_max_chars: int = 1200
    failure_policy: FailurePolicy = "fail_closed"
    deadline_seconds: float = 30.0
    attempt_timeout_seconds: float = 20.0
    max_requests: int = 3
    thinking_tokens: int = 1024
    tokens_per_position: int = 8
    vector_min_similarity: float | None = None
    backend_max_attempts: int = 3
    prices: Mapping[str, Price] = field(default_factory=dict)
    price_discount: float = 1.0

"""The job contract: the pydantic types that cross the queue and the HTTP API.

This module is the only part of ``worker`` that ``api_gateway`` imports (with
``worker.settings`` and ``worker.constants``), so it depends on pydantic alone.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from worker.constants import MAX_LIMIT, MAX_QUERY_CHARS

Mode = Literal["fts", "vector", "hybrid"]
Channel = Literal["bm25", "knn"]
FilterValue = str | int | float | bool


class JobStatus(StrEnum):
    """The life of a search or batch item."""

    QUEUED = "queued"  # accepted and enqueued, no worker has it yet
    RUNNING = "running"  # a worker is running it
    SUCCEEDED = "succeeded"  # finished with a result
    FAILED = "failed"  # finished with a typed error
    CANCELED = "canceled"  # canceled before it ran

    @property
    def final(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DocumentIn(StrictModel):
    """One document to upsert, in Sift's own shape."""

    id: str = Field(min_length=1, max_length=512)
    text: str = Field(min_length=1)
    title: str = ""
    revision: str | None = None
    metadata: dict[str, FilterValue] = Field(default_factory=dict)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("is empty after trimming whitespace")
    return value


INDEX_PATTERN = r"^[a-z0-9][a-z0-9_.-]*$"
IndexName = Annotated[str, Field(min_length=1, max_length=128, pattern=INDEX_PATTERN)]
QueryText = Annotated[
    str, Field(min_length=1, max_length=MAX_QUERY_CHARS), AfterValidator(_not_blank)
]


class SearchSpec(StrictModel):
    """What one search asks for. The tenant never comes from here: the API key decides it."""

    index: IndexName
    query: QueryText
    limit: int = Field(default=10, ge=1, le=MAX_LIMIT)
    mode: Mode = "hybrid"
    rerank: bool | None = None
    include_trace: bool = False
    filters: dict[str, FilterValue] = Field(default_factory=dict)


class Ranks(BaseModel):
    final: int | None = None
    rrf: int | None = None
    bm25: int | None = None
    knn: int | None = None


class Scores(BaseModel):
    rrf: float | None = None
    bm25: float | None = None
    knn: float | None = None


class Hit(BaseModel):
    id: str
    revision: str
    title: str = ""
    text: str
    metadata: dict[str, FilterValue] = Field(default_factory=dict)
    ranks: Ranks
    scores: Scores


class RerankInfo(BaseModel):
    applied: bool
    policy: str | None = None
    fallback_reason: str | None = None


class Usage(BaseModel):
    """What one search's model calls used; token types are disjoint, so they sum to the bill.

    ``cost_usd`` is ``None`` when a call was to a model with no price (``SIFT_PRICES``): the
    cost is unknown, not zero; a sum with an unknown part is unknown too.
    """

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cost_usd: float | None = 0.0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            requests=self.requests + other.requests,
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_read_input_tokens=self.cache_read_input_tokens + other.cache_read_input_tokens,
            cache_creation_input_tokens=self.cache_creation_input_tokens
            + other.cache_creation_input_tokens,
            cost_usd=(
                None
                if self.cost_usd is None or other.cost_usd is None
                else self.cost_usd + other.cost_usd
            ),
        )


class SearchResult(BaseModel):
    hits: list[Hit]
    rerank: RerankInfo
    usage: Usage = Field(default_factory=Usage)
    trace: dict[str, Any] | None = None


class ErrorInfo(BaseModel):
    """A typed failure, as the job record and the API show it. ``usage`` is what the model
    calls made before the failure used: attempts that failed may still have been billed."""

    type: str
    message: str
    retryable: bool = False
    usage: Usage | None = None

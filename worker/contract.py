"""The job contract: the pydantic types that cross the queue and the HTTP API.

This module is the only part of ``worker`` that ``api_gateway`` imports (with
``worker.settings`` and ``worker.constants``), so it depends on pydantic alone.
"""

from __future__ import annotations

import math
import unicodedata
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PlainValidator,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    Strict,
    model_serializer,
    model_validator,
)

from worker.constants import (
    MAX_CANDIDATE_LIMIT,
    MAX_DOCUMENT_CHARS,
    MAX_FILTER_KEYS,
    MAX_FUSION_WEIGHT,
    MAX_LIMIT,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_BYTES,
    MAX_QUERY_CHARS,
    MAX_RANK_CONSTANT,
    MAX_REVISION_CHARS,
    MAX_TITLE_CHARS,
)

Mode = Literal["fts", "vector", "hybrid"]
Channel = Literal["bm25", "knn"]
FusionMethod = Literal["rrf", "linear"]
FilterValue = str | int | float | bool
#: A metadata value as a hit, a document read or a listing shows it: any JSON value. Sift
#: writes only plain values (:data:`FilterValue`, :class:`DocumentIn`); an index that
#: already exists (deploy/README.md §4) holds what its own tool wrote, lists, objects and
#: nulls included (its ``flattened`` metadata field takes them), and shows it as it holds it.
StoredValue = JsonValue
#: What the API says of a shown document's metadata (a hit's, a read's, a listing's).
STORED_METADATA_DOC = (
    "As the index holds it. Sift writes strings, numbers and booleans; an Elasticsearch "
    "index that already exists (deploy/README.md §4) may hold lists, objects and nulls its "
    "own tool wrote, shown as they are."
)

# --- what a client may send as metadata and filters -----------------------------------------
# Checked where a request comes in (the gateway's request models), not on the types the
# job store and the worker read back: a record stored before a check existed must stay
# readable. Each of these once passed the gateway and broke later (DESIGN.md §9: bad input
# is a 4xx naming the field):
# * a key outside the backends' pattern failed the ingest or search job (both backends
#   refuse it: both compile this pattern as their ``_FILTER_KEY``);
# * NaN or Infinity (Python's JSON reader takes them) was stored, written back as ``null``,
#   and every later read of the record (the search, its list, a hit's metadata) was a 500;
# * an integer past 64 bits: SQLite cannot bind it (a filter on it failed the search, an
#   ``OverflowError``);
# * a lone surrogate (``"\ud800"``, valid JSON, no UTF-8): Redis, SQLite and the tokenizer
#   cannot encode it, a 500 at the gateway or an ingest failed as ``internal_error``;
# * a string past Lucene's term limit (32,766 bytes): the embedded backend stored it, and
#   Elasticsearch refused the whole document (``max_bytes_length_exceeded_exception``).
METADATA_KEY_PATTERN = rf"^[A-Za-z0-9_.:-]{{1,{MAX_METADATA_KEY_CHARS}}}$"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def unicode_only(value: str) -> str:
    """``value`` if UTF-8 can encode it (no lone surrogate); pydantic checks this only for
    strings with a length or pattern constraint."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"is not valid Unicode: a lone surrogate at character {exc.start}"
        ) from exc
    return value


def _metadata_value(value: object) -> FilterValue:
    """A metadata or filter value every backend can store and compare exactly."""
    if isinstance(value, str):
        if len(unicode_only(value).encode()) > MAX_METADATA_VALUE_BYTES:
            raise ValueError(f"a string must be at most {MAX_METADATA_VALUE_BYTES} bytes in UTF-8")
        return value
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError("an integer must fit in 64 bits (-2^63 to 2^63 - 1)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("must be a finite number, not NaN or Infinity")
        return value
    raise ValueError("must be a string, a number or a boolean")


MetadataKey = Annotated[str, Field(pattern=METADATA_KEY_PATTERN)]
MetadataValue = Annotated[
    FilterValue, PlainValidator(_metadata_value, json_schema_input_type=FilterValue)
]
# no other key either, in the OpenAPI document too (``patternProperties`` alone allows any)
Metadata = Annotated[
    dict[MetadataKey, MetadataValue], Field(json_schema_extra={"additionalProperties": False})
]
# a search's filters: metadata of at most MAX_FILTER_KEYS keys (a search of 1,000 was taken,
# then failed as the embedded backend's "Expression tree is too large")
Filters = Annotated[Metadata, Field(max_length=MAX_FILTER_KEYS)]


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


def _not_a_dot_segment(value: str) -> str:
    """No ``/``-separated part of an id is ``.`` or ``..``: every HTTP client resolves such a
    path segment (RFC 3986), and an id's ``/`` may be sent raw in a path, so ``DELETE
    /v1/indexes/i/documents/..`` or ``.../documents/x/../..`` reached the server as ``DELETE
    /v1/indexes/i`` and dropped the whole index, ``.../documents/a/../b`` deleted document
    ``b``, and ``GET`` of ``.`` listed the documents. Refused where a document comes in; one
    stored before stays readable (its dots sent as ``%2E``) and deletable (by the delete
    body's ids, which no client resolves)."""
    if any(part in (".", "..") for part in value.split("/")):
        raise ValueError(
            f"{value!r} is not an id a URL can hold: HTTP clients resolve a '.' or '..' "
            "between slashes as a path segment"
        )
    return value


class DocumentRequest(DocumentIn):
    """One document of ``POST /v1/indexes/{index}/documents``: a ``DocumentIn`` whose
    text, title, revision and metadata every backend can store (:data:`Metadata`), each
    bounded (:data:`~worker.constants.MAX_DOCUMENT_CHARS`...). Here, not in
    the gateway's schemas, so ``sift ingest`` checks its lines by the same rules."""

    id: Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_not_a_dot_segment)]
    # the text's limit was checked by the route and the CLI apart: OpenAPI did not show it
    text: str = Field(min_length=1, max_length=MAX_DOCUMENT_CHARS)
    # each length before the Unicode check: after it, pydantic checked the length as a
    # sequence's ("Value should have at most 2000 items after validation"). A revision left
    # out (or null) is a digest of the content; an empty one was taken as left out.
    title: Annotated[str, Field(max_length=MAX_TITLE_CHARS), AfterValidator(unicode_only)] = ""
    revision: (
        Annotated[
            str, Field(min_length=1, max_length=MAX_REVISION_CHARS), AfterValidator(unicode_only)
        ]
        | None
    ) = None
    metadata: Annotated[Metadata, Field(max_length=MAX_METADATA_KEYS)] = Field(default_factory=dict)


def from_beir(line: dict[str, Any]) -> dict[str, Any]:
    """A BEIR ``corpus.jsonl`` line (``_id``, ``title``, ``text``; its optional metadata is
    not Sift's) as a document's fields, a text it leaves out left out (``Field required``).
    A document with a title and no text (an empty or blank one: TREC-COVID's papers with no
    abstract) has its title as its text, so it is indexed and searched: its line was refused
    (``field 'text'``), and ``--skip-invalid`` dropped it from the index and every score.

    >>> from_beir({"_id": "d1", "title": "Aspirin", "text": ""})
    {'id': 'd1', 'title': '', 'text': 'Aspirin'}
    >>> from_beir({"_id": "d2", "title": None, "text": " "}), from_beir({"_id": "d3"})
    ({'id': 'd2', 'title': '', 'text': ' '}, {'id': 'd3', 'title': ''})
    """
    document = {"id": line["_id"], "title": line.get("title") or ""}
    if "text" not in line:
        return document
    text, title = line["text"], document["title"]
    if isinstance(text, str) and is_blank(text) and isinstance(title, str) and not is_blank(title):
        return document | {"title": "", "text": title}
    return document | {"text": text}


def is_blank(value: str) -> bool:
    """Whether ``value`` has no visible character: whitespace (Z*), controls (Cc, ``\0``) and
    format characters (Cf: a zero-width space, a soft hyphen, a BOM) do not count;
    ``str.strip()`` let ``"\u200b"`` through (a query of it searched arbitrary hits, a
    document of it was indexed with no word)."""
    return all(unicodedata.category(char) in _INVISIBLE for char in value)


BLANK = "has no visible character (only whitespace, control or format ones)"


def _not_blank(value: str) -> str:
    """A query with no visible character is blank (:func:`is_blank`)."""
    if is_blank(value):
        raise ValueError(BLANK)
    return value


_INVISIBLE = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})


def is_searchable(value: str) -> bool:
    """Whether ``value`` holds a letter, a digit or a symbol (Unicode's L*, N*, S*: a CJK
    word, ``½``, an emoji, ``$``). Punctuation alone (``"?!"``, ``"..."``) gives BM25 no word
    and the embedder nothing to mean: such a query searched and answered arbitrary hits.

    >>> [is_searchable(q) for q in ("?!", " ... ", "\u3002", "x?", "\U0001f525", "\u6771")]
    [False, False, False, True, True, True]
    """
    return any(unicodedata.category(char)[0] in "LNS" for char in value)


UNSEARCHABLE = "has no letter, digit or symbol (only punctuation): nothing in it can be searched"


def _searchable(value: str) -> str:
    """A query a search is asked for holds something to search (:func:`is_searchable`)."""
    if not is_searchable(value):
        raise ValueError(UNSEARCHABLE)
    return value


INDEX_PATTERN = r"^[a-z0-9][a-z0-9_.-]*$"
IndexName = Annotated[str, Field(min_length=1, max_length=128, pattern=INDEX_PATTERN)]
QueryText = Annotated[
    str, Field(min_length=1, max_length=MAX_QUERY_CHARS), AfterValidator(_not_blank)
]
# what a client may ask for (a search's, a batch query's): a query with something to search.
# Checked where a request comes in, not on the stored spec (a query of punctuation taken
# before the check must stay readable in the job store)
SearchedText = Annotated[QueryText, AfterValidator(_searchable)]


# Strict: a boolean, a string or a float where an integer (or a boolean) goes is a wrong type
# (a 422 naming it), not a value to convert: `"limit": true` ran a one-hit search, `"rerank":
# "yes"` reranked. JSON's integers and booleans, and what Sift stores, are unchanged. A
# weight is a JSON number (an integer is taken as its float): `"knn": false` was a weight of
# 0, which turned the channel off, and `"bm25": "2"` or `true` a weight of 2 or 1. `-0.0`
# passes `ge=0` and is taken as 0 (`abs`), stored and shown as `0.0`.
Weight = Annotated[
    float,
    Strict(),
    Field(ge=0.0, le=MAX_FUSION_WEIGHT, allow_inf_nan=False),
    AfterValidator(abs),
]
RankConstant = Annotated[int, Strict(), Field(ge=1, le=MAX_RANK_CONSTANT)]
CandidateLimit = Annotated[int, Strict(), Field(ge=1, le=MAX_CANDIDATE_LIMIT)]
Limit = Annotated[int, Strict(), Field(ge=1, le=MAX_LIMIT)]
Flag = Annotated[bool, Strict()]


class FusionWeights(StrictModel):
    """The fusion's weight per channel (0 to ``MAX_FUSION_WEIGHT``, finite). A channel left out (or
    ``null``) takes its weight from the next level: the index's settings, then the defaults.
    A channel weighted 0 is not fused, and in a hybrid search not even queried."""

    bm25: Weight | None = None
    knn: Weight | None = None

    @model_validator(mode="after")
    def _not_all_zero(self) -> FusionWeights:
        if self.bm25 == 0 and self.knn == 0:
            raise ValueError("every channel weighted 0 leaves nothing to fuse")
        return self


class FusionSpec(StrictModel):
    """How the channels are fused. ``method`` ``rrf``: weighted RRF, ``score(d) = sum over
    channels of weight / (rank_constant + rank)``; ``linear``: ``sum over channels of
    weight * minmax(score)``, each channel's scores rescaled to [0, 1] over its list (the
    rank constant is not read). Each field left out (or ``null``) comes from the index's
    settings, then the defaults (``SIFT_FUSION_METHOD``, ``SIFT_FUSION_WEIGHTS``,
    ``SIFT_FUSION_RANK_CONSTANT``)."""

    weights: FusionWeights | None = None
    rank_constant: RankConstant | None = None
    method: FusionMethod | None = Field(
        default=None,
        description="`rrf` (reciprocal ranks) or `linear` (min-max normalised scores).",
    )

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without ``method`` when it was not given: a spec from before it existed
        serializes as it did (a previous release's worker reads it, an Idempotency-Key's
        fingerprint is unchanged)."""
        data: dict[str, Any] = handler(self)
        if "method" not in self.model_fields_set:
            data.pop("method", None)
        return data


class IndexSettingsPatch(StrictModel):
    """``PATCH /v1/indexes/{index}``: the index's own search settings. A field left out stays
    as it is; ``null`` clears it back to the default."""

    fusion: FusionSpec | None = None
    candidate_limit: CandidateLimit | None = Field(
        default=None, description="The rerank candidate window (SIFT_RERANK_CANDIDATE_LIMIT)."
    )


def without_unset_overrides(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without ``fusion`` and ``candidate_limit`` where they set nothing (None, or a
    fusion whose every field is: it means what no fusion means): a search or batch that sets
    neither serializes as before they existed, so a worker of the previous release still
    reads its spec, and an Idempotency-Key's body fingerprint is the same across the upgrade
    and for ``fusion: {}`` as for no fusion.

    >>> without_unset_overrides({"index": "a", "fusion": {"weights": {"knn": None}}})
    {'index': 'a'}
    """
    for name in ("fusion", "candidate_limit"):
        if _sets_nothing(data.get(name)):
            data.pop(name, None)
    return data


def _sets_nothing(value: object) -> bool:
    """None, or a dict of values that set nothing."""
    if isinstance(value, dict):
        return all(_sets_nothing(v) for v in value.values())
    return value is None


class SearchSpec(StrictModel):
    """What one search asks for. The tenant never comes from here: the API key decides it."""

    index: IndexName
    query: QueryText
    limit: Limit = 10
    mode: Mode = "hybrid"
    rerank: Flag | None = None
    include_trace: Flag = False
    filters: dict[str, FilterValue] = Field(default_factory=dict)
    fusion: FusionSpec | None = Field(
        default=None,
        description="The fusion (method, weights, rank constant) for this search, over the "
        "index's and defaults.",
    )
    candidate_limit: CandidateLimit | None = Field(
        default=None,
        description="The rerank candidate window for this search, over the index's and default.",
    )

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return without_unset_overrides(handler(self))


class Ranks(BaseModel):
    """A hit's places. ``rrf`` is its place in the fused list whatever the fusion method
    (the name predates ``fusion.method``: under ``linear`` it is the linear fusion's)."""

    final: int | None = None
    rrf: int | None = None
    bm25: int | None = None
    knn: int | None = None


class Scores(BaseModel):
    """A hit's scores. ``rrf`` is the fused score whatever the fusion method: under
    ``linear``, the sum of weight times min-max normalised channel score."""

    rrf: float | None = None
    bm25: float | None = None
    knn: float | None = None


class Hit(BaseModel):
    id: str
    revision: str
    title: str = ""
    text: str
    metadata: dict[str, StoredValue] = Field(default_factory=dict, description=STORED_METADATA_DOC)
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
    # each stage's seconds, trace or not, for its batch's totals (never serialized)
    _stage_seconds: dict[str, float] = PrivateAttr(default_factory=dict)


class ErrorInfo(BaseModel):
    """A typed failure, as the job record and the API show it. ``usage`` is what the model
    calls made before the failure used: attempts that failed may still have been billed.
    ``reason``: a ``rerank_failed`` error's class (:class:`~worker.errors.RerankFailed`'s);
    ``trace``: a search that asked for its trace (``include_trace``) and failed its rerank
    for good keeps it here; each absent otherwise (not ``null``: the other errors' shape
    stands)."""

    type: str
    message: str
    retryable: bool = False
    usage: Usage | None = None
    reason: str | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="The rerank's failure class on a `rerank_failed` error, as its message "
        "names it: its last attempt's (timeout, http_5xx, rate_limited, connection, http_4xx, "
        "malformed, refused, budget_exhausted), deadline (no attempt left in its time) or "
        "no_generation_model; absent on any other error.",
    )
    trace: dict[str, Any] | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="The search's trace up to the failure (its candidates, the attempts "
        "with their outcome class, usage), as a result's `trace`; only on a `rerank_failed` "
        "error of a search or batch that asked for its trace (`include_trace`).",
    )
    # a rerank_failed search's stages' seconds up to the failure, trace or not, for its
    # batch's totals (never serialized; empty for any other failure: none were kept)
    _stage_seconds: dict[str, float] = PrivateAttr(default_factory=dict)

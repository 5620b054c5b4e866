"""The one settings object: every ``SIFT_`` environment variable, validated at start-up."""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticUseDefault
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from standardwebhooks.webhooks import EmptyWebhookSecretError, Webhook

from worker.constants import (
    ECONOMY_MAX_BATCH_BYTES,
    ECONOMY_MAX_REQUESTS_PER_BATCH,
    MAX_CANDIDATE_LIMIT,
    MAX_DOCUMENT_CHARS,
    MAX_RANK_CONSTANT,
    MIN_RESULT_RETENTION_SECONDS,
    RESULT_TTL_SECONDS,
    RRF_K,
)
from worker.contract import FusionWeights
from worker.effort import refused_effort
from worker.errors import ConfigError, validation_message
from worker.prices import DEFAULT_PRICES, Price

# what a tenant's name may be: also what `sift tenant purge` accepts (no glob character, so
# the Redis SCAN patterns it builds from the name match that tenant's keys alone)
TENANT_PATTERN = r"^[A-Za-z0-9_.-]+$"

#: The bound of a duration setting (a per-request timeout, a job's deadline, a sweep's
#: interval): no deployment waits longer, and a longer one overflows a thread's or a
#: socket's timeout; a setting meant to be long (the economy deadline) has its own.
DAY = 86_400

#: The bound of a provider's rate limit (SIFT_RATE_LIMITS): no tier's is near a billion a
#: minute. Like every whole-number setting's bound, it only keeps a typo of many digits out.
PER_MINUTE_MAX = 1_000_000_000

#: The ssl_cert_reqs of a rediss:// SIFT_REDIS_URL: the words redis-py and kombu both take.
REDIS_CERT_CHECKS = frozenset({"required", "optional", "none"})

#: The analyzers SIFT_ELASTICSEARCH_ANALYZER takes: Elasticsearch's built-in language
#: analyzers (its analysis-common module; ``chinese`` left out: ES keeps it for indexes of
#: old releases only, ``cjk`` is the one for new ones) and ``standard``. A name ES has no
#: analyzer of would have its index template refused at every tenant's first write.
ElasticsearchAnalyzer = Literal[
    "standard", "arabic", "armenian", "basque", "bengali", "brazilian", "bulgarian",
    "catalan", "cjk", "czech", "danish", "dutch", "english", "estonian", "finnish", "french",
    "galician", "german", "greek", "hindi", "hungarian", "indonesian", "irish", "italian",
    "latvian", "lithuanian", "norwegian", "persian", "portuguese", "romanian", "russian",
    "sorani", "spanish", "swedish", "thai", "turkish",
]  # fmt: skip
ELASTICSEARCH_ANALYZERS: tuple[str, ...] = get_args(ElasticsearchAnalyzer)


class ApiKey(BaseModel):
    """One API key entry: the key decides the tenant; the secret signs that tenant's webhooks.

    The key is given either as itself (``key``) or as its SHA-256 hex digest (``key_sha256``),
    so a keys file need not hold a usable key: the gateway only ever compares digests."""

    # a refused entry's error must not quote the entry: it holds the key and the secret
    model_config = ConfigDict(hide_input_in_errors=True)

    key: str | None = Field(default=None, min_length=8)
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    tenant: str = Field(min_length=1, pattern=TENANT_PATTERN)
    webhook_secret: str = Field(pattern=r"^whsec_[A-Za-z0-9+/=]+$")
    # During a rotation the previous secret still signs too: two signatures are sent.
    webhook_secret_previous: str | None = Field(default=None, pattern=r"^whsec_[A-Za-z0-9+/=]+$")

    @field_validator("key")
    @classmethod
    def _sendable(cls, key: str | None) -> str | None:
        """A key HTTP can carry as it is: the Authorization header's value loses the
        whitespace at its ends on the way, so such a key was taken and never matched."""
        if key is not None and key != key.strip():
            raise ValueError(
                "has whitespace at its start or end, which HTTP strips from the Authorization "
                "header: it could never authenticate; remove it"
            )
        return key

    @field_validator("webhook_secret", "webhook_secret_previous")
    @classmethod
    def _signs(cls, secret: str | None) -> str | None:
        """A secret the Standard Webhooks library signs with: the pattern took ``whsec_abcde``
        (no base64) and ``whsec_====`` (no key), and every webhook of the tenant raised at its
        signing, never sent nor settled. The library's error names no part of the secret."""
        if secret is not None:
            try:
                Webhook(secret)
            except (ValueError, EmptyWebhookSecretError) as exc:
                raise ValueError(f"no signature can be made with it: {exc}") from None
            if b"CHANGE-ME" in base64.b64decode(secret.removeprefix("whsec_")):
                # deploy/.env.example's and the k8s Secret's: published, so anyone could
                # sign a webhook the tenant's receivers accept
                raise ValueError(
                    "the placeholder of deploy/.env.example, published with Sift; make one: "
                    'python -c "import base64, os; '
                    "print('whsec_' + base64.b64encode(os.urandom(24)).decode())\""
                )
        return secret

    @model_validator(mode="after")
    def _exactly_one_key(self) -> ApiKey:
        if (self.key is None) == (self.key_sha256 is None):
            given = "both" if self.key is not None else "neither"
            raise ValueError(
                f"key, key_sha256: give exactly one (the key, or its SHA-256 as 64 hex "
                f"digits); this entry for tenant {self.tenant!r} has {given}"
            )
        return self

    def digest(self) -> bytes:
        """The key's SHA-256, what the gateway keeps and compares."""
        if self.key_sha256 is not None:
            return bytes.fromhex(self.key_sha256)
        assert self.key is not None
        return hashlib.sha256(self.key.encode()).digest()

    def webhook_secrets(self) -> list[str]:
        """The secrets that sign this tenant's webhooks: the current one first."""
        secrets = [self.webhook_secret]
        if self.webhook_secret_previous and self.webhook_secret_previous != self.webhook_secret:
            secrets.append(self.webhook_secret_previous)
        return secrets


class BatchLimit(BaseModel):
    """The Message Batches API's own limits (the economy lane), as the tier's page lists them:
    requests per minute to the batch endpoints (create, retrieve, results, cancel), and batch
    requests in the processing queue at once."""

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(default=None, ge=1, le=PER_MINUTE_MAX, strict=True)
    queued: int | None = Field(default=None, ge=1, le=PER_MINUTE_MAX, strict=True)


def _per_minute(short: str, long: str) -> Any:
    """A limit per minute, read by its short name or by DESIGN.md §9's long one; a JSON
    number (strict: ``true`` is not 1, nor ``"4000"`` a number)."""
    return Field(
        default=None,
        ge=1,
        le=PER_MINUTE_MAX,
        strict=True,
        validation_alias=AliasChoices(short, long),
    )


class RateLimit(BaseModel):
    """One model's rate limits at the provider, per minute, as the tier's page lists them;
    a limit left out is not metered (or learned from the provider's response headers).
    ``economy``: the economy lane's own bucket (Message Batches), metered apart."""

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = _per_minute("rpm", "requests_per_minute")
    itpm: int | None = _per_minute("itpm", "input_tokens_per_minute")
    otpm: int | None = _per_minute("otpm", "output_tokens_per_minute")
    economy: BatchLimit | None = None


_API_KEY_LIST = TypeAdapter(list[ApiKey])


def _blank(value: Any) -> bool:
    return isinstance(value, str) and not value.strip()


def _json_or_empty(value: Any) -> Any:
    if isinstance(value, str):
        return json.loads(value) if value.strip() else []
    return value


def without_password(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part starred out, for an error
    message: a URL with credentials in it (deploy/'s compose file passes Elasticsearch's
    ``elastic`` password so) must not reach a log.

    >>> without_password("http://elastic:s3cret@es:9200/x")
    'http://elastic:***@es:9200/x'
    >>> without_password("https://es.internal:9200"), without_password("es:9200")
    ('https://es.internal:9200', 'es:9200')
    """
    parts = urlsplit(url)
    user, colon, _password = parts.netloc.rpartition("@")[0].partition(":")
    if not colon:
        return url
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


class Settings(BaseSettings):
    """Sift's settings. Each field is the environment variable ``SIFT_<NAME>``."""

    # no float setting takes inf or nan: an infinite duration crashed `sift worker` (an int()
    # of it), made /readyz a 500 (a socket timeout) or turned the re-drive off silently; each
    # duration is bounded too (DAY, mostly), as 1e20 seconds overflowed a thread's wait
    model_config = SettingsConfigDict(env_prefix="SIFT_", extra="ignore", allow_inf_nan=False)

    redis_url: str | None = None
    search_backend: Literal["embedded", "elasticsearch"] = "embedded"
    data_dir: Path = Path(".sift/data")
    elasticsearch_url: str | None = None
    elasticsearch_api_key: str | None = None
    # A cluster whose certificate a private CA signed (ECK's, Elasticsearch 9's own security
    # setup): trust the CA's PEM bundle, or pin the SHA-256 fingerprint of a certificate the
    # server sends (its own or its CA's, hex, colons allowed). Unset: the system's roots.
    elasticsearch_ca_certs: Path | None = None
    elasticsearch_ssl_fingerprint: str | None = Field(
        default=None, pattern=r"^[0-9A-Fa-f]{2}(?::?[0-9A-Fa-f]{2}){31}$"
    )
    # Elasticsearch (DESIGN.md §6). Tenant T's Sift index NAME is the alias
    # <prefix><key of T>--NAME; a prefix of at most 64 keeps every name under ES's 255 bytes.
    # ES refuses an index name starting with - _ or +, and hides one starting with a dot.
    elasticsearch_index_prefix: str = Field(
        default="sift-", max_length=64, pattern=r"^(?:[a-z0-9][a-z0-9_.-]*)?$"
    )
    elasticsearch_native_rrf: bool = False  # fuse in ES (retriever.rrf); needs a licence
    elasticsearch_num_candidates: int = Field(default=200, ge=1, le=10_000)
    elasticsearch_vector_quantization: Literal["int8_hnsw", "hnsw", "bbq_hnsw"] = "int8_hnsw"
    elasticsearch_vector_dims: int = Field(default=384, ge=1, le=4096)
    elasticsearch_shards: int = Field(default=1, ge=1, le=1024)
    elasticsearch_replicas: int = Field(default=1, ge=0, le=16)
    # index.gc_deletes of every index Sift makes: a delete's tombstone must outlast the
    # longest an ingest accepted before it can still run (redeliveries of each of its retries'
    # messages: 26,940 s at the defaults, worker.queue.config.ingest_redelivery_window), or
    # it wins. At most 30 days, a hundred times that window: Elasticsearch refuses a time
    # value past its range, so every index Sift made was refused
    elasticsearch_gc_deletes_seconds: int = Field(default=27_000, ge=60, le=30 * DAY)
    # the analyzer of the text and title fields of the indexes Sift makes from now on (an
    # index keeps the one it was made with: a reindex makes a new one, from the template)
    elasticsearch_analyzer: ElasticsearchAnalyzer = "english"
    elasticsearch_refresh: Literal["wait_for", "true", "false"] = "wait_for"
    elasticsearch_request_timeout: float = Field(default=10.0, gt=0, le=DAY)
    elasticsearch_bulk_chunk_size: int = Field(default=500, ge=1, le=10_000)
    # Field names, so an existing index can be searched as it is.
    elasticsearch_id_field: str = Field(default="doc_id", min_length=1)
    elasticsearch_text_field: str = Field(default="text", min_length=1)
    elasticsearch_title_field: str = "title"  # empty: the index has no title field
    elasticsearch_vector_field: str = Field(default="vector", min_length=1)
    elasticsearch_tenant_field: str = Field(default="tenant", min_length=1)
    elasticsearch_revision_field: str = Field(default="revision", min_length=1)
    elasticsearch_metadata_field: str = Field(default="metadata", min_length=1)
    # a keyword with each vector's embedding model; empty: not recorded, and not checked
    elasticsearch_model_field: str = "embedding_model"
    # a keyword of typed metadata tokens, what filters match (JSON-value equality); empty:
    # none, and filters compare the metadata field as text
    elasticsearch_metadata_terms_field: str = "metadata_terms"
    # a long with each document's write version, so a drop deletes only what was written
    # before it; empty: none, and a drop deletes the tenant's index whole
    elasticsearch_write_version_field: str = "write_version"
    # the only model Sift ships, so nothing reads it: the embedder names itself (its MODEL_ID)
    embedding_model: Literal["all-MiniLM-L6-v2-onnx-int8"] = "all-MiniLM-L6-v2-onnx-int8"
    # onnxruntime threads per embedding call; 0 = one per core. A worker embeds many queries
    # at once from its own threads, so one each avoids the pool's spinning on 2 cores.
    embedding_threads: int = Field(default=1, ge=0, le=64)
    # Threads of a process in a search's CPU-bound stages (query embedding, the embedded
    # backend's retrieval) at once; the rest wait off the GIL. 0 = one per core, plus one.
    cpu_slots: int = Field(default=0, ge=0, le=1024)
    # Run the model's matrix products in int8 (onnxruntime dynamic quantization, per channel;
    # the graph is made once and kept in SIFT_MODEL_CACHE_DIR) instead of dequantizing its
    # int8 weights to fp32: about 2.2x faster, vectors at cosine >= 0.99 to the fp32 path.
    # Ingest and search must agree: re-ingest after changing it.
    embedding_int8_compute: bool = True
    # where derived model files (the int8-compute graph) are kept, made once per machine
    model_cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "sift")

    generation_model: str | None = Field(default=None, pattern=r"^anthropic:[A-Za-z0-9._-]+$")
    generation_timeout_seconds: float = Field(default=20.0, gt=0, le=DAY)
    generation_max_requests: int = Field(default=3, ge=1, le=10)
    # max_tokens is the thinking allowance + tokens per position x positions (a search's
    # limit, up to MAX_LIMIT: 100) + 16: at these bounds 54,416, within the 64K maximum output of
    # Anthropic's current models that allow least (Haiku 4.5; the 4.5 family's; 4.6's 128K),
    # which refuse any request asking more, every rerank a 400
    generation_thinking_tokens: int = Field(default=1024, ge=0, le=48_000)
    generation_tokens_per_position: int = Field(default=8, ge=1, le=64)
    # output_config.effort: auto (low where the model is known to take it), a level (always
    # sent, for a model newer than the table), or none / empty (never sent)
    generation_effort: Literal["auto", "low", "medium", "high", "xhigh", "max"] | None = "auto"

    rerank_enabled: bool = False
    rerank_candidate_limit: int = Field(default=30, ge=1, le=MAX_CANDIDATE_LIMIT)
    # The default weighted RRF (an index's settings and a request's ``fusion`` override it):
    # a weight per channel, non-negative and finite, not all 0; a channel left out counts 1.
    fusion_weights: Annotated[FusionWeights, NoDecode] = Field(
        default_factory=lambda: FusionWeights(bm25=1.0, knn=1.0)
    )
    fusion_rank_constant: int = Field(default=RRF_K, ge=1, le=MAX_RANK_CONSTANT)
    # ``rrf`` (reciprocal ranks) or ``linear`` (weights times min-max normalised scores).
    fusion_method: Literal["rrf", "linear"] = "rrf"
    # at most a document's own longest text: a larger budget is the same as none
    rerank_candidate_max_chars: int = Field(default=1200, ge=50, le=MAX_DOCUMENT_CHARS)
    rerank_failure_policy: Literal["fail_closed", "fail_open"] = "fail_closed"
    vector_min_similarity: float | None = Field(default=None, ge=-1.0, le=1.0)
    search_deadline_seconds: float = Field(default=30.0, gt=0, le=DAY)

    api_keys_file: Path | None = None
    api_keys: Annotated[list[ApiKey], NoDecode] = Field(default_factory=list)
    # the keys as read and checked once (the file's path, SIFT_API_KEYS's list, the keys of
    # both): :meth:`all_api_keys`
    _keys_read: tuple[Path | None, list[ApiKey], list[ApiKey]] | None = PrivateAttr(default=None)
    webhook_allow_private_networks: bool = False
    # also the most the gateway waits for a webhook URL's host to resolve at registration
    webhook_connect_timeout_seconds: float = Field(default=5.0, gt=0, le=DAY)
    webhook_read_timeout_seconds: float = Field(default=15.0, gt=0, le=DAY)
    # The wall-clock cap on one delivery, connect to status line: httpx's timeouts are per
    # read, so a receiver trickling its headers a byte at a time never trips them.
    webhook_total_timeout_seconds: float = Field(default=30.0, gt=0, le=DAY)
    # Deliveries at once in one worker process; one more is put off, not waited for, so
    # slow receivers cannot take the threads searches and batch items run on.
    webhook_deliveries_per_process: int = Field(default=16, ge=1, le=5000)
    # Of those, one tenant's at once; one more of that tenant's is put off too, so one
    # tenant's hung receiver cannot hold every slot while the others' webhooks wait (and a
    # quarter of the slots are kept for tenants sending nothing else: TenantSlots). Not a
    # quarter: one tenant's receiver a round trip away needs most of them (at 100 ms, 12 a
    # process are 120 webhooks a second).
    webhook_deliveries_per_tenant: int = Field(default=12, ge=1, le=5000)
    # Multiplies the retry schedule (1.0 = Svix-like hours); tests set it tiny.
    webhook_retry_scale: float = Field(default=1.0, ge=0, le=10)  # 10 h waits become 100 h
    prices: Annotated[dict[str, Price], NoDecode] = Field(
        default_factory=lambda: dict(DEFAULT_PRICES)
    )
    # The provider's limits per model ({"claude-haiku-4-5": {"rpm": 4000, "itpm": 400000,
    # "otpm": 80000, "economy": {"rpm": 4000, "queued": 500000}}}): every worker process then
    # draws on one budget per model and lane in Redis (worker/adapters/rate_budget/). A model
    # not named here is metered once the provider's anthropic-ratelimit-* headers have told its
    # limits.
    rate_limits: Annotated[dict[str, RateLimit], NoDecode] = Field(default_factory=dict)
    rate_budget_enabled: bool = True  # false: no shared budget, each process on its own

    # --- the queue (issue 3) ---
    # Celery's pool; set it here, not with --pool: Celery cannot tell an explicit
    # "--pool prefork" from its default, so a configured pool always wins over the flag.
    worker_pool: Literal["threads", "prefork", "solo"] = "threads"
    # Celery worker processes `sift worker` runs under one supervisor; 0: one per core (a
    # threads pool is bound by the GIL to about one core). 1: the process is the worker.
    worker_processes: int = Field(default=0, ge=0, le=256)
    worker_concurrency: int = Field(default=300, ge=1, le=5000)  # threads per worker process
    rerank_max_in_flight: int = Field(default=300, ge=1, le=5000)  # model calls per process
    batch_chunk_size: int = Field(default=25, ge=1, le=1000)  # batch items per chunk task
    batch_item_concurrency: int = Field(default=300, ge=1, le=5000)  # batch items at once
    task_max_retries: int = Field(default=3, ge=0, le=20)  # retries of a retryable error
    task_max_deliveries: int = Field(default=3, ge=1, le=20)  # deliveries before poison
    worker_soft_shutdown_seconds: float = Field(default=10.0, ge=0, le=DAY)
    # When a killed worker's unacked messages come back; unset: derived to outlast the
    # longest task. A test sets it short; it must stay longer than any one task. At most a
    # week (the derived one is about 27 min at the defaults; no task runs for days): a longer
    # one never puts a message back, and makes the ingest redelivery window absurd
    broker_visibility_timeout_seconds: int | None = Field(default=None, ge=1, le=7 * DAY)
    # The re-drive (worker/queue/redrive.py): every this many seconds one worker looks for searches
    # and batches idle longer than the stall threshold whose task messages the broker lost,
    # and enqueues them again. 0 turns the sweeper off.
    redrive_interval_seconds: float = Field(default=30.0, ge=0, le=DAY)
    redrive_stall_seconds: float = Field(default=120.0, ge=0, le=DAY)
    # Dead-worker recovery (worker/queue/liveness.py): every worker process refreshes a heartbeat
    # this often and checks (one worker at a time) for deliveries held by a worker whose
    # heartbeat is older than SIFT_WORKER_DEAD_AFTER_SECONDS; those go back to their queue.
    worker_heartbeat_seconds: float = Field(default=2.0, gt=0, le=60)
    worker_dead_after_seconds: float = Field(default=10.0, gt=0, le=600)
    # an unacked delivery no worker claims (its worker died in the milliseconds between taking
    # it and recording it) goes back once it is this old
    worker_orphan_delivery_seconds: float = Field(default=60.0, gt=0, le=DAY)
    # Past this many queued searches and batch items the gateway answers 429; 0: no limit.
    # At most 100 million: Redis holds no such queue (tens of GB), so a larger one is none.
    max_backlog: int = Field(default=0, ge=0, le=100_000_000)
    # How long a job's record and results stay in Redis from the write that ended it (the
    # gateway's and the workers' must agree). At least 2 days: a webhook's retries (33 h)
    # and an Idempotency-Key's 24 h run within it.
    result_retention_seconds: int = Field(
        default=RESULT_TTL_SECONDS, ge=MIN_RESULT_RETENTION_SECONDS, le=90 * 24 * 3600
    )
    # How many indexes one tenant may hold (each costs a FTS5 table, or an Elasticsearch
    # shard): a write that would make one more fails index_limit_reached; 0: no limit.
    # at most 100,000 (an Elasticsearch cluster holds 1,000 shards a node by default)
    max_indexes_per_tenant: int = Field(default=100, ge=0, le=100_000)
    # at most 1 GiB: the gateway reads a body into memory and parses it (several times its
    # size); the largest request the limits allow (1,000 documents of 100,000 characters)
    # is a few hundred MB
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, le=1024**3)
    runtime_factory: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.]+:[A-Za-z0-9_]+$")

    # --- the economy lane (issue 7): Message Batches at half the price ---
    # errored or expired requests are resubmitted until this long after the batch was submitted
    economy_deadline_seconds: float = Field(default=86_400.0, gt=0, le=30 * DAY)
    economy_poll_seconds: float = Field(default=30.0, gt=0, le=DAY)  # a provider batch's first poll
    economy_poll_max_seconds: float = Field(default=600.0, gt=0, le=DAY)  # the backoff's cap
    economy_max_requests_per_batch: int = Field(
        default=ECONOMY_MAX_REQUESTS_PER_BATCH, ge=1, le=ECONOMY_MAX_REQUESTS_PER_BATCH
    )
    economy_max_batch_bytes: int = Field(
        default=ECONOMY_MAX_BATCH_BYTES, ge=65_536, le=ECONOMY_MAX_BATCH_BYTES
    )

    # the level of Sift's, Celery's and uvicorn's loggers; third-party loggers that would
    # print request bodies (the model SDK, httpx, httpcore) stay at WARNING or above
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    gateway_port: int = Field(default=8080, ge=1, le=65535)
    # How long the gateway waits for Redis to answer one command before its request is 503
    # (a Redis that accepts connections and never answers: stopped, swapping, cut off). Its
    # commands answer in milliseconds (a 100,000-query batch's writes: under 0.1 s each).
    gateway_redis_timeout_seconds: float = Field(default=10.0, gt=0, le=DAY)
    worker_metrics_port: int = Field(default=9808, ge=0, le=65535)
    # When set, the gateway's /metrics answers only `Authorization: Bearer <this>` (Prometheus's
    # `authorization` scrape option); a tenant's API key is not enough. Unset: open, like the
    # workers' port, so keep the gateway's /metrics off any network tenants reach.
    # Stripped, as the presented token is: a Secret made from a file ends with its newline.
    metrics_token: (
        Annotated[str, StringConstraints(strip_whitespace=True, min_length=16)] | None
    ) = None
    prometheus_url: str = "http://127.0.0.1:9090"  # what `sift cost` reads

    # --- the CLI client (``sift ingest``, ``sift search``, ``sift batch``) ---
    url: str = "http://127.0.0.1:8080"  # SIFT_URL, the gateway the CLI talks to
    api_key: str | None = None  # SIFT_API_KEY, sent as the bearer token

    @model_validator(mode="before")
    @classmethod
    def _decode_json(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in ("api_keys", "prices", "rate_limits", "fusion_weights"):
                if name in data:
                    try:
                        if name == "fusion_weights" and _blank(data[name]):
                            continue  # refused by _weights_given, naming it
                        data[name] = _json_or_empty(data[name])
                        if name in ("rate_limits", "fusion_weights") and data[name] == []:
                            data[name] = {}
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"SIFT_{name.upper()} is not valid JSON: {exc}") from exc
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        """An optional setting's empty variable (``SIFT_VECTOR_MIN_SIMILARITY=``) is unset,
        except the metrics token's: an empty one (a Secret gone missing) must not open
        ``/metrics``, so it stays an error."""
        name = info.field_name
        if value != "" or name is None or name == "metrics_token":
            return value
        return None if type(None) in get_args(cls.model_fields[name].annotation) else value

    @field_validator("rate_limits", mode="before")
    @classmethod
    def _bare_model_names(cls, value: Any) -> Any:
        """A model named as SIFT_GENERATION_MODEL names it (``anthropic:claude-haiku-4-5``) is
        that model: its limits were kept under a name no budget looks up, unmetered."""
        if not isinstance(value, dict):
            return value
        named: dict[Any, Any] = {}
        for name, limits in value.items():
            bare = name.removeprefix("anthropic:") if isinstance(name, str) else name
            if bare in named:
                raise ValueError(f"{bare}: given twice, also as anthropic:{bare}; give one")
            named[bare] = limits
        return named

    @field_validator("fusion_weights", mode="before")
    @classmethod
    def _weights_given(cls, value: Any) -> Any:
        """Not an unset setting, whose empty variable is the default: its default is weights,
        and a compose file's unset ``${FUSION_WEIGHTS}`` was taken for them, silently."""
        if _blank(value):
            raise ValueError('is empty: give JSON weights ({"bm25": 1, "knn": 1}), or unset it')
        return value

    @field_validator("data_dir", "model_cache_dir", mode="before")
    @classmethod
    def _a_folder(cls, value: Any) -> Any:
        """A folder, never the working directory by accident: ``Path("")`` is ``.``, so an
        empty ``SIFT_DATA_DIR`` (a compose file's unset ``${DATA_DIR}``) put the index, and
        ``sift up``'s AOF, logs and development key, wherever the process started."""
        if isinstance(value, str) and not value.strip():
            raise ValueError("is empty: give a folder, or unset the variable for the default")
        return value

    @field_validator(
        *(f"elasticsearch_{name}_field" for name in ("id", "text", "title", "vector", "tenant",
          "revision", "metadata", "model", "metadata_terms", "write_version")),
    )  # fmt: skip
    @classmethod
    def _a_field_name(cls, value: str) -> str:
        """A field's name, or (where the field may be left out) ``""``: ``" "`` passed
        ``min_length=1``, the name of a field made of spaces."""
        if value and not value.strip():
            raise ValueError("is blank: give a field's name")
        return value

    @field_validator("redis_url")
    @classmethod
    def _a_redis_url(cls, value: str | None) -> str | None:
        """A URL redis-py and kombu read. Anything else, such as ``127.0.0.1:6379`` (a compose
        file's spelling), would stop the gateway on redis-py's traceback and have ``sift
        worker``'s Celery retry an AMQP broker made of it for as long as it ran."""
        if value is None:
            return value
        parts, shown = urlsplit(value), repr(without_password(value))
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                "must start with redis://, rediss:// or unix:// (redis://127.0.0.1:6379/0), "
                f"not {shown}"
            )
        if parts.scheme != "unix":
            try:
                port = parts.port
            except ValueError:  # not a number, or past 65535
                port = 0
            if port is not None and not 1 <= port <= 65535:
                raise ValueError(f"the port must be a number from 1 to 65535, not in {shown}")
        # the database: redis-py reads the path (or ?db=), kombu the path; "abc" was db 0 in
        # the gateway, and an exit 0 of the worker
        databases = parse_qs(parts.query).get("db", [])
        path = "" if parts.scheme == "unix" else unquote(parts.path)
        if not re.fullmatch(r"/?[0-9]*", path) or not all(
            re.fullmatch("[0-9]+", db) for db in databases
        ):
            raise ValueError(
                f"the database (the path, or ?db=) must be a number from 0, as in "
                f"redis://127.0.0.1:6379/0, not that of {shown}"
            )
        # the certificate check: redis-py takes these three words only, kombu raised KeyError
        # on any other (the worker's traceback) and the gateway's first command RedisError
        if not set(parse_qs(parts.query).get("ssl_cert_reqs", [])) <= REDIS_CERT_CHECKS:
            raise ValueError(f"ssl_cert_reqs must be required, optional or none, not in {shown}")
        return value

    @field_validator("url", "prometheus_url", "elasticsearch_url")
    @classmethod
    def _an_http_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        """An http(s) URL with a host (and for Elasticsearch, whose client asks for one, a
        port). Without it, ``SIFT_URL=127.0.0.1:8080`` would have every CLI read retry for two
        minutes what no retry mends."""
        if value is None:
            return value
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError:  # not a number, or out of range
            port = None
        needs_port = info.field_name == "elasticsearch_url"
        if parts.scheme not in ("http", "https") or not parts.hostname or (needs_port and not port):
            example = "https://es.internal:9200" if needs_port else "http://127.0.0.1:8080"
            with_port = ", a host and a port" if needs_port else " and a host"
            shown = without_password(value)
            raise ValueError(f"must be http:// or https://{with_port} ({example}), not {shown!r}")
        return value

    @field_validator("gateway_port", "worker_metrics_port", mode="before")
    @classmethod
    def _service_link_is_unset(cls, value: Any) -> Any:
        """Kubernetes gives every pod ``SIFT_GATEWAY_PORT=tcp://10.96.0.7:80`` for a Service
        named ``sift-gateway`` (:data:`NOT_SETTINGS`): an address, never this setting, so
        the default stands."""
        if isinstance(value, str) and _SERVICE_LINK.fullmatch(value):
            raise PydanticUseDefault
        return value

    @field_validator("generation_effort", mode="before")
    @classmethod
    def _effort_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and value.lower() == "none" else value

    @model_validator(mode="after")
    def _rerank_needs_a_model(self) -> Settings:
        if self.rerank_enabled and not self.generation_model:
            raise ValueError(
                "SIFT_RERANK_ENABLED=true needs SIFT_GENERATION_MODEL "
                "(for example anthropic:claude-haiku-4-5)"
            )
        return self

    @model_validator(mode="after")
    def _effort_the_model_takes(self) -> Settings:
        """A level the model is known to refuse would fail every call with a 400."""
        model = self.generation_model_id
        why = refused_effort(model, self.generation_effort) if model else None
        if why:
            raise ValueError(
                f"SIFT_GENERATION_EFFORT={self.generation_effort} is refused by "
                f"SIFT_GENERATION_MODEL: {why} (auto sends only what the model takes)"
            )
        return self

    @model_validator(mode="after")
    def _one_way_to_trust_elasticsearch(self) -> Settings:
        ca, pin = self.elasticsearch_ca_certs is not None, bool(self.elasticsearch_ssl_fingerprint)
        # the client checks only the fingerprint when given one: the CA would be ignored
        if ca and pin:
            raise ValueError(
                "SIFT_ELASTICSEARCH_CA_CERTS, SIFT_ELASTICSEARCH_SSL_FINGERPRINT: give one "
                "(with a fingerprint the client checks no chain, so the CA would be ignored)"
            )
        url = self.elasticsearch_url or ""
        if (ca or pin) and url and not url.lower().startswith("https://"):
            name = "SIFT_ELASTICSEARCH_CA_CERTS" if ca else "SIFT_ELASTICSEARCH_SSL_FINGERPRINT"
            shown = without_password(url)
            raise ValueError(f"{name} needs an https:// SIFT_ELASTICSEARCH_URL, not {shown!r}")
        return self

    @model_validator(mode="after")
    def _bbq_has_its_dimensions(self) -> Settings:
        """Elasticsearch refuses a ``bbq_hnsw`` vector field of fewer than 64 dimensions
        (its ``BBQ_MIN_DIMS``): every tenant's first write would fail on the template."""
        dims = self.elasticsearch_vector_dims
        if self.elasticsearch_vector_quantization == "bbq_hnsw" and dims < 64:
            raise ValueError(
                "SIFT_ELASTICSEARCH_VECTOR_QUANTIZATION=bbq_hnsw needs "
                f"SIFT_ELASTICSEARCH_VECTOR_DIMS of at least 64 (Elasticsearch refuses fewer), "
                f"not {dims}: use int8_hnsw or hnsw"
            )
        return self

    @model_validator(mode="after")
    def _heartbeat_outlives_its_interval(self) -> Settings:
        if self.worker_dead_after_seconds < 3 * self.worker_heartbeat_seconds:
            raise ValueError(
                "SIFT_WORKER_DEAD_AFTER_SECONDS must be at least 3x SIFT_WORKER_HEARTBEAT_SECONDS "
                "(a worker missing one beat is not dead)"
            )
        return self

    @property
    def generation_model_id(self) -> str | None:
        """The provider's model id, without the ``anthropic:`` prefix."""
        return self.generation_model.split(":", 1)[1] if self.generation_model else None

    @property
    def native_fusion(self) -> bool:
        """The backend fuses both channels itself (Elasticsearch's retriever, one request)."""
        return self.search_backend == "elasticsearch" and self.elasticsearch_native_rrf

    def all_api_keys(self) -> list[ApiKey]:
        """The keys of ``SIFT_API_KEYS_FILE`` (a JSON list) and of ``SIFT_API_KEYS``, checked
        as one list (:func:`check_api_keys`): a ConfigError for a key of two tenants or a
        tenant of two webhook secrets, in the gateway and the workers alike.

        The file is read once, at the first call (a worker makes it at its start, the gateway
        at its own), and kept: an edit takes effect at a restart, for the gateway and the
        workers alike (docs/security.md's rotation). A worker read it again at every webhook
        attempt, so a half-written edit failed every tenant's webhooks, and each attempt
        parsed every entry anew (170 ms of CPU at 10,000 entries)."""
        read = self._keys_read
        # a copy given another file, or other SIFT_API_KEYS, reads and checks them again
        if read is None or read[0] != self.api_keys_file or read[1] is not self.api_keys:
            keys = list(self.api_keys)
            if self.api_keys_file is not None:
                keys += _read_keys_file(self.api_keys_file)
            check_api_keys(keys)
            read = (self.api_keys_file, self.api_keys, keys)
            self._keys_read = read
        return list(read[2])


def check_api_keys(keys: Sequence[ApiKey]) -> None:
    """A ConfigError, naming the tenants or the entries and quoting no key nor secret, for
    keys the gateway and the workers would read differently:

    - one key for two tenants (a pasted entry, a digest of another tenant's key): the
      gateway served its holder whichever tenant was listed last;
    - one tenant given different webhook secrets (``webhook_secret``, and
      ``webhook_secret_previous`` while it rotates) by two entries (a second key made with a
      fresh secret, a rotation applied to one entry of two): a tenant's webhooks are signed
      with one secret, which the worker takes from its first entry, so the other was never
      used and a receiver holding it refused every webhook. Only the gateway checked this: a
      worker given the file it refused started, and signed with the first entry's secret.
    """
    owners: dict[bytes, str] = {}
    first: dict[str, tuple[int, list[str]]] = {}
    for i, key in enumerate(keys):
        other = owners.setdefault(key.digest(), key.tenant)
        if other != key.tenant:
            raise ConfigError(
                f"SIFT_API_KEYS, SIFT_API_KEYS_FILE: one key is given for tenants "
                f"{other!r} and {key.tenant!r}; a key must decide one tenant"
            )
        index, secrets = first.setdefault(key.tenant, (i, key.webhook_secrets()))
        if key.webhook_secrets() != secrets:
            raise ConfigError(
                f"SIFT_API_KEYS, SIFT_API_KEYS_FILE: tenant {key.tenant!r} is given "
                f"different webhook secrets by entries {index} and {i} (SIFT_API_KEYS's, then "
                "the file's); its webhooks are signed with one secret: give each of its "
                "entries the same webhook_secret (and webhook_secret_previous)"
            )


def _read_keys_file(path: Path) -> list[ApiKey]:
    """The entries of the keys file at ``path``, validated; when it cannot be read, a
    ConfigError of one line naming ``SIFT_API_KEYS_FILE`` and the file once, then each
    problem by its entry and field, never its value:

    ``SIFT_API_KEYS_FILE (keys.json): entry 0, field key: String should have at least 8
    characters; entry 1: Input should be an object``"""
    try:
        return _API_KEY_LIST.validate_json(path.read_bytes())
    except ValidationError as exc:
        problems = "; ".join(
            _entry_problem(error["loc"], validation_message(error["msg"])) for error in exc.errors()
        )
        raise ConfigError(f"SIFT_API_KEYS_FILE ({path}): {problems}") from exc
    except OSError as exc:  # its strerror: str(exc) names the file again
        raise ConfigError(f"SIFT_API_KEYS_FILE ({path}): {exc.strerror or exc}") from exc


def _entry_problem(loc: tuple[int | str, ...], message: str) -> str:
    """A keys file's problem where pydantic's ``loc`` puts it: the entry, then its field.

    >>> _entry_problem((0, "key"), "Field required"), _entry_problem((), "Invalid JSON")
    ('entry 0, field key: Field required', 'Invalid JSON')
    """
    where = [f"entry {loc[0]}"] if loc else []
    if len(loc) > 1:
        where.append("field " + ".".join(str(step) for step in loc[1:]))
    return ": ".join([", ".join(where), message]) if where else message


# SIFT_ variables set on purpose that are no setting: compose's image tag and KEDA's Redis
# address (deploy/), the tests' own (SIFT_TEST_*), and Kubernetes's service links, which give
# a pod every Service's address (the Service sift-gateway: SIFT_GATEWAY_SERVICE_HOST,
# SIFT_GATEWAY_PORT_8080_TCP..., and SIFT_GATEWAY_PORT=tcp://..., here a setting set anyway;
# the Service sift: SIFT_SERVICE_HOST, SIFT_PORT_80_TCP..., SIFT_PORT=tcp://...).
NOT_SETTINGS = frozenset({"SIFT_IMAGE", "SIFT_REDIS_ADDRESS"})
_NOT_SETTINGS = re.compile(
    r"SIFT_TEST_\w+|SIFT(?:_\w+)?_(?:SERVICE_HOST|SERVICE_PORT(?:_\w+)?"
    r"|PORT_\d+_(?:TCP|UDP|SCTP)(?:_PROTO|_PORT|_ADDR)?)"
)
_SERVICE_LINK = re.compile(r"(?:tcp|udp|sctp)://\S*")


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """Each ``SIFT_`` variable of ``environ`` that is no setting (nor one of
    :data:`NOT_SETTINGS`), described with the closest setting's name: a misspelled
    ``SIFT_RERANK_ENABLE=true`` did nothing, silently.

    >>> unknown_variables({"SIFT_RERANK_ENABLE": "true", "SIFT_LOG_LEVEL": "INFO"})
    ['SIFT_RERANK_ENABLE is no setting (did you mean SIFT_RERANK_ENABLED?)']

    Names are compared after the ``SIFT_`` every one shares, so a name like no setting gets
    no guess:

    >>> unknown_variables({"SIFT_FOO_BAR": "1"})
    ['SIFT_FOO_BAR is no setting']
    """
    known = {f"SIFT_{name.upper()}" for name in Settings.model_fields}
    problems = []
    for name, value in sorted(environ.items()):
        upper = name.upper()  # pydantic-settings reads the names case-insensitively
        if not upper.startswith("SIFT_") or upper in known or upper in NOT_SETTINGS:
            continue
        if _NOT_SETTINGS.fullmatch(upper) or (
            upper.endswith("_PORT") and _SERVICE_LINK.fullmatch(value)
        ):
            continue
        names = [name.upper() for name in Settings.model_fields]
        close = difflib.get_close_matches(upper.removeprefix("SIFT_"), names, n=1)
        hint = f" (did you mean SIFT_{close[0]}?)" if close else ""
        problems.append(f"{name} is no setting{hint}")
    return problems


def load_settings(**overrides: Any) -> Settings:
    """Read the settings, turning a validation error into a ConfigError that names the variable.
    A ``SIFT_`` variable that is no setting is a ConfigError too (:func:`unknown_variables`)."""
    unknown = unknown_variables(os.environ)
    if unknown:
        raise ConfigError(
            "invalid settings; "
            + "; ".join(unknown)
            + " (docs/settings.md lists every SIFT_ variable)"
        )
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = [
            error_path(error["loc"]) + ": " + validation_message(error["msg"])
            for error in exc.errors()
        ]
        raise ConfigError("invalid settings; " + "; ".join(problems)) from exc


def error_path(loc: tuple[int | str, ...]) -> str:
    """Where a settings error is: the variable (pydantic's ``loc``'s first step, the field's
    name), then the path inside its JSON value, joined with dots.

    >>> error_path(("prices", "claude-haiku-4-5", "cache_creation")), error_path(())
    ('SIFT_PRICES.claude-haiku-4-5.cache_creation', 'settings')
    """
    steps = [str(step) for step in loc]
    if not steps:
        return "settings"
    return ".".join([f"SIFT_{steps[0].upper()}", *steps[1:]])

"""In-memory fakes of the ports, for unit tests of the pipeline through bootstrap."""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import httpx
import pytest

from worker.cli._http import Gateway
from worker.contract import Channel, DocumentIn, FilterValue, RerankInfo, SearchResult, SearchSpec
from worker.core.catalog import StoredDocument
from worker.core.pipeline import BeforeModel, holds_filters
from worker.core.types import (
    ChannelHit,
    ChannelQuery,
    ChannelResults,
    Document,
    IndexProbe,
    RerankPrompt,
    RerankReply,
    TokenUsage,
)
from worker.errors import BackendUnavailable, EmbeddingModelMismatch, IndexNotFound


class EmptyRuntime:
    """A worker runtime (:class:`worker.queue.base.Runtime`) with nothing behind it: each
    search finds no hits, each ingest writes all it is given. Tests subclass it and script
    the calls they are about."""

    def search(
        self,
        spec: SearchSpec,
        tenant: str,
        before_model: BeforeModel | None = None,
        *,
        spent: float = 0.0,
        answers: object = None,
    ) -> SearchResult:
        return SearchResult(hits=[], rerank=RerankInfo(applied=False))

    def ingest(
        self,
        index: str,
        tenant: str,
        documents: list[DocumentIn],
        progress: Callable[[int], None] | None = None,
        *,
        version: int | None = None,
    ) -> int:
        return len(documents)


class FakeEmbedder:
    """Bag-of-words vectors hashed into 64 dimensions: similar words, similar vectors."""

    model_id = "fake-bow-64"
    dimension = 64

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        out = []
        for text in texts:
            vec = [0.0] * self.dimension
            for word in text.lower().split():
                slot = int(hashlib.md5(word.encode()).hexdigest(), 16) % self.dimension
                vec[slot] += 1.0
            norm = math.sqrt(sum(v * v for v in vec)) or 1.0
            out.append([v / norm for v in vec])
        return out


def _same_json(held: object, wanted: object) -> bool:
    """Whether a metadata value equals a filter value as JSON values (docs/architecture.md,
    "Metadata filters"): numbers by value, a boolean only itself (``True == 1`` is not)."""
    if isinstance(held, bool) or isinstance(wanted, bool):
        return type(held) is type(wanted) and held == wanted
    return held == wanted


@dataclass
class _Row:
    tenant: str
    document: Document
    vector: list[float] | None


class InMemoryBackend:
    """Term-overlap 'BM25' and exact dot-product kNN over dicts; filters before the window."""

    name = "memory"

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, str], _Row] = {}
        self.calls: list[ChannelQuery] = []
        self.fail_next: int = 0
        self.models: dict[tuple[str, str], str] = {}  # (index, tenant) -> embedding model

    def channels(self, index: str, tenant: str) -> frozenset[Channel]:
        rows = [r for (i, t, _), r in self.rows.items() if i == index and t == tenant]
        if not rows:
            return frozenset()
        has_vectors = any(r.vector is not None for r in rows)
        return frozenset({"bm25", "knn"} if has_vectors else {"bm25"})

    def probe(self, index: str, tenant: str, *, timeout_seconds: float | None = None) -> IndexProbe:
        return IndexProbe(self.channels(index, tenant), self.models.get((index, tenant)))

    def holds(self, index: str, tenant: str) -> bool:
        return bool(self.channels(index, tenant))

    def upsert(
        self,
        index: str,
        tenant: str,
        documents: Sequence[Document],
        vectors: Sequence[Sequence[float]] | None,
        *,
        version: int | None = None,
        model: str | None = None,
    ) -> int:
        held = self.models.get((index, tenant))
        if vectors is not None and model is not None and held not in (None, model):
            raise EmbeddingModelMismatch(index, str(held), model)
        if vectors is not None and model is not None and documents:
            self.models[(index, tenant)] = model
        for i, doc in enumerate(documents):
            vector = list(vectors[i]) if vectors is not None else None
            self.rows[(index, tenant, doc.id)] = _Row(tenant, doc, vector)
        return len(documents)

    def stored_documents(
        self, index: str, tenant: str, ids: Sequence[str]
    ) -> dict[str, StoredDocument]:
        found = (self.rows.get((index, tenant, doc_id)) for doc_id in ids)
        return {
            row.document.id: StoredDocument(
                row.document.id,
                row.document.text,
                row.document.title,
                row.document.revision,
                row.document.metadata,
            )
            for row in found
            if row is not None
        }

    def holds_filters(self, document: StoredDocument, filters: Mapping[str, FilterValue]) -> bool:
        return holds_filters(document.metadata, filters)

    def retrieve(self, query: ChannelQuery) -> ChannelResults:
        self.calls.append(query)
        if self.fail_next:
            self.fail_next -= 1
            raise BackendUnavailable("fake backend is down")
        allowed = [
            r
            for (i, t, _), r in sorted(self.rows.items())
            if i == query.index
            and t == query.filters.tenant
            and all(
                _same_json(r.document.metadata.get(k), v) for k, v in query.filters.fields.items()
            )
        ]
        if not any(i == query.index for (i, _, _) in self.rows):
            raise IndexNotFound(query.index)
        hits: dict[Channel, list[ChannelHit]] = {}
        terms = set(query.text.lower().split())
        if "bm25" in query.channels:
            scored = []
            for r in allowed:
                words = f"{r.document.title} {r.document.text}".lower().split()
                score = float(sum(1 for w in words if w in terms))
                if score > 0:
                    scored.append(ChannelHit(r.document, score))
            scored.sort(key=lambda h: (-h.score, h.document.id))
            hits["bm25"] = scored[: query.size]
        if "knn" in query.channels and query.vector is not None:
            scored = [
                ChannelHit(
                    r.document, sum(a * b for a, b in zip(r.vector, query.vector, strict=True))
                )
                for r in allowed
                if r.vector is not None
            ]
            scored.sort(key=lambda h: (-h.score, h.document.id))
            hits["knn"] = scored[: query.size]
        return ChannelResults(hits=hits, seconds={c: 0.001 for c in hits})


@dataclass
class FakeClock:
    """Monotonic time that moves only when told to, or when something sleeps."""

    now: float = 1000.0
    sleeps: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@dataclass
class BusySlots:
    """CPU slots all held by other searches: one is had only after ``wait`` seconds."""

    clock: FakeClock
    wait: float

    def __enter__(self) -> None:
        self.clock.now += self.wait

    def __exit__(self, *exc: object) -> None:
        return None


Step = Callable[[RerankPrompt, float], RerankReply]


class ScriptedReranker:
    """A Reranker that plays a script of steps: each returns a reply or raises an error.

    A step may advance a FakeClock to stand for the time the call took.
    """

    def __init__(self, steps: Sequence[Step], model: str = "claude-haiku-4-5") -> None:
        self.model = model
        self.effort: str | None = None
        self.steps = list(steps)
        self.calls: list[tuple[RerankPrompt, float]] = []

    def rerank(self, prompt: RerankPrompt, timeout_seconds: float) -> RerankReply:
        self.calls.append((prompt, timeout_seconds))
        step = self.steps.pop(0) if self.steps else reply([1])
        return step(prompt, timeout_seconds)


USAGE = TokenUsage(
    input_tokens=1000,
    output_tokens=40,
    cache_read_input_tokens=200,
    cache_creation_input_tokens=100,
)


def reply(positions: Sequence[object], usage: TokenUsage = USAGE) -> Step:
    def step(prompt: RerankPrompt, timeout: float) -> RerankReply:
        return RerankReply(positions=list(positions), usage=usage, model="claude-haiku-4-5")

    return step


def fail(error: Exception, clock: FakeClock | None = None, takes: float = 0.0) -> Step:
    def step(prompt: RerankPrompt, timeout: float) -> RerankReply:
        if clock is not None:
            clock.now += min(takes, timeout) if takes else 0.0
        raise error

    return step


class RecordingRecorder:
    """A Recorder that counts every event, for exactly-once assertions."""

    def __init__(self) -> None:
        self.events: Counter[tuple[str, ...]] = Counter()
        self.usage: Counter[str] = Counter()
        self.cost = 0.0
        self.unread_tokens = 0
        self.search_seconds: list[float] = []

    def retrieval(self, backend: str, channel: str, seconds: float) -> None:
        self.events["retrieval", channel] += 1

    def retrieval_hits(self, backend: str, channel: str, hits: int) -> None:
        self.events["hits", channel] += 1

    def rerank_attempt(self, model: str, result: str) -> None:
        self.events["attempt", result] += 1

    def rerank_usage(self, model: str, usage: dict[str, int], cost_usd: float | None) -> None:
        self.usage.update(usage)
        self.cost += cost_usd or 0.0

    def rerank_done(self, model: str, outcome: str, seconds: float) -> None:
        self.events["rerank", outcome] += 1

    def rerank_unpriced(self, model: str) -> None:
        self.events["unpriced", model] += 1

    def rerank_unread(self, model: str, input_tokens: int) -> None:
        self.events["unread", model] += 1
        self.unread_tokens += input_tokens

    def rerank_outcome(self, policy: str, outcome: str) -> None:
        self.events["outcome", outcome] += 1

    def search_done(self, mode: str, outcome: str, seconds: float) -> None:
        self.events["search", outcome] += 1
        self.search_seconds.append(seconds)


def cli_answered_by(
    monkeypatch: pytest.MonkeyPatch, command: ModuleType, transport: httpx.BaseTransport
) -> None:
    """A CLI command module's gateway client sends to ``transport`` (the gateway's answers, or
    its failures, scripted), and its retries' back-off takes no time."""

    @contextlib.contextmanager
    def gateway(_: httpx.BaseTransport | None = None) -> Iterator[Gateway]:
        client = Gateway("http://sift.test", "k", transport=transport)
        try:
            yield client
        finally:
            client.close()

    monkeypatch.setattr(command, "gateway", gateway)
    monkeypatch.setattr(time, "sleep", lambda s: None)

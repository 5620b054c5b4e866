"""The ports: what the pipeline needs from the outside world, as Protocols.

Adapters live in :mod:`worker.adapters`; fakes for tests live in ``tests/``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Protocol

from worker.contract import Channel, FilterValue
from worker.core.catalog import (
    IndexInfo,
    IndexSize,
    ListedDocument,
    SearchSettings,
    StoredDocument,
)
from worker.core.types import (
    BudgetGrant,
    ChannelQuery,
    ChannelResults,
    Document,
    IndexProbe,
    RerankPrompt,
    RerankReply,
    TokenUsage,
)


class Embedder(Protocol):
    """Turns text into unit-length vectors."""

    model_id: str
    dimension: int

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One L2-normalised vector per text."""
        ...


class SearchBackend(Protocol):
    """A store with a BM25 channel and a kNN channel that filter inside the query."""

    name: str

    def channels(self, index: str, tenant: str) -> frozenset[Channel]:
        """The channels the tenant's part of this index can serve now (no vectors: no ``knn``).

        Empty when the tenant holds no document in the index. This is the test of "the
        index exists" a search makes, and it is the tenant's: an index only another tenant
        has must answer exactly like one that does not exist (same result, same cost). A
        backend may answer it from a memo kept for a while (:meth:`probe`'s); :meth:`holds`
        never does.
        """
        ...

    def holds(self, index: str, tenant: str) -> bool:
        """Whether the tenant holds a document in the index now, asked of the store every
        time, never of a memo: what a search finished long after its retrieval (an economy
        item) asks when none of its candidates is stored any more, the index maybe dropped
        in another process a moment ago. The tenant's, as :meth:`channels` is."""
        ...

    def probe(self, index: str, tenant: str, *, timeout_seconds: float | None = None) -> IndexProbe:
        """:meth:`channels` and the embedding model the tenant's vectors in the index were
        written with, in one request: what a search asks before it runs. A backend that
        waits on the network waits ``timeout_seconds`` at most (what is left of the
        search's deadline; None: its own request timeout)."""
        ...

    def retrieve(self, query: ChannelQuery) -> ChannelResults:
        """Run the asked channels. Raises BackendUnavailable or BackendRequestError."""
        ...

    def stored_documents(
        self, index: str, tenant: str, ids: Sequence[str]
    ) -> dict[str, StoredDocument]:
        """The tenant's documents of these ids as stored now, by id, in one request; an id
        it holds no document of (deleted, or never written) is left out. What a search
        finished long after its retrieval (an economy item) checks its candidates against."""
        ...

    def holds_filters(self, document: StoredDocument, filters: Mapping[str, FilterValue]) -> bool:
        """Whether a search with these metadata ``filters`` finds ``document`` (as
        :meth:`stored_documents` answered it), compared as this backend's filters compare:
        what a search finished long after its retrieval (an economy item) asks of a
        candidate written again meanwhile, so it drops only what its retrieval, run now,
        would not find."""
        ...

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
        """Insert or replace by id, both channels at once; answers how many were written.

        With a ``version`` (see :mod:`worker.core.catalog`), an id whose last accepted write
        (an upsert, a delete, a drop of the index) is newer is left as it is. ``model``
        names the embedder of ``vectors``: the first write of the tenant's index records it,
        and a write of another model's vectors raises
        :class:`~worker.errors.EmbeddingModelMismatch`, writing nothing, until the index is
        dropped."""
        ...

    def check(self) -> None:
        """At a worker's start, once: raise :class:`~worker.errors.ConfigError` if the store
        holds what this Sift cannot serve (a data dir of another schema version, indexes of
        an earlier layout), rather than failing each job the worker then takes."""
        ...


class IndexCatalog(Protocol):
    """The index lifecycle a backend offers besides search: list, read, delete.

    Every method is the tenant's: another tenant's index or document reads exactly like
    one that does not exist (None, or not listed), and is never deleted.
    """

    def indexes(
        self, tenant: str, after: str | None = None, limit: int | None = None
    ) -> list[IndexInfo]:
        """Up to ``limit`` (all, if None) of the tenant's indexes (those holding one of its
        documents) named after ``after`` (all, if None), by name (code point order)."""
        ...

    def index_info(self, index: str, tenant: str) -> IndexInfo | None: ...

    def document(self, index: str, tenant: str, doc_id: str) -> StoredDocument | None: ...

    def documents(
        self, index: str, tenant: str, after: str | None, limit: int
    ) -> list[ListedDocument] | None:
        """Up to ``limit`` of the tenant's documents with ids after ``after`` (all, if None),
        by id (code point order, as UTF-8 bytes compare); None when the tenant has no such
        index (an empty list: nothing after ``after``). A seek, not a scan, on each page."""
        ...

    def delete_documents(
        self, index: str, tenant: str, ids: Sequence[str], *, version: int | None = None
    ) -> int:
        """Delete by id from both channels; a tombstone of ``version`` for each id."""
        ...

    def delete_index(self, index: str, tenant: str, *, version: int | None = None) -> int:
        """Delete every document of the tenant in the index written before ``version``."""
        ...


class IndexSizing(Protocol):
    """A backend that sums what a tenant's index holds (the embedded one; Elasticsearch
    does not yet): a worker records it after each write (ingest, delete, drop) for the
    gateway's admission of batches."""

    def index_size(self, index: str, tenant: str) -> IndexSize | None:
        """The tenant's documents in the index and their stored bytes; None: it holds none."""
        ...


class IndexSettingsStorage(Protocol):
    """Where a backend keeps each tenant's index's own settings, beside the index's data, so
    they last as long as it does (a Redis that comes back empty keeps nothing of them).
    ``settings`` None is a cleared record: it still holds its version."""

    def stored_settings(
        self, indexes: Sequence[str], tenant: str
    ) -> list[tuple[dict[str, Any] | None, int] | None]:
        """For each of the tenant's ``indexes``, the settings last stored and their write
        version (None: never stored), in one round trip."""
        ...

    def store_settings(
        self, index: str, tenant: str, settings: Mapping[str, Any] | None, version: int
    ) -> bool:
        """Keep ``settings`` (None: clear them) if ``version`` is newer than the one held;
        False, storing nothing, if it is not."""
        ...


class IndexSettingsSource(Protocol):
    """Where a search finds its index's own settings (``PATCH /v1/indexes/{index}``)."""

    def get(self, index: str, tenant: str) -> SearchSettings:
        """The tenant's index's settings (empty when none are set); cheap enough per search."""
        ...


# What a wait inside :meth:`Reranker.rerank` before its request goes (the process's in-flight
# places: :class:`worker.runtime.ratelimit.ProviderLimiter`) asks every ``WAIT_CHECK_SECONDS``
# and once more as it ends: a batch item's cancel check, set around each attempt by the
# model calls, which raises ``Canceled`` or ``HandedBack`` to end the call unsent; None for a
# search.
SEND_CHECK: ContextVar[Callable[[], None] | None] = ContextVar("sift_send_check", default=None)


class Reranker(Protocol):
    """One listwise model call. Raises RerankAttemptError with the attempt's class (its
    ``sent`` False when the provider never saw the call: no request, no pause for others)."""

    model: str
    effort: str | None  # the output_config.effort it sends (None: none), for the trace

    def rerank(self, prompt: RerankPrompt, timeout_seconds: float) -> RerankReply: ...


class AnswerKeeper(Protocol):
    """Where one run of a search keeps its model's answer past its own process (the queue's
    run claim, in Redis): a worker killed after the model answered, before the result was
    saved, would otherwise have the search's next run pay for the same call again."""

    def saved(self) -> Mapping[str, Any] | None:
        """The answer an earlier run of this search kept (None: the model is to be called)."""
        ...

    def save(self, answer: Mapping[str, Any]) -> None:
        """Keep this run's answer (JSON-able data), just after the model call returns."""
        ...

    def slot_held(self, waited: float, ran: float = 0.0) -> None:
        """The run holds its CPU slot now, after ``waited`` seconds of waiting for one: its
        deadline starts here (the wait is a queue's, not the search's), so the run's record
        of its time and its lease, taken before the wait, are to start here too. Held again
        after a retrieval retry's back-off, the run had run ``ran`` seconds (its deadline
        leaves the wait out): its record goes on from there. Raises
        :class:`~worker.errors.RunTakenOver` when another run took its claim over meanwhile:
        this one is to stop before its model call."""
        ...

    def later(self, figures: Sequence[Callable[[], None]]) -> None:
        """The run's figures of the search (its retrieval's, its outcome and duration, its
        model answer's), to record once its result is saved (or the run is retried, or
        canceled before its model call): a run dying before that
        leaves them to the run finishing the search, which recorded them again on a kept
        answer when they were recorded before the save."""
        ...


class RateBudget(Protocol):
    """The provider's rate limits, shared by every process calling the model (one budget per
    model and lane). The pipeline reserves before each attempt and settles after it."""

    def reserve(
        self, prompt: RerankPrompt, max_wait: float, *, yields_probe: bool = False
    ) -> BudgetGrant:
        """Reserve one request, the prompt's estimated input tokens and its ``max_tokens``,
        if the budget frees them within ``max_wait`` seconds; the grant says how long to wait.
        ``yields_probe``: the search lets another search waiting go as the breaker's next
        probe (its own call went as the probe before and failed, or this is its last
        attempt): the breaker half open, another search waiting goes as the next probe, not
        this one."""
        ...

    def sent(self, waited: float) -> None:
        """A call went out to the provider after waiting ``waited`` seconds in all for the
        budget (its wait metric): one the process's own limiter held back is not counted."""
        ...

    def settle(
        self,
        grant: BudgetGrant,
        usage: TokenUsage | None,
        *,
        sent: bool = True,
        closes: bool = True,
        quiet: bool = True,
    ) -> None:
        """Give back what the call did not use (``usage`` as reported); ``None``: unknown,
        the reservation stands. ``sent`` False: the provider never saw the call, so its
        request is given back too, and a grant that was the breaker's probe lets the next
        call probe. An answer (``usage`` given) closes the breaker a 5xx opened, unless
        ``closes`` is False (a 429). ``quiet``: never raises: it comes after what happened
        to the call (billed, canceled, handed back), which a failure of the budget's store
        must not replace; a settlement not made leaves the share taken until the buckets
        refill it. Not ``quiet`` (an attempt to be retried), a failure of the store raises,
        as :meth:`pause` and the breaker's writes do."""
        ...

    def pause(self, seconds: float) -> None:
        """The provider answered 429: no call from any process for ``seconds``."""
        ...

    def paused_for(self) -> float:
        """Seconds left of a 429's pause on every process (0: none)."""
        ...

    def breaker_shut(self, grant: BudgetGrant) -> bool:
        """Whether the breaker holds back ``grant``'s call, admitted before: a 5xx opened it
        since, or it is not closed and the grant is not its probe (the probe goes alone)."""
        ...

    def trip(self, retry_after: float | None) -> None:
        """The provider answered 5xx (529 overloaded included): no call from any process for
        a while, then one alone until an answer that is not a 5xx (the breaker)."""
        ...

    def unanswered(self, grant: BudgetGrant) -> None:
        """``grant``'s call got no answer (a timeout, a connection lost): if it is the
        breaker's probe still out, it ends."""
        ...

    def answered(self, grant: BudgetGrant) -> None:
        """``grant``'s call was answered, neither 5xx nor 429, with no usage (a body that is
        not a message): the breaker closes if it was its probe."""
        ...

    def backlog(self) -> float:
        """Seconds a typical call reserved now would wait (reserving nothing)."""
        ...

    def shut(self) -> bool:
        """Whether the breaker holds every call now (open, or its probe out): the backlog
        a batch paces on reads a day."""
        ...

    def started(self) -> None:
        """This thread's batch item, paced by :meth:`backlog`, goes on to its call: it counts
        in every process's backlog until it reserves the call or :meth:`ended`."""
        ...

    def ended(self) -> None:
        """This thread's item no longer counts as started: its search ended (with or without
        a call)."""
        ...


class Recorder(Protocol):
    """Where the pipeline reports what it did; the metrics adapter implements it."""

    def retrieval(self, backend: str, channel: str, seconds: float) -> None: ...

    def retrieval_hits(self, backend: str, channel: str, hits: int) -> None:
        """How many hits a channel returned for one search, or fusion kept (``fuse``)."""

    def rerank_attempt(self, model: str, result: str) -> None: ...

    def rerank_usage(self, model: str, usage: dict[str, int], cost_usd: float | None) -> None:
        """One model call's usage by token type and its cost, as soon as the call reports
        them: a billed call shows even if its search never ends (the task dies, the item is
        canceled between economy rounds). ``cost_usd`` None: the model has no price."""

    def rerank_done(self, model: str, outcome: str, seconds: float) -> None: ...

    def rerank_unpriced(self, model: str) -> None:
        """One model call that reported usage the price table has no price for."""

    def rerank_unread(self, model: str, input_tokens: int) -> None:
        """One attempt sent that got no answer read (a timeout, a connection lost after the
        request went out), with its prompt's estimated ``input_tokens``: the provider may
        have billed it, but no usage says so."""

    def rerank_outcome(self, policy: str, outcome: str) -> None: ...

    def search_done(self, mode: str, outcome: str, seconds: float) -> None: ...


class NullRecorder:
    """A Recorder that records nothing."""

    def retrieval(self, backend: str, channel: str, seconds: float) -> None:
        pass

    def retrieval_hits(self, backend: str, channel: str, hits: int) -> None:
        pass

    def rerank_attempt(self, model: str, result: str) -> None:
        pass

    def rerank_usage(self, model: str, usage: dict[str, int], cost_usd: float | None) -> None:
        pass

    def rerank_done(self, model: str, outcome: str, seconds: float) -> None:
        pass

    def rerank_unpriced(self, model: str) -> None:
        pass

    def rerank_unread(self, model: str, input_tokens: int) -> None:
        pass

    def rerank_outcome(self, policy: str, outcome: str) -> None:
        pass

    def search_done(self, mode: str, outcome: str, seconds: float) -> None:
        pass

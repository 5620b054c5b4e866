"""The read path of a search: the probe that tells which channels a tenant's index can
serve (and its embedding model, remembered for a while), both channels in one
``_msearch`` or ES's own fusion in one ``_search``, and the parsing of their hits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.adapters.elasticsearch._bodies import _Bodies
from worker.adapters.elasticsearch._errors import (
    _index_missing,
    _raise_for_item,
    _raise_if_partial,
    _total,
    _translated,
)
from worker.contract import Channel
from worker.core.types import (
    ChannelHit,
    ChannelQuery,
    ChannelResults,
    Document,
    IndexProbe,
    derive_revision,
)
from worker.errors import BackendRequestError, IndexNotFound

#: How long a "this index has vectors" answer is trusted before asking ES again.
CHANNELS_TTL_SECONDS = 60.0
#: Past this many (alias, tenant) answers, expired ones are dropped as a new one is kept.
CHANNELS_MEMO_SIZE = 4096


class _Search(_Bodies):
    """The channels probe, the retrieval of both channels, native fusion, hit parsing."""

    def channels(self, index: str, tenant: str) -> frozenset[Channel]:
        """``bm25`` once the tenant holds a document in the index, plus ``knn`` once one of
        them holds a vector (and the field is a ``dense_vector``); empty otherwise."""
        return self.probe(index, tenant).channels

    def probe(self, index: str, tenant: str, *, timeout_seconds: float | None = None) -> IndexProbe:
        """The tenant's channels and the embedding model its vectors were written with.

        One ``_msearch`` on the tenant's own alias with two tenant-filtered probes
        (``terminate_after: 1``): the tenant's documents, and the tenant's documents with a
        vector; the second returns its one hit's model field (writes keep one model per
        tenant's index, so any vector's model is the index's). The alias existing is not
        enough: a drop by ids can leave it empty, and an empty index reads like none. A
        missing alias (a name another tenant has, or nobody) answers the same empty set
        after the same one round trip. The mapping is read only once the tenant's own
        vectors are found, and a positive answer (with the model) is kept per
        (alias, tenant) for ``CHANNELS_TTL_SECONDS``. Its requests together wait at most
        ``timeout_seconds`` (what is left of the search's deadline), within the request
        timeout: a search must not wait past its deadline on the probe alone.
        """
        alias = self.alias(index, tenant)
        seen = self._with_vectors.get((alias, tenant))
        if seen is not None and self._clock() - seen[0] < CHANNELS_TTL_SECONDS:
            return IndexProbe(frozenset({"bm25", "knn"}), seen[1])
        none = IndexProbe(frozenset())
        what = f"channels of index {index!r}"
        bound = self.request_timeout
        if timeout_seconds is not None:
            bound = min(bound, timeout_seconds)
        started = self._clock()
        with _translated(what, index, missing_ok=True) as missing:
            es = self._es(bound)
            response = es.msearch(index=alias, searches=self.probe_searches(tenant)).body
        if missing:
            return none
        answers = response.get("responses", [])
        if len(answers) != 2:
            raise BackendRequestError(f"_msearch answered {len(answers)} probes for 2 sent")
        if any(_index_missing(answer) for answer in answers):
            return none
        for answer in answers:
            _raise_for_item(answer, what, index)
        has_documents, has_vectors = (_total(answer) > 0 for answer in answers)
        bm25: IndexProbe = IndexProbe(frozenset({"bm25"}))
        if not has_documents:
            return none
        if not has_vectors:
            return bm25
        # the mapping read has what the _msearch left of the bound (each given all of it, the
        # probe waited up to twice that); none left, it times out at once
        left = max(bound - (self._clock() - started), 0.001)
        with _translated(what, index, missing_ok=True) as missing:
            mappings = self._es(left).indices.get_mapping(index=alias).body
        if missing:
            return none
        if not self._maps_vectors(mappings):
            return bm25
        model = self._model_of(answers[1])
        self._saw_vectors(alias, tenant, model)
        return IndexProbe(frozenset({"bm25", "knn"}), model)

    def holds(self, index: str, tenant: str) -> bool:
        """Whether the tenant holds a document in the index now: the first of
        :meth:`probe`'s searches alone (tenant-filtered, ``terminate_after: 1``, no hit
        returned) on the tenant's alias, asked every time. Never the memo: its "this index
        has vectors" answers for a minute after the index was dropped in another process. A
        missing alias holds none."""
        what = f"documents of index {index!r}"
        with _translated(what, index, missing_ok=True) as missing:
            answer = (
                self._es()
                .search(index=self.alias(index, tenant), **self.probe_searches(tenant)[1])
                .body
            )
        if missing:
            return False
        _raise_if_partial(answer, what)
        return _total(answer) > 0

    def _model_of(self, answer: Mapping[str, Any]) -> str | None:
        """The model field of a search answer's first hit (None: no hit, or none recorded)."""
        hits = answer.get("hits", {}).get("hits") or []
        if not hits or not self.fields.model:
            return None
        model = (hits[0].get("_source") or {}).get(self.fields.model)
        return str(model) if model else None

    def _saw_vectors(self, alias: str, tenant: str, model: str | None) -> None:
        """Remember that the tenant's part of ``alias`` holds vectors of ``model`` (expired
        entries go once the memo is large, so many tenants don't grow it without bound)."""
        now = self._clock()
        if len(self._with_vectors) >= CHANNELS_MEMO_SIZE:  # a copy: other threads add to it
            self._with_vectors = {
                key: seen
                for key, seen in list(self._with_vectors.items())
                if now - seen[0] < CHANNELS_TTL_SECONDS
            }
        self._with_vectors[(alias, tenant)] = (now, model)

    def retrieve(self, query: ChannelQuery) -> ChannelResults:
        """Both channels in one ``_msearch``; each channel's hits best first.

        With ``native_rrf`` on, a hybrid search is one ``retriever.rrf`` (or
        ``retriever.linear``, by the search's method) instead, and the results carry ES's
        fused list only.
        """
        channels = tuple(dict.fromkeys(query.channels))
        if self.native_rrf and len(channels) == 2:
            started = self._clock()
            fused = self.retrieve_native(query)
            return ChannelResults(hits={}, seconds={"rrf": self._clock() - started}, fused=fused)
        # The tenant's own index in the URL, none in the header lines: the request cannot
        # reach another index (and ES's rest.action.multi.allow_explicit_index=false holds).
        alias = self.alias(query.index, query.filters.tenant)
        searches: list[Mapping[str, Any]] = []
        for channel in channels:
            searches += [{}, self.channel_body(channel, query)]
        started = self._clock()
        with _translated(f"search of index {query.index!r}", query.index):
            es = self._es(query.timeout_seconds)
            response = es.msearch(index=alias, searches=searches).body
        round_trip = self._clock() - started
        answers = response.get("responses", [])
        if len(answers) != len(channels):
            raise BackendRequestError(
                f"_msearch answered {len(answers)} searches for {len(channels)} sent"
            )
        hits: dict[Channel, list[ChannelHit]] = {}
        seconds: dict[str, float] = {}
        for channel, answer in zip(channels, answers, strict=True):
            _raise_for_item(answer, f"{channel} search of index {query.index!r}", query.index)
            hits[channel] = [self._hit(channel, raw) for raw in answer["hits"]["hits"]]
            took = answer.get("took")  # the server's time for this search, in ms
            seconds[channel] = float(took) / 1000.0 if took is not None else round_trip
        if not any(hits.values()):
            self._check_still_held(query)
        return ChannelResults(hits=hits, seconds=seconds)

    def _check_still_held(self, query: ChannelQuery) -> None:
        """After a search that found nothing: raise IndexNotFound if the tenant's index holds
        none of its documents any more, as the embedded backend does.

        The pipeline's probe may have answered from this process's memo of the tenant's
        vectors (``CHANNELS_TTL_SECONDS``), while the tenant's last documents were deleted
        by id here or in another worker: an emptied index must read like a missing one, not
        as one with no match. Only then is it asked, with one small search (the probe's
        first); the memo goes only if no document is left. A tenant not in the memo (no
        vectors seen) was probed from ES within this search: nothing is sent."""
        tenant = query.filters.tenant
        alias = self.alias(query.index, tenant)
        if (alias, tenant) not in self._with_vectors:
            return
        what = f"documents of index {query.index!r}"
        body = self.probe_searches(tenant)[1]
        with _translated(what, query.index, missing_ok=True) as missing:
            answer = self._es(query.timeout_seconds).search(index=alias, **body).body
        if not missing:
            _raise_if_partial(answer, what)
        if missing or not _total(answer):
            self._with_vectors.pop((alias, tenant), None)
            raise IndexNotFound(query.index)

    def retrieve_native(self, query: ChannelQuery) -> list[ChannelHit]:
        """Fused hits from ES's own ``rrf`` or ``linear`` retriever (by ``query.method``;
        each needs a licence tier that has it).

        The hits carry ES's fused score only: no per-channel rank or score, and no kNN
        similarity floor can apply. :meth:`retrieve` calls it when ``native_rrf`` is on.
        """
        body = self.native_body(query)
        what = f"native {query.method} search of index {query.index!r}"
        with _translated(what, query.index):
            alias = self.alias(query.index, query.filters.tenant)
            response = self._es(query.timeout_seconds).search(index=alias, **body)
        _raise_if_partial(response.body, what)
        fused = [self._hit("bm25", raw, native=True) for raw in response.body["hits"]["hits"]]
        if not fused:
            self._check_still_held(query)
        return fused

    def _maps_vectors(self, mappings: Mapping[str, Any]) -> bool:
        for mapping in mappings.values():
            node: Any = mapping.get("mappings", {})
            for part in self.fields.vector.split("."):
                node = node.get("properties", {}).get(part, {})
            if node.get("type") == "dense_vector":
                return True
        return False

    def _hit(self, channel: Channel, raw: Mapping[str, Any], native: bool = False) -> ChannelHit:
        source = raw.get("_source") or {}
        fields = self.fields
        doc_id = source.get(fields.id)
        if doc_id is None:  # an operator's index without the id field: the _id is the id,
            # whole (Sift always writes the field: its ``<tenant>:`` ``_id``s never come here)
            doc_id = str(raw["_id"])
        metadata = source.get(fields.metadata) or {}
        title = source.get(fields.title, "") if fields.title else ""
        text = source.get(fields.text, "")
        revision = source.get(fields.revision) or derive_revision(
            str(title), str(text), metadata if isinstance(metadata, Mapping) else {}
        )
        document = Document(
            id=str(doc_id),
            text=str(text),
            title=str(title or ""),
            revision=str(revision),
            metadata=dict(metadata) if isinstance(metadata, Mapping) else {},
        )
        score = float(raw.get("_score") or 0.0)
        if channel == "knn" and not native:
            score = 2.0 * score - 1.0  # ES's cosine score is (1 + cos) / 2
        return ChannelHit(document, score)

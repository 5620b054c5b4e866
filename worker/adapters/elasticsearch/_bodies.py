"""The request bodies the backend sends (pure: built from the field names and the query,
no request is made here): the hard filters, the BM25 and kNN channels, the probes, the
model check, a document's ``_source`` and the bodies of native fusion; and two rules they
use: ``num_candidates`` of a kNN search, and the revision derived for a document sent
without one (the embedded backend's rule)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from worker.adapters.elasticsearch._core import _Core
from worker.contract import METADATA_KEY_PATTERN, Channel, FilterValue
from worker.core.catalog import StoredDocument
from worker.core.types import ChannelQuery, Document, HardFilters, derive_revision
from worker.errors import BackendRequestError, InvalidRequest, ModeUnavailable

MAX_NUM_CANDIDATES = 10_000
_FILTER_KEY = re.compile(METADATA_KEY_PATTERN)  # the gateway checks the same


def num_candidates(size: int, setting: int) -> int:
    """``num_candidates`` for a kNN search of ``k = size``: at least k, at most 10,000.

    >>> num_candidates(120, 200), num_candidates(500, 200), num_candidates(50, 20_000)
    (200, 500, 10000)
    """
    if size > MAX_NUM_CANDIDATES:
        raise InvalidRequest("size", f"at most {MAX_NUM_CANDIDATES} kNN candidates, got {size}")
    return min(MAX_NUM_CANDIDATES, max(size, setting))


class _Bodies(_Core):
    """The request bodies, from the backend's field names and settings."""

    def tenant_query(self, tenant: str) -> dict[str, Any]:
        return {"bool": {"filter": [{"term": {self.fields.tenant: tenant}}]}}

    def tenants_query(self, tenants: Sequence[str]) -> dict[str, Any]:
        """The documents of ``tenants``: :meth:`tenant_query` for one, a ``terms`` query for
        more (a tenant-key collision), none for none."""
        if len(tenants) == 1:
            return self.tenant_query(tenants[0])
        return {"bool": {"filter": [{"terms": {self.fields.tenant: sorted(tenants)}}]}}

    def filters(self, filters: HardFilters) -> list[dict[str, Any]]:
        """The hard filters as ES ``term`` queries: the tenant first, then the caller's
        (:meth:`metadata_filter`)."""
        terms: list[dict[str, Any]] = [{"term": {self.fields.tenant: filters.tenant}}]
        for key, value in sorted(filters.fields.items()):
            if not _FILTER_KEY.match(key):
                raise InvalidRequest(f"filters.{key}", "filter names use letters, digits and _.:-")
            terms.append(self.metadata_filter(key, value))
        return terms

    def metadata_filter(self, key: str, value: FilterValue) -> dict[str, Any]:
        """The query for one metadata filter ``key: value``.

        It is a ``term`` on the document's typed tokens (:func:`metadata_terms`), so it
        compares JSON values as the embedded backend does. A document without tokens
        (written before they existed, or into an index Sift did not make) is compared as
        ES's ``flattened`` field holds it instead: as text, a number on each of its
        spellings (:func:`_term_texts`)."""
        field, texts = f"{self.fields.metadata}.{key}", _term_texts(value)
        as_text = {"terms": {field: texts}} if len(texts) > 1 else {"term": {field: texts[0]}}
        if not self.fields.metadata_terms:
            return as_text
        untyped = {"exists": {"field": self.fields.metadata_terms}}
        return {
            "bool": {
                "should": [
                    {"term": {self.fields.metadata_terms: metadata_term(key, value)}},
                    {"bool": {"filter": [as_text], "must_not": [untyped]}},
                ],
                "minimum_should_match": 1,
            }
        }

    def holds_filters(self, document: StoredDocument, filters: Mapping[str, FilterValue]) -> bool:
        """Whether a search with ``filters`` finds ``document`` (as :meth:`stored_documents`
        read it), each filter compared as :meth:`metadata_filter`'s query compares it: on
        the document's typed tokens (``document.terms``) when it holds any, else on its
        metadata as the ``flattened`` field indexes it, as text (:func:`flattened_texts`:
        a document an earlier release wrote, or one Sift did not write, where ``"5"`` is
        ``5`` and a list holds each of its values)."""
        typed = self.fields.metadata_terms and document.terms
        for key, value in filters.items():
            if typed:
                if metadata_term(key, value) not in (document.terms or ()):
                    return False
            elif not set(_term_texts(value)) & flattened_texts(document.metadata, key):
                return False
        return True

    def probe_searches(self, tenant: str) -> list[Mapping[str, Any]]:
        """The ``_msearch`` lines of :meth:`probe`: does the tenant hold a document, and one
        with a vector (returning that one's model field)? Each probe stops at the first
        match (per shard); the first returns no hit."""
        tenant_filter = self.filters(HardFilters(tenant))
        with_vector = [*tenant_filter, {"exists": {"field": self.fields.vector}}]
        model = {"size": 1, "_source": [self.fields.model]} if self.fields.model else {"size": 0}
        searches: list[Mapping[str, Any]] = []
        for filters, returned in ((tenant_filter, {"size": 0}), (with_vector, model)):
            searches += [
                {},
                {
                    **returned,
                    "terminate_after": 1,
                    "track_total_hits": True,
                    "query": {"bool": {"filter": filters}},
                },
            ]
        return searches

    def model_check_body(self, tenant: str, model: str) -> dict[str, Any]:
        """The ``_search`` body that finds one of the tenant's vectors recorded by a model
        other than ``model`` (documents that record none are not counted)."""
        return {
            "size": 1,
            "terminate_after": 1,
            "_source": [self.fields.model],
            "query": {
                "bool": {
                    "filter": [
                        *self.filters(HardFilters(tenant)),
                        {"exists": {"field": self.fields.model}},
                    ],
                    "must_not": [{"term": {self.fields.model: model}}],
                }
            },
        }

    def channel_body(self, channel: Channel, query: ChannelQuery) -> dict[str, Any]:
        """The ``_msearch`` body of one channel, with the hard filters inside it."""
        if channel == "bm25":
            return self.bm25_body(query)
        if channel == "knn":
            return self.knn_body(query)
        raise BackendRequestError(f"unknown channel {channel!r}")

    def bm25_body(self, query: ChannelQuery) -> dict[str, Any]:
        text_fields = [name for name in (self.fields.title, self.fields.text) if name]
        return {
            "size": query.size,
            "query": {
                "bool": {
                    "must": {
                        "multi_match": {
                            "query": query.text,
                            "fields": text_fields,
                            "type": "best_fields",
                            "operator": "or",
                        }
                    },
                    "filter": self.filters(query.filters),
                }
            },
            "_source": self.fields.source(),
            "track_total_hits": False,
        }

    def knn_body(self, query: ChannelQuery) -> dict[str, Any]:
        if query.vector is None:
            raise ModeUnavailable("the knn channel needs a query vector")
        return {
            "size": query.size,
            "knn": {
                "field": self.fields.vector,
                "query_vector": [float(v) for v in query.vector],
                "k": query.size,
                "num_candidates": num_candidates(query.size, self.num_candidates),
                "filter": self.filters(query.filters),
            },
            "_source": self.fields.source(),
            "track_total_hits": False,
        }

    def source(
        self,
        tenant: str,
        doc: Document,
        vector: Sequence[float] | None,
        model: str | None = None,
        version: int | None = None,
    ) -> dict[str, Any]:
        """The ``_source`` Sift writes for one document (``model``: its vector's embedder;
        ``version``: its write's version, what a drop compares with its own)."""
        metadata: dict[str, FilterValue] = {}
        for key, value in doc.metadata.items():
            if not _FILTER_KEY.match(key) or not isinstance(value, str | int | float | bool):
                raise InvalidRequest(
                    f"documents[{doc.id}].metadata", f"bad key or value for {key!r}"
                )
            metadata[key] = value
        revision = doc.revision or derive_revision(doc.title, doc.text, metadata)
        body: dict[str, Any] = {
            self.fields.id: doc.id,
            self.fields.text: doc.text,
            self.fields.tenant: tenant,
            self.fields.revision: revision,
            self.fields.metadata: metadata,
        }
        if self.fields.metadata_terms:
            body[self.fields.metadata_terms] = metadata_terms(metadata)
        if self.fields.write_version and version is not None:
            body[self.fields.write_version] = version
        if self.fields.title:
            body[self.fields.title] = doc.title
        if vector is not None:
            body[self.fields.vector] = [float(v) for v in vector]
            if model is not None and self.fields.model:
                body[self.fields.model] = model
        return body

    def native_body(self, query: ChannelQuery) -> dict[str, Any]:
        """The ``_search`` body that fuses on ES's side, by the search's fusion method."""
        if query.method == "linear":
            return self.native_linear_body(query)
        return self.native_rrf_body(query)

    def _children(self, query: ChannelQuery) -> list[tuple[Channel, dict[str, Any]]]:
        """The filtered BM25 and kNN child retrievers of a native fusion."""
        bm25 = self.bm25_body(query)
        knn = self.knn_body(query)["knn"]
        return [("bm25", {"standard": {"query": bm25["query"]}}), ("knn", {"knn": knn})]

    def native_rrf_body(self, query: ChannelQuery) -> dict[str, Any]:
        """One ``_search`` whose ``retriever.rrf`` fuses a filtered BM25 and a filtered kNN,
        with the search's rank constant. Weights other than 1 go as each child retriever's
        ``weight`` (the ``{"retriever": ..., "weight": w}`` form, Elasticsearch 9.2+); at
        equal weights of 1 the plain form is sent, which every 9.x reads."""
        children = self._children(query)
        weights = {channel: float(query.weights.get(channel, 1.0)) for channel, _ in children}
        retrievers: list[dict[str, Any]] = (
            [child for _, child in children]
            if all(weight == 1.0 for weight in weights.values())
            else [{"retriever": child, "weight": weights[c]} for c, child in children]
        )
        return {
            "size": query.size,
            "retriever": {
                "rrf": {
                    "retrievers": retrievers,
                    "rank_window_size": query.size,
                    "rank_constant": query.rank_constant,
                }
            },
            "_source": self.fields.source(),
            "track_total_hits": False,
        }

    def native_linear_body(self, query: ChannelQuery) -> dict[str, Any]:
        """One ``_search`` whose ``retriever.linear`` (Elasticsearch 8.18+ / 9.x) sums each
        child's ``minmax``-normalised score times its weight: Sift's ``linear`` fusion. Each
        child is normalised over its own ``rank_window_size`` hits, as Sift normalises over
        each channel's list; the kNN score ES reports, ``(1 + cos) / 2``, normalises to the
        same values as ``cos`` does (min-max is blind to an affine map)."""
        return {
            "size": query.size,
            "retriever": {
                "linear": {
                    "retrievers": [
                        {
                            "retriever": child,
                            "weight": float(query.weights.get(channel, 1.0)),
                            "normalizer": "minmax",
                        }
                        for channel, child in self._children(query)
                    ],
                    "rank_window_size": query.size,
                }
            },
            "_source": self.fields.source(),
            "track_total_hits": False,
        }


def metadata_term(key: str, value: FilterValue) -> str:
    """The keyword that stands for ``key: value`` in a document's typed metadata tokens and
    in a filter on it: equal tokens for equal JSON values, as the embedded backend compares.

    A number is ``n:`` and its exact value: an integral one (``5``, ``5.0``, ``-0.0``)
    within 64 bits as that integer, any other float as its shortest repr, which is unique
    per float; a boolean is ``b:`` and a string ``s:``, so neither equals a number.

    >>> [metadata_term("year", v) for v in (5, 5.0, 5.5, "5", True, 1, -0.0)]
    ['year=n:5', 'year=n:5', 'year=n:5.5', 'year=s:5', 'year=b:true', 'year=n:1', 'year=n:0']
    >>> metadata_term("n", 9007199254740993), metadata_term("n", 9007199254740992.0)
    ('n=n:9007199254740993', 'n=n:9007199254740992')
    >>> metadata_term("n", 1e20)
    'n=n:1e+20'
    """
    if isinstance(value, bool):
        return f"{key}=b:{'true' if value else 'false'}"
    if isinstance(value, str):
        return f"{key}=s:{value}"
    if _integral_int64(value):
        value = int(value)
    return f"{key}=n:{value!r}"


def metadata_terms(metadata: Mapping[str, FilterValue]) -> list[str]:
    """A document's typed metadata tokens (:func:`metadata_term`), one per key, sorted."""
    return sorted(metadata_term(key, value) for key, value in metadata.items())


def flattened_texts(metadata: Mapping[str, Any], key: str) -> set[str]:
    """The keywords ES's ``flattened`` field indexes under ``key`` for a document's
    ``metadata`` (its ``_source`` as JSON decodes it): each leaf's, its path the keys down to
    it joined by dots (``{"a": {"b": 1}}`` and ``{"a.b": 1}`` are both ``a.b``), an array's
    elements each, a boolean as ``true``/``false``, a number as its JSON text, no null.

    >>> doc = {"tags": ["a", "b"], "o": {"k": 5}, "o.k": 5.0, "on": True, "none": None}
    >>> sorted(flattened_texts(doc, "tags")), sorted(flattened_texts(doc, "o.k"))
    (['a', 'b'], ['5', '5.0'])
    >>> flattened_texts(doc, "on")
    {'true'}
    >>> flattened_texts(doc, "none"), flattened_texts(doc, "o"), flattened_texts(doc, "gone")
    (set(), set(), set())
    """
    found: set[str] = set()
    for path, leaf in _leaves(metadata, ""):
        if path == key and leaf is not None:
            found.add(("true" if leaf else "false") if isinstance(leaf, bool) else str(leaf))
    return found


def _leaves(value: Any, path: str) -> list[tuple[str, Any]]:
    """``value``'s leaves with their dotted paths under ``path``; an array's each."""
    if isinstance(value, Mapping):
        return [
            leaf
            for name, inner in value.items()
            for leaf in _leaves(inner, f"{path}.{name}" if path else str(name))
        ]
    if isinstance(value, list):
        return [leaf for inner in value for leaf in _leaves(inner, path)]
    return [(path, value)]


def _integral_int64(value: FilterValue) -> bool:
    """Whether ``value`` is a float with an integral value a 64-bit integer holds (``5.0``,
    ``-0.0``): its typed token and its texts are then those of that integer.

    >>> _integral_int64(5.0), _integral_int64(5.5), _integral_int64(2.0**63), _integral_int64(5)
    (True, False, False, False)
    """
    return isinstance(value, float) and value.is_integer() and -(2.0**63) <= value < 2.0**63


def _term_texts(value: FilterValue) -> list[str]:
    """The keywords a ``flattened`` field may hold for a value equal to ``value``: what a
    document without metadata tokens is compared on. It holds each value as the text it
    was written with, so a number is every way JSON (Python's ``json``, which Sift's client
    writes with) spells an equal one: ``5`` and ``5.0``, ``1e+16`` and
    ``10000000000000000``, the three zeros. A boolean is ``true``/``false`` and a string
    itself, which the text cannot tell from the string ``"true"`` or ``"5"``.

    >>> _term_texts(5), _term_texts(5.0), _term_texts(5.5), _term_texts(True)
    (['5', '5.0'], ['5', '5.0'], ['5.5'], ['true'])
    >>> _term_texts(10**16), _term_texts(9007199254740993), _term_texts(0)
    (['10000000000000000', '1e+16'], ['9007199254740993'], ['-0.0', '0', '0.0'])
    """
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, str):
        return [value]
    texts = {repr(value)}
    if _integral_int64(value):
        texts.add(str(int(value)))
    if isinstance(value, int) and float(value) == value:
        texts.add(repr(float(value)))
    if value == 0:
        texts |= {"0", "0.0", "-0.0"}
    return sorted(texts)

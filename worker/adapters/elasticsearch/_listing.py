"""Reads of what a tenant holds: its indexes with their counts and embedding models, one
index's count and model, one document by id, and a page of its documents by id (never
another tenant's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elasticsearch import NotFoundError

from worker.adapters.elasticsearch._bodies import _Bodies
from worker.adapters.elasticsearch._errors import (
    _error_type,
    _first_key,
    _index_missing,
    _raise_for_doc,
    _raise_if_partial,
    _total,
    _translated,
)
from worker.adapters.elasticsearch._layout import document_es_id
from worker.constants import DOCUMENT_PREVIEW_CHARS
from worker.core.catalog import IndexInfo, ListedDocument, StoredDocument

#: The most indexes one tenant's list shows (the terms aggregation's size).
MAX_LISTED_INDEXES = 1000

# A listed document's text preview and length, computed in Elasticsearch (``script_fields``)
# so a page of long texts never leaves the cluster whole. Painless strings are Java's: UTF-16,
# so both count code points (as Python's ``len`` and slices do, and the embedded backend's
# SQLite ``substr``/``length``): a cut at 200 UTF-16 units could split a surrogate pair, and
# a length in units counts a character outside the BMP twice. The source is constant (the
# field and the cut are params), so Elasticsearch compiles each once.
_TEXT_OF_SOURCE = (
    "def t = params['_source'][params.field]; String s = t == null ? '' : String.valueOf(t);"
)
PREVIEW_SCRIPT = (
    _TEXT_OF_SOURCE + " return s.codePointCount(0, s.length()) <= params.chars ? s"
    " : s.substring(0, s.offsetByCodePoints(0, params.chars));"
)
LENGTH_SCRIPT = _TEXT_OF_SOURCE + " return s.codePointCount(0, s.length());"


class _Listing(_Bodies):
    """List the tenant's indexes, count one, get one document, list its documents."""

    def indexes(
        self, tenant: str, after: str | None = None, limit: int | None = None
    ) -> list[IndexInfo]:
        """Up to ``limit`` of the tenant's indexes named after ``after``, by name: its
        aliases (``GET _alias/<prefix><key>--*``; a wildcard that matches nothing answers
        ``{}``), of them those named after ``after``, then one tenant-filtered ``size: 0``
        search over the same pattern with a terms aggregation on ``_index`` (and, inside
        it, on the model field) for the counts. After a name, or past
        :data:`MAX_LISTED_INDEXES` aliases, the search also filters on ``_index`` to the
        concrete indexes of the aliases left, by name, as many as the aggregation holds at
        a time (a search more while empty indexes leave the page short), so the buckets go
        to the names the page shows, not to the biggest indexes; with none left (the rest
        dropped since the token was made) nothing is sent. A concrete index no alias of
        the tenant points at (one a reindex kept) is not listed, nor an index holding none
        of its documents."""
        stem = self.tenant_stem(tenant)
        pattern = f"{stem}*"
        with _translated("list of indexes", None):
            aliases = self._aliases(pattern)
        names = {
            concrete: alias.removeprefix(stem)
            for concrete, held in aliases.items()
            for alias in held
            if alias.startswith(stem) and (after is None or alias.removeprefix(stem) > after)
        }
        if not names:
            return []
        ordered = sorted(names, key=names.__getitem__)
        wanted = len(ordered) if limit is None else limit
        # count the names in name order, a chunk at a time, each count filtered on its
        # chunk's indexes: not the aggregation's biggest indexes by count, among which old
        # indexes a reindex kept for a rollback would leave a small live one out
        listed: dict[str, IndexInfo] = {}
        for start in range(0, len(ordered), MAX_LISTED_INDEXES):
            chunk = {c: names[c] for c in ordered[start : start + MAX_LISTED_INDEXES]}
            counted = self._counted(tenant, pattern, chunk)
            if counted is None:  # every index gone meanwhile
                break
            listed.update(counted)
            if len(listed) >= wanted:  # empty indexes are not listed: else the next chunk
                break
        return [listed[name] for name in sorted(listed)[:limit]]

    def empty_indexes(self, tenant: str) -> list[str]:
        """The names of the tenant's aliases whose indexes hold no document at all, by name:
        one emptied by deletes by id, or made by a delete by id into a new name. Not listed
        (:meth:`indexes`: an index exists while it holds one of the tenant's documents), yet
        each is an index of the tenant's key, with its shard and its deleted documents' data
        until its segments merge: ``sift tenant purge`` drops them with the listed ones.
        ``GET _alias/<prefix><key>--*``, then one ``size: 0`` search over their concrete
        indexes with no tenant filter, counting by ``_index``: an alias an operator pointed at
        an index other tenants' documents are in is not empty (nothing of the tenant's is
        there, and the drop would leave that index and alias as they are). An answer from
        some shards only is ``BackendUnavailable``: an index holding documents must never be
        called empty."""
        stem = self.tenant_stem(tenant)
        with _translated("list of indexes", None):
            held = {  # concrete index -> the tenant's alias on it
                concrete: alias
                for concrete, aliases in self._aliases(f"{stem}*").items()
                for alias in aliases
                if alias.startswith(stem)
            }
        if not held:
            return []
        with _translated("list of indexes", None, missing_ok=True) as missing:
            answer = (
                self._es()
                .search(
                    index=f"{stem}*",
                    size=0,
                    query={"terms": {"_index": sorted(held)}},
                    aggs={"indexes": {"terms": {"field": "_index", "size": len(held)}}},
                    ignore_unavailable=True,
                    allow_no_indices=True,
                )
                .body
            )
        if missing:  # every index gone meanwhile
            return []
        _raise_if_partial(answer, "list of indexes")
        buckets = answer.get("aggregations", {}).get("indexes", {}).get("buckets", [])
        holding = {held.get(bucket["key"]) for bucket in buckets if int(bucket["doc_count"])}
        return sorted({alias.removeprefix(stem) for alias in held.values() if alias not in holding})

    def _counted(
        self, tenant: str, pattern: str, names: dict[str, str]
    ) -> dict[str, IndexInfo] | None:
        """The tenant's document count and model in each of ``names`` (concrete index ->
        Sift name) holding any, by one ``size: 0`` search over ``pattern``, filtered on
        those concrete indexes; None when no index matched at all."""
        by_index: dict[str, Any] = {"terms": {"field": "_index", "size": MAX_LISTED_INDEXES}}
        if self.fields.model:
            by_index["aggs"] = self._models_agg()
        query = self.tenant_query(tenant)
        query["bool"]["filter"].append({"terms": {"_index": sorted(names)}})
        with _translated("list of indexes", None, missing_ok=True) as missing:
            answer = (
                self._es()
                .search(
                    index=pattern,
                    size=0,
                    query=query,
                    aggs={"indexes": by_index},
                    ignore_unavailable=True,
                    allow_no_indices=True,
                )
                .body
            )
        if missing:
            return None
        _raise_if_partial(answer, "list of indexes")
        counted: dict[str, IndexInfo] = {}
        for bucket in answer.get("aggregations", {}).get("indexes", {}).get("buckets", []):
            name = names.get(bucket["key"])
            if name is not None and int(bucket["doc_count"]):
                counted[name] = self._info(name, int(bucket["doc_count"]), _first_key(bucket))
        return counted

    def _models_agg(self) -> dict[str, Any]:
        """The aggregation naming the model the tenant's vectors record (one, by design)."""
        return {"models": {"terms": {"field": self.fields.model, "size": 1}}}

    def _info(self, name: str, count: int, model: str | None) -> IndexInfo:
        return IndexInfo(name, count, self.name, model, self.index_settings.dims, None)

    def index_info(self, index: str, tenant: str) -> IndexInfo | None:
        """The tenant's part of one index: a tenant-filtered ``size: 0`` search, its total
        the count and its aggregation the recorded embedding model."""
        body: dict[str, Any] = {
            "size": 0,
            "track_total_hits": True,
            "query": self.tenant_query(tenant),
        }
        if self.fields.model:
            body["aggs"] = self._models_agg()
        with _translated(f"count of index {index!r}", index, missing_ok=True) as missing:
            answer = self._es().search(index=self.alias(index, tenant), **body).body
        if not missing:
            _raise_if_partial(answer, f"count of index {index!r}")
        count = 0 if missing else _total(answer)
        model = None if missing else _first_key(answer.get("aggregations", {}))
        return self._info(index, count, model) if count else None

    def document(self, index: str, tenant: str, doc_id: str) -> StoredDocument | None:
        """``GET <alias>/_doc/<_id>`` (:func:`document_es_id`) without the vector; if none,
        the tenant's document of that id under an ``_id`` of its own (:meth:`_found_by_id`);
        None if the tenant has none."""
        with _translated(f"document in index {index!r}", index, missing_ok=True) as missing:
            try:
                answer = (
                    self._es()
                    .get(
                        index=self.alias(index, tenant),
                        id=document_es_id(tenant, doc_id),
                        source_excludes=[self.fields.vector],
                    )
                    .body
                )
            except NotFoundError as exc:
                if _error_type(exc) == "index_not_found_exception":
                    raise
                answer = {}  # no such _id
        if missing:
            return None
        if answer.get("found") and answer.get("_source", {}).get(self.fields.tenant) == tenant:
            return self._stored(doc_id, answer)
        return self._found_by_id(index, tenant, [doc_id]).get(doc_id)

    def stored_documents(
        self, index: str, tenant: str, ids: Sequence[str]
    ) -> dict[str, StoredDocument]:
        """``_mget`` of the ids' ``_id`` (:func:`document_es_id`) on the tenant's alias,
        without the vector: those found and the tenant's, by id; the ids it did not find,
        one search more on the id field (:meth:`_found_by_id`: a document another tool wrote
        under an ``_id`` of its own). A missing alias holds none (a 404, or an
        ``index_not_found`` in each document's place); any other error in a document's
        place is raised (:func:`_raise_for_doc`): that document is not known to be gone,
        and a caller would take it for deleted."""
        if not ids:
            return {}
        with _translated(f"documents in index {index!r}", index, missing_ok=True) as missing:
            answer = (
                self._es()
                .mget(
                    index=self.alias(index, tenant),
                    ids=[document_es_id(tenant, doc_id) for doc_id in ids],
                    source_excludes=[self.fields.vector],
                )
                .body
            )
        if missing:
            return {}
        found, gone = {}, False
        for doc_id, doc in zip(ids, answer.get("docs", []), strict=False):
            _raise_for_doc(doc, f"documents in index {index!r}")
            gone = gone or _index_missing(doc)
            if doc.get("found") and doc.get("_source", {}).get(self.fields.tenant) == tenant:
                found[doc_id] = self._stored(doc_id, doc)
        unread = [doc_id for doc_id in ids if doc_id not in found]
        if unread and not gone:
            found.update(self._found_by_id(index, tenant, unread))
        return found

    def _found_by_id(
        self, index: str, tenant: str, ids: Sequence[str]
    ) -> dict[str, StoredDocument]:
        """The tenant's documents of these ids stored under an ``_id`` other than Sift's
        (:func:`document_es_id`): an index that already exists, aliased for the tenant
        (deploy/README.md §4), holds its tool's ``_id``s, and a search finds its documents
        by their id field, or by the ``_id`` itself where they have none
        (:meth:`_hit`). One tenant-filtered search for both, without the vector. A hit
        under Sift's own ``_id`` for its id is not taken: the ``_mget`` (realtime) did not
        find it, so it is deleted, and the search (near-realtime) may not know yet."""
        fields = self.fields
        query, asked = self.tenant_query(tenant), list(ids)
        query["bool"]["should"] = [{"terms": {fields.id: asked}}, {"ids": {"values": asked}}]
        query["bool"]["minimum_should_match"] = 1
        what = f"documents in index {index!r}"
        with _translated(what, index, missing_ok=True) as missing:
            answer = (
                self._es()
                .search(
                    index=self.alias(index, tenant),
                    query=query,
                    size=2 * len(ids),
                    source_excludes=[fields.vector],
                    version=True,
                    track_total_hits=False,
                )
                .body
            )
        if missing:
            return {}
        _raise_if_partial(answer, what)
        wanted, found = set(ids), {}
        for hit in answer.get("hits", {}).get("hits", []):
            held = (hit.get("_source") or {}).get(fields.id)
            doc_id = str(hit["_id"]) if held is None else str(held)
            sifts = hit["_id"] == document_es_id(tenant, doc_id)  # deleted: the _mget said so
            if doc_id in wanted and doc_id not in found and not sifts:
                found[doc_id] = self._stored(doc_id, hit)
        return found

    def _stored(self, doc_id: str, answer: dict[str, Any]) -> StoredDocument:
        """A document as a ``GET _doc`` or an ``_mget`` entry answers it."""
        src = answer.get("_source", {})
        text = src.get(self.fields.text)  # null (an operator's index) is empty, as listed
        return StoredDocument(
            id=doc_id,
            text="" if text is None else str(text),
            title=str(src.get(self.fields.title, "")) if self.fields.title else "",
            revision=str(src.get(self.fields.revision, "")),
            metadata=dict(src.get(self.fields.metadata) or {}),
            version=int(answer["_version"]) if "_version" in answer else None,
            terms=self._terms(src),
        )

    def _terms(self, src: dict[str, Any]) -> tuple[str, ...] | None:
        """The document's typed metadata tokens; None when it has none (ES's ``exists``
        finds no value in a missing field, a null or ``[]``), or the index keeps none."""
        if not self.fields.metadata_terms:
            return None
        held = src.get(self.fields.metadata_terms)
        listed = held if isinstance(held, list) else [held]
        terms = tuple(str(term) for term in listed if term is not None)
        return terms or None

    def documents(
        self, index: str, tenant: str, after: str | None, limit: int
    ) -> list[ListedDocument] | None:
        """Up to ``limit`` of the tenant's documents after id ``after``: one tenant-filtered
        search on its alias sorted by the id field (a ``keyword``: UTF-8 byte order, which is
        code point order) from ``search_after``, without the vector or the text
        (``_source.excludes``): the text's preview and length are ``script_fields``
        (:data:`PREVIEW_SCRIPT`, :data:`LENGTH_SCRIPT`), so a page of 1,000 texts of 100,000
        characters sends 200 characters of each, not 100 MB; with each hit's ``_version``,
        and no total. Keyset paging needs no point in time:
        each page starts after an id, so a write between pages moves no document across a
        page's edge (a PIT would only pin a snapshot, and it expires). A missing alias, or
        a first page with no hit, is no index (None); an empty page after an id (the rest
        deleted since the token was made) asks :meth:`index_info` whether the tenant still
        holds one (``[]``) or none (None). A document without the id field (an operator's
        index: Sift always writes it) is not listed: it has no place in the order."""
        fields = self.fields
        query = self.tenant_query(tenant)
        query["bool"]["filter"].append({"exists": {"field": fields.id}})
        body: dict[str, Any] = {
            "size": limit,
            "track_total_hits": False,
            "query": query,
            "sort": [{fields.id: "asc"}],
            "_source": {"excludes": [fields.vector, fields.text]},
            "script_fields": {
                "text_preview": self._text_script(PREVIEW_SCRIPT),
                "text_length": self._text_script(LENGTH_SCRIPT),
            },
            "version": True,
        }
        if after is not None:
            body["search_after"] = [after]
        what = f"documents of index {index!r}"
        with _translated(what, index, missing_ok=True) as missing:
            answer = self._es().search(index=self.alias(index, tenant), **body).body
        if missing:
            return None
        _raise_if_partial(answer, what)
        hits = answer.get("hits", {}).get("hits", [])
        if not hits and (after is None or self.index_info(index, tenant) is None):
            return None
        return [self._listed(hit) for hit in hits]

    def _text_script(self, source: str) -> dict[str, Any]:
        params = {"field": self.fields.text, "chars": DOCUMENT_PREVIEW_CHARS}
        return {"script": {"lang": "painless", "source": source, "params": params}}

    def _listed(self, hit: dict[str, Any]) -> ListedDocument:
        src = hit.get("_source", {})
        computed = hit.get("fields", {})  # each script field's value, in a list
        return ListedDocument(
            id=str(src[self.fields.id]),
            title=str(src.get(self.fields.title, "")) if self.fields.title else "",
            revision=str(src.get(self.fields.revision, "")),
            text_preview=str((computed.get("text_preview") or [""])[0]),
            text_length=int((computed.get("text_length") or [0])[0]),
            metadata=dict(src.get(self.fields.metadata) or {}),
            version=int(hit["_version"]) if "_version" in hit else None,
        )

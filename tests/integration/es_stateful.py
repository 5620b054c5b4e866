"""A small stateful stand-in for Elasticsearch 9, behind the loopback server's plumbing.

Unlike the scripted routes of :mod:`tests.integration.es_loopback`, it keeps state and
answers as ES does, so a test of the index lifecycle asserts outcomes (what a tenant reads
after a drop, a reindex, a race) instead of the requests the adapter happens to send:

* concrete indexes with their mapping (an index template applies on create; ``dynamic:
  strict`` refuses an unmapped top-level field; a ``dense_vector``'s ``dims`` is checked),
  their ``_meta``, and aliases pointing at them;
* documents with versions: internal (+1), or external (``version_type=external``: applied
  only if newer than the held one, tombstones included, else a 409
  ``version_conflict_engine_exception``); a delete's tombstone is forgotten once the index's
  ``index.gc_deletes`` (60 s unless its settings say otherwise) has passed on the stand-in's
  clock (``now``, which a test moves on), as ES prunes it from its version map;
* ``PUT <index>``: ``resource_already_exists_exception`` for an existing index,
  ``invalid_index_name_exception`` for a name an alias holds;
* ``_bulk`` with ``require_alias``: an index/create item whose target is no alias is refused
  (404 ``index_not_found_exception`` "... is not an alias"); without it, a missing index is
  auto-created. As in ES 9 (``DeleteRequest.isRequireAlias()`` is false; TransportBulkAction
  creates a missing index for a delete only under external versioning), ``require_alias``
  never applies to a delete: an external-versioned delete on a missing target auto-creates a
  bare index of that name, any other delete on it answers 404;
* an ``_id`` over 512 bytes (UTF-8) in a write: the whole request is refused, 400
  ``action_request_validation_exception`` "Validation Failed: 1: id [...] is too long, must
  be no longer than 512 bytes but was: N;" (``DocWriteRequest.validateDocIdLength``, checked
  by ``BulkRequest.validate`` for every item before any runs); a ``GET`` of one finds nothing;
* ``GET _resolve/index/<expr>`` (GET only, as ES registers it: any other method is 405);
* ``GET _alias/<expr>``: a wildcard matching nothing is 200 ``{}``, a missing exact alias
  is 404 ``{"error": "alias [x] missing", "status": 404}``;
* ``DELETE <index,...>``: concrete names only (an alias or a wildcard is refused);
* ``script_fields`` of the two painless scripts the documents listing sends (no other: a
  script the stand-in does not know is refused), run with Java's string semantics: UTF-16
  units, a surrogate pair one code point to ``codePointCount`` and ``offsetByCodePoints``;
* queries: ``bool``, ``term``, ``terms``, ``ids``, ``exists``, ``multi_match``, and ``range``
  (``gt``/``gte``/``lt``/``lte``) on a ``long`` field (a document without it matches no
  range, as in ES);
* ``_search``, ``_msearch``, ``_count``, ``GET _doc``, ``_mget`` by ``ids`` (a missing
  index: 404 ``index_not_found_exception``), ``_delete_by_query`` and ``_reindex``
  (``wait_for_completion=false`` gives a task, read by ``GET _tasks/<id>``), ``_aliases``,
  ``_refresh``, ``_mapping``.

BM25 is crude (term overlap weighted by each index's own idf, best field wins); kNN is exact
cosine over the filtered documents, reported as ES does, ``(1 + cos) / 2``. Writes are
visible at once (every write behaves as if refreshed).
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import math
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from tests.integration.es_loopback import (
    Answer,
    FakeElasticsearchServer,
    Recorded,
    delete_by_query_response,
    delete_by_query_task,
    error_body,
    index_missing,
)
from worker.adapters.elasticsearch._listing import LENGTH_SCRIPT, PREVIEW_SCRIPT

_WORD = re.compile(r"\w+")
#: What ES refuses anywhere in an index name, and at its start.
_INVALID_CHARS = set('\\/*?"<>| ,#:')
#: ES's limit on a document's ``_id``, in UTF-8 bytes.
_MAX_ID_BYTES = 512


@dataclass
class Doc:
    """One document (``source`` None: a delete's tombstone) and its version."""

    source: dict[str, Any] | None
    version: int
    deleted_at: float | None = None  # a tombstone's time, on the stand-in's clock


@dataclass
class Index:
    """One concrete index."""

    name: str
    mappings: dict[str, Any]
    settings: dict[str, Any]
    docs: dict[str, Doc] = field(default_factory=dict)

    def live(self) -> Iterator[tuple[str, Doc]]:
        return ((i, d) for i, d in self.docs.items() if d.source is not None)

    def gc_deletes(self) -> float:
        """Seconds a delete's tombstone is kept (``index.gc_deletes``, flat or nested)."""
        value = self.settings.get("index.gc_deletes")
        if value is None:
            value = (self.settings.get("index") or {}).get("gc_deletes", "60s")
        text = str(value)
        units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
        for unit in sorted(units, key=len, reverse=True):
            if text.endswith(unit):
                return float(text.removesuffix(unit)) * units[unit]
        raise _refuse("illegal_argument_exception", f"failed to parse [{text}] as a time value")


class _Refused(Exception):
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body


def _refuse(kind: str, reason: str, status: int = 400, **extra: Any) -> _Refused:
    return _Refused(status, error_body(kind, reason, status=status, **extra))


def _missing(name: str) -> _Refused:
    return _Refused(404, index_missing(name))


def _check_ids(ids: list[str]) -> None:
    """Refuse a write request holding an ``_id`` over 512 bytes, as ES's request validation
    does: one 400 for the whole request, every such id numbered in the reason."""
    errors = []
    for doc_id in ids:
        size = len(doc_id.encode("utf-8", "replace"))  # as Java's getBytes(UTF_8) counts
        if size > _MAX_ID_BYTES:
            errors.append(
                f"id [{doc_id}] is too long, must be no longer than {_MAX_ID_BYTES} bytes "
                f"but was: {size}"
            )
    if errors:
        numbered = "".join(f"{n}: {error};" for n, error in enumerate(errors, 1))
        raise _refuse("action_request_validation_exception", f"Validation Failed: {numbered}")


class StatefulElasticsearch:
    """The state and the answers; :func:`stateful_server` puts it behind a loopback server.

    A test can still script a route on the server (``server.on``) to inject a failure or to
    run something between two requests; unscripted requests reach this fallback."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.indexes: dict[str, Index] = {}
        self.aliases: dict[str, set[str]] = {}  # alias -> concrete indexes
        self.templates: dict[str, dict[str, Any]] = {}
        self.tasks: dict[str, dict[str, Any]] = {}
        self._task_ids = itertools.count(1)
        #: How many reads of ``GET _tasks/<id>`` a copy started from now on answers as
        #: still running (listed by ``GET _tasks`` meanwhile); its documents are copied
        #: when it starts.
        self.copy_running_reads = 0
        #: The same for a ``_delete_by_query`` started from now on (its documents are
        #: deleted when it starts).
        self.delete_running_reads = 0
        self._running: dict[str, int] = {}  # task id -> reads left while running
        #: The stand-in's clock (seconds): a tombstone older than its index's
        #: ``index.gc_deletes`` on it is forgotten. A test moves it on.
        self.now = 0.0

    # --- entry -----------------------------------------------------------------------

    def __call__(self, request: Recorded) -> Answer:
        try:
            with self.lock:
                status, body = self._route(request)
        except _Refused as refused:
            return Answer(refused.status, refused.body)
        return Answer(status, body)

    def _route(self, r: Recorded) -> tuple[int, Any]:
        parts = [unquote(p) for p in r.path.strip("/").split("/")] if r.path != "/" else []
        method = r.method
        q = {k: v[-1] for k, v in r.query.items()}
        body = r.json() if r.body and not r.path.endswith(("_bulk", "_msearch")) else {}
        if parts[:1] == ["_index_template"] and method == "PUT":
            self.templates[parts[1]] = body
            return 200, {"acknowledged": True}
        if parts == ["_bulk"] or parts[1:] == ["_bulk"]:
            return 200, self.bulk(r.ndjson(), q)
        if parts == ["_alias"] or (parts[:1] == ["_alias"] and len(parts) == 2):
            return self.get_alias(parts[1] if len(parts) > 1 else "*")
        if parts[:2] == ["_resolve", "index"]:
            if method != "GET":
                return 405, {
                    "error": f"Incorrect HTTP method for uri [{r.path}] and method "
                    f"[{method}], allowed: [GET]",
                    "status": 405,
                }
            return 200, self.resolve_index(parts[2])
        if parts == ["_aliases"] and method == "POST":
            return 200, self.update_aliases(body.get("actions", []))
        if parts == ["_reindex"]:
            return 200, self.reindex(body, q)
        if parts[:1] == ["_tasks"]:
            return self.get_tasks(parts[1:], q)
        if len(parts) == 1:
            return self.index_level(method, parts[0], body, q)
        target, action = parts[0], parts[1]
        if action == "_msearch":
            return 200, self.msearch(target, r.ndjson())
        if action == "_search":
            return 200, self.search(target, body, q)
        if action == "_count":
            return 200, {"count": len(self._matching(target, body.get("query"), q))}
        if action == "_doc":
            return self.doc(method, target, parts[2], body, q)
        if action == "_mget":
            if not self._resolve(target, {"ignore_unavailable": "true"}):
                return 404, index_missing(target)
            return 200, {"docs": [self.doc("GET", target, i, {}, q)[1] for i in body["ids"]]}
        if action == "_delete_by_query":
            return 200, self.delete_by_query(target, body, q)
        if action == "_refresh":
            self._resolve(target, q)
            return 200, {"_shards": {"total": 1, "successful": 1, "failed": 0}}
        if action == "_mapping":
            return self.mapping(method, target, body)
        raise _refuse("unsupported", f"the stateful fake has no {method} {r.path}")

    # --- names -----------------------------------------------------------------------

    def _resolve(
        self, expression: str, q: Mapping[str, str] | None = None, write: bool = False
    ) -> list[Index]:
        """Concrete indexes an expression names: index names, aliases, wildcards of both."""
        q = q or {}
        ignore = q.get("ignore_unavailable") == "true"
        found: dict[str, Index] = {}
        for part in expression.split(","):
            if "*" in part:
                names = [n for n in self.indexes if fnmatch.fnmatchcase(n, part)]
                for alias, held in self.aliases.items():
                    if fnmatch.fnmatchcase(alias, part):
                        names += sorted(held)
                if not names and q.get("allow_no_indices") == "false":
                    raise _missing(part)
            elif part in self.indexes:
                names = [part]
            elif part in self.aliases:
                names = sorted(self.aliases[part])
                if write and len(names) != 1:
                    raise _refuse(
                        "illegal_argument_exception",
                        f"no write index is defined for alias [{part}]",
                    )
            elif ignore:
                names = []
            else:
                raise _missing(part)
            found |= {n: self.indexes[n] for n in names}
        return list(found.values())

    @staticmethod
    def _check_name(name: str) -> None:
        if (
            name != name.lower()
            or any(c in _INVALID_CHARS for c in name)
            or name[:1] in ("-", "_", "+")
            or name in (".", "..")
            or len(name.encode()) > 255
        ):
            raise _refuse("invalid_index_name_exception", f"Invalid index name [{name}]")

    def create_index(self, name: str, body: Mapping[str, Any]) -> None:
        self._check_name(name)
        if name in self.indexes:
            raise _refuse(
                "resource_already_exists_exception",
                f"index [{name}/uuid] already exists",
                index=name,
            )
        if name in self.aliases:
            raise _refuse(
                "invalid_index_name_exception",
                f"Invalid index name [{name}], already exists as alias",
                index=name,
            )
        for alias in body.get("aliases") or {}:
            if alias in self.indexes:
                raise _refuse(
                    "invalid_alias_name_exception",
                    f"Invalid alias name [{alias}]: an index or data stream exists with the "
                    "same name as the alias",
                )
        template = self._template_for(name)
        mappings = json.loads(json.dumps(template.get("mappings", {})))
        settings = dict(template.get("settings", {}))
        given = body.get("mappings") or {}
        mappings.setdefault("properties", {}).update(given.get("properties", {}))
        mappings |= {k: v for k, v in given.items() if k != "properties"}
        settings |= body.get("settings") or {}
        self.indexes[name] = Index(name, mappings, settings)
        for alias in body.get("aliases") or {}:
            self.aliases.setdefault(alias, set()).add(name)

    def _template_for(self, name: str) -> dict[str, Any]:
        matching = [
            t
            for t in self.templates.values()
            if any(fnmatch.fnmatchcase(name, p) for p in t.get("index_patterns", []))
        ]
        if not matching:
            return {}
        best = max(matching, key=lambda t: int(t.get("priority", 0)))
        return dict(best.get("template", {}))

    def index_level(
        self, method: str, name: str, body: Mapping[str, Any], q: Mapping[str, str]
    ) -> tuple[int, Any]:
        if method == "HEAD":
            try:
                return (200 if self._resolve(name) else 404), None
            except _Refused:
                return 404, None
        if method == "PUT":
            self.create_index(name, body)
            return 200, {"acknowledged": True, "shards_acknowledged": True, "index": name}
        if method == "DELETE":
            return self.delete_indexes(name, q.get("ignore_unavailable") == "true")
        if method == "GET":
            return 200, {
                i.name: {"aliases": self._aliases_of(i.name), "mappings": i.mappings}
                for i in self._resolve(name, q)
            }
        raise _refuse("unsupported", f"{method} /{name}")

    def delete_indexes(self, expression: str, ignore_unavailable: bool) -> tuple[int, Any]:
        names = expression.split(",")
        for name in names:
            if "*" in name:
                raise _refuse(
                    "illegal_argument_exception",
                    "Wildcard expressions or all indices are not allowed",
                )
            if name in self.aliases:
                raise _refuse(
                    "illegal_argument_exception",
                    f"The provided expression [{name}] matches an alias, specify the "
                    "corresponding concrete indices instead.",
                )
            if name not in self.indexes and not ignore_unavailable:
                raise _missing(name)
        for name in names:
            if self.indexes.pop(name, None) is None:
                continue
            for alias in list(self.aliases):
                self.aliases[alias].discard(name)
                if not self.aliases[alias]:
                    del self.aliases[alias]
        return 200, {"acknowledged": True}

    def resolve_index(self, expression: str) -> dict[str, Any]:
        """``GET _resolve/index/<expr>``: matching indexes and aliases, listed apart."""
        indexes: set[str] = set()
        aliases: set[str] = set()
        for part in expression.split(","):
            indexes |= {n for n in self.indexes if fnmatch.fnmatchcase(n, part)}
            aliases |= {a for a in self.aliases if fnmatch.fnmatchcase(a, part)}
            if "*" not in part and not (indexes | aliases):
                raise _missing(part)
        return {
            "indices": [
                {"name": n, "aliases": sorted(self._aliases_of(n)), "attributes": ["open"]}
                for n in sorted(indexes)
            ],
            "aliases": [{"name": a, "indices": sorted(self.aliases[a])} for a in sorted(aliases)],
            "data_streams": [],
        }

    def _aliases_of(self, concrete: str) -> dict[str, Any]:
        return {a: {} for a, held in sorted(self.aliases.items()) if concrete in held}

    def get_alias(self, expression: str) -> tuple[int, Any]:
        answer: dict[str, Any] = {}
        missing: list[str] = []
        for part in expression.split(","):
            matched = [a for a in self.aliases if fnmatch.fnmatchcase(a, part)]
            if not matched and "*" not in part:
                missing.append(part)
            for alias in matched:
                for concrete in self.aliases[alias]:
                    answer.setdefault(concrete, {"aliases": {}})["aliases"][alias] = {}
        if missing:
            names = ",".join(missing)
            return 404, {"error": f"alias [{names}] missing", "status": 404, **answer}
        return 200, answer

    def update_aliases(self, actions: list[Mapping[str, Any]]) -> dict[str, Any]:
        staged = {a: set(h) for a, h in self.aliases.items()}
        for action in actions:
            (kind, args), *_ = action.items()
            indexes = [args["index"]] if "index" in args else list(args.get("indices", []))
            alias = args.get("alias")
            for name in indexes:
                if name not in self.indexes:
                    raise _missing(name)
                if kind == "add":
                    if alias in self.indexes:
                        raise _refuse("invalid_alias_name_exception", f"[{alias}] is an index")
                    staged.setdefault(alias, set()).add(name)
                elif kind == "remove":
                    if name not in staged.get(alias, set()):
                        raise _refuse(
                            "aliases_not_found_exception",
                            f"aliases [{alias}] missing",
                            status=404,
                        )
                    staged[alias].discard(name)
                else:
                    raise _refuse("unsupported", f"alias action {kind}")
        self.aliases = {a: h for a, h in staged.items() if h}
        return {"acknowledged": True, "errors": False}

    # --- documents -------------------------------------------------------------------

    def _check_source(self, index: Index, source: Mapping[str, Any]) -> None:
        properties = index.mappings.get("properties", {})
        if index.mappings.get("dynamic") == "strict":
            for key in source:
                if key not in properties:
                    raise _refuse(
                        "strict_dynamic_mapping_exception",
                        f"[1:2] mapping set to strict, dynamic introduction of [{key}] "
                        "within [_doc] is not allowed",
                    )
        for key, value in source.items():
            about = properties.get(key, {})
            if about.get("type") == "long" and not (
                isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
            ):
                raise _refuse(
                    "document_parsing_exception",
                    f"[1:2] failed to parse field [{key}] of type [long] in document",
                )
            if about.get("type") == "dense_vector" and len(value) != about.get("dims"):
                raise _refuse(
                    "document_parsing_exception",
                    f"[1:2] failed to parse: The [dense_vector] field [{key}] in doc has a "
                    f"number of dimensions [{len(value)}] less than defined in the mapping "
                    f"[{about.get('dims')}]",
                )

    def write(
        self,
        index: Index,
        doc_id: str,
        source: dict[str, Any] | None,
        version: int | None,
        external: bool,
    ) -> tuple[int, dict[str, Any]]:
        """Index (``source``) or delete (None) one document; (status, item) as ``_bulk``."""
        held = index.docs.get(doc_id)
        if (
            held is not None
            and held.deleted_at is not None
            and self.now - held.deleted_at > index.gc_deletes()
        ):
            held = None  # the tombstone was pruned: ES no longer knows the delete's version
            del index.docs[doc_id]
        base = {"_index": index.name, "_id": doc_id}
        if external:
            assert version is not None
            if held is not None and held.version >= version:
                reason = (
                    f"[{doc_id}]: version conflict, current version [{held.version}] is "
                    f"higher or equal to the one provided [{version}]"
                )
                error = {
                    "type": "version_conflict_engine_exception",
                    "reason": reason,
                    "index": index.name,
                }
                return 409, {**base, "status": 409, "error": error}
            new_version = version
        else:
            new_version = (held.version if held is not None else 0) + 1
        if source is not None:
            self._check_source(index, source)
            result, status = ("updated", 200) if held and held.source else ("created", 201)
        else:
            found = held is not None and held.source is not None
            result, status = ("deleted", 200) if found else ("not_found", 404)
            if not found and not external and held is None:
                new_version = 1
        index.docs[doc_id] = Doc(source, new_version, None if source is not None else self.now)
        shards = {"total": 2, "successful": 1, "failed": 0}
        return status, {
            **base,
            "_version": new_version,
            "result": result,
            "_shards": shards,
            "status": status,
        }

    def bulk(self, lines: list[Any], q: Mapping[str, str]) -> dict[str, Any]:
        require_alias = q.get("require_alias") == "true"
        requests: list[tuple[str, dict[str, Any], Any]] = []  # (op, metadata, source)
        it = iter(lines)
        for action in it:
            (op, meta), *_ = action.items()
            requests.append((op, meta, next(it) if op in ("index", "create") else None))
        _check_ids([str(meta["_id"]) for _op, meta, _source in requests])
        items: list[dict[str, Any]] = []
        for op, meta, source in requests:
            target, doc_id = meta["_index"], str(meta["_id"])
            version = int(meta["version"]) if "version" in meta else None
            external = meta.get("version_type") == "external"
            try:
                if require_alias and op != "delete" and target not in self.aliases:
                    reason = (
                        f"no such index [{target}] and [require_alias] request flag is "
                        f"[true] and [{target}] is not an alias"
                    )
                    raise _refuse("index_not_found_exception", reason, 404, index=target)
                if target not in self.indexes and target not in self.aliases:
                    if op == "delete" and not external:
                        raise _missing(target)
                    self.create_index(target, {})
                (index,) = self._resolve(target, write=True)
                _status, item = self.write(index, doc_id, source, version, external)
            except _Refused as refused:
                error = refused.body["error"]
                error = {k: v for k, v in error.items() if k != "root_cause"}
                item = {"_index": target, "_id": doc_id, "status": refused.status, "error": error}
            items.append({op: item})
        errors = any(next(iter(i.values()))["status"] >= 300 for i in items)
        return {"errors": errors, "took": 1, "items": items}

    def doc(
        self, method: str, target: str, doc_id: str, body: Any, q: Mapping[str, str]
    ) -> tuple[int, Any]:
        if method in ("PUT", "POST"):
            _check_ids([doc_id])
            if target not in self.indexes and target not in self.aliases:
                self.create_index(target, {})
            (index,) = self._resolve(target, write=True)
            external = q.get("version_type") == "external"
            version = int(q["version"]) if "version" in q else None
            status, item = self.write(index, doc_id, dict(body), version, external)
            if "error" in item:
                raise _Refused(409, {"error": item["error"], "status": 409})
            return status, {k: v for k, v in item.items() if k != "status"}
        if method == "GET":
            (index,) = self._resolve(target)
            held = index.docs.get(doc_id)
            if held is None or held.source is None:
                return 404, {"_index": index.name, "_id": doc_id, "found": False}
            excludes = q.get("_source_excludes", "")
            source = {k: v for k, v in held.source.items() if k not in excludes.split(",")}
            return 200, {
                "_index": index.name,
                "_id": doc_id,
                "_version": held.version,
                "_seq_no": 0,
                "_primary_term": 1,
                "found": True,
                "_source": source,
            }
        raise _refuse("unsupported", f"{method} _doc")

    def mapping(self, method: str, target: str, body: Mapping[str, Any]) -> tuple[int, Any]:
        indexes = self._resolve(target)
        if method == "PUT":
            given = body.get("properties", {})
            for index in indexes:  # ES adds fields; a mapped field keeps its type
                for name, about in given.items():
                    held = index.mappings.get("properties", {}).get(name)
                    if held is not None and held.get("type") != about.get("type"):
                        raise _refuse(
                            "illegal_argument_exception",
                            f"mapper [{name}] cannot be changed from type "
                            f"[{held.get('type')}] to [{about.get('type')}]",
                        )
            for index in indexes:
                index.mappings.setdefault("properties", {}).update(given)
            return 200, {"acknowledged": True}
        return 200, {i.name: {"mappings": i.mappings} for i in indexes}

    def delete_by_query(
        self, target: str, body: Mapping[str, Any], q: Mapping[str, str]
    ) -> dict[str, Any]:
        deleted = 0
        for index, doc_id, _doc in self._matching(target, body.get("query"), {}):
            self.write(index, doc_id, None, None, external=False)
            deleted += 1
        if q.get("wait_for_completion") != "false":
            return delete_by_query_response(deleted)
        task = f"fakenode:{next(self._task_ids)}"
        self.tasks[task] = delete_by_query_task(task, target, deleted=deleted)
        if self.delete_running_reads:
            self._running[task] = self.delete_running_reads
        return {"task": task}

    def reindex(self, body: Mapping[str, Any], q: Mapping[str, str]) -> dict[str, Any]:
        source, dest = body["source"], body["dest"]
        external = dest.get("version_type") == "external"
        if dest["index"] not in self.indexes and dest["index"] not in self.aliases:
            self.create_index(dest["index"], {})
        (into,) = self._resolve(dest["index"], write=True)
        created = updated = conflicts = 0
        for _index, doc_id, doc in self._matching(source["index"], source.get("query"), {}):
            assert doc.source is not None
            status, _item = self.write(
                into, doc_id, dict(doc.source), doc.version if external else None, external
            )
            created += status == 201
            updated += status == 200
            conflicts += status == 409
        report = {
            "took": 1,
            "timed_out": False,
            "total": created + updated + conflicts,
            "created": created,
            "updated": updated,
            "deleted": 0,
            "version_conflicts": conflicts,
            "failures": [],
        }
        if q.get("wait_for_completion") == "false":
            task = f"fakenode:{next(self._task_ids)}"
            self.tasks[task] = {
                "completed": True,
                "task": {
                    "node": "fakenode",
                    "id": int(task.split(":")[1]),
                    "action": "indices:data/write/reindex",
                    "description": f"reindex from [{source['index']}] to [{dest['index']}]",
                },
                "response": report,
            }
            if self.copy_running_reads:
                self._running[task] = self.copy_running_reads
            return {"task": task}
        return report

    def get_tasks(self, parts: list[str], q: Mapping[str, str]) -> tuple[int, Any]:
        if parts:
            task = self.tasks.get(parts[0])
            if task is None:
                return 404, error_body("resource_not_found_exception", "task not found", 404)
            if self._running.get(parts[0]):
                self._running[parts[0]] -= 1
                return 200, {"completed": False, "task": task["task"]}
            self._running.pop(parts[0], None)
            return 200, task
        # ES lists the tasks whose action matches ``actions`` (wildcards, comma-separated),
        # with their description only when ``detailed`` is true
        actions = q.get("actions", "*").split(",")
        running = {
            task: {
                **{
                    k: v
                    for k, v in self.tasks[task]["task"].items()
                    if k != "description" or q.get("detailed") == "true"
                },
                "running_time_in_nanos": 1,
            }
            for task in sorted(self._running)
            if any(fnmatch.fnmatchcase(self.tasks[task]["task"]["action"], a) for a in actions)
        }
        return 200, {
            "nodes": {"fakenode": {"name": "fakenode", "tasks": running}} if running else {}
        }

    # --- searching -------------------------------------------------------------------

    def _matching(
        self, target: str, query: Any, q: Mapping[str, str]
    ) -> list[tuple[Index, str, Doc]]:
        return [
            (index, doc_id, doc)
            for index in self._resolve(target, q)
            for doc_id, doc in index.live()
            if self._matches(index, doc_id, doc.source or {}, query)
        ]

    def _matches(self, index: Index, doc_id: str, source: Mapping[str, Any], query: Any) -> bool:
        if not query or "match_all" in query:
            return True
        (kind, args), *_ = query.items()
        if kind == "bool":
            clauses = [*_listed(args.get("filter")), *_listed(args.get("must"))]
            should = _listed(args.get("should"))
            # ES: with no must/filter clause at least one should must match, else none need
            least = int(args.get("minimum_should_match", 0 if clauses else 1 if should else 0))
            return (
                all(self._matches(index, doc_id, source, c) for c in clauses)
                and sum(self._matches(index, doc_id, source, c) for c in should) >= least
                and not any(
                    self._matches(index, doc_id, source, c) for c in _listed(args.get("must_not"))
                )
            )
        if kind == "term":
            (name, wanted), *_ = args.items()
            wanted = wanted["value"] if isinstance(wanted, Mapping) else wanted
            if name == "_index":
                return bool(index.name == wanted)
            return _keyword(wanted) in _keywords(_field(source, name))
        if kind == "terms":
            (name, wanted), *_ = args.items()
            if name == "_index":
                return index.name in wanted
            return bool({_keyword(w) for w in wanted} & _keywords(_field(source, name)))
        if kind == "ids":
            return doc_id in args["values"]
        if kind == "exists":  # null and [] hold no indexed value
            return bool(_keywords(_field(source, args["field"])))
        if kind == "range":
            (name, bounds), *_ = args.items()
            about = index.mappings.get("properties", {}).get(name, {})
            if about.get("type") != "long":  # the adapter ranges over its long fields only
                raise _refuse("unsupported", f"range on [{name}] of type {about.get('type')}")
            return any(_in_range(int(v), bounds) for v in _listed(_field(source, name)))
        if kind == "multi_match":
            return self._bm25(index, source, args) > 0
        raise _refuse("unsupported", f"query {kind}")

    def _bm25(self, index: Index, source: Mapping[str, Any], args: Mapping[str, Any]) -> float:
        words = set(_WORD.findall(str(args["query"]).lower()))
        docs = [d.source or {} for _, d in index.live()]
        best = 0.0
        for name in args["fields"]:
            mine = _WORD.findall(str(_field(source, name) or "").lower())
            score = 0.0
            for word in words & set(mine):
                df = sum(word in _WORD.findall(str(_field(d, name) or "").lower()) for d in docs)
                tf = mine.count(word)
                idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
                score += idf * tf / (tf + 1.2 * (0.25 + 0.75 * len(mine) / 8))
            best = max(best, score)
        return best

    def search(self, target: str, body: Mapping[str, Any], q: Mapping[str, str]) -> dict[str, Any]:
        q = {"allow_no_indices": "true", **q}
        indexes = self._resolve(target, q)
        query = body.get("query")
        scored: list[tuple[float, Index, str, Doc]] = []
        if "knn" in body:
            knn = body["knn"]
            wanted = [float(v) for v in knn["query_vector"]]
            filters = {"bool": {"filter": _listed(knn.get("filter"))}}
            candidates = []
            for index, doc_id, doc in self._matching(target, filters, q):
                vector = _field(doc.source or {}, knn["field"])
                if vector is not None:
                    candidates.append(((1 + _cosine(wanted, vector)) / 2, index, doc_id, doc))
            scored = sorted(candidates, key=lambda c: -c[0])[: int(knn["k"])]
        else:
            must = _listed((query or {}).get("bool", {}).get("must"))
            for index in indexes:
                for doc_id, doc in index.live():
                    source = doc.source or {}
                    if not self._matches(index, doc_id, source, query):
                        continue
                    score = sum(
                        self._bm25(index, source, m["multi_match"])
                        for m in must
                        if "multi_match" in m
                    )
                    scored.append((score, index, doc_id, doc))
            scored.sort(key=lambda c: -c[0])
        total = len(scored)
        scored = _sorted(scored, body)
        terminate = body.get("terminate_after")
        answer: dict[str, Any] = {
            "took": 1,
            "timed_out": False,
            "_shards": {"total": len(indexes), "successful": len(indexes), "failed": 0},
        }
        if terminate is not None:
            total = min(total, int(terminate) * max(1, len(indexes)))
            if total:
                answer["terminated_early"] = True
        size = int(body.get("size", 10))
        includes = body.get("_source")
        sort = _sort_keys(body)
        hits = [
            {
                "_index": index.name,
                "_id": doc_id,
                "_score": score,
                "_source": _filtered(doc.source or {}, includes),
                **_script_fields(doc.source or {}, body.get("script_fields")),
                **({"_version": doc.version} if body.get("version") else {}),
                **({"sort": [_field(doc.source or {}, k) for k in sort]} if sort else {}),
            }
            for score, index, doc_id, doc in scored[:size]
        ]
        answer["hits"] = {"max_score": hits[0]["_score"] if hits else None, "hits": hits}
        if body.get("track_total_hits", True) is not False:
            answer["hits"]["total"] = {"value": total, "relation": "eq"}
        if "aggs" in body:
            matched = [(index, source_of(doc)) for _, index, _, doc in scored]
            answer["aggregations"] = self._aggs(body["aggs"], matched)
        return answer

    def _aggs(
        self, aggs: Mapping[str, Any], docs: list[tuple[Index, dict[str, Any]]]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, agg in aggs.items():
            if "terms" in agg:
                by: dict[str, list[tuple[Index, dict[str, Any]]]] = {}
                for index, source in docs:
                    key = index.name if agg["terms"]["field"] == "_index" else None
                    if key is None:
                        value = _field(source, agg["terms"]["field"])
                        key = None if value is None else _keyword(value)
                    if key is not None:
                        by.setdefault(key, []).append((index, source))
                ranked = sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0]))
                size = int(agg["terms"].get("size", 10))
                out[name] = {
                    "doc_count_error_upper_bound": 0,
                    "sum_other_doc_count": sum(len(v) for _, v in ranked[size:]),
                    "buckets": [
                        {"key": k, "doc_count": len(v), **self._aggs(agg.get("aggs", {}), v)}
                        for k, v in ranked[:size]
                    ],
                }
            elif "composite" in agg:
                (source_name, source_agg), *_ = agg["composite"]["sources"][0].items()
                keys = sorted(
                    {
                        _keyword(value)
                        for _, source in docs
                        if (value := _field(source, source_agg["terms"]["field"])) is not None
                    }
                )
                after = (agg["composite"].get("after") or {}).get(source_name)
                keys = [k for k in keys if after is None or k > after]
                page = keys[: int(agg["composite"].get("size", 10))]
                counts = {
                    k: sum(_keyword(_field(s, source_agg["terms"]["field"])) == k for _, s in docs)
                    for k in page
                }
                out[name] = {
                    "buckets": [{"key": {source_name: k}, "doc_count": counts[k]} for k in page]
                }
                if page:
                    out[name]["after_key"] = {source_name: page[-1]}
            else:
                raise _refuse("unsupported", f"aggregation {agg}")
        return out

    def msearch(self, target: str, lines: list[Any]) -> dict[str, Any]:
        responses: list[dict[str, Any]] = []
        for header, body in zip(lines[0::2], lines[1::2], strict=True):
            where = header.get("index", target)
            try:
                responses.append({**self.search(where, body, {}), "status": 200})
            except _Refused as refused:
                responses.append({**refused.body, "status": refused.status})
        return {"took": 1, "responses": responses}

    # --- for tests -------------------------------------------------------------------

    def concrete(self, alias: str) -> list[str]:
        with self.lock:
            return sorted(self.aliases.get(alias, set()))

    def live_ids(self, name: str) -> set[str]:
        with self.lock:
            return {i for index in self._resolve(name) for i, _ in index.live()}


def source_of(doc: Doc) -> dict[str, Any]:
    return doc.source or {}


def _listed(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _field(source: Mapping[str, Any], name: str) -> Any:
    """A field by its dotted name (a ``flattened`` field's keys included). As in ES, a key
    holding dots (``{"a.b": 1}``) is the same path as the objects ``{"a": {"b": 1}}``."""
    if name in source:
        return source[name]
    parts = name.split(".")
    for cut in range(1, len(parts)):
        head = ".".join(parts[:cut])
        node = source.get(head)
        if isinstance(node, Mapping):
            found = _field(node, ".".join(parts[cut:]))
            if found is not None:
                return found
    return None


def _in_range(value: int, bounds: Mapping[str, Any]) -> bool:
    """Whether a ``long`` value is within a ``range`` query's ``gt``/``gte``/``lt``/``lte``."""
    tests = {
        "gt": lambda bound: value > bound,
        "gte": lambda bound: value >= bound,
        "lt": lambda bound: value < bound,
        "lte": lambda bound: value <= bound,
    }
    for key, bound in bounds.items():
        if key not in tests:
            raise _refuse("parsing_exception", f"[range] query does not support [{key}]")
        if not tests[key](int(bound)):
            return False
    return True


def _keywords(value: Any) -> set[str]:
    """The keywords a field's value indexes: one per element of an array, none for null."""
    return {_keyword(v) for v in _listed(value) if v is not None}


def _keyword(value: Any) -> str:
    """How a keyword (or a ``flattened`` leaf) holds a value: ``true``, ``5``, ``2.5``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _filtered(source: Mapping[str, Any], includes: Any) -> dict[str, Any]:
    if includes is None or includes is True:
        return dict(source)
    if includes is False:
        return {}
    if isinstance(includes, Mapping):  # {"includes": [...], "excludes": [...]}
        kept = _filtered(source, includes.get("includes"))
        return {k: v for k, v in kept.items() if k not in _listed(includes.get("excludes"))}
    return {k: v for k, v in source.items() if k in _listed(includes)}


def _script_fields(source: Mapping[str, Any], scripts: Any) -> dict[str, Any]:
    """A hit's ``fields`` from the request's ``script_fields``: each value in a list, none
    for a null (as ES leaves a script field out when its script returns null)."""
    values = {name: _painless(spec["script"], source) for name, spec in (scripts or {}).items()}
    fields = {name: [value] for name, value in values.items() if value is not None}
    return {"fields": fields} if fields else {}


def _painless(script: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    """The listing's two scripts as painless runs them, on the text's UTF-16 units."""
    params = script.get("params", {})
    value = source.get(params.get("field"))
    if script.get("source") not in (PREVIEW_SCRIPT, LENGTH_SCRIPT) or not isinstance(
        value, str | None
    ):
        raise _refuse("script_exception", f"the stand-in cannot run {script!r}")
    units = (value or "").encode("utf-16-le", "surrogatepass")
    units_of = [int.from_bytes(units[i : i + 2], "little") for i in range(0, len(units), 2)]
    count = _code_point_count(units_of)
    if script["source"] == LENGTH_SCRIPT:
        return count
    if count <= params["chars"]:
        return value or ""
    end = _offset_by_code_points(units_of, params["chars"])
    return bytes(units[: 2 * end]).decode("utf-16-le", "surrogatepass")


def _pair_at(units: list[int], i: int) -> bool:
    return 0xD800 <= units[i] < 0xDC00 and i + 1 < len(units) and 0xDC00 <= units[i + 1] < 0xE000


def _code_point_count(units: list[int]) -> int:
    """Java's ``String.codePointCount(0, length())``: a lone surrogate counts one."""
    i = count = 0
    while i < len(units):
        i += 2 if _pair_at(units, i) else 1
        count += 1
    return count


def _offset_by_code_points(units: list[int], points: int) -> int:
    """Java's ``String.offsetByCodePoints(0, points)``: the unit index ``points`` in."""
    i = 0
    for _ in range(points):
        i += 2 if _pair_at(units, i) else 1
    return i


def _sort_keys(body: Mapping[str, Any]) -> list[str]:
    """The fields of a ``sort`` of ``[{field: "asc"}]`` (the one shape the adapter sends)."""
    keys = []
    for clause in _listed(body.get("sort")):
        (name, order), *_ = clause.items()
        if order != "asc":
            raise _refuse("unsupported", f"sort {clause}")
        keys.append(name)
    return keys


def _sorted(
    scored: list[tuple[float, Index, str, Doc]], body: Mapping[str, Any]
) -> list[tuple[float, Index, str, Doc]]:
    """``scored`` in the body's ``sort`` order (keywords compare as UTF-8 bytes, which is
    code point order), from after its ``search_after``."""
    keys = _sort_keys(body)
    if not keys:
        if "search_after" in body:
            raise _refuse("illegal_argument_exception", "search_after needs a sort")
        return scored

    def key(entry: tuple[float, Index, str, Doc]) -> list[str]:
        source = entry[3].source or {}
        return [_keyword(_field(source, k)) for k in keys]

    ordered = sorted(scored, key=key)
    after = body.get("search_after")
    if after is None:
        return ordered
    if len(after) != len(keys):
        raise _refuse("illegal_argument_exception", "search_after has the wrong length")
    wanted = [_keyword(v) for v in after]
    return [entry for entry in ordered if key(entry) > wanted]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms else 0.0


def stateful_server() -> tuple[FakeElasticsearchServer, StatefulElasticsearch]:
    """A loopback server (not started) whose unscripted requests the stateful fake answers."""
    server = FakeElasticsearchServer()
    state = StatefulElasticsearch()
    server.fallback = state
    return server, state

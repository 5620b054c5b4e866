"""Writes: upserts and deletes by id through the bulk helper with ``require_alias``, made
again at most ``WRITE_ATTEMPTS`` times when a drop removed the alias meanwhile, the model
check before vectors are written, and the take-back of a versioned write that lost to a
drop run between its floor check and its bulk."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elasticsearch import helpers

from worker.adapters.elasticsearch._errors import (
    _AliasGone,
    _bulk_error,
    _Bulked,
    _holds_own_version,
    _index_missing,
    _raise_if_partial,
    _scrubbed,
    _translated,
    _unavailable,
)
from worker.adapters.elasticsearch._indexes import _Indexes
from worker.adapters.elasticsearch._layout import document_es_id
from worker.adapters.elasticsearch._search import _Search
from worker.core.types import Document
from worker.errors import (
    BackendRequestError,
    BackendUnavailable,
    EmbeddingModelMismatch,
    InvalidRequest,
)

logger = logging.getLogger(__name__)

#: How often a write makes its index again after ``require_alias`` found it gone (another
#: worker's drop ran in between) before it gives up, retryably.
WRITE_ATTEMPTS = 3


class _Writes(_Search, _Indexes):
    """Upserts, deletes by id, and the take-back of a write that lost to a drop (on
    ``_Search``: a write of vectors reads and updates its probe memo)."""

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
        """Index each document under its ``_id`` (:func:`document_es_id`: ``<tenant>:<id>``,
        or a digest of it past 512 bytes), replacing it whole, into the tenant's own index
        (made on its first write) through the bulk helper.

        With a ``version``, each write is ES's external versioning: ES applies it only if
        the version is newer than the one it holds for the ``_id`` (a delete's included,
        for ``index.gc_deletes``), and a refused one (409) is a newer write kept, not an
        error. The version also goes in each document's ``_source``
        (``SIFT_ELASTICSEARCH_WRITE_VERSION_FIELD``), where a drop's query can read it (ES
        searches no ``_version``). ``model`` goes on each document with a vector
        (``SIFT_ELASTICSEARCH_MODEL_FIELD``). Then the tenant's documents of those ids under
        another ``_id`` go (:meth:`_replace_foreign`): the upsert replaces them."""
        if vectors is not None and len(vectors) != len(documents):
            raise InvalidRequest(
                "vectors", f"{len(vectors)} vectors for {len(documents)} documents"
            )
        if not documents:
            return 0
        alias = self.alias(index, tenant)
        recorded = model if vectors is not None and self.fields.model else None
        names = {document_es_id(tenant, doc.id): doc.id for doc in documents}
        actions = [
            {
                "_op_type": "index",
                "_index": alias,
                "_id": document_es_id(tenant, doc.id),
                "_source": self.source(
                    tenant, doc, vectors[i] if vectors is not None else None, recorded, version
                ),
                **_versioned(version),
            }
            for i, doc in enumerate(documents)
        ]
        what = f"bulk write to index {index!r}"

        def prepare() -> None:
            if not self._map_fields(index, tenant):
                return  # dropped meanwhile: the bulk makes the index again
            if recorded is not None:
                self._check_model(index, tenant, recorded)

        outcome = self._write(index, tenant, actions, names, what, version, prepare=prepare)
        # below the floor on this call (None) or after its bulk: an earlier attempt of this
        # write (a retry after a take-back cut short) may have left documents in
        if self._take_back(index, tenant, names, version, what) or outcome is None:
            return 0
        self._replace_foreign(index, tenant, outcome, names, what)
        written = outcome.applied
        if vectors is not None and written:
            self._saw_vectors(alias, tenant, recorded)
        return written

    def _map_fields(self, index: str, tenant: str) -> bool:
        """Once per process and alias, add the model field and the metadata-terms field to
        the index's mapping (``PUT <alias>/_mapping``: a no-op on an index made from the
        current template), so an index made before a field existed takes it under
        ``dynamic: strict``. An index this process just made is no exception: the template
        ES holds is the one put last, maybe by a worker of an earlier release (a rolling
        upgrade), not this one's. False if the index is missing (another worker dropped it
        meanwhile; the bulk write makes it again)."""
        alias = self.alias(index, tenant)
        added = self._added_fields()
        if alias in self._fields_mapped or not added:
            return True
        with _translated(f"mapping of index {index!r}", index, missing_ok=True) as missing:
            self._es().indices.put_mapping(index=alias, properties=added)
        if missing:
            return False
        self._fields_mapped.add(alias)
        return True

    def _check_model(self, index: str, tenant: str, model: str) -> None:
        """Raise EmbeddingModelMismatch if the tenant's index holds another model's vectors
        (an index another worker dropped meanwhile holds no model)."""
        alias = self.alias(index, tenant)
        with _translated(f"model check of index {index!r}", index, missing_ok=True) as missing:
            answer = self._es().search(index=alias, **self.model_check_body(tenant, model)).body
        if not missing:
            _raise_if_partial(answer, f"model check of index {index!r}")
        held = None if missing else self._model_of(answer)
        if held is not None:
            raise EmbeddingModelMismatch(index, held, model)

    def _write(
        self,
        index: str,
        tenant: str,
        actions: list[dict[str, Any]],
        names: Mapping[str, str],
        what: str,
        version: int | None,
        prepare: Callable[[], None] | None = None,
    ) -> _Bulked | None:
        """Run ``actions`` into the tenant's index, made if missing; None if a drop accepted
        after this write has already run (nothing is written, no index made). ``names``
        maps each action's ``_id`` to its document id, for the error naming what failed.

        Each attempt reads the drop floor first, makes the index, runs ``prepare`` (the
        model check; a delete's mark) and the bulk. A delete bulk checks the alias first,
        not what this process remembers: ``require_alias`` does not apply to a delete, so
        one sent to a dropped alias would make a bare index of its name (:meth:`_bulk`
        clears it).
        The alias found gone (another worker dropped the index since), or the index's first
        concrete name found without its alias, starts the next attempt; every action is sent
        again, which external versions and whole-document writes make safe. After
        ``WRITE_ATTEMPTS`` the write fails, naming what it found: retryably
        (``BackendUnavailable``) if drops kept removing the alias, not retryably
        (``BackendRequestError``) if an index without its alias is in the way, which no
        retry clears."""
        alias = self.alias(index, tenant)
        existed = 0
        gone = _AliasGone(index)
        deleting = any(action.get("_op_type") == "delete" for action in actions)
        for _attempt in range(WRITE_ATTEMPTS):
            if self._floors.below(alias, version):
                return None if not existed else _Bulked(0, existed, [])
            try:
                if deleting:
                    with self._lock:
                        self._ready_aliases.discard(alias)  # ensure_index asks ES
                self.ensure_index(index, tenant)
                if prepare is not None:
                    prepare()
                bulked = self._bulk(actions, what, index, tenant, names)
            except _AliasGone as refused:
                self._forget(alias, tenant)
                existed += refused.existed
                gone = refused
                continue
            bulked.existed += existed
            return bulked
        # the operator's log names the concrete indexes; the tenant's error, its own index
        # (_scrubbed: the deployment's prefix and the tenant's key are not the tenant's)
        if gone.leftover:
            logger.warning(
                "the %s cannot make index %r of tenant %r: the concrete index %r exists "
                "without its alias %r (%s): drop the index again, or delete %r by name",
                what,
                index,
                tenant,
                gone.leftover,
                alias,
                gone.reason,
                gone.leftover,
            )
            raise BackendRequestError(
                f"the {what} cannot make index {index!r}: a concrete index of it exists "
                f"without its alias ({_scrubbed(gone.reason)}), and no retry clears it: "
                f"drop index {index!r} again (the drop deletes it)"
            ) from gone
        logger.warning(
            "the %s found the alias %r of index %r of tenant %r gone %d times (%s)",
            what,
            alias,
            index,
            tenant,
            WRITE_ATTEMPTS,
            gone.reason,
        )
        raise BackendUnavailable(
            f"the {what} found the alias of index {index!r} gone {WRITE_ATTEMPTS} times as "
            f"it made it again ({_scrubbed(gone.reason)}): another worker's drops kept "
            "removing it"
        ) from gone

    def _take_back(
        self, index: str, tenant: str, names: Mapping[str, str], version: int | None, what: str
    ) -> bool:
        """Whether a versioned write lost to a drop (then none of it stays written).

        The floor check and the bulk are two requests: a drop accepted after this write can
        run between them, and a newer writer can make the index again, so the bulk finds
        the alias and writes. So the floor is read again after the bulk; if a drop of this
        write's version or newer has run, every ``_id`` of the write (``names``) is deleted
        with the drop's version as external version: a document a newer writer put in
        since answers 409 and stays. The deletes go every time the floor is at or above the
        version, even when this call wrote nothing: a retry of a write whose take-back was
        cut short (a 5xx, a crash) completes it. They go only while the alias exists
        (``HEAD _alias``): a delete is not held to ``require_alias``, and one reaching a
        dropped alias would make a bare index of its name; one that does anyway (the alias
        dropped between the check and the bulk) is cleared by :meth:`_bulk`."""
        if version is None or not names:
            return False
        alias = self.alias(index, tenant)
        floor = self._floors.floor(alias)
        if floor < version:
            return False
        taken = f"{what} (taken back after drop {floor})"
        deletes = [
            {"_op_type": "delete", "_index": alias, "_id": _id, **_versioned(floor)}
            for _id in names
        ]
        if self._alias_exists(alias, taken, index):
            with contextlib.suppress(_AliasGone):  # dropped again: nothing of it is left
                self._bulk(deletes, taken, index, tenant, names)
        self._forget(alias, tenant)
        logger.info(
            "%s: version %d lost to drop %d run meanwhile; %d document(s) taken back",
            what,
            version,
            floor,
            len(deletes),
        )
        return True

    def _bulk(
        self,
        actions: list[dict[str, Any]],
        what: str,
        index: str,
        tenant: str,
        names: Mapping[str, str],
    ) -> _Bulked:
        """Run bulk ``actions`` (``names``: each ``_id``'s document id, for the error naming
        the documents not written): how many applied, how many found their document, and the
        ``_id`` of each one applied. A 409 (a newer version held) and a delete's 404 (nothing
        to delete) are answers, not failures; a 409 on an upsert that finds its own version
        held counts as applied (an earlier attempt of this write, cut short by a failure of
        other items, put the document there: the retry reports every document it wrote).
        ``require_alias``: an index action whose alias is gone fails (``_AliasGone``, with
        what was deleted before it) instead of auto-creating a bare concrete index of that
        name. ES does not hold a delete to ``require_alias``, and makes a missing index for
        an external-versioned one: a delete answered from an index named like the alias
        itself found the alias dropped since its check and made that bare index, which is
        deleted here (:meth:`_clear_bare`) before the attempt counts as the alias gone; the
        rest of the bulk is not sent."""
        failures: list[dict[str, Any]] = []
        bulked = _Bulked(0, 0, [])
        alias = self.alias(index, tenant)
        with _translated(what, index):
            for ok, item in helpers.streaming_bulk(
                self._es(),
                actions,
                chunk_size=self.bulk_chunk_size,
                raise_on_error=False,
                raise_on_exception=True,
                max_retries=0,
                refresh=self.refresh,
                require_alias=True,
            ):
                op = next(iter(item.values())) if item else {}
                status = int(op.get("status", 500))
                if "error" not in op and op.get("_index") == alias:  # a delete made it
                    cleared = self._clear_bare(alias, what, index)
                    raise _AliasGone(
                        index,
                        existed=bulked.existed,
                        leftover="" if cleared else alias,
                        reason=f"a delete made the bare index {alias!r}",
                    )
                own = status == 409 and _holds_own_version(op)  # an earlier attempt's
                if ok or own or (status == 404 and op.get("result") == "not_found"):
                    bulked.landed[str(op.get("_id"))] = str(op.get("_index"))
                if ok:
                    bulked.applied += 1
                    bulked.existed += op.get("result") in ("deleted", "updated")
                    bulked.written.append(str(op.get("_id")))
                elif status == 404 and op.get("result") == "not_found":
                    bulked.applied += 1
                elif status == 409 and "index" in item and _holds_own_version(op):
                    bulked.applied += 1  # an earlier attempt of this write put it there
                elif _index_missing(op):
                    raise _AliasGone(index, existed=bulked.existed, reason="require_alias")
                elif status != 409:
                    failures.append(item)
        if failures:
            self._raise_if_unmapped(alias, failures)
            raise _bulk_error(failures, names)
        return bulked

    def _raise_if_unmapped(self, alias: str, failures: Sequence[Mapping[str, Any]]) -> None:
        """Raise BackendUnavailable (retryable) if ``dynamic: strict`` refused a field this
        process had mapped on the alias (:meth:`_map_fields`, once per alias), letting that
        memo go: the index was made again since from a template without it (a worker of an
        earlier release dropped and re-made it), and the retry maps it before it writes."""
        added = self._added_fields()
        for item in failures:
            error = (next(iter(item.values())) if item else {}).get("error")
            reason = str(error.get("reason", "")) if isinstance(error, Mapping) else ""
            kind = error.get("type") if isinstance(error, Mapping) else None
            field = next((name for name in added if f"[{name}]" in reason), None)
            if (
                kind == "strict_dynamic_mapping_exception"
                and field
                and alias in self._fields_mapped
            ):
                with self._lock:
                    self._fields_mapped.discard(alias)
                raise BackendUnavailable(
                    f"index {alias!r} does not map {field!r} any more (made again since from "
                    f"an earlier release's template): {reason}; the retry maps it"
                )

    def delete_documents(
        self, index: str, tenant: str, ids: Sequence[str], *, version: int | None = None
    ) -> int:
        """Delete each id's ``_id`` (:func:`document_es_id`), external-versioned: a newer
        write stays, and the delete's tombstone refuses an older upsert for
        ``index.gc_deletes`` (SIFT_ELASTICSEARCH_GC_DELETES_SECONDS in Sift's index template;
        ES's own default is 60 s). Answers how many existed. The tenant's index
        is created first if it is missing, as an upsert would: a delete may run before the
        upsert it was accepted after. A versioned delete not below the floor records its
        version for the alias before its bulk (:meth:`DropFloors.raise_delete`): a drop
        accepted before it and run after it then keeps the index, and with it the
        tombstones. Then the tenant's documents of those ids under another ``_id`` go too
        (:meth:`_replace_foreign`), counted with the rest."""
        alias = self.alias(index, tenant)
        names = {document_es_id(tenant, i): i for i in ids}
        actions = [
            {"_op_type": "delete", "_index": alias, "_id": _id, **_versioned(version)}
            for _id in names
        ]
        # the index is made if missing, so the tombstones exist for an older upsert that
        # runs later
        if not actions:
            return 0
        what = f"bulk delete in index {index!r}"

        def prepare() -> None:  # before any tombstone: a drop that runs later sees it
            if version is not None:
                self._floors.raise_delete(alias, version, what, index)

        bulked = self._write(index, tenant, actions, names, what, version, prepare=prepare)
        if bulked is None:
            return 0
        existed = bulked.existed + self._replace_foreign(index, tenant, bulked, names, what)
        if existed:  # maybe its last vectors: probe again
            self._with_vectors.pop((alias, tenant), None)
        return existed

    def _replace_foreign(
        self, index: str, tenant: str, bulked: _Bulked, names: Mapping[str, str], what: str
    ) -> int:
        """Delete the tenant's documents of the ids a write by id has just written or deleted
        (``bulked.landed``) that sit under an ``_id`` other than Sift's; how many went.

        An index that already exists, aliased for the tenant (deploy/README.md §4), holds
        its own tool's ``_id``s (and so does an index Sift copied from one: a reindex
        keeps each ``_id``), and a search finds such a document by its id field, or by its
        ``_id`` where it has none (:meth:`_hit`): an upsert under Sift's ``_id`` would sit
        beside it, and a delete would leave it. So one ``_delete_by_query`` on the alias
        takes the tenant's documents of those ids, by the id field or by an ``_id`` without
        it, never under Sift's own ``_id``; in an index holding none (every index Sift
        wrote) it deletes nothing. It sees what the last refresh holds, as a search does,
        and the index is refreshed after it (as the bulk's ``refresh`` asks) only when it
        deleted one. Only ids whose Sift ``_id`` holds this write's version are taken: an
        older write run after a newer one (409) leaves what the newer one left, so a delete
        accepted after an upsert still wins. Conflicts (the tool wrote one meanwhile) or
        failures fail the write retryably: its retry, idempotent, takes what is left."""
        ids = sorted({names[_id] for _id in bulked.landed if _id in names})
        if not ids:
            return 0
        alias = self.alias(index, tenant)
        field = self.fields.id
        untagged = {"ids": {"values": ids}}
        query = self.tenant_query(tenant)
        query["bool"]["should"] = [
            {"terms": {field: ids}},
            {"bool": {"filter": [untagged], "must_not": [{"exists": {"field": field}}]}},
        ]
        query["bool"]["minimum_should_match"] = 1
        sifts = [document_es_id(tenant, i) for i in ids]
        query["bool"]["must_not"] = [{"ids": {"values": sifts}}]
        doing = f"{what} (the documents of its ids under other _ids)"
        with _translated(doing, index, missing_ok=True) as missing:
            es = self._es()
            report = es.delete_by_query(index=alias, query=query, conflicts="proceed").body
            deleted = int(report.get("deleted", 0))
            if deleted and self.refresh:
                es.indices.refresh(index=alias)
        if missing:  # dropped meanwhile: the drop took them
            return 0
        conflicts = int(report.get("version_conflicts", 0))
        failures = report.get("failures") or []
        if conflicts or failures:
            raise _unavailable(
                f"{doing}: deleted {deleted} and left some ({conflicts} changed since it "
                f"began, {len(failures)} failure(s)): run again",
                json.dumps(failures[:1]),
            )
        return deleted


def _versioned(version: int | None) -> dict[str, Any]:
    """Bulk action metadata for ES's external versioning (none without a version)."""
    return {} if version is None else {"version": version, "version_type": "external"}

"""Making a tenant's index: its alias and first concrete index, made once and found again
by the alias (never by a concrete name), and the bare index named like an alias (one a
delete made after a drop) cleared out of the way when it holds no document."""

from __future__ import annotations

import logging

from elasticsearch import ApiError

from worker.adapters.elasticsearch._bodies import _Bodies
from worker.adapters.elasticsearch._errors import (
    _AliasGone,
    _error_type,
    _raise_if_partial,
    _translated,
)
from worker.adapters.elasticsearch._layout import concrete_name
from worker.errors import IndexLimitReached

logger = logging.getLogger(__name__)


class _Indexes(_Bodies):
    """Make the tenant's index if it is missing; clear a bare index in its alias's way."""

    def ensure_index(self, index: str, tenant: str, *, capped: bool = True) -> bool:
        """Create the tenant's alias and its first concrete index if they don't exist yet;
        whether this call created them. When ``capped``, one more than the tenant may hold
        (``max_indexes_per_tenant``) is not made: :meth:`_check_limit`.

        The alias is what is looked for (``HEAD _alias/<alias>``): a concrete index of the
        alias's own name is not it. The first concrete name is fixed, so two workers racing
        both end with the one index. Found already there, the alias is checked too: that
        index without its alias (a drop cut short) is never written into again
        (``_AliasGone`` naming it). A concrete index named like the alias (a delete sent as
        the alias was dropped made it: ES holds no delete to ``require_alias``) makes the
        create fail; it is deleted if it holds no document (:meth:`_clear_bare`) and the
        next attempt makes the index, else it is named as in the way (``_AliasGone``)."""
        alias = self.alias(index, tenant)
        if alias in self._ready_aliases:
            return False
        created = False
        with self._lock:
            if not self._alias_exists(alias, f"index {index!r}", index):
                if capped:
                    self._check_limit(index, tenant)
                created = self._create_first(index, alias)
            self._ready_aliases.add(alias)
        return created

    def _create_first(self, index: str, alias: str) -> bool:
        """``PUT <alias>~000001`` with the alias; whether this call made it."""
        concrete = concrete_name(alias, "000001")
        what = f"create index {index!r}"
        with _translated(what, index):
            try:
                self._es().indices.create(
                    index=concrete, aliases={alias: {}}, **self._explicit_body()
                )
                return True
            except ApiError as exc:
                kind = _error_type(exc)
                if kind == "invalid_alias_name_exception":  # an index has the alias's name
                    cleared = self._clear_bare(alias, what, index)
                    reason = f"the concrete index {alias!r} has the alias's name"
                    leftover = "" if cleared else alias
                    raise _AliasGone(index, leftover=leftover, reason=reason) from exc
                if kind != "resource_already_exists_exception":
                    raise
                if not self._es().indices.exists_alias(name=alias):
                    reason = "a drop cut short, or the alias removed by hand"
                    raise _AliasGone(index, leftover=concrete, reason=reason) from exc
        return False

    def _check_limit(self, index: str, tenant: str) -> None:
        """Raise ``IndexLimitReached`` if the tenant already holds ``max_indexes_per_tenant``
        aliases (``GET _alias/<prefix><key>--*``: every one holds a shard, an empty one a
        delete made too). Not atomic with the create: workers making new names for one
        tenant at the same moment each pass it, so the tenant may end one over per such
        worker process (one process makes its indexes one at a time, under its lock). The
        alias itself found among them (another process made it since the ``HEAD``) is no
        new one: the write goes into it."""
        limit = self.max_indexes_per_tenant
        if not limit:
            return
        stem = self.tenant_stem(tenant)
        what = f"create index {index!r}"
        with _translated(what, index):
            held = {  # concrete index -> the tenant's alias on it
                concrete: alias
                for concrete, aliases in self._aliases(f"{stem}*").items()
                for alias in aliases
                if alias.startswith(stem)
            }
        if self.alias(index, tenant) in held.values():
            return
        if len(set(held.values())) >= limit:
            unlisted = self._unlisted(tenant, stem, held, what, index)
            raise IndexLimitReached(index, len(set(held.values())), limit, unlisted)

    def _unlisted(
        self, tenant: str, stem: str, held: dict[str, str], what: str, index: str
    ) -> list[str]:
        """Of the tenant's aliases (``held``: concrete index -> alias), the names of those
        holding none of its documents, which ``GET /v1/indexes`` does not list: one ``size:
        0`` search, filtered on the tenant, counting by ``_index``. Asked only on a refusal,
        so the tenant is told which names to drop; none named when the answer cannot say
        (every index gone meanwhile, or some shards not read: a name holding documents
        must never be called empty)."""
        query = self.tenant_query(tenant)
        # the aliases' own indexes only: an old one a reindex kept for a rollback would take
        # a bucket, and a live index left without one would be named as holding nothing
        query["bool"]["filter"].append({"terms": {"_index": sorted(held)}})
        with _translated(what, index, missing_ok=True) as missing:
            answer = (
                self._es()
                .search(
                    index=f"{stem}*",
                    size=0,
                    query=query,
                    aggs={"indexes": {"terms": {"field": "_index", "size": len(held)}}},
                    ignore_unavailable=True,
                    allow_no_indices=True,
                )
                .body
            )
        if missing or (answer.get("_shards") or {}).get("failed"):
            return []
        buckets = answer.get("aggregations", {}).get("indexes", {}).get("buckets", [])
        holding = {held.get(bucket["key"]) for bucket in buckets if int(bucket["doc_count"])}
        return sorted(
            alias.removeprefix(stem) for alias in set(held.values()) if alias not in holding
        )

    def _alias_exists(self, alias: str, what: str, index: str) -> bool:
        """``HEAD _alias/<alias>``."""
        with _translated(what, index):
            found = bool(self._es().indices.exists_alias(name=alias))
        return found

    def _clear_bare(self, alias: str, what: str, index: str) -> bool:
        """Delete the bare concrete index named ``alias`` (one a versioned delete
        auto-created after the alias was dropped: Sift's name, the template's mapping, only
        delete tombstones) if it holds no document; whether it is gone. Nothing but deletes
        can land in it meanwhile (every other write is held to ``require_alias``)."""
        with _translated(what, index, missing_ok=True) as missing:
            counted = self._es().count(index=alias).body
            _raise_if_partial(counted, what)  # a partial 0 would delete documents
            held = int(counted.get("count", 0))
            if not held:
                self._es().indices.delete(index=alias, ignore_unavailable=True)
        if missing or not held:
            logger.warning("%s: deleted the bare index %s a delete made", what, alias)
            return True
        return False

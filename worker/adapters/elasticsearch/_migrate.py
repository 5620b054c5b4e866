"""The shared layout of earlier releases (one index per Sift name for every tenant, the
alias ``<prefix>NAME``): finding Sift's own indexes of it, and copying them into the
per-tenant layout (``sift elasticsearch-migrate``; deploy/README.md §6)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from worker.adapters.elasticsearch._errors import _AliasGone, _raise_if_partial, _translated
from worker.adapters.elasticsearch._layout import _ANY_TENANT_ALIAS, _SIFT_CONCRETE, _TENANT_ALIAS
from worker.errors import BackendRequestError, BackendUnavailable, ConfigError

if TYPE_CHECKING:
    from worker.adapters.elasticsearch import ElasticsearchBackend

logger = logging.getLogger(__name__)


class SharedLayout:
    """The shared layout's indexes in the cluster ``backend`` talks to, under its prefix."""

    def __init__(self, backend: ElasticsearchBackend) -> None:
        self.backend = backend

    def check(self) -> None:
        """Refuse to run over indexes of the shared layout (one index per Sift name for every
        tenant, ``<prefix>NAME``) that hold documents, which this adapter no longer reads:
        they would silently vanish from every search. ConfigError names them and what to
        run; meant for a worker's start (``sift worker``), once."""
        legacy = [alias for alias in self.find() if self._holds_documents(alias)]
        if not legacy:
            return
        names = ", ".join(sorted(legacy)[:5]) + (" and more" if len(legacy) > 5 else "")
        raise ConfigError(
            f"Elasticsearch holds {len(legacy)} index(es) of Sift's old shared layout, one "
            f"index per name for every tenant ({names}), which this Sift does not read: "
            "stop the workers and run `sift elasticsearch-migrate` (deploy/README.md §6, "
            "'Migrating from the shared layout')"
        )

    def find(self) -> dict[str, list[str]]:
        """The aliases of the shared layout and their concrete indexes.

        An alias is one only if all of these hold: it is under the prefix and does not
        start with a tenant key, nor hold another prefix's ``<key>--`` (a sibling
        deployment's per-tenant alias, ``sift-staging-<key>--docs`` under ``sift-``); it
        points at concrete indexes Sift named (``<alias>-000001`` or
        ``<alias>-<timestamp>``); and each of them carries Sift's own mapping of the shared
        layout: no ``_meta.sift`` marker (every index made since has one), ``dynamic:
        strict``, and the id, text, tenant, revision, metadata and vector fields mapped as
        :func:`index_template` maps them. An operator's rollover alias (``logs-app`` over
        ``logs-app-000001``) is none of these."""
        with _translated("list of indexes", None):
            answer = self.backend._aliases(f"{self.backend.prefix}*")
            found: dict[str, list[str]] = {}
            for concrete, held in answer.items():
                for alias in held:
                    if self._shared_shape(alias, concrete):
                        found.setdefault(alias, []).append(concrete)
            ours = self._with_shared_mapping(sorted({c for cs in found.values() for c in cs}))
        return {
            alias: sorted(concretes)
            for alias, concretes in found.items()
            if all(concrete in ours for concrete in concretes)
        }

    def _shared_shape(self, alias: str, concrete: str) -> bool:
        """Whether ``alias`` over ``concrete`` is named as the shared layout named them."""
        if not alias.startswith(self.backend.prefix) or not concrete.startswith(f"{alias}-"):
            return False
        rest = alias.removeprefix(self.backend.prefix)
        return (
            bool(_SIFT_CONCRETE.fullmatch(concrete.removeprefix(f"{alias}-")))
            and not _TENANT_ALIAS.match(rest)
            and not _ANY_TENANT_ALIAS.search(rest)
        )

    def _with_shared_mapping(self, concretes: list[str]) -> set[str]:
        """Those of ``concretes`` whose mapping is Sift's shared layout's (a few per
        ``GET <names>/_mapping``, so no URL grows past what a proxy takes)."""
        ours: set[str] = set()
        for start in range(0, len(concretes), 20):
            batch = concretes[start : start + 20]
            mappings = self.backend._es().indices.get_mapping(index=",".join(batch)).body
            for name in batch:
                if self._is_shared_mapping(mappings.get(name, {}).get("mappings", {})):
                    ours.add(name)
        return ours

    def _is_shared_mapping(self, mapping: Mapping[str, Any]) -> bool:
        if "sift" in (mapping.get("_meta") or {}) or mapping.get("dynamic") != "strict":
            return False
        properties = mapping.get("properties") or {}
        fields = self.backend.fields
        wanted = {
            fields.id: "keyword",
            fields.text: "text",
            fields.tenant: "keyword",
            fields.revision: "keyword",
            fields.metadata: "flattened",
            fields.vector: "dense_vector",
        }
        return all(
            (properties.get(name) or {}).get("type") == kind for name, kind in wanted.items()
        )

    def _holds_documents(self, alias: str) -> bool:
        with _translated(f"count of {alias!r}", None, missing_ok=True) as missing:
            counted = self.backend._es().count(index=alias).body
            _raise_if_partial(counted, f"count of {alias!r}")
            count = int(counted.get("count", 0))
        return not missing and count > 0

    def migrate(
        self, *, delete_old: bool = False, dry_run: bool = False
    ) -> dict[str, dict[str, int]]:
        """Copy every shared-layout index into per-tenant indexes, then take its alias away.

        For each alias ``<prefix>NAME`` of :meth:`find` and each tenant holding a
        document in it: make the tenant's index ``NAME`` and ``_reindex`` the tenant's
        documents into it (same ``_id`` and external version; run again, it copies nothing
        twice). Then the old alias is removed, so :meth:`check` passes; the old concrete
        indexes are kept for a rollback unless ``delete_old``. An alias whose index holds
        no tenant's document is left as it is (reported with no tenant). Answers, per Sift
        name, how many documents each tenant got (with ``dry_run``: holds, and nothing is
        written). Run it with no worker writing."""
        report: dict[str, dict[str, int]] = {}
        for alias, concretes in sorted(self.find().items()):
            name = alias.removeprefix(self.backend.prefix)
            what = f"migration of index {name!r}"
            tenants = self.backend._tenants_in(alias)
            if dry_run or not tenants:
                report[name] = tenants
                continue
            copied: dict[str, int] = {}
            for tenant in tenants:
                self._ensure_for_copy(name, tenant, what)
                source = {"index": alias, "query": self.backend.tenant_query(tenant)}
                copied[tenant] = self.backend._copy(source, self.backend.alias(name, tenant), what)
            with _translated(what, name):
                self.backend.move_alias(alias, concretes, None, delete_old=delete_old)
            logger.info("migrated %s: %d tenant(s), %s", alias, len(copied), copied)
            report[name] = copied
        return report

    def _ensure_for_copy(self, index: str, tenant: str, what: str) -> None:
        """:meth:`ensure_index`, tried twice (a bare index of the alias's name it cleared
        lets the second make the index); an index in the way that no retry clears (a
        leftover) is a lasting error naming it and the remedy."""
        gone = _AliasGone(index)
        for _attempt in range(2):
            try:
                self.backend.ensure_index(index, tenant, capped=False)
                return
            except _AliasGone as refused:
                gone = refused
                if refused.leftover:
                    raise BackendRequestError(
                        f"the {what} cannot make index {index!r} of tenant {tenant!r}: the "
                        f"concrete index {refused.leftover!r} is in its alias's way "
                        f"({refused.reason}): drop index {index!r} of that tenant, or "
                        f"delete {refused.leftover!r} by name, then run again"
                    ) from refused
        raise BackendUnavailable(
            f"the {what} cannot make index {index!r} of tenant {tenant!r} ({gone.reason}): "
            "run again"
        ) from gone

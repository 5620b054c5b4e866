"""Each tenant's index's own search settings, kept in Elasticsearch beside its documents
(:class:`~worker.core.ports.IndexSettingsStorage`): one document per tenant's alias in
``<prefix>sift-settings``, its external ``_version`` the settings' write version (ES keeps
the highest: an older write is a 409 and stores nothing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from elasticsearch import ApiError

from worker.adapters.elasticsearch._core import _Core
from worker.adapters.elasticsearch._errors import (
    _error_type,
    _raise_for_doc,
    _translated,
)
from worker.adapters.elasticsearch._layout import SETTINGS_INDEX

#: The settings' one field: an object ES keeps in ``_source`` and never maps (``enabled``
#: false), so a new setting needs no mapping change.
SETTINGS_FIELD = "sift_settings"


class _Settings(_Core):
    """Each index's settings, in :attr:`settings_index`; the newer write version wins."""

    @property
    def settings_index(self) -> str:
        return f"{self.prefix}{SETTINGS_INDEX}"

    def stored_settings(
        self, indexes: Sequence[str], tenant: str
    ) -> list[tuple[dict[str, Any] | None, int] | None]:
        """One realtime ``_mget`` by id: it sees a change stored a moment ago. No settings
        index yet is none stored (a 404, or an error in each document's place); any other
        error in a document's place is raised (:func:`_raise_for_doc`: its shard not read,
        ``BackendUnavailable``; the key refused, a config error): none stored would run a
        search at the defaults, and merge a change into nothing."""
        if not indexes:
            return []
        ids = [self.alias(index, tenant) for index in indexes]
        with _translated("index settings", indexes[0] if len(indexes) == 1 else None):
            answer = (
                self._es().options(ignore_status=404).mget(index=self.settings_index, ids=ids)
            ).body
        docs = answer.get("docs") or [{}] * len(ids)
        for doc in docs:
            _raise_for_doc(doc, "index settings")
        return [
            (doc["_source"].get(SETTINGS_FIELD), int(doc["_version"])) if doc.get("found") else None
            for doc in docs
        ]

    def store_settings(
        self, index: str, tenant: str, settings: Mapping[str, Any] | None, version: int
    ) -> bool:
        with _translated("index settings", index):
            self._ensure_settings_index()
            answer = (
                self._es()
                .options(ignore_status=409)
                .index(
                    index=self.settings_index,
                    id=self.alias(index, tenant),
                    document={SETTINGS_FIELD: settings},
                    version=version,
                    version_type="external",
                )
            )
        return answer.meta.status != 409

    def _ensure_settings_index(self) -> None:
        """Create the settings index once per process: the template's settings (one shard),
        and its one field mapped as never indexed."""
        if self._settings_ready:
            return
        body = self._explicit_body()
        mappings = dict(body.get("mappings") or {})
        field = {SETTINGS_FIELD: {"type": "object", "enabled": False}}
        mappings["properties"] = {**mappings.get("properties", {}), **field}
        try:
            self._es().indices.create(index=self.settings_index, **{**body, "mappings": mappings})
        except ApiError as exc:
            if _error_type(exc) != "resource_already_exists_exception":
                raise
        self._settings_ready = True

"""The embedded backend's keeping of each tenant's index's own search settings, in the same
SQLite file as its documents (:class:`~worker.core.ports.IndexSettingsStorage`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ._pool import _Pool, _read, _translated, _write


class _Settings(_Pool):
    """An index's settings, one row per tenant's index; the newer write version wins."""

    def stored_settings(
        self, indexes: Sequence[str], tenant: str
    ) -> list[tuple[dict[str, Any] | None, int] | None]:
        found: dict[str, tuple[dict[str, Any] | None, int]] = {}
        with self._conn() as conn, _translated("index settings"), _read(conn):
            for index in indexes:  # a seek on the key each
                row = conn.execute(
                    "SELECT settings, version FROM index_settings WHERE idx = ? AND tenant = ?",
                    (index, tenant),
                ).fetchone()
                if row is not None:
                    found[index] = (None if row[0] is None else json.loads(row[0])), int(row[1])
        return [found.get(index) for index in indexes]

    def store_settings(
        self, index: str, tenant: str, settings: Mapping[str, Any] | None, version: int
    ) -> bool:
        raw = None if settings is None else json.dumps(settings)
        with self._conn() as conn, _translated("index settings"), _write(conn):
            conn.execute(
                "INSERT INTO index_settings(idx, tenant, settings, version) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(idx, tenant) DO UPDATE SET settings = excluded.settings,"
                " version = excluded.version WHERE excluded.version > index_settings.version",
                (index, tenant, raw, version),
            )
            return bool(conn.changes())

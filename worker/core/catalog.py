"""What the index lifecycle reads from a backend: a tenant's index, one stored document.

Writes carry a *version*: a number the gateway takes from one Redis counter when it
accepts the write (an upsert, a delete, an index drop). A backend applies a write only
if its version is newer than the one it holds for that id (a delete leaves a tombstone
with its version; a drop leaves a floor for the whole tenant's index), so the write
accepted last wins whichever worker runs it, and in whatever order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from worker.contract import FilterValue


@dataclass(frozen=True, slots=True)
class IndexInfo:
    """One tenant's part of one index."""

    name: str
    documents: int
    backend: str
    model: str | None = None
    dimension: int | None = None
    last_write: float | None = None  # epoch seconds of the tenant's last applied write


@dataclass(frozen=True, slots=True)
class StoredDocument:
    """A document as stored, without its vector."""

    id: str
    text: str
    title: str
    revision: str
    metadata: Mapping[str, FilterValue] = field(default_factory=dict)
    version: int | None = None  # the accepted write that put it there (None: unversioned)

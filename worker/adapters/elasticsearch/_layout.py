"""How the Elasticsearch adapter names what it keeps in ES, and its drop floors.

Tenant ``T``'s Sift index ``NAME`` is the alias ``<prefix><key>--NAME`` over concrete indexes
``<alias>~<000001 or a reindex's timestamp>``; drop floors live in ``<prefix>sift-floors``
and each index's own search settings in ``<prefix>sift-settings`` (see the package's
docstring, and deploy/README.md §6).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

from elasticsearch import ApiError, Elasticsearch

from worker.adapters.elasticsearch._errors import _error_type, _translated
from worker.errors import InvalidRequest

#: Hex digits of the tenant key in index names: 64 bits, collision-free for any real
#: number of tenants (and a collision still keeps tenants apart: see "Tenancy, in depth").
TENANT_KEY_LENGTH = 16
#: Between the tenant key and the Sift index name. Sift names may hold ``--`` too; the key's
#: fixed length is what makes a name readable back.
KEY_SEPARATOR = "--"
#: The index of drop floors, after the prefix (no tenant key: see ``floors_index``).
FLOORS_INDEX = "sift-floors"
#: After an alias, the ``_id`` in the floors index of the newest delete by id run on it (no
#: alias holds ``#``).
DELETES_MARK = "#deletes"
#: The index of each tenant's index's own search settings, after the prefix (as the floors').
SETTINGS_INDEX = "sift-settings"
#: Elasticsearch's limit on an index name, in bytes.
MAX_INDEX_NAME_BYTES = 255
#: What Elasticsearch accepts as an index name (lowercase; none of ``\ / * ? " < > | , # :``
#: or spaces; not starting with ``-``, ``_`` or ``+``; not ``.`` or ``..``), restricted to
#: what Sift ever composes: the prefix, the key, ``--``, a Sift index name, all in
#: ``[a-z0-9_.-]``, and ``~`` before a concrete index's suffix.
_ES_INDEX_NAME = re.compile(r"^(?![-_+])(?!\.{1,2}$)[a-z0-9_.~-]+$")
#: An alias of the per-tenant layout, after the prefix: a tenant key, ``--``, a Sift name.
_TENANT_ALIAS = re.compile(rf"^[0-9a-f]{{{TENANT_KEY_LENGTH}}}{KEY_SEPARATOR}[a-z0-9]")
#: A tenant key and ``--`` anywhere: another (longer) prefix's per-tenant alias.
_ANY_TENANT_ALIAS = re.compile(rf"(^|[_.-])[0-9a-f]{{{TENANT_KEY_LENGTH}}}{KEY_SEPARATOR}")
#: Elasticsearch's limit on a document's ``_id``, in UTF-8 bytes (a longer one fails the whole
#: request with ``action_request_validation_exception``).
MAX_ID_BYTES = 512
#: What starts a hashed ``_id`` (see :func:`document_es_id`). A tenant id never holds ``#``.
HASHED_ID_MARKER = "#sha256:"
#: Between an alias and the suffix of its concrete indexes (``000001`` or a reindex's
#: timestamp). ES accepts ``~`` in an index name; Sift's own names never hold it, so no
#: Sift name's alias can ever be another name's concrete index.
CONCRETE_SEPARATOR = "~"
#: How Sift names a concrete index after its alias: ``000001`` or a reindex's timestamp.
_SIFT_CONCRETE = re.compile(r"000001|\d{8}t\d{12}")


def tenant_key(tenant: str) -> str:
    """The tenant's part of its index names: a fixed-length hex digest of the tenant id.

    Tenant ids may hold what ES refuses in an index name (capitals, ``:``, ``/``, spaces,
    any Unicode); the digest never does. It is stable across releases: existing indexes
    are named by it.

    >>> tenant_key("acme"), len(tenant_key("Ünïcode/tenant: *?"))
    ('822b33ad87c148a0', 16)
    """
    return hashlib.sha256(tenant.encode()).hexdigest()[:TENANT_KEY_LENGTH]


def document_es_id(tenant: str, doc_id: str) -> str:
    """The ``_id`` of the tenant's document ``doc_id``: ``<tenant>:<doc id>`` if that fits in
    Elasticsearch's 512 bytes, else ``#sha256:`` and the SHA-256 hex digest of that long form.

    The gateway accepts a document id of up to 512 *characters* (up to 2,048 bytes in UTF-8),
    and the tenant prefix comes on top, so without the digest ES would refuse the write of an
    id the embedded backend takes. The short form is what every existing index holds, and no
    id that ever fitted changes: ES never stored an ``_id`` over 512 bytes. No short form can
    equal a hashed one: a short form starts with its tenant id, whose characters are
    ``[A-Za-z0-9_.-]`` (``ApiKey.tenant``), never ``#``; the digest is over the whole short
    form, so two tenants' hashed ids differ as their short forms do, and it is 72 bytes for
    any tenant. Bytes are counted as ES counts them (Java's UTF-8 encoder puts one ``?`` for
    a lone surrogate); the digest keeps lone surrogates apart (``surrogatepass``).

    >>> document_es_id("acme", "doc-1")
    'acme:doc-1'
    >>> document_es_id("acme", "x" * 507) == "acme:" + "x" * 507  # 512 bytes: still short
    True
    >>> hashed = document_es_id("acme", "é" * 254)  # 508 bytes, 513 with the prefix
    >>> hashed.startswith("#sha256:"), len(hashed), hashed == document_es_id("acme2", "é" * 254)
    (True, 72, False)
    """
    short = f"{tenant}:{doc_id}"
    if len(short.encode("utf-8", "replace")) <= MAX_ID_BYTES:
        return short
    digest = hashlib.sha256(short.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{HASHED_ID_MARKER}{digest}"


def concrete_name(alias: str, suffix: str) -> str:
    """The name of one of ``alias``'s concrete indexes: ``<alias>~<suffix>``.

    >>> concrete_name("sift-822b33ad87c148a0--docs", "000001")
    'sift-822b33ad87c148a0--docs~000001'
    """
    return f"{alias}{CONCRETE_SEPARATOR}{suffix}"


def checked_index_name(name: str, what: str = "index") -> str:
    """``name`` if Elasticsearch accepts it as an index or alias name; InvalidRequest if not.

    >>> checked_index_name("sift-822b33ad87c148a0--docs")
    'sift-822b33ad87c148a0--docs'
    >>> checked_index_name("sift-822b--Docs")  # ES names are lowercase
    Traceback (most recent call last):
    ...
    worker.errors.InvalidRequest: index: 'sift-822b--Docs' is no Elasticsearch index name
    """
    if len(name.encode()) > MAX_INDEX_NAME_BYTES or not _ES_INDEX_NAME.match(name):
        raise InvalidRequest(what, f"{name!r} is no Elasticsearch index name")
    return name


class DropFloors:
    """What orders a drop before the writes accepted ahead of it: one empty document per
    dropped alias in :attr:`index`, its external ``_version`` the version of the alias's
    last drop (ES keeps the highest: a lower one is a 409). Not under any tenant's key, so
    no tenant lists or probes it. And what orders a drop after the deletes by id accepted
    after it: ``<alias>#deletes``, its ``_version`` the newest delete's on the alias."""

    def __init__(
        self,
        es: Callable[[], Elasticsearch],
        index: str,
        create_body: Callable[[], dict[str, Any]],
    ) -> None:
        self._es = es
        self.index = index
        self._create_body = create_body  # the floors index's settings and mappings
        self._ready = False

    def floor(self, alias: str) -> int:
        """The version of the last drop of ``alias`` (0: never dropped, or no floors yet).
        A realtime ``GET`` by id: it sees a floor written a moment ago."""
        return self._held(alias, "drop floor")

    def last_delete(self, alias: str) -> int:
        """The version of the newest delete by id that ran on ``alias`` (0: none recorded)."""
        return self._held(f"{alias}{DELETES_MARK}", "deletes mark")

    def raise_delete(self, alias: str, version: int, what: str, index: str) -> None:
        """Record that a delete by id of ``version`` runs on ``alias`` (a newer one's stays):
        a drop accepted before it and run after it must not delete the index, whose
        tombstones keep an older upsert from writing the documents back."""
        self._raise(f"{alias}{DELETES_MARK}", version, what, index)

    def _held(self, doc_id: str, what: str) -> int:
        """The external ``_version`` of ``doc_id`` in the floors index (0: none)."""
        with _translated(what, None):
            answer = (self._es().options(ignore_status=404).get(index=self.index, id=doc_id)).body
        return int(answer.get("_version", 0)) if answer.get("found") else 0

    def below(self, alias: str, version: int | None) -> bool:
        """Whether a write of ``version`` was accepted before a drop that has already run."""
        return version is not None and version <= self.floor(alias)

    def raise_to(self, alias: str, version: int, what: str, index: str) -> None:
        """Record a drop of ``version`` for ``alias`` (a newer drop's floor stays)."""
        self._raise(alias, version, what, index)

    def _raise(self, doc_id: str, version: int, what: str, index: str) -> None:
        """Hold ``version`` as ``doc_id``'s external version, unless a higher one is held."""
        with _translated(what, index):
            self._ensure_index()
            self._es().options(ignore_status=409).index(
                index=self.index,
                id=doc_id,
                document={},
                version=version,
                version_type="external",
            )

    def _ensure_index(self) -> None:
        """Create the floors index once per process (the template's mapping, and its one
        shard, apply; an empty document fits any mapping)."""
        if self._ready:
            return
        try:
            self._es().indices.create(index=self.index, **self._create_body())
        except ApiError as exc:
            if _error_type(exc) != "resource_already_exists_exception":
                raise
        self._ready = True

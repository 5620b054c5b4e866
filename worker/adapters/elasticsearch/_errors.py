"""How the Elasticsearch adapter reads ES's errors: the client's exceptions and the error
items of ``_msearch`` and ``_bulk`` answers, as Sift's errors (retryable or not)."""

from __future__ import annotations

import functools
import json
import logging
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticsearch import (
    ApiError,
    ConnectionError,
    ConnectionTimeout,
    NotFoundError,
    SSLError,
    TransportError,
    helpers,
)

from worker.errors import (
    BackendAccessRefused,
    BackendRequestError,
    BackendUnavailable,
    IndexNotFound,
    SiftError,
)

logger = logging.getLogger(__name__)


class _AliasGone(Exception):
    """A bulk write's alias is gone (``require_alias``): another worker dropped the index;
    or the index's first concrete name exists without its alias (``leftover``)."""

    def __init__(
        self, index: str, existed: int = 0, leftover: str = "", reason: str = "alias missing"
    ) -> None:
        super().__init__(index)
        self.existed = existed  # documents deleted before the refusal
        self.leftover = leftover
        self.reason = reason  # what showed the alias gone, for the error after the attempts


@dataclass(slots=True)
class _Bulked:
    """What one bulk call did: actions applied, documents found, ``_id`` of each applied;
    and the concrete index each ``_id`` whose version ES now holds went to (``landed``: an
    action applied, a delete that found nothing included, or one an earlier attempt of the
    same write applied)."""

    applied: int
    existed: int
    written: list[str]
    landed: dict[str, str] = field(default_factory=dict)


class _Missing:
    """Set inside a ``_translated(..., missing_ok=True)`` block when the index is missing."""

    def __init__(self) -> None:
        self.value = False

    def __bool__(self) -> bool:
        return self.value


class _translated:  # a context manager; named like one
    """Translate the client's errors into Sift's, ``raise ... from exc``."""

    def __init__(self, what: str, index: str | None, missing_ok: bool = False) -> None:
        self.what = what
        self.index = index
        self.missing = _Missing()
        self.missing_ok = missing_ok

    def __enter__(self) -> _Missing:
        return self.missing

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> bool:
        if exc is None or isinstance(exc, SiftError):
            return False
        if isinstance(exc, NotFoundError) and _error_type(exc) == "index_not_found_exception":
            if self.missing_ok:
                self.missing.value = True
                return True
            raise IndexNotFound(self.index or "") from exc
        if isinstance(exc, ApiError):
            status = exc.meta.status
            reason = _reason(exc.body) or str(exc.message)
            if _retryable(status):
                raise _unavailable(
                    f"Elasticsearch answered {status} to the {self.what}{_kind(exc.body)}",
                    reason,
                ) from exc
            if _access_refused(status, exc.body):
                raise _credentials_refused(self.what, status, exc.body, reason) from exc
            if _error_type(exc) == "media_type_header_exception":
                reason += (
                    " (the 9.x client sends compatible-with=9, which Elasticsearch 8.x "
                    "refuses: Sift needs Elasticsearch 9)"
                )
            raise BackendRequestError(
                f"Elasticsearch refused the {self.what} ({status}): {_scrubbed(reason)}"
            ) from exc
        if isinstance(exc, ConnectionTimeout):
            raise _unavailable(f"Elasticsearch timed out on the {self.what}", _detail(exc)) from exc
        if isinstance(exc, SSLError):
            raise _unavailable(
                f"Elasticsearch's TLS certificate is not trusted for the {self.what} "
                "(a private CA: set SIFT_ELASTICSEARCH_CA_CERTS or "
                "SIFT_ELASTICSEARCH_SSL_FINGERPRINT)",
                _detail(exc),
            ) from exc
        if isinstance(exc, ConnectionError):
            raise _unavailable(
                f"cannot reach Elasticsearch for the {self.what}: {_connection_failure(exc)}",
                _detail(exc),
            ) from exc
        if isinstance(exc, TransportError):
            raise _unavailable(
                f"Elasticsearch transport error on the {self.what} ({type(exc).__name__})",
                _detail(exc),
            ) from exc
        if isinstance(exc, helpers.BulkIndexError):
            raise BackendRequestError(f"the {self.what} failed: {exc}") from exc
        return False


def _unavailable(message: str, detail: str) -> BackendUnavailable:
    """A retryable failure whose ``message`` (the job's error, a tenant's to read) says what
    kind of failure it was; ``detail``, ES's reason or the client's text, may name the
    cluster's hosts, ports or nodes by address, so only the worker's log has it."""
    logger.warning("%s: %s", message, detail)
    return BackendUnavailable(message)


def _access_refused(status: int, body: Any) -> bool:
    """Whether ES refused Sift's own credentials (401: its API key unknown or expired) or
    their rights (403, or a ``security_exception`` under another status: a role missing)."""
    return status in (401, 403) or _cause_type(body) == "security_exception"


def _credentials_refused(what: str, status: int, body: Any, reason: str) -> BackendAccessRefused:
    """The deployment's setting is wrong, not the tenant's request: ``config_error``, which the
    tenant may read, with the status and the cause's type only. ES's reason names Sift's
    service user, its roles, its API key's id and the concrete index names (the deployment's
    prefix, the tenant's key): only the worker's log has it, as an error for the operator."""
    kind = _cause_type(body) or "error"
    logger.error("Elasticsearch refused the %s (%s %s): %s", what, status, kind, reason)
    return BackendAccessRefused(
        f"Elasticsearch refused the {what} ({status} {kind}): Sift's credentials there "
        "(SIFT_ELASTICSEARCH_API_KEY) or their roles do not allow it; the worker's log has "
        "Elasticsearch's reason"
    )


@functools.cache
def _index_names() -> tuple[re.Pattern[str], re.Pattern[str]]:
    """How ES's text names an index of Sift's: a concrete index or alias of the per-tenant
    layout (the deployment's prefix, the tenant's key and ``--`` before the tenant's own
    index name, then maybe a concrete index's suffix and the index's UUID, ``[name/uuid]``);
    and Sift's own indexes (the drop floors, the index settings) after the prefix. Built on
    first use: the layout's module reads this one's errors."""
    from worker.adapters.elasticsearch import _layout as layout

    uuid = r"(?:/[A-Za-z0-9_-]{22})?"
    tenants = re.compile(
        rf"[a-z0-9_.-]*?[0-9a-f]{{{layout.TENANT_KEY_LENGTH}}}{layout.KEY_SEPARATOR}"
        rf"([a-z0-9_.-]+)(?:{layout.CONCRETE_SEPARATOR}[a-z0-9]+)?{uuid}"
    )
    own = re.compile(
        rf"[a-z0-9_.-]*?({re.escape(layout.FLOORS_INDEX)}|{re.escape(layout.SETTINGS_INDEX)}){uuid}"
    )
    return tenants, own


def _scrubbed(reason: str) -> str:
    """ES's reason for a refusal the tenant may need to fix (a bad query, a field of the wrong
    type), as the tenant may read it: an index ES names by its concrete name is named by the
    tenant's own index name, and Sift's own indexes by what they are, without the
    deployment's prefix, the tenant's key or the index's UUID.

    >>> _scrubbed("no [a] in [acme-sift-822b33ad87c148a0--my-docs~000001/kA1qF3ZpQ9-x2Yb7cD8eWg]")
    'no [a] in [my-docs]'
    >>> _scrubbed("[sift-sift-floors] is read-only")
    "[Sift's floors index] is read-only"
    """
    tenants, own = _index_names()
    return own.sub(
        lambda m: "Sift's floors index" if "floors" in m.group(1) else "Sift's settings index",
        tenants.sub(r"\1", reason),
    )


def _connection_failure(exc: BaseException) -> str:
    """What kind of failure a connection error was, from the OS error under it (the
    client's own text names the host and port)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, ConnectionResetError):
            return "connection reset"
        if isinstance(cause, socket.gaierror):
            return "its host name did not resolve"
        if isinstance(cause, TimeoutError):
            return "connection timed out"
        if isinstance(cause, OSError) and cause.errno is not None:
            return f"{type(cause).__name__} (errno {cause.errno})"
        cause = cause.__cause__ or cause.__context__
    return "connection failed"


def _detail(exc: BaseException) -> str:
    """The client's text of ``exc`` and of what caused it, for the worker's log (the
    transport's own ``str`` drops its cause's text, which names the host and port)."""
    parts: list[str] = []
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        text = cause.message if isinstance(cause, TransportError) else cause
        parts.append(f"{type(cause).__name__}({text})")
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(parts)


def _cause_type(body: Any) -> str | None:
    """The root cause's type of an ES error body (an ``_msearch`` or ``_bulk`` item's too):
    a tenant may read it, where its reason may name a node by its address."""
    error = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(error, Mapping):
        return None
    causes = error.get("root_cause") or [error]
    first = causes[0] if isinstance(causes, list) and causes else error
    kind = first.get("type") if isinstance(first, Mapping) else None
    return str(kind) if kind else None


def _kind(body: Any) -> str:
    """`` (<type>)`` of :func:`_cause_type`, or nothing when the body names none."""
    kind = _cause_type(body)
    return f" ({kind})" if kind else ""


def _retryable(status: int) -> bool:
    """Whether an ES status is a passing failure: 429 (rejected: a queue full), 5xx, or 408
    (a request that timed out on the server: a ``_delete_by_query`` answers so, its partial
    report as the body)."""
    return status in (408, 429) or status >= 500


def _error_type(exc: ApiError) -> str | None:
    body = exc.body
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping):
            kind = error.get("type")
            return str(kind) if kind else None
    return None


def _reason(body: Any) -> str | None:
    """ES's own explanation from an error body: the root cause's type and reason."""
    if not isinstance(body, Mapping):
        return str(body) if body else None
    error = body.get("error")
    if isinstance(error, str):
        return error
    if not isinstance(error, Mapping):
        return None
    causes = error.get("root_cause") or [error]
    first = causes[0] if isinstance(causes, list) and causes else error
    return f"{first.get('type', 'error')}: {first.get('reason', '')}".strip()


#: How ES explains an external-versioned write refused by the version it holds (the
#: reason of a 409 ``version_conflict_engine_exception``).
_HELD_VERSION = re.compile(
    r"current version \[(\d+)\] is higher or equal to the one provided \[(\d+)\]"
)


def _holds_own_version(op: Mapping[str, Any]) -> bool:
    """Whether a refused (409) external-versioned bulk item found its own version held: the
    same write applied by an earlier attempt (one counter gives every write its version,
    so no other write holds it), as a retry after a partial bulk failure finds it."""
    error = op.get("error")
    reason = str(error.get("reason", "")) if isinstance(error, Mapping) else ""
    found = _HELD_VERSION.search(reason)
    return found is not None and found.group(1) == found.group(2)


def _index_missing(answer: Mapping[str, Any]) -> bool:
    """Whether one ``_msearch`` item failed because its index does not exist."""
    error = answer.get("error")
    return isinstance(error, Mapping) and error.get("type") == "index_not_found_exception"


def _total(answer: Mapping[str, Any]) -> int:
    """``hits.total.value`` of one search answer (0 when ES left it out)."""
    total = answer.get("hits", {}).get("total")
    if isinstance(total, Mapping):
        return int(total.get("value", 0))
    return int(total or 0)


def _first_key(aggregations: Mapping[str, Any]) -> str | None:
    """The first bucket's key of the ``models`` terms aggregation (None: no bucket)."""
    buckets = aggregations.get("models", {}).get("buckets") or []
    return str(buckets[0]["key"]) if buckets else None


def _raise_if_partial(answer: Mapping[str, Any], what: str) -> None:
    """A search or count ES answered from some shards only raises ``BackendUnavailable``.

    ES answers 200 when some of an index's shards failed (a node left, a shard request was
    rejected), with the rest's hits and totals and the failures in ``_shards``. Used, such
    an answer would read a tenant's index as empty (``index_not_found``, for good), rank
    without the failed shards' documents, or count too few: it is a retryable failure."""
    shards = answer.get("_shards")
    if not isinstance(shards, Mapping) or not shards.get("failed"):
        return
    failures = shards.get("failures") or [{}]
    cause = failures[0].get("reason") if isinstance(failures[0], Mapping) else None
    kind = str(cause.get("type", "error")) if isinstance(cause, Mapping) else "error"
    raise _unavailable(
        f"Elasticsearch answered the {what} from {shards.get('successful', 0)} of "
        f"{shards.get('total', '?')} shards ({shards['failed']} failed, {kind}): a partial "
        "answer is not used",
        json.dumps(failures[0]),
    )


def _raise_for_item(answer: Mapping[str, Any], what: str, index: str) -> None:
    """One ``_msearch`` item that carries an error raises like a whole-request error; one
    answered from some shards only, as :func:`_raise_if_partial` says."""
    if "error" not in answer:
        _raise_if_partial(answer, what)
        return
    status = int(answer.get("status", 500))
    reason = _reason(answer) or "unknown error"
    if _index_missing(answer):
        raise IndexNotFound(index)
    if _retryable(status):
        raise _unavailable(f"Elasticsearch answered {status} to the {what}{_kind(answer)}", reason)
    if _access_refused(status, answer):
        raise _credentials_refused(what, status, answer, reason)
    raise BackendRequestError(f"Elasticsearch refused the {what} ({status}): {_scrubbed(reason)}")


def _raise_for_doc(doc: Mapping[str, Any], what: str) -> None:
    """An ``_mget`` entry that carries an error other than its index missing raises: a
    refusal of Sift's credentials (ES authorizes each shard request of an ``_mget`` on its
    own, and puts a ``security_exception`` in a document's place, with no status) as
    :func:`_credentials_refused`; any other (its shard not read) as ``BackendUnavailable``:
    the document is not known to be missing."""
    if not doc.get("error") or _index_missing(doc):
        return
    reason = str(_reason(doc))
    status = int(doc.get("status") or 403)
    if _access_refused(int(doc.get("status") or 0), doc):
        raise _credentials_refused(f"read of the {what}", status, doc, reason)
    raise _unavailable(f"Elasticsearch could not read the {what}{_kind(doc)}", reason)


def _bulk_error(failures: Sequence[Mapping[str, Any]], names: Mapping[str, str]) -> SiftError:
    """One error naming the documents the bulk call could not write, and why: each item's
    ``_id`` mapped back through ``names`` (the ``_id`` of each action sent: a hashed one
    holds no document id to strip a prefix from), the ``_id`` itself if it is not there."""
    named: list[str] = []
    reasons: list[str] = []
    retryable, denied = True, False
    for item in failures:
        op = next(iter(item.values())) if item else {}
        status = int(op.get("status", 500))
        retryable = retryable and _retryable(status)
        es_id = str(op.get("_id", "?"))
        doc = names.get(es_id, es_id)
        # a refusal's reason is the tenant's to fix; a passing failure's may name a node,
        # and one of Sift's credentials names its service user and roles
        reason = _reason(op) or "error"
        refused = _access_refused(status, op)
        denied = denied or refused
        hidden = _retryable(status) or refused
        why = (_cause_type(op) or "error") if hidden else _scrubbed(reason)
        named.append(f"{doc} ({status} {why})")
        reasons.append(f"{doc} ({status} {reason})")
    listing = "; ".join(named[:5]) + (f"; and {len(named) - 5} more" if len(named) > 5 else "")
    message = f"{len(failures)} document(s) not written: {listing}"
    if retryable:
        return _unavailable(message, "; ".join(reasons))
    if denied:
        logger.error("%s: %s", message, "; ".join(reasons))
        return BackendAccessRefused(
            f"{message}: Sift's credentials in Elasticsearch (SIFT_ELASTICSEARCH_API_KEY) or "
            "their roles do not allow it; the worker's log has Elasticsearch's reason"
        )
    return BackendRequestError(message)

"""Drops of a tenant's index: the floor raised first (for versioned drops), every concrete
index of the alias found before anything is deleted, the kept ones deleted before the
live one, and only the tenant's documents deleted (those not written after a versioned
drop) from an index another tenant shares or one holding a write newer than the drop."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from worker.adapters.elasticsearch._bodies import _Bodies
from worker.adapters.elasticsearch._core import task_canceled
from worker.adapters.elasticsearch._errors import (
    _cause_type,
    _index_missing,
    _raise_for_item,
    _total,
    _translated,
    _unavailable,
)
from worker.adapters.elasticsearch._layout import _SIFT_CONCRETE, CONCRETE_SEPARATOR
from worker.constants import INGEST_TIME_LIMIT_SECONDS
from worker.errors import BackendRequestError

logger = logging.getLogger(__name__)

#: How long a drop waits between two reads of its delete task.
DROP_POLL_SECONDS = 0.5
#: The longest a drop waits on its delete task: its job's budget (the ingest task's time
#: limit), less a minute for the drop's other requests. The task runs on past it, and the
#: job's retry waits on it.
DROP_MAX_SECONDS = INGEST_TIME_LIMIT_SECONDS - 60.0


class _Drops(_Bodies):
    """Delete a tenant's index (or its documents from a shared one)."""

    drop_max_seconds = DROP_MAX_SECONDS

    def delete_index(self, index: str, tenant: str, *, version: int | None = None) -> int:
        """Delete the tenant's index: its concrete indexes (the alias goes with them);
        answers how many of the tenant's documents the one the alias pointed at held.

        The names to delete are found first, before anything is deleted (a write accepted
        after the drop may make the index again while it runs; its new index is not on the
        list), in one request (``GET _resolve/index/<alias>*``, closed ones too): the
        indexes the alias points at, and every concrete index named after it: those a reindex
        kept (``<alias>~<suffix>``) and a bare index of the alias's own name (a delete
        made it). Then one ``_msearch`` on the alias (or that bare index) counts the
        tenant's documents and looks for one of another tenant's (``terminate_after: 1``).
        An index holding one (a key collision, or an alias an operator pointed at an index
        it shares) is never deleted: only the tenant's documents go, with one
        ``_delete_by_query`` on the tenant term, run as a task and polled
        (:meth:`_delete_tenants_documents`). Else the kept indexes are deleted, then the
        live ones. The alias already gone (a drop cut short, or run twice) still deletes what
        is found named after it, so a drop run again completes one cut short.

        With a ``version``, the drop first raises the tenant's floor for the index
        (:meth:`DropFloors.raise_to`), before anything is deleted: a write accepted before the drop
        and run after it is skipped, as on the embedded backend. An ingest accepted after
        the drop but run before it stays, as on the embedded backend: each document holds
        its write's version (``SIFT_ELASTICSEARCH_WRITE_VERSION_FIELD``), the ``_msearch``
        also looks for one of the tenant's above the drop's (``terminate_after: 1``), and
        an index holding one is not deleted either: the kept indexes are, and from the live
        one only the tenant's documents not written after the drop
        (:meth:`dropped_query`). Nor is one where a delete by id accepted after the drop
        has run (:meth:`DropFloors.last_delete`, read after the floor is raised): its
        tombstones, which the index holds, keep the upsert it was accepted after from
        writing the document back."""
        alias = self.alias(index, tenant)
        what = f"delete of index {index!r}"
        deleted_after = False  # a delete by id accepted after the drop has run
        if version is not None:
            self._floors.raise_to(alias, version, what, index)
            deleted_after = self._floors.last_delete(alias) > version
        with _translated(what, index):
            live, named = self._named(alias)
        with _translated(what, index, missing_ok=True) as missing:
            searches = self.drop_searches(tenant, version)
            response = self._es().msearch(index=alias, searches=searches).body
        answers = [] if missing else response.get("responses", [])
        if missing or any(_index_missing(answer) for answer in answers):
            mine = others = newer = 0
        else:
            for answer in answers:
                _raise_for_item(answer, what, index)
            mine, others, *rest = (_total(answer) for answer in answers)
            newer = rest[0] if rest else 0
        newer = newer or (deleted_after and not missing and bool(answers))
        if others or newer:
            if not others:  # the tenant's own index: what a reindex kept goes whole
                self._delete_kept(live, named, what, index)
            gone = self._delete_tenants_documents(alias, tenant, what, index, version)
        else:
            gone = mine if self._delete_concrete(live, named, what, index) else 0
        self._forget(alias, tenant)
        return gone

    def drop_searches(self, tenant: str, version: int | None = None) -> list[Mapping[str, Any]]:
        """The ``_msearch`` lines of :meth:`delete_index`: the tenant's documents counted,
        whether the index holds any other tenant's, and (a versioned drop, with a
        write-version field) any of the tenant's written after the drop (each stopping at
        the first)."""
        others = {"bool": {"must_not": [{"term": {self.fields.tenant: tenant}}]}}
        searches: list[Mapping[str, Any]] = [
            {},
            {"size": 0, "track_total_hits": True, "query": self.tenant_query(tenant)},
            {},
            {"size": 0, "terminate_after": 1, "track_total_hits": True, "query": others},
        ]
        if version is not None and self.fields.write_version:
            after = {"range": {self.fields.write_version: {"gt": version}}}
            newer = {"bool": {"filter": [{"term": {self.fields.tenant: tenant}}, after]}}
            searches += [
                {},
                {"size": 0, "terminate_after": 1, "track_total_hits": True, "query": newer},
            ]
        return searches

    def dropped_query(self, tenant: str, version: int | None) -> dict[str, Any]:
        """The tenant's documents a drop deletes by query: all of them, or with a
        ``version`` (and a write-version field) those not written after it: a document
        without the field (an earlier release's write, or an unversioned one) goes too."""
        query = self.tenant_query(tenant)
        if version is not None and self.fields.write_version:
            query["bool"]["must_not"] = [{"range": {self.fields.write_version: {"gt": version}}}]
        return query

    def _delete_concrete(
        self, live: Sequence[str], named: Sequence[str], what: str, index: str
    ) -> bool:
        """Delete the concrete indexes of an alias, found before (ES deletes no index by
        its alias): ``named`` (those a reindex kept for a rollback, whose documents the drop
        takes too and whose first name would otherwise block the next write; a bare index
        of the alias's name), then ``live``, the ones it points at, last: a drop cut short
        leaves the alias, and the next one finds everything again. Whether this call
        deleted the index the alias pointed at: a concurrent drop that got there first
        deleted it, and counts it."""
        self._delete_kept(live, named, what, index)
        with _translated(what, index, missing_ok=True) as missing:
            if live:
                self._es().indices.delete(index=",".join(live))
        return bool(live) and not missing

    def _delete_kept(
        self, live: Sequence[str], named: Sequence[str], what: str, index: str
    ) -> None:
        """Delete the concrete indexes named after the alias that it does not point at."""
        with _translated(what, index):
            kept = [name for name in named if name not in live]
            if kept:
                self._es().indices.delete(index=",".join(kept), ignore_unavailable=True)

    def _named(self, alias: str) -> tuple[list[str], list[str]]:
        """The concrete indexes ``alias`` points at (or a bare index named ``alias`` itself,
        one a delete made), and those named after it, ``<alias>~<suffix>`` (the live one
        and any a reindex kept). One snapshot of both:
        ``GET _resolve/index/<alias>*?expand_wildcards=all`` (ES registers only GET for it;
        ``all``: a closed kept index is found too)."""
        answer = self._es().perform_request(
            "GET",
            f"/_resolve/index/{quote(alias, safe='')}*",
            params={"expand_wildcards": "all"},
            headers={"accept": "application/json"},
        )
        stem = f"{alias}{CONCRETE_SEPARATOR}"
        names = [str(found.get("name", "")) for found in answer.body.get("indices", [])]
        live = [
            str(name)
            for found in answer.body.get("aliases", [])
            if found.get("name") == alias
            for name in found.get("indices", [])
        ]
        named = [
            name
            for name in names
            if name.startswith(stem) and _SIFT_CONCRETE.fullmatch(name.removeprefix(stem))
        ]
        if alias in names:  # no alias then: that bare index is what the alias's name reads
            live.append(alias)
        return sorted(live), sorted(named)

    def _delete_tenants_documents(
        self, alias: str, tenant: str, what: str, index: str, version: int | None
    ) -> int:
        """Only the tenant's documents (:meth:`dropped_query`), from an index another
        tenant's share or one holding a write newer than the drop: one
        ``_delete_by_query``, run as an ES task
        (``wait_for_completion=false``) and polled (``GET _tasks/<id>``) for at most
        ``drop_max_seconds``, within the job's own budget: a large tenant's delete outlasts
        any one request's timeout. One on the alias still running (this drop's earlier
        run, which gave up waiting or died, or another drop's) is waited on first, within
        the same budget, rather than raced by a second; then this drop's own runs, since
        ES does not say what the running one deletes (an older drop's takes less, an
        earlier release's the tenant's newer documents too), and takes what is left,
        counted with what the running one deleted.
        A report of version conflicts (a document written since the delete began) or
        failures fails the drop retryably: the delete is idempotent, and its run again
        takes what is left. A task that failed outright is an error naming ES's reason."""
        doing = f"{what} (the tenant's documents)"
        deadline = self._clock() + self.drop_max_seconds
        earlier = 0
        with _translated(what, index, missing_ok=True) as missing:
            running = self._running_delete(alias)
            if running is not None:
                logger.info("%s: waiting on the delete already running (task %s)", what, running)
                done = self._await_task(running, doing, self.drop_max_seconds, DROP_POLL_SECONDS)
                earlier = int((done.get("response") or {}).get("deleted", 0))
            task = self._start_delete(alias, tenant, version)
            left = max(0.0, deadline - self._clock())
            answer = self._await_task(task, doing, left, DROP_POLL_SECONDS)
        return earlier if missing else earlier + _deleted(answer, what, task)

    def _start_delete(self, alias: str, tenant: str, version: int | None) -> str:
        """Start the ``_delete_by_query`` of the tenant's documents on ``alias`` as a task."""
        started = self._es().delete_by_query(
            index=alias,
            query=self.dropped_query(tenant, version),
            conflicts="proceed",
            refresh=True,
            wait_for_completion=False,
        )
        return str(started.body["task"])

    def _running_delete(self, alias: str) -> str | None:
        """The id of a running ``_delete_by_query`` on ``alias`` (ES describes one as
        ``delete-by-query [<alias>]``), if any."""
        for task_id, description in sorted(self._running_tasks("*delete/byquery").items()):
            if description == f"delete-by-query [{alias}]":
                return task_id
        return None


def _deleted(answer: Mapping[str, Any], what: str, task: str) -> int:
    """How many documents a done ``_delete_by_query`` task deleted, from its
    ``GET _tasks/<id>`` answer; raises if it did not delete every one it matched.

    >>> _deleted({"completed": True, "response": {"deleted": 3, "version_conflicts": 0,
    ...     "failures": []}}, "drop", "n:1")
    3
    >>> _deleted({"completed": True, "response": {"deleted": 2, "version_conflicts": 1,
    ...     "failures": []}}, "drop", "n:1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    worker.errors.BackendUnavailable: drop: task n:1 deleted 2 ... (1 changed since it began)...
    """
    error = answer.get("error")
    if isinstance(error, Mapping):
        if error.get("type") == "index_not_found_exception":
            return 0  # the index went meanwhile (another drop): nothing of the tenant's left
        raise BackendRequestError(
            f"{what}: task {task} failed: {error.get('type', 'error')}: {error.get('reason', '')}"
        )
    report = answer.get("response") or {}
    canceled = task_canceled(answer)
    if canceled:
        raise BackendRequestError(f"{what}: task {task} was cancelled ({canceled}): run again")
    deleted = int(report.get("deleted", 0))
    conflicts = int(report.get("version_conflicts", 0))
    failures = report.get("failures") or []
    if conflicts or failures:
        why = [f"{conflicts} changed since it began"] if conflicts else []
        if failures:  # the first's cause by its type: its reason may name a node
            first = failures[0] if isinstance(failures[0], Mapping) else {}
            kind = _cause_type({"error": first.get("cause")}) or "error"
            why.append(f"{len(failures)} failure(s), the first {kind}")
        raise _unavailable(
            f"{what}: task {task} deleted {deleted} of the tenant's documents and left some "
            f"({'; '.join(why)}): run again",
            json.dumps(failures[:1]),
        )
    return deleted

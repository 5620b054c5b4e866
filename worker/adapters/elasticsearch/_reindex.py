"""Rebuilding an index (``reindex``): a new concrete index from the current template, a
copy run as an ES task and polled (also what the migration of the shared layout copies
with), then the alias moved to it in one atomic ``_aliases`` call."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from worker.adapters.elasticsearch._bodies import _Bodies
from worker.adapters.elasticsearch._core import task_canceled
from worker.adapters.elasticsearch._errors import (
    _raise_if_partial,
    _retryable,
    _total,
    _translated,
)
from worker.adapters.elasticsearch._layout import (
    KEY_SEPARATOR,
    TENANT_KEY_LENGTH,
    concrete_name,
)
from worker.errors import BackendRequestError, BackendUnavailable, IndexNotFound

logger = logging.getLogger(__name__)

#: How long a migration's copy waits between two reads of its task.
COPY_POLL_SECONDS = 0.5


class _Reindex(_Bodies):
    """Rebuild a tenant's index (or every tenant's) and swap its alias; copy with ``_reindex``."""

    def reindex(self, index: str, tenant: str, *, delete_old: bool = False) -> str:
        """Rebuild the tenant's ``index`` into a new concrete index, then swap the alias
        atomically.

        1. ``PUT <alias>~<timestamp>`` (the current template applies: new mapping,
           quantisation, shard count);
        2. ``POST _reindex`` of the tenant's documents (a tenant-term ``query``: an alias an
           operator pointed at an index tenants share holds others' too) from the alias into
           it (``version_type: external``: each document keeps its version, so the write
           ordering holds across it), then
           ``POST <new>/_refresh`` and ``PUT <new>/_mapping`` of the fields writes carry
           (:meth:`_added_fields`: the new index may come from an earlier release);
        3. ``POST _aliases`` with ``remove`` of the alias from every old index and ``add``
           to the new one, in one request (atomic: searches see old or new, never none);
        4. optionally delete the old indexes (kept by default, for a rollback), each only
           if it holds no other tenant's document (a ``terminate_after: 1`` search), as a
           drop never deletes one.

        Answers the new concrete index's name.
        """
        return self._rebuild(index, self.alias(index, tenant), delete_old, [tenant])

    def reindex_all(self, index: str, *, delete_old: bool = False) -> list[str]:
        """:meth:`reindex` of every tenant's ``index`` (an operator knows names, not which
        tenants hold them): each alias ``<prefix><key>--<index>`` found by
        ``GET _alias/<prefix>*--<index>`` (a name that merely ends so is left out). Each
        alias's tenants are those of its documents whose key is the alias's
        (:meth:`_tenants_in`), so only theirs are copied, as :meth:`reindex` copies one's."""
        exact = re.compile(
            rf"{re.escape(self.prefix)}[0-9a-f]{{{TENANT_KEY_LENGTH}}}{KEY_SEPARATOR}"
            + re.escape(index)
        )
        self.alias(index, "")  # refuses a name ES would
        with _translated(f"reindex of index {index!r}", index):
            answer = self._aliases(f"{self.prefix}*{KEY_SEPARATOR}{index}")
        found = {alias for held in answer.values() for alias in held}
        return [self._rebuild(index, a, delete_old) for a in sorted(found) if exact.fullmatch(a)]

    def _rebuild(
        self, index: str, alias: str, delete_old: bool, tenants: Sequence[str] | None = None
    ) -> str:
        """The steps of :meth:`reindex` for one alias, copying the documents of ``tenants``
        (None: each tenant whose own alias of ``index`` is ``alias``).

        A copy from the alias still running (an earlier run of this rebuild that gave up
        waiting, or was cut) is waited on and its index used: a run again never starts a
        second copy of the same documents."""
        what = f"reindex of index {index!r}"
        with _translated(what, index):
            old = self._concrete(alias)
            if not old:
                raise IndexNotFound(index)
            if tenants is None:
                tenants = [t for t in self._tenants_in(alias) if self.alias(index, t) == alias]
            mine = self.tenants_query(tenants)
            concrete = self._copied_index(alias, old, what, mine)
            # the index may be an earlier release's (the copy waited on), or made from a
            # template such a release put since: workers that mapped the alias's fields
            # before (``_map_fields``, once per alias) write them into it from the move on
            if added := self._added_fields():
                self._es().indices.put_mapping(index=concrete, properties=added)
            shared = [name for name in old if delete_old and self._holds_others(name, mine)]
            self.move_alias(alias, old, concrete, delete_old=delete_old, keep=shared)
        if shared:
            logger.warning(
                "%s: kept %s: it holds other tenants' documents too (delete_old deletes only "
                "an index holding none)",
                what,
                ", ".join(shared),
            )
        self._forget(alias)
        logger.info("reindexed %s: %s -> %s", alias, old, concrete)
        return concrete

    def _holds_others(self, concrete: str, mine: Mapping[str, Any]) -> bool:
        """Whether ``concrete`` holds a document ``mine`` does not match (another tenant's):
        one ``size: 0`` search that stops at the first."""
        answer = (
            self._es()
            .search(
                index=concrete,
                size=0,
                terminate_after=1,
                track_total_hits=True,
                query={"bool": {"must_not": [mine]}},
            )
            .body
        )
        _raise_if_partial(answer, f"count of {concrete!r}")  # a partial 0 would delete it
        return _total(answer) > 0

    def _tenants_in(self, alias: str) -> dict[str, int]:
        """Every tenant holding a document in ``alias`` and how many: a ``composite``
        aggregation on the tenant field, page by page (no limit on how many)."""
        tenants: dict[str, int] = {}
        after: dict[str, Any] | None = None
        while True:
            composite: dict[str, Any] = {
                "size": 1000,
                "sources": [{"tenant": {"terms": {"field": self.fields.tenant}}}],
            }
            if after is not None:
                composite["after"] = after
            with _translated(f"tenants of {alias!r}", None):
                answer = (
                    self._es().search(
                        index=alias, size=0, aggs={"tenants": {"composite": composite}}
                    )
                ).body
            _raise_if_partial(answer, f"tenants of {alias!r}")  # else a tenant left behind
            page = answer.get("aggregations", {}).get("tenants", {})
            for bucket in page.get("buckets", []):
                tenants[str(bucket["key"]["tenant"])] = int(bucket.get("doc_count", 0))
            after = page.get("after_key")
            if not page.get("buckets") or after is None:
                return tenants

    def _copied_index(
        self, alias: str, old: Sequence[str], what: str, mine: Mapping[str, Any]
    ) -> str:
        """Step 2 of :meth:`reindex`: the new index holding a copy of ``alias``'s documents.
        An earlier rebuild's copy still running (``old``: the indexes the alias points at) is
        waited on and its index answered; else a new index is made and the documents ``mine``
        matches are copied into it."""
        running = self._running_copy_from(alias, old)
        if running is not None:
            task, concrete = running
            logger.info("%s: waiting on the copy into %s (task %s)", what, concrete, task)
            self._await_copy(task, concrete, what)
            return concrete
        stamp = datetime.now(UTC).strftime("%Y%m%dt%H%M%S%f")
        concrete = concrete_name(alias, stamp)
        self._template_ready = False  # put the template again: current settings
        self._es().indices.create(index=concrete, **self._explicit_body())
        self._start_copy({"index": alias, "query": dict(mine)}, concrete, what)  # none runs
        return concrete

    def _copy(self, source: Mapping[str, Any], dest: str, what: str) -> int:
        """``POST _reindex`` into ``dest`` keeping each document's ``_id`` and version (a newer
        one already in ``dest`` stays), then refresh ``dest``; answers how many documents
        were written.

        The copy runs as an ES task (``wait_for_completion=false``), polled with the
        adapter's request timeout, so no request waits for the whole copy and a cut
        connection leaves the task running on its own. A copy into ``dest`` still running
        (an earlier run cut short) is waited on instead of starting a second one (a check,
        then the start: two runs started at the same moment can both copy; the external
        versions keep the result right). A task that reports failures, an error, or
        ``canceled`` (someone ran ``_tasks/<id>/_cancel``: a partial copy) fails the copy,
        and so does one not done after ``COPY_MAX_SECONDS`` (retryably): the caller then
        neither moves an alias nor deletes a source."""
        with _translated(what, None):
            running = self._running_copy(dest)
        if running:
            logger.info("%s: waiting on the copy into %s (task %s)", what, dest, running)
            return self._await_copy(running, dest, what)
        return self._start_copy(source, dest, what)

    def _start_copy(self, source: Mapping[str, Any], dest: str, what: str) -> int:
        """Start the copy task of :meth:`_copy` (none is running into ``dest``) and wait."""
        with _translated(what, None):
            task = (
                self._es()
                .reindex(
                    source=dict(source),
                    dest={"index": dest, "version_type": "external"},
                    conflicts="proceed",
                    wait_for_completion=False,
                )
                .body["task"]
            )
        return self._await_copy(str(task), dest, what)

    def _await_copy(self, task: str, dest: str, what: str) -> int:
        """Poll the copy ``task`` into ``dest`` until it is done (at most
        ``COPY_MAX_SECONDS``), fail as :meth:`_copy` says if it did not copy everything,
        else refresh ``dest``; answers how many documents it wrote."""
        with _translated(what, None):
            answer = self._await_task(
                task, f"{what} into {dest!r}", self.copy_max_seconds, COPY_POLL_SECONDS
            )
            report = answer.get("response") or {}
            canceled = task_canceled(answer)
            if canceled:
                raise BackendRequestError(
                    f"{what} into {dest!r} was cancelled (task {task}: {canceled}): the copy "
                    "is partial; run it again"
                )
            failed = answer.get("error") or report.get("failures")
            if failed:
                message = f"{what} into {dest!r} failed: {json.dumps(failed)}"
                statuses = [f.get("status") for f in report.get("failures") or [] if f]
                if not answer.get("error") and all(
                    isinstance(n, int) and _retryable(n) for n in statuses
                ):
                    raise BackendUnavailable(f"{message}: run again")  # rejected, a node gone
                raise BackendRequestError(message)
            self._es().indices.refresh(index=dest)
        return int(report.get("created", 0)) + int(report.get("updated", 0))

    def _running_copies(self) -> dict[str, str]:
        """Every running ``_reindex`` task: its id -> ``reindex from [<source>] to [<dest>]``."""
        return self._running_tasks("*reindex")

    def _running_copy(self, dest: str) -> str | None:
        """The id of a running ``_reindex`` task into ``dest``, if any."""
        for task_id, description in self._running_copies().items():
            if description.endswith(f" to [{dest}]"):
                return task_id
        return None

    def _running_copy_from(self, alias: str, live: Sequence[str]) -> tuple[str, str] | None:
        """A running copy from ``alias`` into one of its own concrete indexes the alias
        does not point at (``live``): an earlier rebuild's, as (task id, that index)."""
        pattern = re.compile(
            rf"reindex from \[{re.escape(alias)}\] to \[({re.escape(alias)}~[^\]]+)\]"
        )
        for task_id, description in sorted(self._running_copies().items()):
            found = pattern.fullmatch(description)
            if found and found.group(1) not in live:
                return task_id, found.group(1)
        return None

    def move_alias(
        self,
        alias: str,
        old: Sequence[str],
        new: str | None,
        *,
        delete_old: bool,
        keep: Sequence[str] = (),
    ) -> None:
        """In one ``POST _aliases`` (atomic: searches see the old indexes or the new one,
        never none), remove ``alias`` from ``old`` and add it to ``new`` (None: nowhere);
        then delete ``old`` but ``keep`` if ``delete_old``. Errors are the caller's to
        translate."""
        actions: list[Mapping[str, Any]] = [
            {"remove": {"index": name, "alias": alias}} for name in old
        ]
        if new is not None:
            actions.append({"add": {"index": new, "alias": alias}})
        self._es().indices.update_aliases(actions=actions)
        deleted = [name for name in old if name not in keep]
        if delete_old and deleted:
            self._es().indices.delete(index=",".join(deleted))

    def _concrete(self, alias: str) -> list[str]:
        """The concrete indexes ``alias`` points at (none if it is missing)."""
        return sorted(name for name, held in self._aliases(alias).items() if alias in held)

"""What every part of the Elasticsearch backend shares: its state (the client, the names
and settings, the drop floors, and what this process remembers of aliases), the names of a
tenant's aliases, the client with a request timeout, what ``GET _alias`` holds, and Sift's
index template, put once per process before a first index is made."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal
from urllib.parse import quote

from elasticsearch import Elasticsearch, NotFoundError

from worker.adapters.elasticsearch._errors import _detail, _error_type, _translated, _unavailable
from worker.adapters.elasticsearch._layout import (
    FLOORS_INDEX,
    KEY_SEPARATOR,
    DropFloors,
    checked_index_name,
    tenant_key,
)
from worker.adapters.elasticsearch._mapping import FieldNames, IndexSettings, index_template
from worker.errors import BackendUnavailable

#: How long a reindex or migration waits for its copy task before it gives up (retryably,
#: naming the task, which runs on: a run made while it does waits on it, one made after it
#: ended starts the copy again).
COPY_MAX_SECONDS = 6 * 3600.0
Refresh = Literal["wait_for", "true", "false"]


class _Core:
    """The backend's state and the helpers every part of it uses.

    :class:`~worker.adapters.elasticsearch.ElasticsearchBackend` is one class made of one
    part per module of this package (``_Search``, ``_Writes``, ...), so each job reads on
    its own; every part builds on this one, which holds all the state."""

    name = "elasticsearch"

    def __init__(
        self,
        client: Elasticsearch,
        *,
        prefix: str = "sift-",
        fields: FieldNames | None = None,
        index_settings: IndexSettings | None = None,
        num_candidates: int = 200,
        refresh: Refresh = "wait_for",
        request_timeout: float = 10.0,
        bulk_chunk_size: int = 500,
        native_rrf: bool = False,
        max_indexes_per_tenant: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self.max_indexes_per_tenant = max_indexes_per_tenant  # 0: no limit
        self.native_rrf = native_rrf
        self.prefix = prefix
        self.fields = fields or FieldNames()
        self.index_settings = index_settings or IndexSettings()
        self.num_candidates = num_candidates
        self.refresh = refresh
        self.copy_max_seconds = COPY_MAX_SECONDS
        self.request_timeout = request_timeout
        self.bulk_chunk_size = bulk_chunk_size
        self._clock = clock
        self._lock = threading.Lock()
        self._template_ready = False
        self._settings_ready = False  # the settings index made, or found made
        self._floors = DropFloors(
            self._es, f"{prefix}{FLOORS_INDEX}", lambda: self._explicit_body()
        )
        self._ready_aliases: set[str] = set()
        # aliases whose mapping has the model and metadata-terms fields
        self._fields_mapped: set[str] = set()
        # (alias, tenant) -> when the tenant's knn was last seen available, and its model
        self._with_vectors: dict[tuple[str, str], tuple[float, str | None]] = {}

    def floors_index(self) -> str:
        """Where drop floors live (:class:`~worker.adapters.elasticsearch.DropFloors`)."""
        return self._floors.index

    def tenant_stem(self, tenant: str) -> str:
        """What every alias of the tenant starts with: ``<prefix><key>--``."""
        return f"{self.prefix}{tenant_key(tenant)}{KEY_SEPARATOR}"

    def alias(self, index: str, tenant: str) -> str:
        """The ES alias behind the tenant's Sift index ``index``: ``<prefix><key>--<index>``.

        The gateway admits ``[a-z0-9][a-z0-9_.-]*`` of at most 128 characters, the prefix is
        at most 64 of ``[a-z0-9_.-]``: with the key, the separator and a concrete index's
        ``~<timestamp>``, at most 233 bytes. Checked anyway, for callers of this class."""
        return checked_index_name(f"{self.tenant_stem(tenant)}{index}")

    def _es(self, timeout: float | None = None) -> Elasticsearch:
        return self._client.options(request_timeout=timeout or self.request_timeout)

    def _forget(self, alias: str, tenant: str | None = None) -> None:
        """Drop what this process remembers of an alias that is gone or was rebuilt: for
        ``tenant``'s part of it, or every tenant's (None)."""
        with self._lock:
            self._ready_aliases.discard(alias)
            self._fields_mapped.discard(alias)
        for key in [key for key in list(self._with_vectors) if key[0] == alias]:
            if tenant is None or key[1] == tenant:
                self._with_vectors.pop(key, None)

    def _added_fields(self) -> dict[str, Any]:
        """The fields a release added to Sift's mapping after its first (the model field,
        the metadata-terms field, the write-version field), for ``PUT <target>/_mapping`` on
        an index made before them: writes carry them, and ``dynamic: strict`` refuses a
        document with a field its index does not map. Empty if none is set."""
        types = (
            (self.fields.model, "keyword"),
            (self.fields.metadata_terms, "keyword"),
            (self.fields.write_version, "long"),
        )
        return {name: {"type": kind} for name, kind in types if name}

    def _aliases(self, name: str) -> dict[str, list[str]]:
        """``GET _alias/<name or pattern>`` as concrete index -> its aliases matching it.

        Nothing found is ``{}`` in every shape ES answers it: a wildcard matching nothing
        (200 ``{}``), a missing alias (404 ``{"error": "alias [..] missing", "status":
        404}``), or, with security on and no index the key may see yet, a 404
        ``index_not_found_exception``."""
        answer = self._es().options(ignore_status=404).indices.get_alias(name=name).body
        return {
            concrete: list(about.get("aliases") or {})
            for concrete, about in answer.items()
            if isinstance(about, Mapping) and "aliases" in about
        }

    def _explicit_body(self) -> dict[str, Any]:
        """Settings and mappings for ``indices.create``: the template's, or none if it applies.

        With an empty prefix no template is put (its pattern would be ``*``), so each new
        index carries the mapping itself.
        """
        if self.prefix:
            self.ensure_template()
            return {}
        template = index_template(self.prefix, self.fields, self.index_settings)["template"]
        return {"settings": template["settings"], "mappings": template["mappings"]}

    def ensure_template(self) -> None:
        """Put Sift's index template (idempotent; once per process; needs a prefix)."""
        if self._template_ready or not self.prefix:
            return
        body = index_template(self.prefix, self.fields, self.index_settings)
        with _translated("index template", None):
            self._es().indices.put_index_template(name=f"{self.prefix}sift", **body)
        self._template_ready = True

    # --- ES tasks: a long request (a copy, a tenant's delete) run as a task and polled ---

    def _task_api(self, path: str, endpoint: str, **params: Any) -> Mapping[str, Any]:
        """A ``GET`` of the task API (in every 9.x) as the client's own ``tasks`` methods send
        it, minus their preview decorator: that walked ``inspect.stack()``, reading the source
        of every frame (about 0.4 s of CPU a call in a worker's deep stack, at every poll of a
        copy or a tenant's delete), to place a warning Sift then had to hide inside
        ``warnings.catch_warnings()``, which swaps the process's filters under its other
        threads."""
        answer = self._es().perform_request(
            "GET", path, params=params, headers={"accept": "application/json"},
            endpoint_id=endpoint,
        )  # fmt: skip
        body: Mapping[str, Any] = answer.body
        return body

    def _task(self, task: str, what: str = "task") -> Mapping[str, Any]:
        """``GET _tasks/<id>``. One ES no longer knows (404 ``resource_not_found_exception``:
        the node running it left, as in a rolling restart, before it stored its result) is
        ``BackendUnavailable``: a run again finds it not running and does what is left. It
        failed the drop or copy for good, as a request ES refused."""
        try:
            return self._task_api(f"/_tasks/{quote(task, safe=',*')}", "tasks.get")
        except NotFoundError as exc:
            if _error_type(exc) != "resource_not_found_exception":
                raise
            raise _unavailable(
                f"{what}: task {task} is gone (its node left before it stored its result); "
                "run again",
                _detail(exc),
            ) from exc

    def _running_tasks(self, actions: str) -> dict[str, str]:
        """Every running task whose action matches ``actions`` (``GET _tasks``): its id ->
        its description (``reindex from [<source>] to [<dest>]``, ``delete-by-query
        [<index>]``). A node that did not answer may be running one, so its failure is an
        error (retryable), never "none running"."""
        answer = self._task_api("/_tasks", "tasks.list", actions=actions, detailed=True)
        failed = answer.get("node_failures") or answer.get("task_failures")
        if failed:
            raise _unavailable(
                "cannot tell which tasks are running, a node did not answer", json.dumps(failed)
            )
        return {
            str(task_id): str(task.get("description", ""))
            for node in (answer.get("nodes") or {}).values()
            for task_id, task in (node.get("tasks") or {}).items()
        }

    def _await_task(
        self, task: str, what: str, max_seconds: float, poll_seconds: float
    ) -> Mapping[str, Any]:
        """``GET _tasks/<id>`` every ``poll_seconds`` until the task is done: its last
        answer (``response``: the report; ``error``: why it failed). Not done after
        ``max_seconds``: ``BackendUnavailable`` naming the task, which runs on (a run again
        finds it in :meth:`_running_tasks` and waits on it)."""
        answer = self._task(task, what)
        deadline = self._clock() + max_seconds
        while not answer.get("completed"):
            if self._clock() >= deadline:
                raise BackendUnavailable(
                    f"{what} not done after {max_seconds:g} s (task {task} runs on): "
                    "run again to wait on it"
                )
            time.sleep(poll_seconds)
            answer = self._task(task, what)
        return answer


def task_canceled(answer: Mapping[str, Any]) -> Any:
    """Why a done ES task was cancelled (its report's or its status's ``canceled``), if it was.

    >>> task_canceled({"task": {"status": {"canceled": "by user request"}}})
    'by user request'
    >>> task_canceled({"response": {"deleted": 3}}) is None
    True
    """
    report = answer.get("response") or {}
    status = (answer.get("task") or {}).get("status") or {}
    return report.get("canceled") or status.get("canceled")

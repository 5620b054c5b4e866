"""An index's own search settings over a real redis-server and the real embedded backend: a
change is the tenant's and needs the tenant's index; ``null`` clears; a drop clears them
unless a change was accepted after it, in either order of the two; other processes see a
change within the TTL; a search uses them, below its own; an earlier release's, in Redis,
are read until the next change."""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from starlette.testclient import TestClient

from tests.fakes import FakeClock, FakeEmbedder
from tests.integration.gateway_app import ACME, gateway_settings
from worker.adapters.embedded import EmbeddedBackend
from worker.adapters.index_settings import IndexSettingsStore, settings_key
from worker.constants import INDEX_SETTINGS_LOCK_KEY, SEARCH_QUEUE
from worker.contract import DocumentIn, SearchSpec
from worker.errors import (
    BackendAccessRefused,
    BackendRequestError,
    BackendUnavailable,
    ConfigError,
    TenantRemoved,
)
from worker.queue import lifecycle
from worker.queue.jobstore import JobStore
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.settings import load_settings

pytestmark = pytest.mark.integration

DEFAULTS = {
    "fusion": {"method": None, "weights": {"bm25": None, "knn": None}, "rank_constant": None},
    "candidate_limit": None,
}


@pytest.fixture
def runtime(tmp_path: Path, store: JobStore, redis_url: str) -> Runtime:
    pipeline = build_pipeline(
        load_settings(redis_url=redis_url, data_dir=tmp_path / "data"),
        backend=EmbeddedBackend(tmp_path / "data"),
        embedder=FakeEmbedder(),
    )
    runtime = Runtime(pipeline)
    for tenant in ("acme", "globex"):
        docs = [DocumentIn(id=f"{tenant}-{i}", text=f"volcano ash {i} {tenant}") for i in range(6)]
        runtime.ingest("docs", tenant, docs)
    runtime.ingest("notes", "acme", [DocumentIn(id="n", text="jazz notes")])
    return runtime


def stored(runtime: Runtime, index: str, tenant: str = "acme") -> Any:
    """What the backend keeps for the tenant's index: (settings or None, version) or None."""
    backend = runtime.pipeline.backend
    assert isinstance(backend, EmbeddedBackend)
    return backend.stored_settings([index], tenant)[0]


def call(runtime: Runtime, operation: str, tenant: str, index: str, body: Any = None) -> Any:
    answer = json.loads(
        lifecycle.read(runtime, operation, tenant, index, "", json.dumps(body) if body else "")
    )
    if "error" in answer:
        return answer
    return answer["found"]


def test_a_change_is_stored_shown_and_the_tenants_own(runtime: Runtime) -> None:
    patch = {"fusion": {"weights": {"knn": 0.25}, "rank_constant": 20}, "candidate_limit": 40}
    found = call(runtime, "update", "acme", "docs", patch)
    assert found["name"] == "docs" and found["documents"] == 6
    assert found["settings"] == {
        "fusion": {"method": None, "weights": {"bm25": None, "knn": 0.25}, "rank_constant": 20},
        "candidate_limit": 40,
    }
    assert call(runtime, "show", "acme", "docs")["settings"] == found["settings"]
    listed = call(runtime, "list", "acme", "", {"after": None, "limit": 100})
    assert not listed["more"]
    assert {i["name"]: i["settings"] for i in listed["indexes"]} == {
        "docs": found["settings"],
        "notes": DEFAULTS,
    }
    # a page at a time, each index with its own settings
    first = call(runtime, "list", "acme", "", {"after": None, "limit": 1})
    assert [(i["name"], i["settings"]) for i in first["indexes"]] == [("docs", found["settings"])]
    rest = call(runtime, "list", "acme", "", {"after": "docs", "limit": 1})
    assert first["more"] and not rest["more"]
    assert [(i["name"], i["settings"]) for i in rest["indexes"]] == [("notes", DEFAULTS)]
    # the other tenant's index of the same name has its own settings: none
    assert call(runtime, "show", "globex", "docs")["settings"] == DEFAULTS
    listed = call(runtime, "list", "globex", "", {"after": None, "limit": 100})
    assert listed["indexes"][0]["settings"] == DEFAULTS


def test_a_change_to_an_index_the_tenant_lacks_stores_nothing(runtime: Runtime) -> None:
    assert call(runtime, "update", "globex", "notes", {"candidate_limit": 5}) is None
    assert call(runtime, "update", "acme", "nothing", {"candidate_limit": 5}) is None
    assert stored(runtime, "notes", "globex") is None and stored(runtime, "nothing") is None


def test_null_clears_a_field_and_every_field_cleared_leaves_none(runtime: Runtime) -> None:
    call(runtime, "update", "acme", "docs", {"fusion": {"weights": {"bm25": 2, "knn": 0.5}}})
    found = call(runtime, "update", "acme", "docs", {"fusion": {"weights": {"knn": None}}})
    assert found["settings"]["fusion"]["weights"] == {"bm25": 2.0, "knn": None}
    found = call(runtime, "update", "acme", "docs", {"fusion": None, "candidate_limit": None})
    assert found["settings"] == DEFAULTS
    assert stored(runtime, "docs")[0] == {}


def test_a_change_that_would_weight_every_channel_zero_is_refused(runtime: Runtime) -> None:
    call(runtime, "update", "acme", "docs", {"fusion": {"weights": {"knn": 0}}})
    answer = call(runtime, "update", "acme", "docs", {"fusion": {"weights": {"bm25": 0}}})
    assert answer["error"]["type"] == "invalid_request"
    assert answer["error"]["field"] == "fusion.weights"
    weights = call(runtime, "show", "acme", "docs")["settings"]["fusion"]["weights"]
    assert weights == {"bm25": None, "knn": 0.0}  # unchanged


def test_a_drop_clears_them_unless_a_change_came_after_it(
    runtime: Runtime, store: JobStore
) -> None:
    call(runtime, "update", "acme", "docs", {"candidate_limit": 40})
    call(runtime, "update", "globex", "docs", {"candidate_limit": 7})
    drop = store.create_deletion("acme", "docs", None)
    lifecycle.delete(runtime, drop, None)
    assert call(runtime, "show", "acme", "docs") is None
    assert stored(runtime, "docs")[0] is None
    assert call(runtime, "show", "globex", "docs")["settings"]["candidate_limit"] == 7

    # accepted: a drop, then a change; run: the change, then the drop's task
    runtime.ingest("notes", "acme", [DocumentIn(id="m", text="more notes")])
    late_drop = store.create_deletion("acme", "notes", None)
    call(runtime, "update", "acme", "notes", {"candidate_limit": 12})
    lifecycle.delete(runtime, late_drop, None)
    assert stored(runtime, "notes")[0] == {"candidate_limit": 12}


def test_other_processes_see_a_change_within_the_ttl(runtime: Runtime, redis_url: str) -> None:
    clock = FakeClock()
    elsewhere = IndexSettingsStore.from_url(runtime.pipeline.backend, redis_url)  # type: ignore[arg-type]
    elsewhere._clock = clock  # another worker process's copy, on a clock of our own
    assert elsewhere.get("docs", "acme").candidate_limit is None
    call(runtime, "update", "acme", "docs", {"candidate_limit": 40})
    assert elsewhere.get("docs", "acme").candidate_limit is None  # its copy, still fresh
    clock.now += elsewhere._ttl
    assert elsewhere.get("docs", "acme").candidate_limit == 40
    # the process that made the change sees it at once, and a restarted one reads it anew
    source = runtime.pipeline.index_settings
    assert source is not None and source.get("docs", "acme").candidate_limit == 40
    again = IndexSettingsStore.from_url(runtime.pipeline.backend, redis_url)  # type: ignore[arg-type]
    assert again.get("docs", "acme").candidate_limit == 40


def test_a_search_uses_the_indexs_settings_below_its_own(runtime: Runtime) -> None:
    call(runtime, "update", "acme", "docs", {"fusion": {"weights": {"knn": 0.5}}})
    asked = SearchSpec(index="docs", query="volcano ash", include_trace=True)
    trace = runtime.search(asked, "acme").trace
    assert trace is not None and trace["fusion"]["weights"] == {"bm25": 1.0, "knn": 0.5}
    assert trace["fusion"]["from"]["weights"] == {"bm25": "default", "knn": "index"}
    other = runtime.search(asked, "globex").trace
    assert other is not None and other["fusion"]["weights"] == {"bm25": 1.0, "knn": 1.0}
    own = SearchSpec.model_validate({**asked.model_dump(), "fusion": {"weights": {"knn": 2.0}}})
    trace = runtime.search(own, "acme").trace
    assert trace is not None and trace["fusion"]["weights"]["knn"] == 2.0
    assert trace["fusion"]["from"]["weights"]["knn"] == "request"


def test_a_change_no_worker_started_in_time_is_dropped_unapplied(
    runtime: Runtime, store: JobStore, redis_url: str
) -> None:
    """The gateway answers 503 when no worker took a change within its wait; that change must
    never land later, behind a newer one: a change past its ``start_by`` is dropped."""
    from worker.queue import base, tasks
    from worker.runtime.ratelimit import ProviderLimiter

    context = base.WorkerContext(
        settings=load_settings(redis_url=redis_url), store=store, limiter=ProviderLimiter(4)
    )
    context._runtime = runtime
    base.set_context(context)
    try:
        late = json.dumps({"candidate_limit": 50})
        tasks.index_read.apply(args=["reply-late", "update", "acme", "docs", "", late, 1.0])
        assert store.redis.exists("reply-late") == 0  # nobody waits for it: no answer
        assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] is None
        in_time = json.dumps({"candidate_limit": 20})
        start_by = time.time() + 60
        tasks.index_read.apply(args=["reply-ok", "update", "acme", "docs", "", in_time, start_by])
        assert store.redis.exists("reply-ok") == 1
        assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] == 20
    finally:
        base.set_context(None)


def _redis_seconds(store: JobStore) -> float:
    """Redis's clock (``TIME``): the one the gateways and the workers share."""
    seconds, micros = store.redis.time()
    return float(seconds) + micros / 1_000_000


def _worker_context(
    runtime: Runtime,
    store: JobStore,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    skew: float = 0.0,
    **settings: Any,
) -> None:
    """This process as a worker on ``runtime`` (the tasks' context, unset by the caller),
    its own clock ``skew`` seconds off Redis's, given ``settings``."""
    from worker.queue import base
    from worker.runtime.ratelimit import ProviderLimiter

    context = base.WorkerContext(
        settings=load_settings(redis_url=redis_url, **settings),
        store=store,
        limiter=ProviderLimiter(4),
    )
    context._runtime = runtime
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew)
    base.set_context(context)


@pytest.mark.parametrize("skew", [-100.0, 0.0, 100.0])
def test_whether_a_change_started_in_time_is_read_on_redis_s_clock(
    runtime: Runtime, store: JobStore, redis_url: str, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    """``start_by`` is set on Redis's clock (the gateway's own, compared with the worker's,
    was another host's): the worker reads Redis's too. With its own clock ``skew`` seconds
    off, it dropped a change in time (ahead), or applied one its gateway had answered 503
    for (behind); now the same changes land and are dropped whatever its clock says."""
    from worker.queue import base, tasks

    _worker_context(runtime, store, redis_url, monkeypatch, skew)
    try:
        late = json.dumps({"candidate_limit": 50})
        start_by = _redis_seconds(store) - 5  # its gateway's wait ended 5 s ago
        tasks.index_read.apply(args=["reply-late", "update", "acme", "docs", "", late, start_by])
        assert store.redis.exists("reply-late") == 0
        assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] is None
        in_time = json.dumps({"candidate_limit": 20})
        start_by = _redis_seconds(store) + 5  # its gateway waits 5 s more
        tasks.index_read.apply(args=["reply-ok", "update", "acme", "docs", "", in_time, start_by])
        assert store.redis.exists("reply-ok") == 1
        assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] == 20
    finally:
        base.set_context(None)


def test_a_read_taken_after_its_gateway_gave_up_is_dropped_and_counted(
    runtime: Runtime, store: JobStore, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read carries the end of its gateway's wait as ``start_by`` too: taken after it (a
    backlog, a worker started late) it ran, answering no one (and each retry of the client
    added another). Now it is dropped unrun, counted by operation; one in time is answered."""
    from worker.observability import metrics
    from worker.queue import base, tasks

    def dropped() -> float:
        return float(metrics.INDEX_READS_DROPPED.labels("show")._value.get())

    _worker_context(runtime, store, redis_url, monkeypatch, 0.0)
    try:
        before = dropped()
        late = _redis_seconds(store) - 1
        tasks.index_read.apply(args=["reply-late", "show", "acme", "docs", "", "", late])
        assert store.redis.exists("reply-late") == 0 and dropped() == before + 1
        in_time = _redis_seconds(store) + 5
        tasks.index_read.apply(args=["reply-ok", "show", "acme", "docs", "", "", in_time])
        assert store.redis.exists("reply-ok") == 1 and dropped() == before + 1
    finally:
        base.set_context(None)


def test_deleting_an_indexs_last_document_clears_them_as_a_drop_does(
    runtime: Runtime, store: JobStore
) -> None:
    call(runtime, "update", "acme", "notes", {"candidate_limit": 12})
    call(runtime, "update", "acme", "docs", {"candidate_limit": 40})
    some = store.create_deletion("acme", "docs", ["acme-0", "acme-1"])
    lifecycle.delete(runtime, some, ["acme-0", "acme-1"])
    assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] == 40

    last = store.create_deletion("acme", "notes", ["n"])
    assert lifecycle.delete(runtime, last, ["n"]) == 1
    assert call(runtime, "show", "acme", "notes") is None
    assert stored(runtime, "notes")[0] is None
    # a new index of the name starts at the defaults
    runtime.ingest("notes", "acme", [DocumentIn(id="n2", text="new notes")])
    assert call(runtime, "show", "acme", "notes")["settings"] == DEFAULTS


def test_an_upsert_accepted_before_the_delete_of_the_last_document_keeps_them(
    runtime: Runtime, store: JobStore
) -> None:
    """Replacing an index's documents (new ones sent, then the old deleted): the delete's
    task may run first, while the upsert accepted before it is still being embedded. The
    index is empty for that moment, but never in the order the writes were accepted, and
    the upsert lands after: the index keeps its settings. Once no earlier upsert is left, a
    delete that empties the index clears them."""
    call(runtime, "update", "acme", "notes", {"candidate_limit": 12})
    new = [DocumentIn(id="n2", text="new jazz notes")]
    upsert = store.create_ingest("acme", "notes", new)  # accepted first, its task not run yet
    old = store.create_deletion("acme", "notes", ["n"])
    assert lifecycle.delete(runtime, old, ["n"], jobs=store) == 1  # its task runs first
    assert runtime.ingest("notes", "acme", new, version=upsert.version) == 1
    assert store.start_ingest(upsert.id) and store.finish_ingest(upsert.id, upserted=1)
    shown = call(runtime, "show", "acme", "notes")
    assert shown["documents"] == 1 and shown["settings"]["candidate_limit"] == 12

    last = store.create_deletion("acme", "notes", ["n2"])
    assert lifecycle.delete(runtime, last, ["n2"], jobs=store) == 1
    assert stored(runtime, "notes")[0] is None


def test_a_delete_that_emptied_the_index_run_again_after_a_newer_ingest_clears_them(
    runtime: Runtime, store: JobStore
) -> None:
    """The delete of the index's last document committed, then its worker died before it
    cleared the index's settings; an ingest accepted after the delete landed; then the delete
    was redelivered. In the order the writes were accepted the delete emptied the index (its
    settings go with it) and the ingest began a new one, at the defaults: the run again
    clears them as of the delete's version. It kept them: the index held a document again."""
    call(runtime, "update", "acme", "notes", {"candidate_limit": 12})
    last = store.create_deletion("acme", "notes", ["n"])
    backend = runtime.pipeline.backend
    assert backend.delete_documents("notes", "acme", ["n"], version=last.version) == 1  # killed
    new = [DocumentIn(id="n2", text="new jazz notes")]
    later = store.create_ingest("acme", "notes", new)
    assert runtime.ingest("notes", "acme", new, version=later.version) == 1
    assert lifecycle.delete(runtime, last, ["n"], jobs=store) == 1  # redelivered
    shown = call(runtime, "show", "acme", "notes")
    assert shown["documents"] == 1 and shown["settings"] == DEFAULTS, shown


def test_a_change_racing_a_drop_lands_in_the_order_of_their_versions(
    runtime: Runtime, store: JobStore
) -> None:
    """A change whose version is older than a drop's and whose store lands after the drop's
    task (its worker paused between taking the version and storing): the drop's cleared
    record, newer, refuses the store, and the change reads again with a new version, so
    it lands after the drop, as one accepted after the drop does. The settings are never
    an older change's over a newer clear."""
    call(runtime, "update", "acme", "docs", {"candidate_limit": 40})
    backend = runtime.pipeline.backend
    assert isinstance(backend, EmbeddedBackend)
    before = stored(runtime, "docs")[1]
    drop = store.create_deletion("acme", "docs", None)
    assert drop.version is not None and drop.version > before
    # an older change's store, after the drop's clear: refused
    lifecycle.delete(runtime, drop, None)
    assert not backend.store_settings("docs", "acme", {"candidate_limit": 3}, before + 1)
    assert stored(runtime, "docs") == (None, drop.version)
    # a clear older than the settings held leaves them
    runtime.ingest("docs", "acme", [DocumentIn(id="again", text="volcano ash again")])
    call(runtime, "update", "acme", "docs", {"candidate_limit": 9})
    assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] == 9
    store.redis.delete(settings_key("docs", "acme"))
    source = lifecycle.settings_store(runtime)
    assert source is not None
    source.clear("docs", "acme", drop.version)
    assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] == 9


def test_an_earlier_releases_settings_in_redis_are_read_until_changed(
    runtime: Runtime, store: JobStore
) -> None:
    earlier = {"settings": {"candidate_limit": 25}, "version": 5}
    store.redis.set(settings_key("docs", "acme"), json.dumps(earlier))
    assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] == 25
    found = call(runtime, "update", "acme", "docs", {"fusion": {"rank_constant": 30}})
    assert found["settings"]["candidate_limit"] == 25  # merged into what was held
    assert stored(runtime, "docs")[0] == {"candidate_limit": 25, "fusion": {"rank_constant": 30}}
    assert store.redis.exists(settings_key("docs", "acme")) == 0


class ClearedBetween:
    """The embedded backend, with a drop's clear landing (without the lock: it was lost with
    a Redis that went away) between a change's read and its store, ``times`` times."""

    def __init__(self, backend: EmbeddedBackend, store: JobStore, times: int) -> None:
        self.backend, self.store, self.times = backend, store, times

    def stored_settings(self, indexes: Any, tenant: str) -> Any:
        return self.backend.stored_settings(indexes, tenant)

    def store_settings(self, index: str, tenant: str, settings: Any, version: int) -> bool:
        if self.times and settings is not None:
            self.times -= 1
            drop = self.store.create_deletion(tenant, index, None)
            assert drop.version is not None
            assert self.backend.store_settings(index, tenant, None, drop.version)
        return self.backend.store_settings(index, tenant, settings, version)


def test_a_change_whose_store_a_newer_clear_refused_reads_again(
    runtime: Runtime, store: JobStore
) -> None:
    call(runtime, "update", "acme", "docs", {"candidate_limit": 40})
    backend = runtime.pipeline.backend
    assert isinstance(backend, EmbeddedBackend)
    once = IndexSettingsStore(ClearedBetween(backend, store, 1), store.redis)
    # merged into what the clear left (nothing), not into the settings it first read
    assert once.update("docs", "acme", {"fusion": {"rank_constant": 30}}).stored == {
        "fusion": {"rank_constant": 30}
    }
    assert stored(runtime, "docs")[0] == {"fusion": {"rank_constant": 30}}
    always = IndexSettingsStore(ClearedBetween(backend, store, 100), store.redis)
    with pytest.raises(BackendUnavailable):
        always.update("docs", "acme", {"candidate_limit": 5})  # bounded, never a loop
    assert stored(runtime, "docs")[0] is None  # the newest clear


def test_a_change_waits_for_the_lock_then_says_so(runtime: Runtime, store: JobStore) -> None:
    held = store.redis.lock(f"{INDEX_SETTINGS_LOCK_KEY}acme:docs", timeout=30)
    assert held.acquire(blocking=False)
    try:
        answer = call(runtime, "update", "acme", "docs", {"candidate_limit": 5})
        assert answer["error"]["type"] == "backend_unavailable"
    finally:
        held.release()
    assert (
        call(runtime, "update", "acme", "docs", {"candidate_limit": 5})["settings"][
            "candidate_limit"
        ]
        == 5
    )


@pytest.mark.parametrize("skew", [0.0, -100.0])
def test_a_change_started_in_time_never_lands_after_its_gateway_gave_up(
    runtime: Runtime, store: JobStore, redis_url: str, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    """A change started just before its ``start_by`` and then held up by the lock (another
    worker's change, or one that died holding it) must not land once its gateway has answered
    503 (``start_by`` + the grace): it takes the lock by ``start_by`` or gives up unapplied.
    ``start_by`` is on Redis's clock: a worker whose own clock is behind (``skew``) waited
    the whole ``LOCK_WAIT_SECONDS`` for the lock, and landed the change after the 503."""
    from worker.constants import INDEX_CHANGE_GRACE_SECONDS
    from worker.queue import base, tasks

    _worker_context(runtime, store, redis_url, monkeypatch, skew)
    lock_key = f"{INDEX_SETTINGS_LOCK_KEY}acme:docs"
    assert store.redis.set(lock_key, "another worker", ex=30, nx=True)
    start_by = _redis_seconds(store) + 0.5
    # the other holder lets go only once the gateway has answered (start_by + the grace)
    freed = threading.Timer(0.5 + INDEX_CHANGE_GRACE_SECONDS + 0.5, store.redis.delete, [lock_key])
    freed.start()
    try:
        late = json.dumps({"candidate_limit": 7})
        tasks.index_read.apply(args=["reply-held", "update", "acme", "docs", "", late, start_by])
        freed.join()
        answer = json.loads(store.redis.lpop("reply-held") or "{}")
        assert answer["error"]["type"] == "backend_unavailable"
        assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] is None
    finally:
        freed.cancel()
        base.set_context(None)


def test_a_delete_that_empties_an_index_reads_none_of_another_tenants_ingests(
    runtime: Runtime, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether an upsert accepted before it is pending, a delete that empties the index asks
    of its own tenant's unfinished ingests only. It read every tenant's active job ids and
    each of their ingest records: its run grew with the others' backlog (N queued ingests of
    another tenant, N Redis reads in one delete), and its time told that backlog."""
    for i in range(40):  # globex's ingests, queued behind a busy fleet
        store.create_ingest("globex", "docs", [DocumentIn(id=f"q{i}", text="queued")])
    mine = store.create_ingest("acme", "docs", [DocumentIn(id="later", text="x")])
    read: list[str] = []
    get_ingest = store.get_ingest

    def counted(job_id: str) -> Any:
        read.append(job_id)
        return get_ingest(job_id)

    monkeypatch.setattr(store, "get_ingest", counted)
    last = store.create_deletion("acme", "notes", ["n"])
    assert lifecycle.delete(runtime, last, ["n"], jobs=store) == 1
    assert read == [mine.id]  # the tenant's own unfinished ingest, its delete skipped
    assert stored(runtime, "notes") is None or stored(runtime, "notes")[0] is None


def test_a_removed_tenants_index_is_neither_read_nor_changed(
    runtime: Runtime, store: JobStore, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker given keys that no longer name the tenant (removed, while a gateway not yet
    restarted still takes its key) answers its index reads and changes ``tenant_removed``,
    as it ends the tenant's jobs unrun: it showed the index and applied the change."""
    from worker.queue import base, tasks
    from worker.settings import ApiKey

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LKLYYb"
    keys = [ApiKey(key="key-globex-0123456789", tenant="globex", webhook_secret=secret)]
    _worker_context(runtime, store, redis_url, monkeypatch, api_keys=keys)
    try:
        patch = json.dumps({"candidate_limit": 9})
        tasks.index_read.apply(args=["reply-show", "show", "acme", "docs", ""])
        tasks.index_read.apply(args=["reply-set", "update", "acme", "docs", "", patch])
        tasks.index_read.apply(args=["reply-other", "show", "globex", "docs", ""])
    finally:
        base.set_context(None)
    for key in ("reply-show", "reply-set"):
        answer = json.loads(store.redis.lpop(key) or "{}")
        assert answer["error"]["type"] == "tenant_removed", answer
    assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] is None
    other = json.loads(store.redis.lpop("reply-other") or "{}")
    assert other["found"]["name"] == "docs", other  # a tenant with a key is read as before


LEAK = "Error 111 connecting to 10.0.0.5:6379. Connection refused."


@pytest.mark.parametrize(
    ("failure", "said", "retry_after"),
    [
        (redis.ConnectionError(LEAK), "unavailable", "1"),
        (redis.TimeoutError("Timeout reading from 10.0.0.5:6379"), "unavailable", "1"),
        (
            redis.exceptions.OutOfMemoryError(
                "command not allowed when used memory > 'maxmemory'."
            ),
            "job_store_full",
            "30",
        ),
        (
            redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device"),
            "job_store_full",
            "30",
        ),
    ],
)
def test_an_index_read_the_job_store_failed_in_the_worker_is_the_job_store_s_503(
    runtime: Runtime,
    store: JobStore,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    failure: redis.RedisError,
    said: str,
    retry_after: str,
) -> None:
    """A worker whose read of the index's settings met Redis failing answered its gateway
    ``internal_error``, which the gateway told its client as ``503 backend_unavailable``: the
    search backend blamed for the job store, with no Retry-After. It is the gateway's own 503
    of the job store (``unavailable``, or ``job_store_full`` at Redis's maxmemory), which
    names no Redis host."""

    def down(*args: Any, **kwargs: Any) -> Any:
        raise failure

    monkeypatch.setattr(IndexSettingsStore, "read", down)
    answer = _read_through_a_gateway(runtime, store, redis_url, monkeypatch)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["type"] == said, answer.text
    assert answer.headers.get("retry-after") == retry_after, answer.headers
    assert "10.0.0.5" not in answer.text, answer.text
    if "MISCONF" in str(failure):  # a refused write, whole, as at maxmemory: not memory's
        assert "disk" in answer.text and "maxmemory" not in answer.text, answer.text


def _read_through_a_gateway(
    runtime: Runtime,
    store: JobStore,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    patch: dict[str, Any] | None = None,
) -> Any:
    """A gateway's ``GET /v1/indexes/docs`` for acme (a ``PATCH`` of ``patch`` if given),
    its read run by this process as the worker (the real task, on the message the gateway
    queued)."""
    from api_gateway.app import create_app
    from worker.queue import base, tasks

    _worker_context(runtime, store, redis_url, monkeypatch)

    def worker() -> None:  # takes the read's message off the queue and runs it here
        _, raw = store.redis.blpop([SEARCH_QUEUE], timeout=10) or (None, "{}")
        message = json.loads(raw)
        tasks.index_read.apply(args=json.loads(base64.b64decode(message["body"]))[0])

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        with TestClient(create_app(gateway_settings(redis_url))) as client:
            if patch is not None:
                return client.patch("/v1/indexes/docs", headers=ACME, json=patch)
            return client.get("/v1/indexes/docs", headers=ACME)
    finally:
        thread.join(10)
        base.set_context(None)


@pytest.mark.parametrize(
    ("failure", "status", "said"),
    [
        (BackendUnavailable("the search backend timed out"), 503, "backend_unavailable"),
        (TenantRemoved("acme"), 503, "tenant_removed"),
        (
            BackendRequestError("answered 400 (illegal_argument_exception)"),
            500,
            "backend_request_error",
        ),
        (BackendAccessRefused("answered 401 (security_exception)"), 500, "config_error"),
        (ConfigError("SIFT_ELASTICSEARCH_URL is wrong"), 500, "config_error"),
        (KeyError("a bug"), 500, "internal_error"),
    ],
)
def test_an_index_read_the_worker_failed_for_good_is_no_503(
    runtime: Runtime,
    store: JobStore,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    failure: Exception,
    status: int,
    said: str,
) -> None:
    """The gateway told every error of the worker but the job store's as ``503
    backend_unavailable`` ("retry"): an Elasticsearch 4xx, a refusal of Sift's credentials,
    a bug, each of which fails every retry too, so a client retried for ever. Each has the
    worker's type now, as a failed job's record has: a 503 only for what may pass
    (the backend down) and for a removed tenant's key (naming the removal); ``500`` for the
    rest, which no retry mends."""

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise failure

    monkeypatch.setattr(IndexSettingsStore, "read", fails)
    answer = _read_through_a_gateway(runtime, store, redis_url, monkeypatch)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["type"] == said, answer.text
    if said == "tenant_removed":
        assert "removed" in answer.json()["error"]["message"], answer.text
    if status == 500:
        assert "retry" not in answer.json()["error"]["message"], answer.text


def test_a_change_whose_worker_cannot_read_redis_s_clock_is_the_job_store_s_503(
    runtime: Runtime, store: JobStore, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's check of a change's ``start_by`` (Redis's ``TIME``) sat outside its
    error handling: a Redis failing it dropped the change with no answer, and the gateway
    waited out its 13 s to say "no worker answered", blaming the workers. The worker answers
    the job store's failure now, unapplied, as it does one met later in the read."""

    def down() -> float:
        raise redis.ConnectionError(LEAK)

    monkeypatch.setattr(store, "server_time", down)
    answer = _read_through_a_gateway(
        runtime, store, redis_url, monkeypatch, patch={"candidate_limit": 7}
    )
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["type"] == "unavailable", answer.text
    assert answer.headers.get("retry-after") == "1", answer.headers
    assert "10.0.0.5" not in answer.text, answer.text
    assert call(runtime, "show", "acme", "docs")["settings"]["candidate_limit"] is None


def test_an_answer_the_worker_cannot_send_is_logged(
    runtime: Runtime,
    store: JobStore,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The answer's own write is the one failure no answer can tell: the worker logs it,
    naming the read, and the task ends (its gateway answers 503 when its wait ends)."""
    from worker.queue import base, tasks

    def down(key: str, answer: str) -> None:
        raise redis.ConnectionError(LEAK)

    monkeypatch.setattr(store, "reply", down)
    _worker_context(runtime, store, redis_url, monkeypatch)
    try:
        with caplog.at_level("WARNING", logger="worker.queue.tasks.index_reads"):
            result = tasks.index_read.apply(args=["reply-lost", "show", "acme", "docs", ""])
    finally:
        base.set_context(None)
    assert result.successful(), result.traceback
    said = [r.getMessage() for r in caplog.records if r.name == "worker.queue.tasks.index_reads"]
    assert any("reply-lost" in m and "could not be sent" in m for m in said), said

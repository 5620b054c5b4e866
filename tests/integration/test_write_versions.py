"""A tenant's write versions count its own writes only: another tenant's ingests, deletes,
drops and settings changes are not visible in them.

The version is in every document a tenant reads back (``GET /v1/indexes/{index}/documents/
{id}``: ``version``). With one counter for the deployment, tenant B writing twice and
reading its document saw the versions jump by the number of writes every other tenant made
in between (9, then 13 after tenant A's three ingests): a count of another tenant's writes.
The order the backends keep is per tenant (per index, tenant and id; per index and tenant for
a drop and the settings), so one counter per tenant keeps every guarantee.
"""

from __future__ import annotations

from pathlib import Path

from worker.adapters.embedded import EmbeddedBackend
from worker.adapters.index_settings import IndexSettingsStore
from worker.constants import (
    LEGACY_WRITE_VERSION_KEY,
    LEGACY_WRITE_VERSION_WINDOW_SECONDS,
    WRITE_VERSION_KEY,
    WRITE_VERSION_TENANT_KEY,
)
from worker.contract import DocumentIn
from worker.core.types import Document
from worker.queue.jobstore import JobStore

# counters set this far on are ahead of the versions' floor, the server's clock in
# microseconds (until the year 2223), so the versions after them count one by one
AHEAD = 8 * 10**15


def ingest_version(store: JobStore, tenant: str) -> int:
    job = store.create_ingest(tenant, "shared", [DocumentIn(id="d1", text="hello")])
    assert job.version is not None
    return job.version


def test_another_tenants_writes_do_not_move_a_tenants_versions(
    store: JobStore, tmp_path: Path
) -> None:
    store.redis.set(WRITE_VERSION_TENANT_KEY + "globex", AHEAD)
    first = ingest_version(store, "globex")
    store.create_ingest("acme", "shared", [DocumentIn(id="d1", text="a")])
    store.create_deletion("acme", "shared", ["d1"])
    store.create_deletion("acme", "shared", None)
    IndexSettingsStore(EmbeddedBackend(tmp_path), store.redis).update(
        "shared", "acme", {"candidate_limit": 5}
    )
    assert ingest_version(store, "globex") == first + 1


def upgraded_long_ago(store: JobStore, shared: int) -> None:
    """The earlier release's last write (to ``shared``) was noticed more than the window ago."""
    now = int(store.redis.time()[0])
    store.redis.set(WRITE_VERSION_KEY, shared)
    seen = now - LEGACY_WRITE_VERSION_WINDOW_SECONDS - 1
    store.redis.hset(LEGACY_WRITE_VERSION_KEY, mapping={"mark": shared, "seen": seen})


def test_a_tenants_versions_go_on_from_the_deployments_shared_counter(store: JobStore) -> None:
    """Documents written before the per-tenant counters hold versions of the shared one: a
    tenant's first version is above it, or its new writes would lose to its old ones. Once
    no earlier release has written for the window, the shared counter stays where it is."""
    upgraded_long_ago(store, AHEAD + 1_000)
    assert ingest_version(store, "acme") == AHEAD + 1_001
    assert ingest_version(store, "globex") == AHEAD + 1_001
    assert store.create_deletion("acme", "shared", None).version == AHEAD + 1_002
    assert ingest_version(store, "initech") == AHEAD + 1_001


def test_a_write_accepted_after_one_of_an_earlier_release_gets_a_higher_version(
    store: JobStore,
) -> None:
    """During a rolling upgrade a gateway (or worker) of the earlier release still moves the
    shared counter: a write accepted after such a write, by an upgraded gateway, must get a
    higher version, or it would lose to the older write (a delete undone)."""
    first = ingest_version(store, "acme")
    store.redis.set(WRITE_VERSION_KEY, AHEAD + 40)  # an earlier release's gateway took ..40
    assert ingest_version(store, "acme") == AHEAD + 41 > first


def test_a_write_an_earlier_release_accepts_after_an_upgraded_one_comes_after_it(
    store: JobStore, tmp_path: Path
) -> None:
    """The other order of a rolling upgrade (deploy/k8s rolls the gateways one pod at a time):
    an upgraded gateway accepts an ingest of d1, then a gateway of the earlier release accepts
    its delete, numbering it as that release does (``INCR sift:write-version``). The delete
    must win. It took the ingest's very version (41, 41): the embedded backend skipped it as
    a run of a write already applied, and d1 stayed, searchable, its delete 'succeeded'."""
    store.redis.set(WRITE_VERSION_KEY, 40)  # an earlier release has been writing
    ingest = ingest_version(store, "acme")
    delete = int(store.redis.incr(WRITE_VERSION_KEY))  # the earlier release's gateway
    assert delete > ingest
    backend = EmbeddedBackend(tmp_path)
    try:
        backend.upsert("shared", "acme", [Document("d1", "hello")], None, version=ingest)
        assert backend.delete_documents("shared", "acme", ["d1"], version=delete) == 1
        assert backend.document("shared", "acme", "d1") is None
    finally:
        backend.close()


def test_while_an_earlier_release_may_run_versions_count_every_tenants_writes(
    store: JobStore,
) -> None:
    """The price of the order above, for the window after an earlier release's last write:
    the shared counter moves with every write, as it did before, so a tenant's versions do
    count the other tenants' writes; once the window is over they don't."""
    store.redis.set(WRITE_VERSION_KEY, AHEAD + 1_000)  # upgraded just now: no mark yet
    versions = [ingest_version(store, t) - AHEAD for t in ("acme", "globex", "acme")]
    assert versions == [1_001, 1_002, 1_003]
    assert int(store.redis.get(WRITE_VERSION_KEY) or 0) == AHEAD + 1_003
    upgraded_long_ago(store, AHEAD + 1_003)
    versions = [ingest_version(store, t) - AHEAD for t in ("acme", "globex", "acme")]
    assert versions == [1_004, 1_004, 1_005]
    store.redis.incr(WRITE_VERSION_KEY)  # an earlier release's process writes again: noticed
    assert [ingest_version(store, t) - AHEAD for t in ("globex", "acme")] == [1_005, 1_006]


def test_a_write_accepted_after_redis_lost_the_counters_is_newer_than_those_before(
    store: JobStore,
) -> None:
    """Redis back without its data (no persistence, or an AOF's last second lost): the
    counters start again, and the versions must still be above those handed out before,
    which the backend holds on disk (tests/reliability/test_redis_wiped.py, end to end)."""
    before = [ingest_version(store, "acme") for _ in range(3)]
    assert before == sorted(set(before))
    store.redis.flushdb()
    assert ingest_version(store, "acme") > before[-1]

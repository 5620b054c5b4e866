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

from worker.adapters.index_settings import RedisIndexSettings
from worker.constants import WRITE_VERSION_KEY
from worker.contract import DocumentIn
from worker.queue.jobstore import JobStore


def ingest_version(store: JobStore, tenant: str) -> int:
    job = store.create_ingest(tenant, "shared", [DocumentIn(id="d1", text="hello")])
    assert job.version is not None
    return job.version


def test_another_tenants_writes_do_not_move_a_tenants_versions(store: JobStore) -> None:
    first = ingest_version(store, "globex")
    store.create_ingest("acme", "shared", [DocumentIn(id="d1", text="a")])
    store.create_deletion("acme", "shared", ["d1"])
    store.create_deletion("acme", "shared", None)
    RedisIndexSettings(store.redis).update("shared", "acme", {"candidate_limit": 5})
    assert ingest_version(store, "globex") == first + 1


def test_a_tenants_versions_go_on_from_the_deployments_shared_counter(store: JobStore) -> None:
    """Documents written before the per-tenant counters hold versions of the shared one: a
    tenant's first version is above it, or its new writes would lose to its old ones."""
    store.redis.set(WRITE_VERSION_KEY, 1_000)
    assert ingest_version(store, "acme") == 1_001
    assert ingest_version(store, "globex") == 1_001
    assert store.create_deletion("acme", "shared", None).version == 1_002
    assert ingest_version(store, "initech") == 1_001


def test_a_write_accepted_after_one_of_an_earlier_release_gets_a_higher_version(
    store: JobStore,
) -> None:
    """During a rolling upgrade a gateway (or worker) of the earlier release still moves the
    shared counter: a write accepted after such a write, by an upgraded gateway, must get a
    higher version, or it would lose to the older write (a delete undone)."""
    assert ingest_version(store, "acme") == 1
    store.redis.set(WRITE_VERSION_KEY, 40)  # an earlier release's gateway took 2..40
    assert ingest_version(store, "acme") == 41

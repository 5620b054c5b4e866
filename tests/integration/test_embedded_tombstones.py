"""The embedded backend's tombstones last the broker's redelivery window, no longer, and a
dropped index's vectors leave every process's memory: what a delete leaves behind is bounded,
and a delete accepted after an ingest still wins, whichever runs first, right up to the end
of that window. SQLite on disk, the backend at its defaults, its clock the test's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from worker.adapters.embedded import TOMBSTONE_SECONDS, EmbeddedBackend, _writes
from worker.core.types import ChannelQuery, Document, HardFilters
from worker.errors import IndexNotFound
from worker.queue.config import ingest_redelivery_window
from worker.runtime.bootstrap import build_backend
from worker.settings import Settings

pytestmark = pytest.mark.integration

VECTORS = np.eye(3, 8, dtype=np.float32) + 0.1


class Clock:
    """``time.time`` for the backend's writes, moved by the test alone."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    held = Clock()
    monkeypatch.setattr(_writes, "time", held)
    return held


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[EmbeddedBackend]:
    opened = EmbeddedBackend(tmp_path)
    yield opened
    opened.close()


def docs(prefix: str, n: int = 3) -> list[Document]:
    return [Document(f"{prefix}{i}", f"vitamin words {prefix} {i}") for i in range(n)]


def tombstones(backend: EmbeddedBackend) -> int:
    """The ``writes`` rows that record a delete (each id's, kept to order it)."""
    with backend._conn() as conn:
        return int(conn.execute("SELECT count(*) FROM writes WHERE deleted != 0").get)


def test_tombstones_are_let_go_once_the_redelivery_window_is_over(
    backend: EmbeddedBackend, clock: Clock
) -> None:
    """An index whose documents are written and deleted by id, round after round (a feed of
    short-lived documents), an hour between rounds: each deleted id's tombstone stayed for
    good (the index held three documents at a time and 3 x 12 tombstones a day on), where it
    is needed only while an ingest accepted before its delete can still run."""
    version = 0
    hours = 3 * TOMBSTONE_SECONDS // 3600  # three windows' worth of rounds
    for hour in range(hours):
        written = docs(f"r{hour}-")
        version += 1
        assert backend.upsert("sci", "acme", written, VECTORS, version=version) == 3
        version += 1
        assert backend.delete_documents("sci", "acme", [d.id for d in written], version=version)
        clock.now += 3600
    # the tombstones of the last window's rounds are kept, the older ones let go
    assert tombstones(backend) <= 3 * (TOMBSTONE_SECONDS // 3600 + 1)
    with backend._conn() as conn:
        assert int(conn.execute("SELECT count(*) FROM tombstones").get) == tombstones(backend)


@pytest.mark.parametrize("delete_runs_first", [True, False])
def test_a_delete_accepted_after_an_ingest_wins_right_up_to_the_end_of_the_window(
    backend: EmbeddedBackend, clock: Clock, delete_runs_first: bool
) -> None:
    """The ingest (version 10) and the delete of its ids (version 11, accepted after it) run
    in either order; run after the delete, the ingest is redelivered as late as the window
    allows, other writes (which collect expired tombstones) running meanwhile. The delete
    wins: its ids stay deleted, the other documents stay."""
    ingest = docs("d")
    if not delete_runs_first:
        assert backend.upsert("sci", "acme", ingest, VECTORS, version=10) == 3
    backend.delete_documents("sci", "acme", ["d0", "d1"], version=11)
    deleted_at = clock.now
    for step, late in enumerate((1.0, TOMBSTONE_SECONDS / 2, TOMBSTONE_SECONDS - 1.0)):
        clock.now = deleted_at + late
        backend.upsert("other", "acme", docs(f"o{step}-", 1), VECTORS[:1], version=20 + step)
    clock.now = deleted_at + TOMBSTONE_SECONDS  # the last moment of the window
    backend.upsert("other", "acme", docs("o9-", 1), VECTORS[:1], version=30)
    assert backend.upsert("sci", "acme", ingest, VECTORS, version=10) == (
        1 if delete_runs_first else 3  # (run again, it reports what its first run wrote)
    )
    assert backend.document("sci", "acme", "d0") is None
    assert backend.document("sci", "acme", "d1") is None
    assert backend.document("sci", "acme", "d2") is not None


def test_the_backend_as_a_worker_builds_it_keeps_tombstones_past_the_redelivery_window(
    tmp_path: Path,
) -> None:
    """At the defaults the tombstones outlast every redelivery of an ingest accepted before
    the delete; SIFT_ELASTICSEARCH_GC_DELETES_SECONDS, raised with the window (the worker
    warns at start when it is shorter), keeps them longer, as on Elasticsearch."""
    settings = Settings(data_dir=tmp_path)
    built = build_backend(settings)
    assert isinstance(built, EmbeddedBackend)
    assert built.tombstone_seconds == TOMBSTONE_SECONDS >= ingest_redelivery_window(settings)
    longer = Settings(data_dir=tmp_path, elasticsearch_gc_deletes_seconds=90_000)
    assert getattr(build_backend(longer), "tombstone_seconds", None) == 90_000


def test_an_unversioned_drop_leaves_no_write_record_of_its_documents(
    backend: EmbeddedBackend,
) -> None:
    """A drop without a version (the backend called directly; every job's has one) removed
    the documents but kept each one's ``writes`` row for good."""
    backend.upsert("sci", "acme", docs("d"), VECTORS)
    backend.delete_documents("sci", "acme", ["d0"])
    assert backend.delete_index("sci", "acme") == 2
    with backend._conn() as conn:
        assert conn.execute("SELECT count(*) FROM writes").get == 0


def test_a_drop_takes_the_tombstones_below_it_and_their_dates(backend: EmbeddedBackend) -> None:
    """A drop's floor refuses every write accepted before it, so the tombstones below it go
    with it, and the ids they name (a purged tenant's among them): only a delete accepted
    after the drop keeps its tombstone, and its date."""
    backend.upsert("sci", "acme", docs("d"), VECTORS, version=10)
    backend.delete_documents("sci", "acme", ["d0", "d1"], version=12)
    backend.delete_documents("sci", "acme", ["d2"], version=15)  # accepted after the drop
    assert backend.delete_index("sci", "acme", version=14) == 0
    with backend._conn() as conn:
        assert conn.execute("SELECT id FROM writes").fetchall() == [("d2",)]
        assert conn.execute("SELECT id FROM tombstones").fetchall() == [("d2",)]
    assert backend.upsert("sci", "acme", docs("d"), VECTORS, version=13) == 0  # the floor


def test_tombstones_an_earlier_release_wrote_go_a_window_after_the_upgrade(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data dir from before the ``tombstones`` table (its tombstones undated): the first
    open dates them, so they still refuse an older ingest for a window, then go."""
    from worker.adapters.embedded import _pool

    monkeypatch.setattr(_pool, "time", clock)
    earlier = EmbeddedBackend(tmp_path)
    earlier.upsert("sci", "acme", docs("d"), VECTORS, version=10)
    earlier.delete_documents("sci", "acme", ["d0", "d1"], version=11)
    with earlier._conn() as conn:
        conn.execute("DROP TABLE tombstones")  # as an earlier release left it
    earlier.close()
    clock.now += 10 * TOMBSTONE_SECONDS
    upgraded = EmbeddedBackend(tmp_path)
    try:
        assert upgraded.upsert("sci", "acme", docs("d"), VECTORS, version=9) == 0
        assert tombstones(upgraded) == 2
        clock.now += TOMBSTONE_SECONDS + 1
        upgraded.upsert("other", "acme", docs("o", 1), VECTORS[:1], version=12)
        assert tombstones(upgraded) == 0
    finally:
        upgraded.close()


def knn(backend: EmbeddedBackend, index: str) -> None:
    query = ChannelQuery(index, HardFilters("acme"), ("knn",), 10, "vitamin", vector=VECTORS[0])
    backend.retrieve(query)


def test_a_dropped_index_s_vectors_leave_the_memory_of_a_process_that_searched_it(
    tmp_path: Path,
) -> None:
    """Worker process A searched two indexes (their vectors loaded into its memory); process
    B drops one. A kept the dropped index's vectors in memory for as long as it lived
    (150 MB for 100,000 documents at 384 dimensions) unless it searched that name again;
    its next kNN search of any index lets them go."""
    a, b = EmbeddedBackend(tmp_path), EmbeddedBackend(tmp_path)
    try:
        a.upsert("sci", "acme", docs("d"), VECTORS, version=1)
        a.upsert("other", "acme", docs("o"), VECTORS, version=2)
        knn(a, "sci")
        knn(a, "other")
        assert set(a._vectors) == {("sci", "acme"), ("other", "acme")}
        assert b.delete_index("sci", "acme", version=3) == 3
        knn(a, "other")
        assert set(a._vectors) == {("other", "acme")}
        b.delete_documents("other", "acme", ["o0", "o1", "o2"], version=4)  # emptied by ids
        with pytest.raises(IndexNotFound):
            knn(b, "other")
        assert a.upsert("third", "acme", docs("t"), VECTORS, version=5) == 3
        knn(a, "third")
        assert set(a._vectors) == {("third", "acme")}
    finally:
        a.close()
        b.close()

"""The embedded backend's connections and schema, for real (SQLite on disk): a pool bounded
by the operations in flight at once, fork safety, and a drop that takes its FTS5 table."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import apsw
import numpy as np
import pytest

from worker.adapters.embedded import DB_FILE, EmbeddedBackend
from worker.contract import Channel
from worker.core.types import ChannelQuery, Document, HardFilters
from worker.errors import IndexNotFound

pytestmark = pytest.mark.integration

BOTH: tuple[Channel, ...] = ("bm25", "knn")


def fts_tables(data_dir: Path) -> set[str]:
    """The FTS5 tables in the data dir's schema, read on a connection of the test's own."""
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        return {
            name
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE sql LIKE 'CREATE VIRTUAL TABLE%'"
            )
        }
    finally:
        conn.close()


def open_files(data_dir: Path) -> int:
    """This process's file descriptors on the database file: one per open connection."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, closed by now
            found += os.readlink(f"/proc/self/fd/{fd}") == str(data_dir / DB_FILE)
    return found


def num_of(data_dir: Path, index: str, tenant: str) -> tuple[int, int]:
    """The tenant's index's number and generation."""
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        row = conn.execute(
            "SELECT num, generation FROM indexes WHERE name = ? AND tenant = ?", (index, tenant)
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])
    finally:
        conn.close()


def test_many_threads_search_and_write_correctly_on_as_many_connections_as_run_at_once(
    tmp_path: Path,
) -> None:
    """64 threads, at most 4 of them in the backend at once (as a worker's CPU slots let
    them), each writing its own tenant's first documents (a schema change each) and
    searching them; then 64 more threads one after another."""
    backend = EmbeddedBackend(tmp_path)
    rng = np.random.default_rng(5)
    vectors = rng.normal(size=(64, 8)).astype(np.float32)
    slots = threading.BoundedSemaphore(4)
    backend.upsert("sci", "seed", [Document("seed", "shared words")], vectors[:1])

    def work(k: int) -> list[str]:
        tenant = f"t{k}"
        found: list[str] = []
        for i in range(3):
            with slots:
                doc = Document(f"{tenant}-{i}", f"shared words of tenant {k}")
                assert backend.upsert("sci", tenant, [doc], vectors[k : k + 1]) == 1
            with slots:
                query = ChannelQuery(
                    "sci", HardFilters(tenant), BOTH, 10, "shared words", vector=vectors[k]
                )
                results = backend.retrieve(query)
            found = sorted({h.document.id for c in BOTH for h in results.hits[c]})
        return found

    with ThreadPoolExecutor(max_workers=64) as pool:
        found = list(pool.map(work, range(64)))
    assert found == [[f"t{k}-{i}" for i in range(3)] for k in range(64)]
    assert 1 <= len(backend._connections) <= 4
    opened = list(backend._connections)

    def one(k: int) -> int:
        return backend.count("sci", f"t{k}")

    for k in range(64):  # a new thread each time: no connection of its own any more
        with ThreadPoolExecutor(max_workers=1) as pool:
            assert pool.submit(one, k).result() == 3
    assert backend._connections == opened
    assert open_files(tmp_path) == len(opened)
    backend.close()
    assert backend._connections == []


def test_a_connection_left_in_a_transaction_is_closed_not_lent_again(tmp_path: Path) -> None:
    backend = EmbeddedBackend(tmp_path)
    with backend._conn() as first:
        first.execute("BEGIN")  # as a failed ROLLBACK would leave it
    assert first not in backend._connections
    with pytest.raises(apsw.ConnectionClosedError):
        first.execute("SELECT 1")
    backend.upsert("sci", "acme", [Document("a", "words")], None)
    assert backend.count("sci", "acme") == 1
    (second,) = backend._connections
    with backend._conn() as again:
        assert again is second  # one given back clean is lent again
    backend.close()


def test_a_forked_child_opens_its_own_connections_and_leaves_the_parents_alone(
    tmp_path: Path,
) -> None:
    backend = EmbeddedBackend(tmp_path)
    backend.upsert("sci", "acme", [Document("a", "parent words")], None)
    (parent_conn,) = backend._connections
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            backend.upsert("sci", "acme", [Document("b", "child words")], None)
            query = ChannelQuery("sci", HardFilters("acme"), ("bm25",), 10, "words")
            hits = {h.document.id for h in backend.retrieve(query).hits["bm25"]}
            mine = list(backend._connections)
            backend.close()  # closes the child's own only
            ok = hits == {"a", "b"} and len(mine) == 1 and mine[0] is not parent_conn
            os.write(write, b"ok" if ok else repr((hits, mine)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read()
    assert os.waitstatus_to_exitcode(status) == 0 and said == b"ok", said
    # The parent's connection is still open and still its own, and sees the child's write.
    assert backend._connections == [parent_conn]
    assert backend.count("sci", "acme") == 2
    backend.close()


def test_a_drop_that_empties_a_tenants_index_drops_its_fts5_table(tmp_path: Path) -> None:
    backend = EmbeddedBackend(tmp_path)
    other = EmbeddedBackend(tmp_path)  # another process's connections, in effect
    vectors = np.eye(3, 8, dtype=np.float32) + 0.1
    docs = [Document(f"d{i}", f"vitamin words {i}") for i in range(3)]
    for tenant in ("acme", "globex"):
        backend.upsert("sci", tenant, docs, vectors)
    acme, generation = num_of(tmp_path, "sci", "acme")
    globex, _ = num_of(tmp_path, "sci", "globex")
    assert {f"fts_{acme}", f"fts_{globex}"} <= fts_tables(tmp_path)

    def search(backend: EmbeddedBackend, tenant: str) -> dict[Channel, list[str]]:
        query = ChannelQuery("sci", HardFilters(tenant), BOTH, 10, "vitamin", vector=vectors[0])
        return {
            c: [h.document.id for h in hits] for c, hits in backend.retrieve(query).hits.items()
        }

    assert search(other, "acme")["bm25"]  # its BM25 statement on fts_{acme}, prepared and cached
    # A versioned drop that leaves a later document keeps the table.
    backend.upsert("sci", "acme", [Document("late", "vitamin late")], vectors[:1], version=10)
    assert backend.delete_index("sci", "acme", version=5) == 3
    assert f"fts_{acme}" in fts_tables(tmp_path)
    assert search(other, "acme")["bm25"] == ["late"]
    assert backend.delete_index("sci", "acme") == 1
    tables = fts_tables(tmp_path)
    assert f"fts_{acme}" not in tables and f"fts_{globex}" in tables
    # The other connections' next search: the answer a name nobody has gets (IndexNotFound),
    # not another error (no such table).
    for reader in (other, backend):
        with pytest.raises(IndexNotFound):
            search(reader, "acme")
        assert reader.channels("sci", "acme") == frozenset()
        assert set(search(reader, "globex")["bm25"]) == {"d0", "d1", "d2"}
    # The search that found the index gone let go of its vectors.
    assert ("sci", "acme") not in other._vectors and ("sci", "globex") in other._vectors
    # The index's row stays, its generation still counting; a re-ingest makes the table again.
    again, later = num_of(tmp_path, "sci", "acme")
    assert again == acme and later > generation
    backend.upsert("sci", "acme", docs[:2], vectors[:2])
    assert f"fts_{acme}" in fts_tables(tmp_path)
    for reader in (other, backend):
        assert set(search(reader, "acme")["bm25"]) == {"d0", "d1"}
        assert reader.count("sci", "acme") == 2
    backend.close()
    other.close()

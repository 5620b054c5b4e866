"""The embedded backend's answers at the edges of an index's life, for real (SQLite on disk,
and a second process writing): a tenant's index exists while it holds one of the tenant's
documents, so every way of having none (never written, only another tenant's, dropped,
every document deleted by id, a drop racing the search) answers as a name nobody has."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import apsw
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.test_embedded_connections import fts_tables
from worker.adapters.embedded import EmbeddedBackend, _writes
from worker.contract import Channel
from worker.core.catalog import IndexSize
from worker.core.types import ChannelQuery, ChannelResults, Document, HardFilters
from worker.errors import IndexLimitReached, IndexNotFound, ModeUnavailable

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
BOTH: tuple[Channel, ...] = ("bm25", "knn")
VECTORS = np.eye(3, 8, dtype=np.float32) + 0.1
DOCS = [Document(f"d{i}", f"vitamin words {i}") for i in range(3)]
ASKS: tuple[tuple[Channel, ...], ...] = (("bm25",), ("knn",), BOTH)


def retrieve(
    backend: EmbeddedBackend, tenant: str, channels: tuple[Channel, ...] = BOTH, index: str = "sci"
) -> ChannelResults:
    vector = VECTORS[0] if "knn" in channels else None
    return backend.retrieve(
        ChannelQuery(index, HardFilters(tenant), channels, 10, "vitamin", vector=vector)
    )


def not_found_words(backend: EmbeddedBackend, tenant: str, index: str) -> set[str]:
    """What each channel set's search answers, the index name blanked: one set of words."""
    words = set()
    for channels in ASKS:
        with pytest.raises(IndexNotFound) as caught:
            retrieve(backend, tenant, channels, index)
        words.add(caught.value.message.replace(repr(index), "NAME"))
    return words


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[EmbeddedBackend]:
    opened = EmbeddedBackend(tmp_path)
    yield opened
    opened.close()


def test_a_name_only_another_tenant_has_answers_retrieve_as_one_nobody_has(
    backend: EmbeddedBackend,
) -> None:
    backend.upsert("sci", "acme", DOCS, VECTORS)
    nobody = not_found_words(backend, "beta", "nobody")
    assert len(nobody) == 1
    assert not_found_words(backend, "beta", "sci") == nobody


@pytest.mark.parametrize("neighbour", ["none", "vectors", "text only"])
def test_a_search_after_its_tenants_drop_answers_not_found_whatever_others_hold(
    tmp_path: Path, neighbour: str
) -> None:
    """The tenant's ``indexes`` row outlives the drop (its generation keeps counting), so
    this is the state a search racing a drop meets: it must not depend on another tenant."""
    backend = EmbeddedBackend(tmp_path)
    backend.upsert("sci", "acme", DOCS, VECTORS)
    if neighbour != "none":
        backend.upsert("sci", "globex", DOCS, VECTORS if neighbour == "vectors" else None)
    retrieve(backend, "acme")  # warm: a cached vector block and prepared statements
    assert backend.delete_index("sci", "acme") == len(DOCS)
    assert not_found_words(backend, "acme", "sci") == not_found_words(backend, "acme", "nobody")
    backend.close()


@pytest.mark.parametrize("neighbour_vectors", [False, True])
def test_knn_without_the_tenants_own_vectors_is_unavailable_whatever_others_hold(
    tmp_path: Path, neighbour_vectors: bool
) -> None:
    backend = EmbeddedBackend(tmp_path)
    backend.upsert("sci", "acme", DOCS, None)
    backend.upsert("sci", "globex", DOCS, VECTORS if neighbour_vectors else None)
    assert retrieve(backend, "acme", ("bm25",)).hits["bm25"]
    with pytest.raises(ModeUnavailable, match="holds no vectors"):
        retrieve(backend, "acme", ("knn",))
    backend.close()


def test_a_warm_search_finds_the_tenants_index_in_one_statement(
    backend: EmbeddedBackend,
) -> None:
    """The index's number, its generation and whether the tenant holds a document come
    from one statement: no second lookup (a seek of its own) before the channels run."""
    backend.upsert("sci", "acme", DOCS, VECTORS)
    for channels in ASKS:
        retrieve(backend, "acme", channels)  # warm: documents and vectors cached
    (conn,) = backend._connections
    ran: list[str] = []

    def tracer(cursor: apsw.Cursor, sql: str, bindings: object) -> bool:
        ran.append(sql.split()[0].upper())
        return True

    conn.exec_trace = tracer
    for channels, expected in (
        (("bm25",), ["BEGIN", "SELECT", "SELECT", "COMMIT"]),  # the lookup, the BM25 query
        (("knn",), ["BEGIN", "SELECT", "COMMIT"]),  # the lookup; the scan is in memory
    ):
        ran.clear()
        assert retrieve(backend, "acme", channels).hits[channels[0]]
        assert ran == expected, channels


def test_deleting_every_document_by_id_ends_the_index_as_a_drop_does(
    tmp_path: Path, backend: EmbeddedBackend
) -> None:
    """No FTS5 table, no listing, no count, no channels, no recorded model or dimension:
    the same as after a drop; the other tenant's index untouched; the name usable again,
    with another model and dimension; a drop of the emptied name still answers."""
    other = EmbeddedBackend(tmp_path)  # another process's connections, in effect
    for tenant in ("acme", "globex"):
        backend.upsert("sci", tenant, DOCS, VECTORS, model="m-1")
    assert retrieve(other, "acme").hits["bm25"]  # its statement on the FTS5 table, cached
    before = fts_tables(tmp_path)
    assert backend.delete_documents("sci", "acme", ["d0", "d1"]) == 2
    assert fts_tables(tmp_path) == before  # one document left: the table stays
    assert backend.probe("sci", "acme").model == "m-1"
    assert backend.delete_documents("sci", "acme", ["d2", "never"]) == 1

    (gone,) = before - fts_tables(tmp_path)
    assert len(before) == 2
    for reader in (backend, other):
        assert reader.count("sci", "acme") == 0
        assert reader.index_info("sci", "acme") is None
        assert "sci" not in {info.name for info in reader.indexes("acme")}
        assert reader.channels("sci", "acme") == frozenset()
        assert not_found_words(reader, "acme", "sci") == not_found_words(reader, "acme", "nobody")
        assert {h.document.id for h in retrieve(reader, "globex").hits["knn"]} == {"d0", "d1", "d2"}
    info = backend.index_info("sci", "globex")
    assert info is not None and (info.documents, info.model, info.dimension) == (3, "m-1", 8)

    wide = np.eye(2, 4, dtype=np.float32) + 0.1
    assert backend.upsert("sci", "acme", DOCS[:2], wide, model="m-2") == 2  # no mismatch
    assert gone in fts_tables(tmp_path)
    info = other.index_info("sci", "acme")
    assert info is not None and (info.documents, info.model, info.dimension) == (2, "m-2", 4)
    assert {h.document.id for h in retrieve(other, "acme", ("bm25",)).hits["bm25"]} == {"d0", "d1"}
    assert backend.delete_documents("sci", "acme", ["d0", "d1"]) == 2
    assert gone not in fts_tables(tmp_path)
    assert backend.delete_index("sci", "acme") == 0  # a drop of the emptied name: nothing left
    assert backend.count("sci", "acme") == 0 and backend.count("sci", "globex") == 3
    other.close()


def test_searches_racing_drops_in_another_process_answer_hits_or_not_found(
    tmp_path: Path,
) -> None:
    """A writer process fills and empties the tenant's index (drops, and deletes by id) as
    fast as it can; this process probes then searches, as the pipeline does. A search whose
    probe saw documents the writer removed before its query must answer IndexNotFound (the
    words a name nobody has gets), never another error, never another tenant's answer."""
    backend = EmbeddedBackend(tmp_path)
    backend.upsert("sci", "acme", DOCS, VECTORS)
    stop = tmp_path / "stop"
    writer = textwrap.dedent(
        f"""
        from pathlib import Path
        import numpy as np
        from worker.adapters.embedded import EmbeddedBackend
        from worker.core.types import Document
        backend = EmbeddedBackend(Path({str(tmp_path)!r}))
        docs = [Document(f"d{{i}}", f"vitamin words {{i}}") for i in range(3)]
        vectors = np.eye(3, 8, dtype=np.float32) + 0.1
        stop = Path({str(stop)!r})
        for cycle in range(20_000):
            if stop.exists():
                break
            backend.upsert("sci", "acme", docs, vectors)
            if cycle % 2:
                backend.delete_index("sci", "acme")
            else:
                backend.delete_documents("sci", "acme", [d.id for d in docs])
        """
    )
    process = subprocess.Popen([sys.executable, "-c", writer], cwd=REPO_ROOT)
    nobody = not_found_words(backend, "acme", "nobody")
    raced = found = 0
    try:
        while process.poll() is None and raced < 10:
            if not backend.channels("sci", "acme"):
                continue
            try:
                results = retrieve(backend, "acme")
            except IndexNotFound as exc:
                assert exc.message.replace("'sci'", "NAME") in nobody
                raced += 1
            else:
                found += 1
                for channel in BOTH:  # the writer always writes all three, with vectors
                    assert {h.document.id for h in results.hits[channel]} == {"d0", "d1", "d2"}
    finally:
        stop.touch()
        process.wait(timeout=60)
    assert process.returncode == 0
    assert raced and found, (raced, found)
    backend.close()


def test_a_delete_run_again_reports_the_documents_its_first_run_deleted(
    backend: EmbeddedBackend,
) -> None:
    """A delete job's worker killed after the delete's commit but before its job record
    moved: the redelivered task runs the delete again with its own version, which finds
    nothing left to delete and changes nothing. It reports what its first run deleted (as
    an upsert run again reports what it wrote), so the job's ``deleted`` matches the
    documents that went: the id that never existed is not counted, and one a newer write
    has taken since still is (the first run deleted it)."""
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=10) == 3
    assert backend.delete_documents("sci", "acme", ["d0", "d1", "nope"], version=11) == 2
    assert backend.delete_documents("sci", "acme", ["d0", "d1", "nope"], version=11) == 2
    assert backend.upsert("sci", "acme", DOCS[:1], VECTORS[:1], version=12) == 1
    assert backend.delete_documents("sci", "acme", ["d0", "d1", "nope"], version=11) == 2
    assert backend.document("sci", "acme", "d0") is not None
    assert backend.document("sci", "acme", "d1") is None
    # the last documents: the index goes with them, the count stays
    assert backend.delete_documents("sci", "acme", ["d0", "d2"], version=13) == 2
    assert backend.index_info("sci", "acme") is None
    assert backend.delete_documents("sci", "acme", ["d0", "d2"], version=13) == 2
    assert backend.index_info("sci", "acme") is None


def test_a_drop_run_again_reports_the_documents_its_first_run_deleted(
    backend: EmbeddedBackend,
) -> None:
    """A drop's worker killed after the drop's commit, before its job record moved: the
    redelivered drop changes nothing and reports what its first run deleted, whatever ran
    since: a document written by a newer ingest stays and is not taken, and a newer drop
    does not change the older one's count."""
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=10) == 3
    assert backend.delete_index("sci", "acme", version=11) == 3
    assert backend.delete_index("sci", "acme", version=11) == 3
    assert backend.upsert("sci", "acme", DOCS[:1], VECTORS[:1], version=12) == 1
    assert backend.delete_index("sci", "acme", version=11) == 3
    assert backend.document("sci", "acme", "d0") is not None
    assert backend.delete_index("sci", "acme", version=13) == 1
    assert backend.delete_index("sci", "acme", version=11) == 3
    assert backend.delete_index("sci", "acme", version=13) == 1
    assert backend.index_info("sci", "acme") is None


def test_an_ingest_run_again_reports_what_its_first_run_wrote(
    backend: EmbeddedBackend,
) -> None:
    """The review's case: an ingest's worker killed right after its commit, a delete of its
    ids accepted and run, then the ingest redelivered. It changes nothing (the delete, accepted
    later, wins) and reports the documents its first run wrote, not the ids it still holds."""
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=10) == 3
    assert backend.delete_documents("sci", "acme", ["d0", "d1"], version=11) == 2
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=10) == 3
    assert backend.document("sci", "acme", "d0") is None
    assert backend.delete_index("sci", "acme", version=12) == 1
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=10) == 3
    assert backend.index_info("sci", "acme") is None
    # a stale write's count stays what it was: none
    assert backend.upsert("sci", "acme", DOCS[:1], VECTORS[:1], version=9) == 0
    assert backend.upsert("sci", "acme", DOCS[:1], VECTORS[:1], version=9) == 0


class Clock:
    """``time.time`` for the backend's writes: each reading a second after the last, so a
    write that stamps ``last_write`` is told apart from one that does not."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def time(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    ticking = Clock()
    monkeypatch.setattr(_writes, "time", ticking)
    return ticking


def last_write(backend: EmbeddedBackend, tenant: str = "acme") -> float | None:
    info = backend.index_info("sci", tenant)
    assert info is not None
    return info.last_write


def test_a_write_that_changes_no_document_leaves_the_last_write(
    backend: EmbeddedBackend, clock: Clock
) -> None:
    """``last_write_at`` is the caller's last applied write. An upsert accepted before a
    delete of its ids and run after it writes nothing (a newer write holds each id), nor
    does an upsert or a drop run again (a redelivery after its commit): none moves it, as a
    delete that found nothing does not. Each did: the listing showed a write at the time a
    stale job ran, after the delete that had won over it."""
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=10) == 3
    assert backend.delete_documents("sci", "acme", ["d0", "d9"], version=12) == 1
    stamped = last_write(backend)
    assert backend.upsert("sci", "acme", DOCS[:1], VECTORS[:1], version=11) == 0  # stale
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=10) == 3  # run again
    assert backend.delete_documents("sci", "acme", ["d9"], version=13) == 0
    assert last_write(backend) == stamped
    assert backend.upsert("sci", "acme", DOCS[:1], VECTORS[:1], version=15) == 1
    written = last_write(backend)
    assert written is not None and stamped is not None and written > stamped
    # a drop accepted before that upsert, run after it: the upsert's document stays
    assert backend.delete_index("sci", "acme", version=14) == 2
    dropped = last_write(backend)
    assert dropped is not None and dropped > written
    assert backend.delete_index("sci", "acme", version=14) == 2  # run again
    assert last_write(backend) == dropped


def test_an_upsert_that_writes_nothing_leaves_a_dropped_index_gone(
    backend: EmbeddedBackend, tmp_path: Path
) -> None:
    """A drop takes the tenant's index's FTS5 table with its last document; an upsert
    accepted before the drop and run after it writes nothing, so it must not make the
    table again (every connection of every worker parses and holds each table's schema;
    it was made again, empty, for as long as the tenant wrote nothing there)."""
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=10) == 3
    assert backend.delete_index("sci", "acme", version=12) == 3
    assert fts_tables(tmp_path) == set()
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=11) == 0
    assert fts_tables(tmp_path) == set()
    assert backend.indexes("acme") == []
    assert backend.upsert("sci", "acme", DOCS[:1], VECTORS[:1], version=13) == 1
    assert len(fts_tables(tmp_path)) == 1


def test_a_drops_record_is_the_tenants_own(backend: EmbeddedBackend) -> None:
    """The record a drop keeps (the empty id in ``writes``) is per tenant: another tenant's
    drop of the same name, newer, neither replaces it nor is counted by it, and it is
    never a document, an index or part of a count."""
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=10) == 3
    assert backend.upsert("sci", "beta", DOCS[:1], VECTORS[:1], version=11) == 1
    assert backend.delete_index("sci", "acme", version=12) == 3
    assert backend.delete_index("sci", "beta", version=13) == 1
    assert backend.delete_index("sci", "acme", version=12) == 3
    assert backend.delete_index("sci", "beta", version=13) == 1
    assert backend.document("sci", "acme", "") is None
    assert backend.count("sci", "acme") == 0
    assert backend.indexes("acme") == []
    assert backend.delete_documents("sci", "acme", [""], version=14) == 0
    assert backend.delete_index("sci", "acme", version=12) == 3  # the delete left it alone


def test_a_page_of_documents_is_a_seek_on_the_unique_key_not_a_scan(
    backend: EmbeddedBackend,
) -> None:
    """``GET /v1/indexes/{index}/documents``'s query: a range search of ``docs``'s unique
    (idx, tenant, id) index from the cursor, read in that index's order (no sort step, no
    scan of any table), then a seek per row on ``bodies`` and ``writes``. So a page costs its
    own rows wherever it starts. Measured once (CPU per 100-document page, 100,000 documents
    of one tenant, load 0.7 on 2 cores): 0.27 ms from the last id but 100, 0.28 ms from the
    start; an ``OFFSET 99900`` page of the same query, 56 ms (it steps over every row)."""
    from worker.adapters.embedded._listing import DOCUMENTS_PAGE

    backend.upsert("sci", "acme", DOCS, VECTORS)
    with backend._conn() as conn:
        plan = [
            str(row[3])
            for row in conn.execute(
                f"EXPLAIN QUERY PLAN {DOCUMENTS_PAGE}", ("sci", "acme", "d0", 2)
            )
        ]
    assert plan == [
        "SEARCH d USING INDEX sqlite_autoindex_docs_1 (idx=? AND tenant=? AND id>?)",
        "SEARCH b USING INTEGER PRIMARY KEY (rowid=?)",
        "SEARCH w USING PRIMARY KEY (idx=? AND tenant=? AND id=?) LEFT-JOIN",
    ]
    assert [d.id for d in backend.documents("sci", "acme", "d0", 2) or []] == ["d1", "d2"]


def test_stored_documents_are_a_seek_per_id_not_a_scan(backend: EmbeddedBackend) -> None:
    """An economy item's finish reads its candidates (up to a few hundred ids) in one
    statement: a seek on ``docs``'s unique (idx, tenant, id) index per id of the JSON array,
    then one on ``bodies`` and ``writes``; no scan of the tenant's documents."""
    from worker.adapters.embedded._listing import STORED_DOCUMENTS

    backend.upsert("sci", "acme", DOCS, VECTORS)
    with backend._conn() as conn:
        plan = [
            str(row[3])
            for row in conn.execute(
                f"EXPLAIN QUERY PLAN {STORED_DOCUMENTS}", ("sci", "acme", '["d0", "d2"]')
            )
        ]
    assert plan[:2] == [
        "SEARCH d USING INDEX sqlite_autoindex_docs_1 (idx=? AND tenant=? AND id=?)",
        "LIST SUBQUERY 1",
    ], plan
    assert "SCAN d" not in " ".join(plan)
    assert sorted(backend.stored_documents("sci", "acme", ["d0", "d2", "d9"])) == ["d0", "d2"]


def _listing_work(data_dir: Path, tenant: str, cursors: list[str | None]) -> list[int]:
    """How much SQLite work each of ``tenant``'s index-list pages (one per cursor) does: its
    virtual-machine steps, counted a hundred at a time by a progress handler on each
    connection a fresh backend on ``data_dir`` opens."""
    steps = 0

    def count() -> bool:
        nonlocal steps
        steps += 1
        return False  # go on

    def hook(conn: apsw.Connection) -> None:
        conn.set_progress_handler(count, 100)

    apsw.connection_hooks.append(hook)
    backend = EmbeddedBackend(data_dir)
    try:
        backend.check()  # the connection and its schema made, under the hook
        work = []
        for after in cursors:
            steps = 0
            backend.indexes(tenant, after, 101)
            work.append(steps)
        return work
    finally:
        backend.close()
        apsw.connection_hooks.remove(hook)


def test_the_index_list_reads_none_of_another_tenants_documents(tmp_path: Path) -> None:
    """``GET /v1/indexes`` on the embedded backend reads the caller's own rows only: its work
    is the same whether another tenant holds 10 documents or 20,000, under a name after the
    caller's cursor or not. It read every document of every tenant named after the cursor
    (a scan of ``docs``'s key from ``idx > ?``, the tenant a filter), so a tenant with one
    document listed in 4.7 ms beside another's 200,000 and in 0.01 ms with its cursor past
    them: its list's time told how many documents the others hold, and, from a cursor it
    made itself (the token's digest is no secret), under which names."""
    backend = EmbeddedBackend(tmp_path)
    backend.upsert("a", "acme", DOCS[:1], VECTORS[:1])
    backend.upsert("m-big", "bob", [Document(f"b{i}", "w") for i in range(10)], None)
    cursors: list[str | None] = [None, "a", "m", "zz"]
    few = _listing_work(tmp_path, "acme", cursors)
    backend.upsert("m-big", "bob", [Document(f"c{i}", "w") for i in range(20_000)], None)
    assert _listing_work(tmp_path, "acme", cursors) == few
    assert [i.name for i in backend.indexes("acme")] == ["a"]
    assert [(i.name, i.documents) for i in backend.indexes("bob")] == [("m-big", 20_010)]
    backend.close()


def test_an_index_emptied_by_deletes_counts_no_more_toward_the_tenants_limit(
    tmp_path: Path,
) -> None:
    """The limit counts the indexes the tenant holds, as listed: one whose every document
    was deleted by id is none of them, and a stale write (skipped whole) makes nothing."""
    backend = EmbeddedBackend(tmp_path / "data", max_indexes_per_tenant=1)
    backend.upsert("sci", "acme", DOCS, VECTORS, version=5)
    with pytest.raises(IndexLimitReached):
        backend.upsert("bio", "acme", DOCS[:1], VECTORS[:1])
    assert backend.delete_documents("sci", "acme", [d.id for d in DOCS], version=6) == 3
    assert backend.upsert("sci", "acme", DOCS, VECTORS, version=4) == 0  # older: skipped
    assert backend.upsert("bio", "acme", DOCS[:1], VECTORS[:1]) == 1
    assert [i.name for i in backend.indexes("acme")] == ["bio"]


def test_the_index_limit_holds_for_writers_racing_on_their_own_connections(
    tmp_path: Path,
) -> None:
    """Eight backends (each its own connections, as eight worker processes have) write into
    eight new names of one tenant at once: exactly the limit's worth are made, because the
    count is read inside the write's own transaction."""
    names = [f"n{i}" for i in range(8)]
    backends = [EmbeddedBackend(tmp_path / "data", max_indexes_per_tenant=3) for _ in names]
    backends[0].check()  # the schema, made once
    start = threading.Barrier(len(names))

    def write(i: int) -> str:
        start.wait()
        try:
            backends[i].upsert(names[i], "acme", DOCS[:1], VECTORS[:1])
            return "written"
        except IndexLimitReached:
            return "refused"

    with ThreadPoolExecutor(len(names)) as pool:
        outcomes = list(pool.map(write, range(len(names))))
    assert sorted(outcomes) == ["refused"] * 5 + ["written"] * 3
    written = {names[i] for i, outcome in enumerate(outcomes) if outcome == "written"}
    assert {i.name for i in backends[0].indexes("acme")} == written


def test_an_index_s_size_is_its_documents_and_the_utf8_bytes_of_what_a_hit_carries(
    backend: EmbeddedBackend,
) -> None:
    """What the gateway prices a batch's hits by (``IndexSize``): the tenant's documents and
    the bytes of their title, text and metadata as stored, as each write leaves them; another
    tenant's documents are not the caller's."""
    long = Document("long", "é" * 1_000 + "\x00tail", title="Tea", metadata={"lang": "fr"})
    backend.upsert("sci", "acme", [*DOCS, long], np.vstack([VECTORS, VECTORS[:1]]))
    backend.upsert("sci", "globex", DOCS, VECTORS)
    short = sum(len(d.text.encode()) + len("{}") for d in DOCS)
    metadata = len(json.dumps(long.metadata))  # its JSON as stored
    held = short + 2_000 + len("\x00tail") + len("Tea") + metadata
    assert backend.index_size("sci", "acme") == IndexSize(4, held)
    backend.upsert("sci", "acme", [Document("long", "short")], VECTORS[:1])  # replaced
    assert backend.index_size("sci", "acme") == IndexSize(4, short + len("short") + 2)
    backend.delete_documents("sci", "acme", ["long"])
    assert backend.index_size("sci", "acme") == IndexSize(3, short)
    backend.delete_index("sci", "acme")
    assert backend.index_size("sci", "acme") is None
    assert backend.index_size("sci", "globex") == IndexSize(3, short)


def recounted(backend: EmbeddedBackend) -> dict[tuple[str, str], IndexSize]:
    """Each tenant's index's size by a full recount of its rows (every body)."""
    with backend._conn() as conn:
        rows = conn.execute(
            "SELECT d.idx, d.tenant, count(*), sum(length(CAST(b.title AS BLOB))"
            " + length(CAST(b.text AS BLOB)) + length(CAST(d.metadata AS BLOB)))"
            " FROM docs AS d JOIN bodies AS b ON b.seq = d.seq GROUP BY d.idx, d.tenant"
        ).fetchall()
    return {(idx, tenant): IndexSize(int(n), int(stored)) for idx, tenant, n, stored in rows}


def kept(backend: EmbeddedBackend) -> dict[tuple[str, str], IndexSize]:
    """Each tenant's index's running totals as ``index_sizes`` keeps them, those counted at
    its generation (the others are stale), and holding a document."""
    with backend._conn() as conn:
        rows = conn.execute(
            "SELECT i.name, i.tenant, s.documents, s.bytes FROM index_sizes AS s"
            " JOIN indexes AS i ON i.num = s.num AND i.generation = s.generation"
            " WHERE s.documents > 0"
        ).fetchall()
    return {(idx, tenant): IndexSize(int(n), int(stored)) for idx, tenant, n, stored in rows}


_sized_names = itertools.count()
SIZE_IDS = ["a", "b", "c", "d"]
SIZE_OWNERS = [("x", "acme"), ("x", "globex"), ("y", "acme")]
_size_text = st.text(max_size=40)  # any code point (surrogates aside), U+0000 among them
_size_metadata = st.dictionaries(
    st.sampled_from(["lang", "year"]), st.one_of(st.text(max_size=8), st.integers(), st.booleans())
)
# one write: ("upsert", owner, [(id, title, text, metadata)]), ("delete", owner, ids) or
# ("drop", owner, versioned); each is given its step's version, and run in any order
_size_write = st.one_of(
    st.tuples(
        st.just("upsert"),
        st.sampled_from(SIZE_OWNERS),
        st.lists(
            st.tuples(st.sampled_from(SIZE_IDS), _size_text, _size_text, _size_metadata),
            min_size=1,
            max_size=4,
            unique_by=lambda row: row[0],
        ),
    ),
    st.tuples(
        st.just("delete"),
        st.sampled_from(SIZE_OWNERS),
        st.lists(st.sampled_from(SIZE_IDS), min_size=1, max_size=4, unique=True),
    ),
    st.tuples(st.just("drop"), st.sampled_from(SIZE_OWNERS), st.booleans()),
)


@pytest.fixture(scope="module")
def sized_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBackend]:
    opened = EmbeddedBackend(tmp_path_factory.mktemp("sized"))
    yield opened
    opened.close()


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(writes=st.lists(_size_write, min_size=1, max_size=10), data=st.data())
def test_an_index_s_running_totals_equal_a_recount_after_any_writes(
    sized_backend: EmbeddedBackend, writes: list[tuple[Any, ...]], data: Any
) -> None:
    """``index_sizes``, kept by each write in its own transaction, equals a full recount
    of the rows after any mix of upserts (new ids and replacements), deletes and drops
    (versioned ones keep what was written after them), run in any order (a stale write
    skipped): a row per tenant's index holding a document, none for one emptied."""
    prefix = f"s{next(_sized_names)}-"
    backend = sized_backend
    steps = list(enumerate(writes, start=1))
    for version, (kind, (index, tenant), arg) in data.draw(st.permutations(steps)):
        index = prefix + index
        if kind == "upsert":
            docs = [Document(i, text, title, metadata=meta) for i, title, text, meta in arg]
            backend.upsert(index, tenant, docs, None, version=version)
        elif kind == "delete":
            backend.delete_documents(index, tenant, arg, version=version)
        else:
            backend.delete_index(index, tenant, version=version if arg else None)

    def ours(sizes: dict[tuple[str, str], IndexSize]) -> dict[tuple[str, str], IndexSize]:
        return {key: size for key, size in sizes.items() if key[0].startswith(prefix)}

    assert ours(kept(backend)) == ours(recounted(backend))
    for index, tenant in SIZE_OWNERS:
        assert backend.index_size(prefix + index, tenant) == recounted(backend).get(
            (prefix + index, tenant)
        )


def test_an_index_s_size_is_a_seek_on_its_running_totals(backend: EmbeddedBackend) -> None:
    """A worker reads the size after every write job: a seek on ``indexes``'s and
    ``index_sizes``'s keys, not a sum over every body of the tenant's index (93 ms of CPU at
    200,000 documents of 1 kB, growing with them)."""
    from worker.adapters.embedded._sizes import CURRENT

    backend.upsert("sci", "acme", DOCS, VECTORS)
    with backend._conn() as conn:
        plan = [
            str(row[3]) for row in conn.execute(f"EXPLAIN QUERY PLAN {CURRENT}", ("sci", "acme"))
        ]
    assert plan == [
        "SEARCH i USING INDEX sqlite_autoindex_indexes_1 (name=? AND tenant=?)",
        "SEARCH s USING INTEGER PRIMARY KEY (rowid=?)",
    ], plan
    held = sum(len(d.text) + len("{}") for d in DOCS)
    assert kept(backend) == recounted(backend) == {("sci", "acme"): IndexSize(3, held)}


def test_an_index_written_before_its_totals_or_by_an_earlier_release_is_counted_again(
    tmp_path: Path,
) -> None:
    """A v2 data folder of the release before (no ``index_sizes``: this one's, dropped) gains
    the table at its first open, read nowhere whole: each index is counted from its rows at
    its next write, and read by a sum of them until then. An earlier release's write (a
    delete: its rows gone, its index's generation bumped, the totals left as they were)
    leaves them stale, and they are counted again the same way. The schema stays v2."""
    made = EmbeddedBackend(tmp_path)
    long = Document("long", "é" * 500 + "\x00tail", title="Tea", metadata={"lang": "fr"})
    made.upsert("sci", "acme", [*DOCS, long], None)
    made.upsert("sci", "globex", DOCS, None)
    made.upsert("bio", "acme", DOCS[:1], None)
    made.close()
    with apsw.Connection(str(tmp_path / "sift.db")) as conn:
        conn.execute("DROP TABLE index_sizes")
        assert conn.execute("PRAGMA user_version").get == 2

    opened = EmbeddedBackend(tmp_path)
    try:
        everything = recounted(opened)
        assert kept(opened) == {} and len(everything) == 3
        for index, tenant in everything:
            assert opened.index_size(index, tenant) == everything[(index, tenant)]
        opened.upsert("sci", "globex", [Document("d1", "replaced")], None)
        opened.delete_documents("sci", "acme", ["long"])
        opened.delete_index("bio", "acme")
        assert kept(opened) == recounted(opened) and len(kept(opened)) == 2
        with opened._conn() as conn:  # an earlier release's delete of d0
            seq = conn.execute(
                "SELECT seq FROM docs WHERE idx = 'sci' AND tenant = 'acme' AND id = 'd0'"
            ).get
            for table in ("docs", "bodies", "vectors"):
                conn.execute(f"DELETE FROM {table} WHERE seq = ?", (seq,))
            conn.execute(
                "UPDATE indexes SET generation = generation + 1"
                " WHERE name = 'sci' AND tenant = 'acme'"
            )
        assert ("sci", "acme") not in kept(opened)  # stale
        assert opened.index_size("sci", "acme") == recounted(opened)[("sci", "acme")]
        opened.upsert("sci", "acme", [Document("d9", "new words")], None)
        assert kept(opened) == recounted(opened)
        assert kept(opened)[("sci", "acme")].documents == 3  # d1, d2 and d9
    finally:
        opened.close()
    with apsw.Connection(str(tmp_path / "sift.db")) as conn:
        assert conn.execute("PRAGMA user_version").get == 2

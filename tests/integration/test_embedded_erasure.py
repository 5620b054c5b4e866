"""The embedded backend erases what a delete or a drop removes, for real (SQLite on disk): once
the write returns, neither the database file nor its write-ahead log holds the document's
text, title, metadata or vector, as docs/security.md promises for a purged tenant and a
takedown. SQLite frees a deleted row's space without overwriting it unless told to."""

from __future__ import annotations

import random
import threading
import uuid
from pathlib import Path
from typing import Any

import apsw
import numpy as np
import pytest

from worker.adapters.embedded import DB_FILE, EmbeddedBackend
from worker.adapters.embedded._schema import _remake_step
from worker.core.types import ChannelQuery, Document, HardFilters
from worker.errors import IndexNotFound

pytestmark = pytest.mark.integration

DIM = 8


class Secret:
    """A document whose every part is a random string no other row holds, so finding any of
    them in a file's bytes can only mean the document was kept."""

    def __init__(self, doc_id: str) -> None:
        self.word = uuid.uuid4().hex
        self.doc = Document(
            doc_id,
            f"erasable{self.word} Jane Roe lives at 12 Elm Street",
            title=f"title{uuid.uuid4().hex}",
            metadata={"owner": f"meta{uuid.uuid4().hex}"},
        )
        rng = np.random.default_rng(int(self.word[:8], 16))
        vector = rng.random(DIM, dtype=np.float32) + 0.5
        self.vector = vector / np.linalg.norm(vector)

    def traces(self) -> dict[str, bytes]:
        """What of the document a file may not hold: each part's random tail (BM25 terms are
        stored prefix-compressed, so a tail, not the whole word) and the stored vector."""
        return {
            "text": self.word[8:].encode(),
            "title": self.doc.title[-24:].encode(),
            "metadata": str(self.doc.metadata["owner"])[-24:].encode(),
            "vector": self.vector.astype(np.float32).tobytes(),
        }


def found_in_files(data_dir: Path, secrets: list[Secret]) -> list[str]:
    """Which part of which secret each of the data dir's files (database, WAL) holds."""
    found = []
    for path in sorted(data_dir.glob(f"{DB_FILE}*")):
        data = path.read_bytes()
        for secret in secrets:
            found += [
                f"{path.name}: {secret.doc.id}'s {part}"
                for part, trace in secret.traces().items()
                if trace in data
            ]
    return found


def checkpointed(data_dir: Path) -> None:
    """Copy the WAL into the database file and empty it, on a connection of the test's own:
    what SQLite does on its own later, so nothing the WAL still holds may be erased there."""
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def kept(count: int) -> tuple[list[Document], np.ndarray]:
    docs = [Document(f"kept{i}", f"unrelated words about vitamins {i}") for i in range(count)]
    return docs, np.ones((count, DIM), dtype=np.float32)


def load(backend: EmbeddedBackend, index: str, secrets: list[Secret], version: int) -> None:
    """The secrets among other documents, in two writes (two FTS5 segments)."""
    others, other_vectors = kept(40)
    backend.upsert(index, "acme", others[:20], other_vectors[:20], version=version)
    docs = [s.doc for s in secrets] + others[20:]
    vectors = np.vstack([np.stack([s.vector for s in secrets]), other_vectors[20:]])
    backend.upsert(index, "acme", docs, vectors, version=version + 1)


def test_a_deleted_documents_text_title_metadata_and_vector_leave_the_files(
    tmp_path: Path,
) -> None:
    backend = EmbeddedBackend(tmp_path)
    secrets = [Secret("pii"), Secret("also-pii")]
    try:
        load(backend, "sci", secrets, version=1)
        checkpointed(tmp_path)  # the secrets in the database file, not only the WAL
        assert found_in_files(tmp_path, secrets)  # the probe sees them while they are held
        assert backend.delete_documents("sci", "acme", ["pii", "also-pii"], version=3) == 2
        assert found_in_files(tmp_path, secrets) == []
        checkpointed(tmp_path)
        assert found_in_files(tmp_path, secrets) == []
    finally:
        backend.close()


def test_a_dropped_indexs_documents_leave_the_files(tmp_path: Path) -> None:
    backend = EmbeddedBackend(tmp_path)
    secrets = [Secret(f"p{i}") for i in range(20)]
    try:
        load(backend, "sci", secrets, version=1)
        backend.upsert("other", "acme", *kept(5), version=3)  # the file goes on holding data
        checkpointed(tmp_path)
        assert found_in_files(tmp_path, secrets)
        assert backend.delete_index("sci", "acme", version=4) == 60
        assert found_in_files(tmp_path, secrets) == []
        checkpointed(tmp_path)
        assert found_in_files(tmp_path, secrets) == []
    finally:
        backend.close()


def test_a_delete_right_after_the_ingest_leaves_no_copy_in_the_wal(tmp_path: Path) -> None:
    """The ingest's pages are still only in the WAL when the delete runs: the WAL's older
    frames held the text after the delete's own frames had overwritten it."""
    backend = EmbeddedBackend(tmp_path)
    secrets = [Secret("pii")]
    try:
        load(backend, "sci", secrets, version=1)
        assert found_in_files(tmp_path, secrets)
        backend.delete_documents("sci", "acme", ["pii"], version=3)
        assert found_in_files(tmp_path, secrets) == []
    finally:
        backend.close()


def made_as_an_earlier_release(data_dir: Path, num: int) -> None:
    """Make the FTS5 table ``fts_{num}`` again as releases before this one did
    (``contentless_delete=1``: a delete by rowid alone, the terms kept until a merge)."""
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(f"DROP TABLE fts_{num}")
        conn.execute(
            f"CREATE VIRTUAL TABLE fts_{num} USING fts5(title, text, content='',"
            " contentless_delete=1, tokenize='porter unicode61 remove_diacritics 2')"
        )
        conn.execute(
            f"INSERT INTO fts_{num}(rowid, title, text) SELECT seq, title, text FROM bodies"
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


def bm25_ids(backend: EmbeddedBackend, text: str) -> list[str]:
    query = ChannelQuery("sci", HardFilters("acme"), ("bm25",), 50, text)
    return [hit.document.id for hit in backend.retrieve(query).hits["bm25"]]


def test_an_index_made_by_an_earlier_release_erases_its_deleted_documents_too(
    tmp_path: Path,
) -> None:
    """Its FTS5 table cannot take a row's terms out: the delete makes it again, once."""
    backend = EmbeddedBackend(tmp_path)
    secrets = [Secret("pii")]
    try:
        load(backend, "sci", secrets, version=1)
        before = bm25_ids(backend, "vitamins words")
        backend.close()
        made_as_an_earlier_release(tmp_path, 1)
        checkpointed(tmp_path)
        assert backend.delete_documents("sci", "acme", ["pii"], version=3) == 1
        assert found_in_files(tmp_path, secrets) == []
        assert bm25_ids(backend, "vitamins words") == [i for i in before if i != "pii"]
        assert bm25_ids(backend, f"erasable{secrets[0].word}") == []
    finally:
        backend.close()


def test_a_delete_whose_checkpoint_a_long_read_holds_off_is_done_and_erased_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read of an older snapshot held past the busy timeout (shortened here from 10 s)
    keeps the delete's checkpoint from finishing. The delete is done all the same (the
    document is in no channel): it returns, saying so in the log, where it raised a
    retryable error, so a job whose retries ran out reported failed a delete it had made.
    The next delete's checkpoint, the read over, erases both."""
    monkeypatch.setattr("worker.adapters.embedded._pool.BUSY_TIMEOUT_MS", 200)
    backend = EmbeddedBackend(tmp_path)
    secrets = [Secret("pii"), Secret("more-pii")]
    reader = apsw.Connection(str(tmp_path / DB_FILE))
    try:
        load(backend, "sci", secrets, version=1)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM bodies").fetchall()  # holds this snapshot
        with caplog.at_level("WARNING", logger="worker.adapters.embedded"):
            assert backend.delete_documents("sci", "acme", ["pii"], version=3) == 1
        assert "checkpoint" in caplog.text, caplog.text
        assert "pii" not in bm25_ids(backend, f"erasable{secrets[0].word}")
        reader.execute("COMMIT")
        assert backend.delete_documents("sci", "acme", ["more-pii"], version=4) == 1
        assert found_in_files(tmp_path, secrets) == []
    finally:
        reader.close()
        backend.close()


class FullAtCheckpoint(apsw.Connection):
    """A connection whose WAL checkpoint fails as on a full disk: the database file must grow
    to take the WAL's pages, where the write itself fitted in the WAL and committed."""

    def wal_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        raise apsw.FullError("database or disk is full")


@pytest.mark.parametrize("drop", [False, True], ids=["delete", "drop"])
def test_a_delete_or_drop_whose_checkpoint_finds_the_disk_full_is_done_and_says_so(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    drop: bool,
) -> None:
    """The write has committed when its checkpoint fails for want of space: the documents
    are in no channel, so the delete or drop answers how many it removed and logs that
    their bytes stay in the WAL. It raised BackendUnavailable, and every retry answered the
    recorded outcome and raised again: the job was failed while its documents were gone,
    and a drop's settings were never cleared (the disk filled in /tmp/exhaust17's p9)."""
    backend = EmbeddedBackend(tmp_path)
    secrets = [Secret("pii")]
    try:
        load(backend, "sci", secrets, version=1)
        backend.close()
        monkeypatch.setattr(apsw, "Connection", FullAtCheckpoint)
        with caplog.at_level("WARNING", logger="worker.adapters.embedded"):
            for _ in range(2):  # the run and a retry, answered from the recorded outcome
                if drop:
                    assert backend.delete_index("sci", "acme", version=3) == 41
                else:
                    assert backend.delete_documents("sci", "acme", ["pii"], version=3) == 1
        assert "database or disk is full" in caplog.text, caplog.text
        assert backend.document("sci", "acme", "pii") is None
        if drop:
            with pytest.raises(IndexNotFound):
                bm25_ids(backend, "vitamins")
        else:
            assert bm25_ids(backend, f"erasable{secrets[0].word}") == []
    finally:
        backend.close()


def corpus(count: int) -> list[Document]:
    """``count`` documents of some 1,650 characters (deploy/README.md §8's measure), drawn
    from a vocabulary small enough that every query word matches many, at varied BM25."""
    rng = random.Random(7)
    words = [f"w{i}" for i in range(400)]
    return [
        Document(f"d{i}", " ".join(rng.choices(words, k=300)), title=f"t{i % 13}")
        for i in range(count)
    ]


def bm25_hits(backend: EmbeddedBackend, index: str, text: str) -> list[tuple[str, float]]:
    query = ChannelQuery(index, HardFilters("acme"), ("bm25",), 50, text)
    return [(hit.document.id, hit.score) for hit in backend.retrieve(query).hits["bm25"]]


class PausedBetweenSteps(apsw.Connection):
    """A connection that holds ``thread`` at the first transaction it begins after it has
    filled an FTS5 table from the stored texts (outside any transaction of its own), until
    ``go`` is set: what an earlier release's table's remaking is, held half done."""

    thread: threading.Thread | None = None
    paused = threading.Event()
    go = threading.Event()
    filled = False

    def execute(self, statement: str, *args: Any, **kwargs: Any) -> Any:
        held = threading.current_thread() is PausedBetweenSteps.thread
        if held and statement.startswith("INSERT INTO fts_") and "SELECT" in statement:
            PausedBetweenSteps.filled = True
        if held and statement == "BEGIN IMMEDIATE" and PausedBetweenSteps.filled:
            PausedBetweenSteps.thread = None  # once
            PausedBetweenSteps.paused.set()
            PausedBetweenSteps.go.wait()
        return super().execute(statement, *args, **kwargs)


def table_sql(data_dir: Path, num: int) -> str:
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        return str(
            conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (f"fts_{num}",)).get
        )
    finally:
        conn.close()


def test_an_earlier_releases_table_is_made_again_in_steps_other_writes_going_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first write of an index after the upgrade made its earlier release's FTS5 table
    again in that write's transaction: one pass over the index holding the data folder's
    write lock, so behind some 400,000 documents every other write waited out its busy
    timeout and retries and failed backend_unavailable. It is made again in steps, each a
    short transaction: held between two, a write of another index and one of the same index
    are done at the default busy timeout, the held write is done after, its deleted
    document is erased, and the index answers as one made with this release's tables."""
    docs = corpus(2_000)  # some 3.3 MB of text: several steps
    secret = Secret("pii")
    fresh = EmbeddedBackend(tmp_path / "fresh")
    upgraded = EmbeddedBackend(tmp_path / "upgraded")
    added = [Document("d5", "w1 w2 w3 replaced"), Document("new", "w1 w7 w9 added")]
    outcome: list[object] = []
    try:
        for backend in (fresh, upgraded):
            backend.upsert("sci", "acme", [*docs, secret.doc], None, version=1)
        upgraded.close()
        made_as_an_earlier_release(tmp_path / "upgraded", 1)
        checkpointed(tmp_path / "upgraded")
        monkeypatch.setattr(apsw, "Connection", PausedBetweenSteps)

        def first_write() -> None:
            try:
                outcome.append(upgraded.delete_documents("sci", "acme", ["pii"], version=2))
            except Exception as exc:
                outcome.append(exc)

        held = threading.Thread(target=first_write)
        PausedBetweenSteps.paused, PausedBetweenSteps.go = threading.Event(), threading.Event()
        PausedBetweenSteps.thread, PausedBetweenSteps.filled = held, False
        held.start()
        while not PausedBetweenSteps.paused.wait(0.05) and held.is_alive():
            pass
        assert PausedBetweenSteps.paused.is_set(), f"never held between two steps: {outcome}"
        assert "contentless_delete" in table_sql(tmp_path / "upgraded", 1)  # half done
        assert upgraded.upsert("other", "acme", docs[:3], None, version=1) == 3
        assert upgraded.upsert("sci", "acme", added, None, version=3) == 2
        PausedBetweenSteps.go.set()
        held.join(timeout=60)
        assert outcome == [1]
        for write in (
            lambda b: b.delete_documents("sci", "acme", ["pii"], version=2),
            lambda b: b.upsert("other", "acme", docs[:3], None, version=1),
            lambda b: b.upsert("sci", "acme", added, None, version=3),
        ):
            write(fresh)
        assert "contentless_delete" not in table_sql(tmp_path / "upgraded", 1)
        checkpointed(tmp_path / "upgraded")
        assert found_in_files(tmp_path / "upgraded", [secret]) == []
        for text in ("w1", "w2 w3", "w7 w9 added", "replaced", "t3 w11", "w399"):
            assert bm25_hits(upgraded, "sci", text) == bm25_hits(fresh, "sci", text), text
        assert bm25_hits(upgraded, "other", "w1") == bm25_hits(fresh, "other", "w1")
    finally:
        PausedBetweenSteps.go.set()
        fresh.close()
        upgraded.close()


def one_step_then_killed(data_dir: Path) -> None:
    """The first step of making ``fts_1`` again, committed by a writer killed after it."""
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        conn.execute("BEGIN IMMEDIATE")
        assert _remake_step(conn, 1, "sci", "acme") is False
        conn.execute("COMMIT")
    finally:
        conn.close()


def remakes_under_way(data_dir: Path) -> list[object]:
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        found = conn.execute("SELECT name FROM sqlite_master WHERE name GLOB 'fts_*_next'")
        return [*found.fetchall(), *conn.execute("SELECT * FROM fts_remakes").fetchall()]
    finally:
        conn.close()


def test_a_remake_left_half_done_is_gone_on_with_or_dropped_by_the_downgrade(
    tmp_path: Path,
) -> None:
    """A worker killed between two steps leaves them committed: the next write of the index
    goes on from there (the index then answers as one made afresh), and ``sift
    embedded-downgrade`` drops them, since the earlier release's writes would not go
    into them."""
    docs = corpus(2_000)
    fresh = EmbeddedBackend(tmp_path / "fresh")
    upgraded = EmbeddedBackend(tmp_path / "upgraded")
    rolled_back = EmbeddedBackend(tmp_path / "rolled-back")
    try:
        for backend, folder in ((upgraded, "upgraded"), (rolled_back, "rolled-back")):
            backend.upsert("sci", "acme", docs, None, version=1)
            backend.close()
            made_as_an_earlier_release(tmp_path / folder, 1)
            one_step_then_killed(tmp_path / folder)
            assert len(remakes_under_way(tmp_path / folder)) == 2
        fresh.upsert("sci", "acme", docs, None, version=1)
        for backend in (fresh, upgraded):
            assert backend.delete_documents("sci", "acme", ["d1"], version=2) == 1
        assert remakes_under_way(tmp_path / "upgraded") == []
        for text in ("w1", "w2 w3", "t3 w11", "w399"):
            assert bm25_hits(upgraded, "sci", text) == bm25_hits(fresh, "sci", text), text
        assert rolled_back.make_earlier_fts() == []  # fts_1 is an earlier release's already
        assert remakes_under_way(tmp_path / "rolled-back") == []
        assert "contentless_delete" in table_sql(tmp_path / "rolled-back", 1)
    finally:
        fresh.close()
        upgraded.close()
        rolled_back.close()


def test_a_drop_of_the_index_a_remake_was_half_way_through_drops_the_remake_too(
    tmp_path: Path,
) -> None:
    """The last document of an index going drops its FTS5 table whole, and with it a remake a
    killed worker left half done: none of the earlier documents' text stays in the half-filled
    table, and the name ingested again is made afresh, answering as a new index does."""
    docs = corpus(2_000)
    secret = Secret("pii")
    fresh = EmbeddedBackend(tmp_path / "fresh")
    upgraded = EmbeddedBackend(tmp_path / "upgraded")
    try:
        upgraded.upsert("sci", "acme", [*docs, secret.doc], None, version=1)
        upgraded.close()
        made_as_an_earlier_release(tmp_path / "upgraded", 1)
        one_step_then_killed(tmp_path / "upgraded")
        assert len(remakes_under_way(tmp_path / "upgraded")) == 2
        assert upgraded.delete_index("sci", "acme", version=2) == len(docs) + 1
        assert remakes_under_way(tmp_path / "upgraded") == []
        checkpointed(tmp_path / "upgraded")
        assert found_in_files(tmp_path / "upgraded", [secret]) == []
        again = docs[:50]
        for backend in (fresh, upgraded):
            assert backend.upsert("sci", "acme", again, None, version=3) == len(again)
        assert "contentless_delete" not in table_sql(tmp_path / "upgraded", 1)
        for text in ("w1", "w2 w3", "t3 w11"):
            assert bm25_hits(upgraded, "sci", text) == bm25_hits(fresh, "sci", text), text
    finally:
        fresh.close()
        upgraded.close()

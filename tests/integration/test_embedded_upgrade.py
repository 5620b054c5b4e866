"""``sift embedded-upgrade``: a data folder of embedded schema v1 (before ``edd94bb``: one
``indexes`` row and FTS5 table per name, shared by its tenants) brought to v2 in place,
its documents, vectors and write versions kept, nothing embedded again. Before it, a v1
folder's only way forward was to move ``sift.db`` aside and ingest every document again.

The v1 folders here are written the way that release wrote them: its schema and its
upsert's and delete's statements, recorded from ``edd94bb^``'s ``worker/adapters/embedded.py``
(checked against a folder that release's own code wrote)."""

from __future__ import annotations

import json
from pathlib import Path

import apsw
import numpy as np
import pytest
from typer.testing import CliRunner, Result

from worker.adapters.embedded import DB_FILE, EmbeddedBackend, _schema
from worker.core.types import ChannelQuery, Document, HardFilters
from worker.errors import ConfigError
from worker.processes.folder_locks import share_data_dir

pytestmark = pytest.mark.integration

#: ``edd94bb^``'s ``_SCHEMA``, as it made a data folder (``PRAGMA user_version=1``).
V1_SCHEMA = """
CREATE TABLE IF NOT EXISTS indexes(
    num INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    dimension INTEGER,
    generation INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS docs(
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    idx TEXT NOT NULL,
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    revision TEXT NOT NULL,
    metadata TEXT NOT NULL,
    has_vector INTEGER NOT NULL,
    UNIQUE(idx, tenant, id)
);
CREATE INDEX IF NOT EXISTS docs_vectors ON docs(idx, seq) WHERE has_vector;
CREATE TABLE IF NOT EXISTS bodies(seq INTEGER PRIMARY KEY, title TEXT NOT NULL, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS vectors(seq INTEGER PRIMARY KEY, vector BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS writes(
    idx TEXT NOT NULL,
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    version INTEGER NOT NULL,
    deleted INTEGER NOT NULL,
    PRIMARY KEY(idx, tenant, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS catalog(
    idx TEXT NOT NULL,
    tenant TEXT NOT NULL,
    floor INTEGER NOT NULL DEFAULT 0,
    model TEXT,
    last_write REAL,
    PRIMARY KEY(idx, tenant)
) WITHOUT ROWID;
PRAGMA user_version=1;
"""

DIMENSION = 4


class V1:
    """A data folder of schema v1, written with that release's statements."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.conn = apsw.Connection(str(data_dir / DB_FILE))
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(V1_SCHEMA)

    def upsert(
        self, index: str, tenant: str, doc: Document, vector: np.ndarray | None, version: int
    ) -> None:
        """v1's ``upsert`` of one new document (its ``_ensure_index``, rows, version, touch)."""
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        c.execute("INSERT OR IGNORE INTO indexes(name) VALUES (?)", (index,))
        num = c.execute("SELECT num FROM indexes WHERE name = ?", (index,)).get
        c.execute(
            f"CREATE VIRTUAL TABLE IF NOT EXISTS fts_{num} USING fts5(title, text,"
            " content='', contentless_delete=1, tokenize='porter unicode61 remove_diacritics 2')"
        )
        if vector is not None:
            c.execute("UPDATE indexes SET dimension = coalesce(dimension, ?) WHERE num = ?",
                      (DIMENSION, num))  # fmt: skip
        c.execute(
            "INSERT INTO docs(idx, tenant, id, revision, metadata, has_vector)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (index, tenant, doc.id, "r1", json.dumps(dict(doc.metadata)), vector is not None),
        )
        seq = c.last_insert_rowid()
        c.execute("INSERT INTO bodies VALUES (?, ?, ?)", (seq, doc.title, doc.text))
        c.execute(f"INSERT INTO fts_{num}(rowid, title, text) VALUES (?, ?, ?)",
                  (seq, doc.title, doc.text))  # fmt: skip
        if vector is not None:
            c.execute("INSERT INTO vectors VALUES (?, ?)", (seq, vector.tobytes()))
        c.execute("INSERT OR REPLACE INTO writes VALUES (?, ?, ?, ?, 0)",
                  (index, tenant, doc.id, version))  # fmt: skip
        c.execute(
            "INSERT INTO catalog(idx, tenant, model, last_write) VALUES (?, ?, ?, 1.0)"
            " ON CONFLICT(idx, tenant) DO UPDATE SET model = coalesce(model, excluded.model)",
            (index, tenant, "m4" if vector is not None else None),
        )
        c.execute("UPDATE indexes SET generation = generation + 1 WHERE num = ?", (num,))
        c.execute("COMMIT")

    def delete(self, index: str, tenant: str, doc_id: str, version: int) -> None:
        """v1's versioned ``delete_documents`` of one id: its rows, its tombstone."""
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        num = c.execute("SELECT num FROM indexes WHERE name = ?", (index,)).get
        seq = c.execute("SELECT seq FROM docs WHERE idx = ? AND tenant = ? AND id = ?",
                        (index, tenant, doc_id)).get  # fmt: skip
        for table in ("docs", "bodies", "vectors"):
            c.execute(f"DELETE FROM {table} WHERE seq = ?", (seq,))
        c.execute(f"DELETE FROM fts_{num} WHERE rowid = ?", (seq,))
        c.execute("INSERT OR REPLACE INTO writes VALUES (?, ?, ?, ?, 1)",
                  (index, tenant, doc_id, version))  # fmt: skip
        c.execute("UPDATE indexes SET generation = generation + 1 WHERE num = ?", (num,))
        c.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIMENSION).astype(np.float32)
    return v / np.linalg.norm(v)


@pytest.fixture
def v1_folder(tmp_path: Path) -> Path:
    """Two tenants under one name (the same id in both), a BM25-only index, a deleted id."""
    data_dir = tmp_path / "data"
    v1 = V1(data_dir)
    v1.upsert("sci", "acme", Document("d1", "vitamin d deficiency", title="Vitamin"), unit(1), 1)
    v1.upsert("sci", "acme", Document("same", "acme's text about zinc"), unit(2), 2)
    v1.upsert("sci", "acme", Document("gone", "a vitamin text deleted"), unit(3), 3)
    v1.upsert("sci", "globex", Document("g1", "vitamin c and colds"), unit(4), 4)
    v1.upsert("sci", "globex", Document("same", "globex's text about iron"), unit(5), 5)
    v1.upsert("notes", "acme", Document("n1", "bm25 only vitamin notes"), None, 6)
    v1.delete("sci", "acme", "gone", 7)
    v1.close()
    return data_dir


def upgrade(data_dir: Path) -> Result:
    env = {"SIFT_DATA_DIR": str(data_dir), "SIFT_SEARCH_BACKEND": "embedded",
           "COLUMNS": "200", "NO_COLOR": "1"}  # fmt: skip
    from worker.cli import app

    return CliRunner().invoke(app, ["embedded-upgrade", "--yes"], env=env)


def ids(backend: EmbeddedBackend, index: str, tenant: str, channel: str, **query: object) -> list:
    asked = ChannelQuery(index, HardFilters(tenant), (channel,), 10, **query)  # type: ignore[arg-type]
    return [hit.document.id for hit in backend.retrieve(asked).hits[channel]]  # type: ignore[index]


def user_version(data_dir: Path) -> int:
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        return int(conn.execute("PRAGMA user_version").get)
    finally:
        conn.close()


def test_a_worker_refuses_a_v1_folder_naming_the_upgrade(v1_folder: Path) -> None:
    backend = EmbeddedBackend(v1_folder)
    try:
        with pytest.raises(ConfigError, match="sift embedded-upgrade"):
            backend.check()
    finally:
        backend.close()


def test_the_upgrade_keeps_every_tenant_s_documents_vectors_and_versions(v1_folder: Path) -> None:
    run = upgrade(v1_folder)

    assert run.exit_code == 0, run.output
    said = " ".join(run.stdout.split())
    assert "acme/notes: 1 document(s)" in said and "acme/sci: 2 document(s)" in said, said
    assert "globex/sci: 2 document(s)" in said and "3 tenant index(es) made" in said, said
    assert user_version(v1_folder) == 2
    backend = EmbeddedBackend(v1_folder)
    try:
        backend.check()
        # BM25: each tenant's own table, nobody else's text (nor the deleted document's)
        assert ids(backend, "sci", "acme", "bm25", text="vitamin") == ["d1"]
        assert ids(backend, "sci", "globex", "bm25", text="vitamin") == ["g1"]
        assert ids(backend, "notes", "acme", "bm25", text="vitamin") == ["n1"]
        assert ids(backend, "sci", "globex", "bm25", text="zinc") == []
        # kNN on the stored vectors, nothing embedded again
        assert ids(backend, "sci", "acme", "knn", text="", vector=unit(2).tolist())[0] == "same"
        assert ids(backend, "sci", "globex", "knn", text="", vector=unit(4).tolist())[0] == "g1"
        same = backend.document("sci", "globex", "same")
        assert same is not None and same.text == "globex's text about iron"
        info = backend.index_info("sci", "acme")
        assert info is not None and (info.documents, info.dimension) == (2, DIMENSION)
        # the write versions kept: a stale ingest of the deleted id, or of d1, is skipped
        assert backend.upsert("sci", "acme", [Document("gone", "late")], None, version=6) == 0
        assert backend.upsert("sci", "acme", [Document("d1", "stale")], None, version=1) == 0
        # and this release's writes work on the upgraded tables: a delete erases at once
        assert backend.delete_documents("sci", "acme", ["d1"], version=8) == 1
        assert ids(backend, "sci", "acme", "bm25", text="vitamin") == []
        assert ids(backend, "sci", "globex", "bm25", text="vitamin") == ["g1"]
    finally:
        backend.close()
    again = upgrade(v1_folder)
    assert again.exit_code == 0 and "at embedded schema v2 already" in again.stdout


def test_an_upgrade_that_fails_midway_leaves_the_v1_folder_as_it_was(
    v1_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = []

    def failing_second(conn: apsw.Connection, fts: str) -> None:
        if made:
            raise apsw.FullError("database or disk is full")
        made.append(fts)
        real(conn, fts)

    real = _schema._create_fts
    monkeypatch.setattr(_schema, "_create_fts", failing_second)
    run = upgrade(v1_folder)
    assert run.exit_code == 1 and "nothing was changed" in " ".join(run.stderr.split()), run.output
    assert user_version(v1_folder) == 1
    monkeypatch.setattr(_schema, "_create_fts", real)
    assert upgrade(v1_folder).exit_code == 0
    backend = EmbeddedBackend(v1_folder)
    try:
        assert ids(backend, "sci", "acme", "bm25", text="vitamin") == ["d1"]
    finally:
        backend.close()


def test_the_upgrade_refuses_a_folder_a_running_worker_shares(v1_folder: Path) -> None:
    held = share_data_dir(v1_folder)
    try:
        run = upgrade(v1_folder)
    finally:
        held.close()
    assert run.exit_code == 2, run.output
    assert "in use by a running `sift worker`" in " ".join(run.stderr.split())
    assert user_version(v1_folder) == 1

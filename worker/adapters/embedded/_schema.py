"""The embedded backend's tables: the schema and its version check, and the ``indexes`` row
and FTS5 table of each tenant's index, made by its first write and let go with its last
document.

The schema is made at a connection's first open (``CREATE ... IF NOT EXISTS``). A data dir
of another schema version is refused, never migrated by a worker: it stops the worker with
:class:`~worker.errors.ConfigError`. A data dir of schema v1 is brought to v2 by ``sift
embedded-upgrade`` (:func:`upgrade_from_v1`), every worker stopped: a worker of the earlier
release still running on it would read another tenant's FTS5 table by its old number."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import cast

import apsw

from worker.contract import METADATA_KEY_PATTERN
from worker.errors import ConfigError, InvalidRequest

DB_FILE = "sift.db"
FTS_TOKENIZER = "porter unicode61 remove_diacritics 2"

#: What a metadata key may be: filters read it by a ``json_extract`` path built from it.
_FILTER_KEY = re.compile(METADATA_KEY_PATTERN)  # the gateway checks the same

SCHEMA_VERSION = 2  # bump on any change to _SCHEMA; an older data dir is refused, never misread


def _check_schema_version(conn: apsw.Connection, data_dir: Path) -> None:
    found = conn.execute("PRAGMA user_version").fetchone()
    version = int(found[0]) if found else 0
    has_tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    if has_tables and has_tables[0] and version != SCHEMA_VERSION:
        raise ConfigError(
            f"SIFT_DATA_DIR {data_dir} holds embedded-index schema v{version}, this Sift "
            f"reads v{SCHEMA_VERSION}: "
            + (
                "stop every worker on it, then run `sift embedded-upgrade` with this Sift "
                "(deploy/README.md §8)"
                if version == 1
                else "with the older Sift, let the work in flight finish (or cancel it); then "
                "move its sift.db (and sift.db-wal, sift.db-shm) aside, not the folder (under "
                "`sift up` it holds Redis and the dev key), and re-ingest (deploy/README.md §8)"
            )
        )


_SCHEMA = """
CREATE TABLE IF NOT EXISTS indexes(
    num INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    tenant TEXT NOT NULL,
    dimension INTEGER,
    generation INTEGER NOT NULL DEFAULT 0,
    UNIQUE(name, tenant)
);
CREATE INDEX IF NOT EXISTS indexes_by_tenant ON indexes(tenant, name);
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
CREATE INDEX IF NOT EXISTS docs_vectors ON docs(idx, tenant, seq) WHERE has_vector;
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
CREATE TABLE IF NOT EXISTS outcomes(
    idx TEXT NOT NULL,
    tenant TEXT NOT NULL,
    version INTEGER NOT NULL,
    count INTEGER NOT NULL,
    emptied INTEGER NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY(idx, tenant, version)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS outcomes_at ON outcomes(at);
CREATE TABLE IF NOT EXISTS tombstones(
    at REAL NOT NULL,
    idx TEXT NOT NULL,
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    version INTEGER NOT NULL,
    PRIMARY KEY(idx, tenant, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tombstones_at ON tombstones(at);
CREATE TABLE IF NOT EXISTS fts_remakes(num INTEGER PRIMARY KEY, copied INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS index_settings(
    idx TEXT NOT NULL,
    tenant TEXT NOT NULL,
    settings TEXT,
    version INTEGER NOT NULL,
    PRIMARY KEY(idx, tenant)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS index_sizes(
    num INTEGER PRIMARY KEY,
    generation INTEGER NOT NULL,
    documents INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
"""
# Seven came after v2 without a bump: a v2 data dir gains them on open, and an earlier v2
# release reads past them. ``index_sizes`` holds each tenant's index's running totals
# (:mod:`._sizes`), each row at the generation of its index it was counted at: a row an
# earlier release's write left stale, or one not made yet, is counted again from the
# index's rows at its next write, so neither a first open nor a rollback and the upgrade
# after it reads a data dir whole. ``fts_remakes`` says how far the making again of an earlier
# release's FTS5 table has come (:func:`_remake_step`); ``tombstones`` says when each delete's
# ``writes`` row was written, so it goes once no ingest accepted before the delete can still
# run (:func:`_date_tombstones` dates those a data dir held before it, as of its first open),
# ``tombstones_at`` the seek on that time; ``index_settings`` holds each tenant's index's own
# search settings (a NULL ``settings`` once cleared); ``indexes_by_tenant`` is the index
# list's seek on the tenant's own names; ``outcomes`` what each versioned write counted, for
# its job run again (a write committed by an earlier release and run again after the upgrade
# counts 0).
# v2: ``indexes`` is keyed by (name, tenant), so each tenant's index has its own FTS5 table
# (BM25 statistics), dimension and generation; a v1 data dir (one per name) is refused, and
# brought to v2 by ``sift embedded-upgrade`` (:func:`upgrade_from_v1`).


def upgrade_from_v1(data_dir: Path) -> list[tuple[str, str, int]] | None:
    """Bring ``data_dir``'s index database from schema v1 to v2, in one transaction: answers
    each tenant's index made, with its documents (None: the database is not v1; nothing done).

    v1 kept one ``indexes`` row, FTS5 table, dimension and generation per name, shared by
    every tenant writing it; v2 one per (name, tenant) (:data:`_SCHEMA`). Nothing else
    changed: ``docs``, ``bodies``, ``vectors``, ``writes`` and ``catalog`` are kept as they
    are (sequence numbers, versions, floors, models), so no document is embedded again and
    no job's order of writes is lost. Each tenant's index gets its own erasing FTS5 table
    (:func:`_create_fts`), filled from ``bodies``; the shared tables are dropped, their pages
    zeroed (``secure_delete``). A tenant's index takes the name's dimension when it holds a
    vector. The tables that came after v2 are made by the first open, as for any v2 data dir.
    A crash before the commit leaves the v1 database as it was; the run can be made again.
    """
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        conn.set_busy_timeout(5_000)
        conn.execute("PRAGMA secure_delete=ON")
        conn.execute("BEGIN EXCLUSIVE")
        try:
            made = _v1_to_v2(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return made
    finally:
        conn.close()


def _v1_to_v2(conn: apsw.Connection) -> list[tuple[str, str, int]] | None:
    if conn.execute("PRAGMA user_version").get != 1:
        return None
    shared = cast(
        list[tuple[int, str, int | None]],
        conn.execute("SELECT num, name, dimension FROM indexes").fetchall(),
    )
    for num, _, _ in shared:
        conn.execute(f"DROP TABLE IF EXISTS fts_{num}")
    conn.execute("ALTER TABLE indexes RENAME TO indexes_v1")
    conn.execute("DROP INDEX IF EXISTS docs_vectors")  # v1's was on (idx, seq)
    conn.execute(_SCHEMA)
    _date_tombstones(conn, time.time())  # v1 had no ``tombstones``: its deletes' were undated
    made = []
    owners = cast(
        list[tuple[str, str]],
        conn.execute("SELECT DISTINCT tenant, idx FROM docs ORDER BY tenant, idx").fetchall(),
    )
    for tenant, index in owners:
        conn.execute(
            "INSERT INTO indexes(name, tenant, dimension) VALUES (?1, ?2, (SELECT dimension"
            " FROM indexes_v1 WHERE name = ?1 AND EXISTS(SELECT 1 FROM docs"
            " WHERE idx = ?1 AND tenant = ?2 AND has_vector)))",
            (index, tenant),
        )
        fts = f"fts_{conn.last_insert_rowid()}"
        _create_fts(conn, fts)
        conn.execute(
            f"INSERT INTO {fts}(rowid, title, text) SELECT b.seq, b.title, b.text FROM docs"
            " AS d JOIN bodies AS b ON b.seq = d.seq WHERE d.idx = ? AND d.tenant = ?",
            (index, tenant),
        )
        made.append((tenant, index, conn.changes()))
    conn.execute("DROP TABLE indexes_v1")
    conn.execute("PRAGMA user_version=2")
    return made


def _date_tombstones(conn: apsw.Connection, now: float) -> None:
    """Date every tombstone of ``writes`` that ``tombstones`` does not know, as written
    ``now``: run when the table is made, on a data dir whose tombstones an earlier release
    wrote (undated, they were kept for good), so they go a window after the upgrade."""
    conn.execute(
        "INSERT OR IGNORE INTO tombstones SELECT ?, idx, tenant, id, version FROM writes"
        " WHERE deleted != 0",
        (now,),
    )


def _ensure_index(conn: apsw.Connection, index: str, tenant: str) -> int:
    """The number of the tenant's index (its FTS5 table ``fts_{num}``), created if new.
    Raises :class:`_EarlierTable` for an earlier release's table (:func:`_make_erasable`)."""
    conn.execute("INSERT OR IGNORE INTO indexes(name, tenant) VALUES (?, ?)", (index, tenant))
    num = int(
        conn.execute("SELECT num FROM indexes WHERE name = ? AND tenant = ?", (index, tenant)).get
    )
    sql = _fts_sql(conn, num)
    if sql is None:
        _create_fts(conn, f"fts_{num}")
    elif _EARLIER_FTS in sql:
        raise _EarlierTable(num)
    return num


def _fts_sql(conn: apsw.Connection, num: int) -> str | None:
    """The statement the tenant's index's FTS5 table was made by (None: no table)."""
    found = conn.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (f"fts_{num}",)
    ).fetchone()
    return None if found is None else str(found[0])


def _create_fts(conn: apsw.Connection, fts: str) -> None:
    """Make the FTS5 table ``fts`` (``fts_{num}``), one whose deletes erase a document's terms.

    It holds no text (``content=''``); a row is removed by FTS5's ``delete`` command given
    the row's own title and text (kept in ``bodies``: :func:`_writes._remove_row`), which
    tells it the terms to take out, and its ``secure-delete`` option (SQLite 3.42 on) takes
    them out of their segment at once. By default FTS5 adds a delete marker and leaves
    the terms in place until a merge rewrites the segment; an earlier release's tables
    (``contentless_delete=1``, deleted by rowid alone) can do no better, as they do not
    know a row's terms: :func:`_make_erasable` makes them again. ``PRAGMA secure_delete``
    (every connection: :meth:`_pool._Pool._open`) zeroes the pages let go.
    """
    conn.execute(
        f"CREATE VIRTUAL TABLE {fts} USING fts5("
        f"title, text, content='', tokenize='{FTS_TOKENIZER}')"
    )
    conn.execute(f"INSERT INTO {fts}({fts}, rank) VALUES ('secure-delete', 1)")


def _make_erasable(conn: apsw.Connection, num: int) -> None:
    """Before a write removes rows of the tenant's index: raise :class:`_EarlierTable` if its
    FTS5 table is an earlier release's (``contentless_delete=1``, which keeps a deleted row's
    terms until a merge, and refuses the ``delete`` command)."""
    sql = _fts_sql(conn, num)
    if sql is not None and _EARLIER_FTS in sql:
        raise _EarlierTable(num)


#: What an earlier release's FTS5 tables were made with (:func:`_make_erasable`).
_EARLIER_FTS = "contentless_delete"


class _EarlierTable(Exception):
    """A write found the FTS5 table ``fts_{num}`` of the index it changes an earlier
    release's: it rolls back, the table is made again (:func:`_remake_step`, step after
    step, each a transaction of its own), and the write runs again."""

    def __init__(self, num: int) -> None:
        super().__init__(f"fts_{num} is an earlier release's")
        self.num = num


#: How much stored text one step of a remake indexes: some 0.1 s of FTS5's work (the whole
#: pass took 12 s for 100,000 documents of 1,650 characters), the longest it holds the write
#: lock. A table made again in one pass held it for as long as the index took: past some
#: 400,000 documents, longer than the other writes' busy timeout and retries.
REMAKE_STEP_CHARS = 1_500_000


def _remake_step(conn: apsw.Connection, num: int, index: str, tenant: str) -> bool:
    """One step, in the caller's transaction, of making the tenant's index's earlier-release
    FTS5 table again: the next stored texts (some :data:`REMAKE_STEP_CHARS`, in ``seq``
    order from where ``fts_remakes`` says the last step stopped) go into ``fts_{num}_next``,
    an erasing table; once none is left it takes the earlier table's place. Answers whether
    the table is done (by this step, another writer's, or none left to make: the index
    emptied meanwhile, :func:`_settle_emptied`).

    No document of the index changes between two steps, so none is missed or left behind:
    every write that adds or removes one finds the earlier table first and waits for it to
    be made again (:meth:`._writes._Writes._remake_fts`), and a drop of every document drops
    both tables. The earlier table answers searches until the last step."""
    sql = _fts_sql(conn, num)
    if sql is None or _EARLIER_FTS not in sql:
        _drop_remake(conn, num)
        return True
    upcoming = f"fts_{num}_next"
    copied = conn.execute("SELECT copied FROM fts_remakes WHERE num = ?", (num,)).get
    if copied is None:
        conn.execute(f"DROP TABLE IF EXISTS {upcoming}")
        _create_fts(conn, upcoming)
        copied = 0
    upto, more = _step_end(conn, index, tenant, int(copied))
    conn.execute(
        f"INSERT INTO {upcoming}(rowid, title, text) SELECT b.seq, b.title, b.text"
        " FROM docs AS d JOIN bodies AS b ON b.seq = d.seq"
        " WHERE d.seq > ? AND d.seq <= ? AND +d.idx = ? AND +d.tenant = ?",
        (copied, upto, index, tenant),
    )
    if more:
        conn.execute("INSERT OR REPLACE INTO fts_remakes(num, copied) VALUES (?, ?)", (num, upto))
        return False
    conn.execute(f"DROP TABLE fts_{num}")  # its pages zeroed (secure_delete)
    conn.execute(f"ALTER TABLE {upcoming} RENAME TO fts_{num}")
    conn.execute("DELETE FROM fts_remakes WHERE num = ?", (num,))
    return True


def _step_end(conn: apsw.Connection, index: str, tenant: str, after: int) -> tuple[int, bool]:
    """The last ``seq`` of the tenant's documents past ``after`` one step takes (some
    :data:`REMAKE_STEP_CHARS` of text), and whether any is left after it. A walk of the
    table's own key from ``after`` (the ``+`` keeps SQLite off the (idx, tenant, id) index,
    which would sort the whole index again at every step), so the steps of a remake read
    each row once."""
    upto, chars = after, 0
    rows = conn.execute(
        "SELECT d.seq, length(b.title) + length(b.text) FROM docs AS d"
        " JOIN bodies AS b ON b.seq = d.seq"
        " WHERE d.seq > ? AND +d.idx = ? AND +d.tenant = ? ORDER BY d.seq",
        (after, index, tenant),
    )
    try:
        for seq, size in rows:
            if chars >= REMAKE_STEP_CHARS:
                return upto, True
            upto, chars = int(seq), chars + int(size)
        return upto, False
    finally:
        rows.close()


def _drop_remake(conn: apsw.Connection, num: int) -> None:
    """Drop a remake of ``fts_{num}`` under way (its table, zeroed, and its progress)."""
    conn.execute(f"DROP TABLE IF EXISTS fts_{num}_next")
    conn.execute("DELETE FROM fts_remakes WHERE num = ?", (num,))


def make_earlier_fts(conn: apsw.Connection) -> list[tuple[str, str, int]]:
    """Make every FTS5 table of this release's (erasing: no ``contentless_delete``) again as
    an earlier release made it (``contentless_delete=1``), from the index's ``bodies``:
    ``sift embedded-downgrade``, run before rolling back past the erasing tables. That
    release removes a row by ``DELETE FROM fts_N WHERE rowid = ?``, which this release's
    tables refuse: its re-ingests, deletes, drops and purges failed, for good. This release
    makes each erasing again at its index's next write (:func:`_ensure_index`). Answers each
    table made again: its tenant, index and rows."""
    made = []
    rows = cast(
        list[tuple[int, str, str]],
        conn.execute("SELECT num, name, tenant FROM indexes ORDER BY tenant, name").fetchall(),
    )
    for num, _, _ in rows:  # a remake under way (its writer killed) would miss their writes
        _drop_remake(conn, num)
    for num, index, tenant in rows:
        sql = _fts_sql(conn, num)
        if sql is None or _EARLIER_FTS in sql:
            continue  # no table (an emptied index), or an earlier release's already
        conn.execute(f"DROP TABLE fts_{num}")
        conn.execute(
            f"CREATE VIRTUAL TABLE fts_{num} USING fts5("
            f"title, text, content='', contentless_delete=1, tokenize='{FTS_TOKENIZER}')"
        )
        conn.execute(
            f"INSERT INTO fts_{num}(rowid, title, text) SELECT b.seq, b.title, b.text FROM docs"
            " AS d JOIN bodies AS b ON b.seq = d.seq WHERE d.idx = ? AND d.tenant = ?",
            (index, tenant),
        )
        made.append((tenant, index, conn.changes()))
    return made


def _claim_dimension(conn: apsw.Connection, num: int, index: str, dimension: int) -> None:
    """The tenant's index (``num``) takes the dimension of its first vectors and keeps it."""
    held = conn.execute("SELECT dimension FROM indexes WHERE num = ?", (num,)).get
    if held is None:
        conn.execute("UPDATE indexes SET dimension = ? WHERE num = ?", (dimension, num))
    elif held != dimension:
        raise InvalidRequest("vectors", f"dimension {dimension}, but index {index!r} holds {held}")


def _index_row(
    conn: apsw.Connection, index: str, tenant: str
) -> tuple[int, int | None, int] | None:
    row = conn.execute(
        "SELECT num, dimension, generation FROM indexes WHERE name = ? AND tenant = ?",
        (index, tenant),
    ).fetchone()
    return None if row is None else (int(row[0]), row[1], int(row[2]))


def _searched_index(conn: apsw.Connection, index: str, tenant: str) -> tuple[int, int] | None:
    """The number and generation of the tenant's index, if it holds one of the tenant's
    documents: one statement, a seek on each table's key. None otherwise (its FTS5 table
    may be gone: :func:`_settle_emptied`)."""
    row = conn.execute(
        "SELECT num, generation FROM indexes WHERE name = ?1 AND tenant = ?2"
        " AND EXISTS(SELECT 1 FROM docs WHERE idx = ?1 AND tenant = ?2)",
        (index, tenant),
    ).fetchone()
    return None if row is None else (int(row[0]), int(row[1]))


def _holds(conn: apsw.Connection, index: str, tenant: str) -> bool:
    """Whether the tenant holds a document in the index (one seek on its unique key)."""
    return bool(
        conn.execute(
            "SELECT EXISTS(SELECT 1 FROM docs WHERE idx = ? AND tenant = ?)", (index, tenant)
        ).get
    )


def _settle_emptied(conn: apsw.Connection, num: int, index: str, tenant: str) -> bool:
    """After a delete or a drop: what goes with the last of the tenant's documents; answers
    whether that was the last (the tenant's index holds none now).

    A tenant's index exists while it holds one of the tenant's documents, however the last
    one went (a drop, or deletes by id). So with the last document go its FTS5 table (five
    schema rows each connection parses and holds; the next write makes it again,
    :func:`_ensure_index`) and its recorded embedding model (a versioned drop keeps the
    documents written after it, and their model with them), and with the last vector its
    claimed dimension: a new model may embed in another. Its ``indexes`` row stays, so its
    generation keeps counting for the vector caches of other processes.
    """
    if _holds(conn, index, tenant):
        conn.execute(
            "UPDATE indexes SET dimension = NULL WHERE num = ?1 AND NOT EXISTS("
            "SELECT 1 FROM docs WHERE idx = ?2 AND tenant = ?3 AND has_vector)",
            (num, index, tenant),
        )
        return False
    conn.execute(f"DROP TABLE IF EXISTS fts_{num}")
    _drop_remake(conn, num)
    conn.execute("UPDATE catalog SET model = NULL WHERE idx = ? AND tenant = ?", (index, tenant))
    conn.execute("UPDATE indexes SET dimension = NULL WHERE num = ?", (num,))
    return True

"""``sift embedded-downgrade``: the step run with this release before rolling back past the
erasing FTS5 tables (57bc511). This release makes each index's FTS5 table contentless
without ``contentless_delete=1``, which refuses an earlier release's ``DELETE FROM fts_N
WHERE rowid = ?``: after a rollback, that release could replace no document, delete none and
drop no index the newer one wrote (nor purge a tenant), for good. The step makes every such
table again as the earlier release made it, from ``bodies``; this release makes it erasing
again at the index's next write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import apsw
import pytest
from typer.testing import CliRunner, Result

from tests.integration.test_embedded_erasure import bm25_ids
from tests.services import celery_worker, redis_server
from worker.adapters.embedded import DB_FILE, EmbeddedBackend
from worker.cli import app
from worker.core.types import Document
from worker.processes.folder_locks import claim_data_dir, exclude_workers

pytestmark = pytest.mark.integration

SIFT = str(Path(sys.executable).with_name("sift"))
DOCS = [Document(f"d{i}", f"vitamins words number {i}") for i in range(6)]


def downgrade(data_dir: Path) -> Result:
    env = {"SIFT_DATA_DIR": str(data_dir), "SIFT_SEARCH_BACKEND": "embedded",
           "COLUMNS": "200", "NO_COLOR": "1"}  # fmt: skip
    return CliRunner().invoke(app, ["embedded-downgrade", "--yes"], env=env)


def fts_sql(data_dir: Path) -> list[str]:
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        rows = conn.execute(
            "SELECT sql FROM sqlite_master WHERE name GLOB 'fts_[0-9]*'"
            " AND sql LIKE 'CREATE VIRTUAL TABLE%'"
        )
        return [str(sql) for (sql,) in rows]
    finally:
        conn.close()


def delete_as_the_earlier_release(data_dir: Path, doc_id: str) -> None:
    """An earlier release's delete of acme's document (its ``_remove_row``): its rows, its FTS5
    row by rowid alone, and its index's generation moved on (the caches' mark)."""
    conn = apsw.Connection(str(data_dir / DB_FILE))
    try:
        conn.execute("BEGIN IMMEDIATE")
        num, seq = conn.execute(
            "SELECT i.num, d.seq FROM docs AS d JOIN indexes AS i"
            " ON i.name = d.idx AND i.tenant = d.tenant WHERE d.id = ? AND d.tenant = 'acme'",
            (doc_id,),
        ).fetchone()
        for table in ("docs", "bodies", "vectors"):
            conn.execute(f"DELETE FROM {table} WHERE seq = ?", (seq,))
        conn.execute(f"DELETE FROM fts_{num} WHERE rowid = ?", (seq,))
        conn.execute("UPDATE indexes SET generation = generation + 1 WHERE num = ?", (num,))
        conn.execute("COMMIT")
    finally:
        conn.close()


def test_the_downgrade_lets_an_earlier_release_delete_and_this_one_upgrade_again(
    tmp_path: Path,
) -> None:
    backend = EmbeddedBackend(tmp_path)
    try:
        backend.upsert("sci", "acme", DOCS, None, version=1)
        backend.upsert("other", "beta", DOCS[:2], None, version=2)
        before = bm25_ids(backend, "vitamins words")
        backend.close()
        with pytest.raises(apsw.SQLError, match="contentless"):  # the rollback's failure
            delete_as_the_earlier_release(tmp_path, "d1")

        run = downgrade(tmp_path)

        assert run.exit_code == 0, run.output
        said = " ".join(run.stdout.split())
        assert "acme/sci: 6 document(s)" in said and "beta/other: 2 document(s)" in said, said
        assert "2 FTS5 table(s) made as an earlier release's" in said, said
        assert all("contentless_delete=1" in sql for sql in fts_sql(tmp_path))
        assert bm25_ids(backend, "vitamins words") == before  # the same terms, the same ranks
        backend.close()
        delete_as_the_earlier_release(tmp_path, "d1")  # the earlier release's form: works
        assert bm25_ids(backend, "vitamins words") == [i for i in before if i != "d1"]
        assert downgrade(tmp_path).exit_code == 0  # a second run: nothing to make again
        # this release, started again: its next write makes the table erasing again
        assert backend.delete_documents("sci", "acme", ["d2"], version=3) == 1
        assert bm25_ids(backend, "vitamins words") == [i for i in before if i not in ("d1", "d2")]
        assert sum("contentless_delete" not in sql for sql in fts_sql(tmp_path)) == 1
    finally:
        backend.close()


def test_the_downgrade_refuses_a_data_folder_a_running_stack_holds(tmp_path: Path) -> None:
    backend = EmbeddedBackend(tmp_path)
    backend.upsert("sci", "acme", DOCS, None, version=1)
    backend.close()
    with claim_data_dir(tmp_path, "pid 4242"):
        run = downgrade(tmp_path)
    assert run.exit_code == 2, run.output
    said = " ".join(run.stderr.split())
    assert "in use by a running `sift up` stack" in said and "stop it" in said, said
    assert all("contentless_delete" not in sql for sql in fts_sql(tmp_path))


@pytest.mark.parametrize("processes", [1, 2])
def test_the_downgrade_refuses_a_data_folder_a_running_worker_uses(
    tmp_path: Path, processes: int
) -> None:
    """A ``sift worker`` on the folder, no ``sift up``: the downgrade saw only the stack's
    lock and made the tables again under the worker, whose next write made them erasing."""
    data_dir = tmp_path / "data"
    backend = EmbeddedBackend(data_dir)
    backend.upsert("sci", "acme", DOCS, None, version=1)
    backend.close()
    before = fts_sql(data_dir)
    with redis_server(tmp_path / "redis") as url:
        env = {"SIFT_REDIS_URL": url + "/0", "SIFT_DATA_DIR": str(data_dir)}
        with celery_worker(tmp_path, env, "downgrade", processes=processes):
            run = downgrade(data_dir)
        assert run.exit_code == 2, run.output
        said = " ".join(run.stderr.split())
        assert "in use by a running `sift worker`" in said and "stop it" in said, said
        assert fts_sql(data_dir) == before
        assert downgrade(data_dir).exit_code == 0  # stopped: the folder is free


def test_a_worker_started_while_the_downgrade_runs_stops(tmp_path: Path) -> None:
    """The downgrade keeps the folder from every worker until it ends: one started meanwhile
    would have written through tables being made again."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    env.update(SIFT_DATA_DIR=str(tmp_path), SIFT_REDIS_URL="redis://127.0.0.1:9/0")
    env.update(SIFT_WORKER_METRICS_PORT="0", COLUMNS="200")
    EmbeddedBackend(tmp_path).close()
    excluded = exclude_workers(tmp_path)
    assert excluded is not None
    with excluded:
        ran = subprocess.run(
            [SIFT, "worker", "--processes", "1"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    said = ran.stdout + ran.stderr
    assert ran.returncode == 2, said
    assert "is being downgraded" in said and len(said.strip().splitlines()) == 1, said


def test_the_downgrade_refuses_a_folder_with_no_embedded_backend(tmp_path: Path) -> None:
    run = downgrade(tmp_path / "elsewhere")
    assert run.exit_code == 2, run.output
    assert "no embedded backend in" in " ".join(run.stderr.split())
    assert not (tmp_path / "elsewhere").exists()

"""A process SIGKILLed inside the embedded backend's write transaction holds nothing after it:
the next write, from another process, takes SQLite's write lock at once, and the killed
write is rolled back whole. (SQLite's locks are the kernel's record locks on ``sift.db`` and
its ``-shm``, let go with the process; the first connection after finds the WAL's index to
rebuild, which it does from the WAL file.) So no write waits on a dead worker's lock: what a
write the killed worker had taken waits for is the dead-worker check giving its message back
(docs/embedded-backend.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from worker.adapters.embedded import EmbeddedBackend, _pool
from worker.core.types import Document

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
VECTORS = np.eye(3, 8, dtype=np.float32) + 0.1


def writer_held_in_its_transaction(data_dir: Path, ready: Path) -> subprocess.Popen[bytes]:
    """A process whose upsert of ``dies`` stops inside its write transaction, after the row
    is written and before the commit (where ``crashing_runtime``'s ``die-in-write`` kills a
    worker), once it has said so by making ``ready``."""
    code = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        import numpy as np
        from worker.adapters.embedded import EmbeddedBackend, _writes
        from worker.core.types import Document

        set_version = _writes._set_version

        def held(conn, index, tenant, doc_id, *args, **kwargs):
            set_version(conn, index, tenant, doc_id, *args, **kwargs)
            if doc_id == "dies":
                Path({str(ready)!r}).touch()
                time.sleep(600)

        _writes._set_version = held
        backend = EmbeddedBackend(Path({str(data_dir)!r}))
        vectors = np.eye(1, 8, dtype=np.float32) + 0.1
        backend.upsert("sci", "acme", [Document("dies", "vitamin words")], vectors, version=5)
        """
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT)


def test_a_write_after_a_writer_is_sigkilled_mid_transaction_takes_the_lock_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = EmbeddedBackend(tmp_path)
    backend.upsert("sci", "acme", [Document("d0", "vitamin words 0")], VECTORS[:1], version=1)
    ready = tmp_path / "ready"
    process = writer_held_in_its_transaction(tmp_path, ready)
    try:
        deadline = time.monotonic() + 120  # a guard against a writer that never got there
        while not ready.exists():
            assert process.poll() is None, "the writer exited before its write"
            assert time.monotonic() < deadline, "the writer did not reach its transaction"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # No busy wait at all: a lock the dead writer still held would fail this write at once
    # (BackendUnavailable), where the default busy timeout would hide it for 10 s.
    monkeypatch.setattr(_pool, "BUSY_TIMEOUT_MS", 0)
    after = EmbeddedBackend(tmp_path)
    try:
        assert after.upsert("sci", "acme", [Document("d1", "words 1")], VECTORS[:1], version=6)
        assert after.document("sci", "acme", "dies") is None  # the killed write: no trace
        assert after.count("sci", "acme") == 2
        with after._conn() as conn:
            assert conn.execute("PRAGMA integrity_check").get == "ok"
    finally:
        after.close()
        backend.close()

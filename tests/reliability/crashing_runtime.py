"""The real worker runtime, SIGKILLed once at a chosen point of an ingest or a delete job.

A job names the point by a document id (``die-embedding``, ``die-in-write``,
``die-after-write``, ``die-after-delete``); the worker process kills itself there with
SIGKILL (no cleanup, no ack, no job-store update: as an OOM kill would), the first time
only: a file in ``$CRASH_ONCE_DIR`` says it happened, so the redelivered task runs through.

- ``die-embedding``: while the documents are being embedded, before any write;
- ``die-in-write``: inside the embedded backend's SQLite write transaction, after a row of
  the upsert was written and before the commit;
- ``die-after-write``: after the upsert's commit, before the job record moves;
- ``die-after-delete``: after a delete by ids committed, before its job record moves;
- an index named ``die-after-drop``: after its drop committed, before its job record moves.

And one pause, not a kill: ``hold-embedding`` in a document's text holds its first
embedding until the file ``release`` appears in ``$CRASH_ONCE_DIR`` (a test restarts Redis
meanwhile); ``hold-till-stop`` holds it until the worker is stopping (a test SIGTERMs it).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from worker.adapters.embedded import _writes
from worker.queue import liveness
from worker.queue.base import load_runtime
from worker.queue.intake import INTAKE
from worker.runtime.inprocess import Runtime
from worker.settings import Settings


def die_once(point: str) -> None:
    """SIGKILL this process, unless it (or an earlier worker) already died at ``point``.

    It dies once the deliveries it holds are on record (the liveness thread writes them
    within milliseconds of their receipt; on a starved CPU a task reached its kill point
    first, and its message came back by the 60 s orphan path, not the dead-worker check
    these tests are about)."""
    flag = Path(os.environ["CRASH_ONCE_DIR"]) / point
    try:
        flag.touch(exist_ok=False)
    except FileExistsError:
        return
    keeper = liveness.current()  # (a prefork child has no liveness thread of its own)
    if keeper is not None and keeper._thread is not None and keeper._thread.is_alive():
        deadline = time.monotonic() + 30
        while keeper._unrecorded and time.monotonic() < deadline:
            time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def hold_once(point: str, until: Callable[[], bool] | None = None) -> None:
    """Wait (at most 120 s) for ``$CRASH_ONCE_DIR/release`` (or ``until()``), the first time
    at ``point``."""
    directory = Path(os.environ["CRASH_ONCE_DIR"])
    try:
        (directory / point).touch(exist_ok=False)
    except FileExistsError:
        return
    released = until or (lambda: (directory / "release").exists())
    deadline = time.monotonic() + 120.0
    while not released() and time.monotonic() < deadline:
        time.sleep(0.05)


def build_runtime(settings: Settings) -> Runtime:
    """The worker's real runtime (as without ``SIFT_RUNTIME_FACTORY``), with the kill points."""
    loaded: Any = load_runtime(settings.model_copy(update={"runtime_factory": None}))
    runtime: Runtime = loaded
    embedder: Any = runtime.pipeline.embedder
    backend: Any = runtime.pipeline.backend
    embed, ingest, delete = embedder.embed, runtime.ingest, backend.delete_documents
    drop = backend.delete_index
    set_version = _writes._set_version

    def embedding(texts: Sequence[str]) -> Any:
        if any("die-embedding" in text for text in texts):
            die_once("die-embedding")
        if any("hold-embedding" in text for text in texts):
            hold_once("hold-embedding")
        if any("hold-till-stop" in text for text in texts):
            hold_once("hold-till-stop", until=lambda: INTAKE.stopping)
        return embed(texts)

    def in_write(conn: Any, index: str, tenant: str, doc_id: str, *args: Any, **kw: Any) -> None:
        set_version(conn, index, tenant, doc_id, *args, **kw)
        if doc_id == "die-in-write":
            die_once("die-in-write")

    def after_write(index: str, tenant: str, documents: Any, *a: Any, **kw: Any) -> int:
        written: int = ingest(index, tenant, documents, *a, **kw)
        if any(d.id == "die-after-write" for d in documents):
            die_once("die-after-write")
        return written

    def after_delete(index: str, tenant: str, ids: Sequence[str], **kw: Any) -> int:
        deleted: int = delete(index, tenant, ids, **kw)
        if "die-after-delete" in ids:
            die_once("die-after-delete")
        return deleted

    def after_drop(index: str, tenant: str, **kw: Any) -> int:
        gone: int = drop(index, tenant, **kw)
        if index == "die-after-drop":
            die_once("die-after-drop")
        return gone

    embedder.embed = embedding
    _writes._set_version = in_write
    runtime.ingest = after_write  # type: ignore[method-assign]
    backend.delete_documents = after_delete
    backend.delete_index = after_drop
    return runtime

"""The real worker runtime, with a search that holds: a query ending ``hold-search <id>``
waits, before its search runs, until the file ``release`` appears in ``$HOLD_DIR``; each run
that reaches the hold first touches ``$HOLD_DIR/hit-<id>-<pid>-<n>``, so a test knows which
items each worker process started (and then SIGKILLs it). An ingest whose first document's
id starts ``hold-ingest`` holds the same way before it embeds (its hit: ``hit-ingest-...``),
so a test can have a later write accepted and applied before it lands."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

from worker.queue.base import load_runtime
from worker.settings import Settings

_n = itertools.count()


def _hold(what: str) -> None:
    folder = Path(os.environ["HOLD_DIR"])
    (folder / f"hit-{what}-{os.getpid()}-{next(_n)}").touch()
    while not (folder / "release").exists():
        time.sleep(0.05)


def build_runtime(settings: Settings) -> Any:
    runtime: Any = load_runtime(settings.model_copy(update={"runtime_factory": None}))
    search, ingest = runtime.search, runtime.ingest

    def held_search(spec: Any, tenant: str, *args: Any, **kwargs: Any) -> Any:
        words = spec.query.split()
        if len(words) >= 2 and words[-2] == "hold-search":
            _hold(words[-1])
        return search(spec, tenant, *args, **kwargs)

    def held_ingest(index: str, tenant: str, documents: Any, *args: Any, **kwargs: Any) -> Any:
        if documents and documents[0].id.startswith("hold-ingest"):
            _hold("ingest")
        return ingest(index, tenant, documents, *args, **kwargs)

    runtime.search, runtime.ingest = held_search, held_ingest
    return runtime

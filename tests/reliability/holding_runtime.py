"""The real worker runtime, with a search that holds: a query ending ``hold-search <id>``
waits, before its search runs, until the file ``release`` appears in ``$HOLD_DIR``; each run
that reaches the hold first touches ``$HOLD_DIR/hit-<id>-<pid>-<n>``, so a test knows which
items each worker process started (and then SIGKILLs it)."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

from worker.queue.base import load_runtime
from worker.settings import Settings

_n = itertools.count()


def build_runtime(settings: Settings) -> Any:
    runtime: Any = load_runtime(settings.model_copy(update={"runtime_factory": None}))
    search = runtime.search

    def held_search(spec: Any, tenant: str, *args: Any, **kwargs: Any) -> Any:
        words = spec.query.split()
        if len(words) >= 2 and words[-2] == "hold-search":
            folder = Path(os.environ["HOLD_DIR"])
            (folder / f"hit-{words[-1]}-{os.getpid()}-{next(_n)}").touch()
            while not (folder / "release").exists():
                time.sleep(0.05)
        return search(spec, tenant, *args, **kwargs)

    runtime.search = held_search
    return runtime

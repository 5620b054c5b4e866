"""CPU per search stage inside a worker process, for ``bench_rerank_cpu.py --profile``.

``SIFT_RUNTIME_FACTORY=benchmarks.stage_probe:runtime`` builds the worker's real runtime (as
:func:`worker.queue.base.load_runtime` does without a factory) and wraps its ports so each
stage's thread CPU time (``time.thread_time``, so time waiting on the GIL or the network is
not counted) is summed per process: the query embedding, the retrieval, the model call (the
SDK's request and response handling; the fake's latency is a wait, not CPU) and the whole
search. Every ``WRITE_EVERY`` searches the sums go to ``$BENCH_STAGE_DIR/<pid>.json``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

WRITE_EVERY = 50
_sums: dict[str, float] = {"embed": 0.0, "retrieve": 0.0, "model_call": 0.0, "search": 0.0}
_counts = {"searches": 0}
_lock = threading.Lock()


def _add(stage: str, seconds: float) -> None:
    with _lock:
        _sums[stage] += seconds
        if stage == "search":
            _counts["searches"] += 1
            if _counts["searches"] % WRITE_EVERY == 0:
                _write()


def _write() -> None:
    directory = os.environ.get("BENCH_STAGE_DIR")
    if directory:
        path = Path(directory) / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**_sums, **_counts}))
        os.replace(tmp, path)


def _timed(stage: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return call(*args, **kwargs)
        finally:
            _add(stage, time.thread_time() - started)

    return wrapper


class _Proxy:
    """The wrapped port, with ``methods`` timed as ``stage``; every other attribute passes."""

    def __init__(self, inner: Any, stage: str, methods: Sequence[str]) -> None:
        self._inner = inner
        for name in methods:
            setattr(self, name, _timed(stage, getattr(inner, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def runtime(settings: Any) -> Any:
    """The worker's runtime, its ports timed."""
    from worker.queue.base import get_context, load_runtime

    real = load_runtime(replace_settings(settings), get_context().limiter)
    pipeline = real.pipeline  # type: ignore[attr-defined]
    pipeline.embedder = _Proxy(pipeline.embedder, "embed", ["embed"])
    pipeline.backend = _Proxy(pipeline.backend, "retrieve", ["retrieve", "channels"])
    if pipeline.reranker is not None:
        pipeline.reranker = _Proxy(pipeline.reranker, "model_call", ["rerank"])
    pipeline.search = _timed("search", pipeline.search)
    return real


def replace_settings(settings: Any) -> Any:
    return settings.model_copy(update={"runtime_factory": None})

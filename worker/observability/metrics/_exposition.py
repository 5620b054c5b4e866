"""The exposition: what ``/metrics`` serves (every process summed in multiprocess mode), for the
gateway's ``/metrics`` route, a worker's own HTTP server, and tests and tools that read it."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Mapping
from threading import Lock, Thread
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.registry import Collector

from worker.constants import ALL_QUEUES, TASK_NAMES
from worker.observability.metrics._multiprocess import SweepingCollector, multiprocess_dir
from worker.observability.metrics._series import preregister


def exposition_registry() -> Collector:
    """What ``/metrics`` serves: every process summed in multiprocess mode, else this one.
    Without prometheus-client's ``*_created`` series (each counter's, histogram's and
    summary's creation time, a gauge per child), which docs/observability.md does not name
    and nothing reads; the multiprocess files never hold them."""
    disable_created_metrics()  # type: ignore[no-untyped-call]  # read as each scrape collects
    directory = multiprocess_dir()
    if directory is None:
        return REGISTRY
    registry = CollectorRegistry()
    SweepingCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return registry


def metrics_response() -> tuple[bytes, str]:
    """The body and content type of a ``/metrics`` answer, for any web framework."""
    return generate_latest(exposition_registry()), CONTENT_TYPE_LATEST


def start_worker_metrics_server(port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, Thread]:
    """Serve ``/metrics`` on ``port`` (``SIFT_WORKER_METRICS_PORT``) from a daemon thread.

    Call it in the worker's main process (Celery ``worker_init``), never in a prefork child.
    Port 0 picks a free port: read it from ``server.server_address[1]``.
    """
    server, thread = start_http_server(port, addr, registry=exposition_registry())
    return server, thread


# this process's /metrics: not served, WAITING (a thread binds its port once it is free) or
# SERVING; _state["now"], changed with _lock held
WAITING, SERVING = "waiting", "serving"
_state: dict[str, str | None] = {"now": None}
_lock = Lock()
# A port in use is tried again this often, until it is free: the `sift worker` this one
# replaces holds it until its warm shutdown ends (up to 25 s at the defaults)
METRICS_PORT_RETRY_SECONDS = 1.0


class WorkerMetricsSettings(Protocol):
    """What a worker's ``/metrics`` is set up from: :class:`worker.settings.Settings` (which
    observability does not import)."""

    @property
    def worker_metrics_port(self) -> int: ...
    @property
    def generation_model_id(self) -> str | None: ...
    @property
    def search_backend(self) -> str: ...
    @property
    def native_fusion(self) -> bool: ...


def serve_worker_metrics(settings: WorkerMetricsSettings) -> None:
    """A worker's start (``sift worker``'s supervisor, or a Celery worker's main process):
    every series it will write created at zero, then ``/metrics`` served on
    ``SIFT_WORKER_METRICS_PORT``. The model's and the backend's series too: a rate or an
    increase over a series that first appears at its first event would miss that event.
    Raises :class:`OSError` when the port cannot be bound. Once a process: ``sift worker``
    run as one process serves it before its wait for Redis, and Celery's ``worker_init``
    calls again after it (a second bind failed); nor while a thread of
    :func:`serve_worker_metrics_when_free` waits for the port."""
    with _lock:
        if _state["now"] is None:
            _serve(settings)


def serve_worker_metrics_when_free(
    settings: WorkerMetricsSettings, say: Callable[[str], None]
) -> bool:
    """:func:`serve_worker_metrics`, and on a port in use (the worker this one replaces, still
    in its warm shutdown), a daemon thread that binds it once it is free, trying every
    :data:`METRICS_PORT_RETRY_SECONDS`, each step said through ``say``. Answers whether it
    is served now; raises :class:`OSError` for any other failure to bind."""
    port = settings.worker_metrics_port
    with _lock:
        if _state["now"] is not None:
            return _state["now"] == SERVING
        try:
            _serve(settings)
            return True
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            _state["now"] = WAITING
    say(
        f"worker metrics not served on :{port} yet: the port is in use (the worker this one "
        "replaces, still stopping?); trying it again every second"
    )

    def bind_once_free() -> None:
        while True:
            time.sleep(METRICS_PORT_RETRY_SECONDS)
            with _lock:
                try:
                    _serve(settings)
                except OSError as exc:
                    if exc.errno == errno.EADDRINUSE:
                        continue
                    _state["now"] = None
                    say(f"worker metrics not served on :{port}: {exc}")
                    return
            say(f"worker metrics on :{port}/metrics, the port free now")
            return

    Thread(target=bind_once_free, name="sift-metrics-port", daemon=True).start()
    return False


def _serve(settings: WorkerMetricsSettings) -> None:
    """Every series at zero, then the server (call with ``_lock`` held)."""
    model = settings.generation_model_id
    preregister(
        models=[model] if model else [],
        backend=settings.search_backend,
        queues=ALL_QUEUES,
        native_fusion=settings.native_fusion,
        tasks=TASK_NAMES,
    )
    start_worker_metrics_server(settings.worker_metrics_port)
    _state["now"] = SERVING


def snapshot(
    registry: Collector | None = None,
) -> Mapping[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition as ``{(name, sorted labels): value}``, for tests and tools."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in (registry or exposition_registry()).collect():
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out

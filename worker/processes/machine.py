"""What this machine gives a process: the cores it may use, the files it may open."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
from pathlib import Path
from typing import TYPE_CHECKING

from worker.redis_client import worker_connections

if TYPE_CHECKING:
    from worker.settings import Settings

log = logging.getLogger(__name__)


def cpu_count() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota
    (``docker run --cpus``) rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return max(1, cores)


#: Open files a worker process holds beside its sockets to the model and Redis: some 30 idle
#: (its log, its metrics files, the data folder's lock, the broker's connections), and the
#: embedded backend's two files per SQLite connection, webhook deliveries, the embedder's.
OPEN_FILES_MARGIN = 128


def open_file_uses(settings: Settings) -> list[tuple[str, int]]:
    """What a worker process at ``settings`` may hold open at once, each use with its count:
    a socket for each model call in flight (held for the call's seconds), a Redis connection
    for each of its threads and its own loops in the job store's pool
    (:func:`worker_connections`) and as many in the rate budget's when a model is set
    (deploy/README.md §2), and the margin for its files.

    >>> from worker.settings import load_settings
    >>> at = dict(redis_url="redis://r/0", worker_concurrency=300, batch_item_concurrency=300)
    >>> sum(count for _, count in open_file_uses(load_settings(**at, generation_model=None)))
    760
    >>> model = "anthropic:claude-haiku-4-5"
    >>> at.update(generation_model=model, rerank_max_in_flight=300, rate_budget_enabled=True)
    >>> sum(count for _, count in open_file_uses(load_settings(**at)))
    1692
    """
    redis = worker_connections(settings)
    threads = (
        f"SIFT_WORKER_CONCURRENCY {settings.worker_concurrency} + "
        f"SIFT_BATCH_ITEM_CONCURRENCY {settings.batch_item_concurrency} + 32"
    )
    uses = [(f"Redis connections of the job store ({threads})", redis)]
    if settings.generation_model_id is not None:
        calls = f"model calls in flight (SIFT_RERANK_MAX_IN_FLIGHT {settings.rerank_max_in_flight})"
        uses.append((calls, settings.rerank_max_in_flight))
        if settings.rate_budget_enabled and settings.redis_url:
            uses.append(("Redis connections of the rate budget (as many)", redis))
    return [*uses, ("its files and other sockets", OPEN_FILES_MARGIN)]


def raise_open_files_limit(settings: Settings) -> None:
    """Raise this process's soft limit of open files (``RLIMIT_NOFILE``) to what its settings
    may hold at once (:func:`open_file_uses`), as far as the hard limit allows, and log a
    warning naming the settings when that is short. Past the soft limit each new socket
    fails (``Too many open files``), which showed only as the model provider's
    ``connection`` failure, the searches failed ``rerank_failed``; 1,024, a common default,
    is under the 1,692 of the defaults with a model. A start is not refused: a worker held to
    fewer files serves what fits, and the log says why the rest fails. Only the soft limit
    moves, never the hard one (a root process could raise it), and never down."""
    uses = open_file_uses(settings)
    needed = sum(count for _, count in uses)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("open files: the soft limit stays %d: %s", soft, exc)
        else:
            log.info("open files: soft limit (RLIMIT_NOFILE) raised from %d to %d", soft, target)
            soft = target
    if soft < needed:
        log.warning(
            "open files: the limit (RLIMIT_NOFILE) is %d (hard %d), short of the %d this "
            "worker may hold at once: %s; past it a new socket fails (Too many open files), "
            "a model call as a connection error. Raise the hard limit (ulimit -Hn, systemd "
            "LimitNOFILE=, docker --ulimit nofile=) or lower those settings",
            soft, hard, needed, ", ".join(f"{count} {what}" for what, count in uses),
        )  # fmt: skip

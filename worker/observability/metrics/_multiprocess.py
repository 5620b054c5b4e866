"""Multiprocess mode: every process writes its values to files in one folder, and the exposition
sums them, forgetting the live gauges of processes that are gone.

The folder is ``PROMETHEUS_MULTIPROC_DIR``, prometheus-client's own variable (as
``ANTHROPIC_BASE_URL`` is the SDK's), so it is not a ``SIFT_`` setting.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from prometheus_client import values as _prometheus_values
from prometheus_client.metrics import Gauge
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from worker.observability.metrics._series import ALL_METRICS
from worker.pids import alive

log = logging.getLogger(__name__)

MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's own variable: when set, values live in files there (multiprocess mode)."""


def multiprocess_dir() -> str | None:
    """The directory of multiprocess mode, or None in single-process mode."""
    return os.environ.get(MULTIPROC_DIR_ENV) or None


def ensure_multiprocess_dir() -> None:
    """Make the folder ``PROMETHEUS_MULTIPROC_DIR`` names, if it is set and missing, before the
    first value is written there (prometheus-client opens its files in it and does not make it).

    For a process that keeps others' files (the gateway): it empties nothing. deploy/k8s mounts
    an ``emptyDir`` at ``/tmp``, which hides the ``/tmp/sift-metrics`` the image made."""
    directory = multiprocess_dir()
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)


def setup_multiprocess(directory: str | os.PathLike[str]) -> Path:
    """Switch to multiprocess mode with a clean ``directory``, once, before forking: in the
    supervisor of worker processes, or in a worker run as one process (``sift worker``).

    Empties the directory of value files from an earlier run, exports
    ``PROMETHEUS_MULTIPROC_DIR`` for the children, and switches this process to file-backed
    values. Raises RuntimeError if a metric has already been recorded in this process.
    """
    recorded = [m for m in ALL_METRICS if getattr(m, "_metrics", None)]
    if recorded:
        names = ", ".join(sorted(m._name for m in recorded))
        raise RuntimeError(f"setup_multiprocess() must run before anything is recorded: {names}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _warn_if_shared(path)
    for stale in path.glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_DIR_ENV] = str(path)
    # prometheus-client picks its value class once, when first imported; pick again now that
    # the directory is known, so values created from here on go to files.
    _prometheus_values.ValueClass = _prometheus_values.get_value_class()  # type: ignore[no-untyped-call]
    return path


def _warn_if_shared(path: Path) -> None:
    """Say so when ``path`` holds files of another process still running: it shares the
    folder (two ``sift worker``, or a worker and a gateway, given one
    ``PROMETHEUS_MULTIPROC_DIR``). Emptying it takes that process's values from its
    ``/metrics`` for good, and while both write there each serves the other's too. A warning,
    not a refusal: the pid may be an unrelated process that reused a dead writer's number."""
    pids = {int(m.group(1)) for f in path.glob("*.db") if (m := _VALUE_FILE.match(f.name))}
    live = sorted(pid for pid in pids if pid != os.getpid() and alive(pid))
    if live:
        log.warning(
            "PROMETHEUS_MULTIPROC_DIR %s holds the metrics files of running pid(s) %s: give each "
            "sift worker and gateway a folder of its own; emptying it now",
            path,
            ", ".join(map(str, live)),
        )


def mark_process_dead(pid: int) -> None:
    """A child process exited: drop its share of the live gauges (its counters stay, and
    are merged once it is gone: :func:`merge_dead_process`, which this hook, run in the
    exiting child itself by Celery, must not do).

    Celery: ``worker_process_shutdown.connect(lambda pid=None, **_: mark_process_dead(pid))``.
    gunicorn: ``def child_exit(server, worker): mark_process_dead(worker.pid)``.
    """
    directory = multiprocess_dir()
    if directory is not None:
        _drop_live_gauges(pid, directory)


_LIVE_GAUGE_MODES: Final = sorted(m for m in Gauge._MULTIPROC_MODES if m.startswith("live"))


def _drop_live_gauges(pid: int, directory: str | os.PathLike[str]) -> None:
    """Remove ``pid``'s live-gauge files, those already gone included: the supervisor (as its
    child exits) and a scrape's sweep (which finds the pid dead) drop the same files at the
    same moment, and prometheus-client's ``mark_process_dead`` raised FileNotFoundError in
    whichever came second (it lists the files, then removes them), killing the supervisor's
    thread."""
    for mode in _LIVE_GAUGE_MODES:
        Path(directory, f"gauge_{mode}_{pid}.db").unlink(missing_ok=True)


_VALUE_FILE = re.compile(r"^[a-z_]+_(\d+)\.db$")  # counter_12.db, gauge_livesum_12.db, ...


# A dead process's counters and histograms are added into the file of this name in place of
# a pid (``counter_merged.db``, ``histogram_merged.db``): their values only add up. Every
# gauge Sift defines is a live one, dropped with its process, so no other file is left.
MERGED: Final = "merged"
_MERGED_KINDS: Final = ("counter", "histogram")
# flock'ed shared by a scrape while it reads the files, exclusive by a merge, in every process
# that reads or merges the folder's files (a gateway's replicas share theirs)
_LOCK_FILE: Final = ".merge.lock"


@contextlib.contextmanager
def _files_locked(directory: str | os.PathLike[str], *, exclusive: bool) -> Iterator[None]:
    with open(Path(directory, _LOCK_FILE), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield  # closing the file lets it go


def merge_dead_process(pid: int) -> None:
    """A child process is gone for good (its supervisor has waited for it): add its counters
    and histograms into the merged files and remove its own, so the folder holds one set of
    files per running process, not one more per restart for as long as the supervisor runs
    (each scrape read every one). No count is lost, none doubled: a scrape reads the files
    only between merges, so no counter goes back. Only for a process that has exited: one
    still running would go on writing into the file removed."""
    directory = multiprocess_dir()
    if directory is not None:
        _merge_counts(pid, directory)


def _merge_counts(pid: int, directory: str | os.PathLike[str]) -> None:
    """Add ``pid``'s counter and histogram values into the merged files, then remove its
    files; nothing when they are gone already (a scrape's sweep and the supervisor may both
    come to it). Killed between the two (the supervisor SIGKILLed), its counts are in both
    files: the folder is emptied when the supervisor starts again anyway."""
    with _files_locked(directory, exclusive=True):
        for kind in _MERGED_KINDS:
            dead = Path(directory, f"{kind}_{pid}.db")
            if not dead.exists():
                continue
            values = _values_in(dead)
            if values:
                merged = MmapedDict(str(Path(directory, f"{kind}_{MERGED}.db")))  # type: ignore[no-untyped-call]
                try:
                    for key, value, timestamp, _ in values:
                        total, _ = merged.read_value(key)  # type: ignore[no-untyped-call]
                        merged.write_value(key, total + value, timestamp)  # type: ignore[no-untyped-call]
                finally:
                    merged.close()  # type: ignore[no-untyped-call]
            dead.unlink(missing_ok=True)


def _values_in(path: Path) -> list[tuple[str, float, float, int]]:
    """A value file's keys and values; none for one its process never wrote a header in
    (it died as it created the file)."""
    if not _has_header(str(path)):
        return []
    return list(MmapedDict.read_all_values_from_file(str(path)))  # type: ignore[no-untyped-call]


def sweep_dead_processes(directory: str | os.PathLike[str]) -> list[int]:
    """Mark dead every pid whose files remain but whose process is gone: its live gauges
    dropped, its counters and histograms merged (:func:`merge_dead_process`), for the
    processes that died without their supervisor's word (a prefork child, a gateway
    replica)."""
    pids = {
        int(match.group(1))
        for path in Path(directory).glob("*.db")
        if (match := _VALUE_FILE.match(path.name))
    }
    dead = [pid for pid in sorted(pids) if not alive(pid)]
    for pid in dead:
        _drop_live_gauges(pid, directory)
        _merge_counts(pid, directory)
    return dead


class SweepingCollector(MultiProcessCollector):
    """Sums every process's files, after forgetting the live gauges of dead processes.

    A file a starting process has just created is still empty (prometheus-client sizes it
    and writes its header a moment later): it is left out of this collection rather than
    failing the whole scrape (``struct.error``), as ``MultiProcessCollector`` would.
    """

    def collect(self) -> Any:
        sweep_dead_processes(self._path)
        with _files_locked(self._path, exclusive=False):  # no merge between list and read
            files = [f for f in glob.glob(os.path.join(self._path, "*.db")) if _has_header(f)]
            return self.merge(files, accumulate=True)  # type: ignore[no-untyped-call]


def _has_header(path: str) -> bool:
    try:
        return os.path.getsize(path) >= 8  # the used-bytes word and its padding
    except OSError:  # removed meanwhile (a dead process's live gauge)
        return False

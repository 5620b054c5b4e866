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

from worker.observability.metrics import _allocated
from worker.observability.metrics._series import ALL_METRICS
from worker.pids import alive

log = logging.getLogger(__name__)

MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's own variable: when set, values live in files there (multiprocess mode)."""

# Every process that records imports this package before its first value opens a file (every
# metric has labels), so here, not in setup_multiprocess(): the processes a `sift worker`
# supervises and the gateway never call it. A full folder then drops values, where it killed
# the process with SIGBUS (_allocated).
_allocated.install()


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

    Empties the directory of value files from an earlier run (and of a merge it left half
    done, whose journal would have the next scrape skip a new process of the pid), exports
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
    for stale in [*path.glob("*.db"), *_merge_files(path)]:
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
# A merge writes the merged files' next contents beside them (``counter_merged.db.next``),
# then names the process they include in the journal, by a rename: that rename is the moment
# the merge happens. Neither name ends in ``.db``, so no collector reads them as values.
_NEXT: Final = ".next"
_JOURNAL: Final = ".merge.journal"


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
    only between merges, so no counter goes back, and a merger killed partway leaves a merge
    the scrape and the next merge finish (:func:`_merge_counts`). Only for a process that has
    exited: one still running would go on writing into the file removed."""
    directory = multiprocess_dir()
    if directory is not None:
        _merge_counts(pid, directory)


def _merge_counts(pid: int, directory: str | os.PathLike[str]) -> None:
    """Add ``pid``'s counter and histogram values into the merged files, then remove its
    files; nothing when they are gone already (a scrape's sweep and the supervisor may both
    come to it).

    Crash-safe: the merged files are never written in place. Their next contents go to files
    of their own, and the journal naming ``pid`` is renamed into place; only then are the
    next files renamed over the merged ones and ``pid``'s removed (:func:`_finish_merge`). A
    merger killed before the journal's rename leaves the files as they were (the next ones
    are dropped); killed after it, the scrape and the next merge read the journal, so
    ``pid``'s counts are in exactly one file read either way. Killed, not a power cut: the
    files are not synced, as the values processes write in them are not. With no room to
    write the next files or the journal (a full disk), the merge is dropped the same way:
    ``pid``'s files stay, counted by each scrape, for a later sweep (:func:`_merge_failed`)."""
    with _files_locked(directory, exclusive=True):
        _finish_merge(directory)  # one a merger killed left half done
        wrote = False
        try:
            for kind in _MERGED_KINDS:
                dead = Path(directory, f"{kind}_{pid}.db")
                if dead.exists():
                    wrote = True
                    _write_sum(_merged(directory, kind), dead, _merged(directory, kind, _NEXT))
            if wrote:
                _write_journal(directory, pid)
                _unmerged.discard(str(directory))  # a later failure is said again
        except OSError as exc:
            _merge_failed(pid, directory, exc)
        _finish_merge(directory)


_unmerged: set[str] = set()  # the folders whose merge failed, said so since the last that did not


def _merge_failed(pid: int, directory: str | os.PathLike[str], exc: OSError) -> None:
    """A merge that could not write (a full disk) leaves ``pid``'s files where they are,
    counted by each scrape, for the next sweep to merge: said once a folder, not at each
    scrape or restart. The next files it began are dropped by :func:`_finish_merge`."""
    if str(directory) not in _unmerged:
        _unmerged.add(str(directory))
        log.warning(
            "metrics: could not merge the files of exited pid %d in %s (%s); they stay "
            "and are merged once there is room",
            pid,
            directory,
            exc.strerror or exc,
        )


def _merged(directory: str | os.PathLike[str], kind: str, suffix: str = "") -> Path:
    return Path(directory, f"{kind}_{MERGED}.db{suffix}")


def _write_sum(merged: Path, dead: Path, target: Path) -> None:
    """Write into ``target`` the values of ``merged`` (when there) plus those of ``dead``."""
    totals: dict[str, tuple[float, float]] = {}
    for path in (merged, dead):
        if path.exists():
            for key, value, timestamp, _ in _values_in(path):
                totals[key] = (totals.get(key, (0.0, 0.0))[0] + value, timestamp)
    written = _allocated.AllocatedMmapedDict(str(target))  # OSError with no room, not SIGBUS
    try:
        for key, (value, timestamp) in totals.items():
            written.write_value(key, value, timestamp)  # type: ignore[no-untyped-call]
    finally:
        written.close()  # type: ignore[no-untyped-call]


def _write_journal(directory: str | os.PathLike[str], pid: int) -> None:
    """Name ``pid`` in the journal, whole or not at all: written aside, then renamed."""
    aside = Path(directory, _JOURNAL + _NEXT)
    aside.write_text(str(pid))
    os.replace(aside, Path(directory, _JOURNAL))


def _journaled(directory: str | os.PathLike[str]) -> int | None:
    """The process whose merge the journal records as done but not yet tidied, if any."""
    try:
        return int(Path(directory, _JOURNAL).read_text())
    except FileNotFoundError:
        return None


def _finish_merge(directory: str | os.PathLike[str]) -> None:
    """Under the exclusive lock: bring a merge left half done to its end. Journaled, its next
    files replace the merged ones and its process's files go, then the journal (each step
    can be done again); not journaled, its next files are dropped, as if it never ran."""
    pid = _journaled(directory)
    if pid is None:
        for kind in _MERGED_KINDS:
            _merged(directory, kind, _NEXT).unlink(missing_ok=True)
        Path(directory, _JOURNAL + _NEXT).unlink(missing_ok=True)
        return
    for kind in _MERGED_KINDS:
        if _merged(directory, kind, _NEXT).exists():
            os.replace(_merged(directory, kind, _NEXT), _merged(directory, kind))
        Path(directory, f"{kind}_{pid}.db").unlink(missing_ok=True)
    Path(directory, _JOURNAL).unlink()


def _merge_files(directory: str | os.PathLike[str]) -> list[Path]:
    """A merge's own files found in ``directory``: outside a merge, one left half done."""
    names = [_JOURNAL, _JOURNAL + _NEXT, *(_merged("", k, _NEXT).name for k in _MERGED_KINDS)]
    return [path for name in names if (path := Path(directory, name)).exists()]


def _files_to_read(directory: str | os.PathLike[str]) -> list[str]:
    """Under the shared lock: the value files a scrape sums. A merge journaled and left half
    done (its merger killed) counts through its next files: its process's own files, or the
    merged ones they replace, are left out where they are still there."""
    files = [f for f in glob.glob(os.path.join(directory, "*.db")) if _has_header(f)]
    pid = _journaled(directory)
    if pid is None:
        return files
    left_out = {str(Path(directory, f"{kind}_{pid}.db")) for kind in _MERGED_KINDS}
    for kind in _MERGED_KINDS:
        if _has_header(str(_merged(directory, kind, _NEXT))):
            left_out.add(str(_merged(directory, kind)))
            files.append(str(_merged(directory, kind, _NEXT)))
    return [f for f in files if f not in left_out]


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
    replica). A merge a killed merger left half done is finished first."""
    if _merge_files(directory):
        with _files_locked(directory, exclusive=True):
            _finish_merge(directory)
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
            return self.merge(_files_to_read(self._path), accumulate=True)  # type: ignore[no-untyped-call]


def _has_header(path: str) -> bool:
    try:
        return os.path.getsize(path) >= 8  # the used-bytes word and its padding
    except OSError:  # removed meanwhile (a dead process's live gauge)
        return False

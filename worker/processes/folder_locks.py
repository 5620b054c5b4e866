"""The locks on a data folder: a ``sift up`` stack's own (:func:`claim_data_dir`), each
``sift worker``'s share of the embedded backend's folder (:func:`share_data_dir`), and the
whole folder kept from every worker while ``sift embedded-downgrade`` runs
(:func:`exclude_workers`)."""

from __future__ import annotations

import errno
import fcntl
import tempfile
from pathlib import Path
from typing import IO

from worker.errors import ConfigError
from worker.processes.stack import StackInUse

LOCK_FILE = "sift-up.lock"
# the folders a stack makes in its data folder: its logs, Redis's AOF, the metrics' files
STACK_FOLDERS = ("logs", "redis", "metrics")


def claim_data_dir(data_dir: Path, description: str) -> IO[str]:
    """Lock ``data_dir`` for this stack (``flock`` on a file in it), or raise
    :class:`StackInUse` naming the folder and the stack that holds it (a folder that cannot be
    made or written, or one of its :data:`STACK_FOLDERS`: :class:`ConfigError` naming it and
    ``--data-dir``).

    The lock lasts as long as the returned file stays open, and ends with this process
    (the children do not inherit it), however it ends. ``description`` (pid, ports) is
    written into the file for the next stack's message."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = open(data_dir / LOCK_FILE, "a+")  # noqa: SIM115 (held open: it is the lock)
    except OSError as exc:
        raise ConfigError(
            f"the data folder {data_dir} cannot be used ({exc.strerror or exc}): "
            "give a folder this user can write: --data-dir (SIFT_DATA_DIR)"
        ) from exc
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise StackInUse(
            f"the data folder {data_dir} is in use by another stack ({holder}); "
            "stop it, or give this one its own: --data-dir (SIFT_DATA_DIR)"
        ) from exc
    for name in STACK_FOLDERS:  # made by the stack once started: a traceback there
        try:
            (data_dir / name).mkdir(exist_ok=True)
            tempfile.TemporaryFile(dir=data_dir / name).close()
        except OSError as exc:
            lock.close()
            raise ConfigError(
                f"the data folder {data_dir} cannot be used ({name}/: {exc.strerror or exc}): "
                "give a folder this user can write: --data-dir (SIFT_DATA_DIR)"
            ) from exc
    lock.truncate(0)
    lock.write(description + "\n")
    lock.flush()
    return lock


def holds_data_dir(data_dir: Path) -> bool:
    """Whether a running stack holds ``data_dir`` (:func:`claim_data_dir`'s lock), probed with
    a shared lock taken and let go at once; a folder with no lock file is held by none."""
    try:
        with open(data_dir / LOCK_FILE) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(lock, fcntl.LOCK_UN)
    except FileNotFoundError:
        return False
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    return False


#: Held by each ``sift worker`` on the embedded backend's data folder (a shared lock, one per
#: worker), and by ``sift embedded-downgrade`` alone (an exclusive one) while it runs.
WORKERS_LOCK_FILE = "sift-workers.lock"


def _workers_lock(data_dir: Path, mode: int) -> IO[str] | None:
    """``flock`` ``mode`` (not waiting) on ``data_dir``'s :data:`WORKERS_LOCK_FILE`: the open
    file, which holds the lock while it stays open, or None if another holds one that excludes
    it. Not inherited by a child the process starts (Python's files close on exec)."""
    lock = open(data_dir / WORKERS_LOCK_FILE, "a+")  # noqa: SIM115 (held open: it is the lock)
    try:
        fcntl.flock(lock, mode | fcntl.LOCK_NB)
    except OSError as exc:
        lock.close()
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return None
    return lock


def share_data_dir(data_dir: Path) -> IO[str]:
    """A ``sift worker``'s share of the embedded backend's ``data_dir``, for as long as the
    returned file stays open (the process's life): ``sift embedded-downgrade`` refuses the
    folder while any worker holds one (:func:`exclude_workers`), on this host, which is the
    only one a SQLite file is shared from. :class:`StackInUse` while a downgrade runs."""
    lock = _workers_lock(data_dir, fcntl.LOCK_SH)
    if lock is None:
        raise StackInUse(
            f"the data folder {data_dir} is being downgraded (`sift embedded-downgrade`): "
            "start the workers of the release it downgrades for, once it ends"
        )
    return lock


def exclude_workers(data_dir: Path) -> IO[str] | None:
    """``data_dir`` kept from every ``sift worker`` while the returned file stays open (none
    can start), or None if a running one shares it (:func:`share_data_dir`)."""
    return _workers_lock(data_dir, fcntl.LOCK_EX)

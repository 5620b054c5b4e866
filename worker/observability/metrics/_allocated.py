"""Value files whose blocks are allocated before anything is written through their map, so a
full disk drops samples instead of killing the process.

prometheus-client's ``MmapedDict`` sizes its file with ``truncate``, which leaves it sparse,
and writes through an ``mmap`` of it: on a full filesystem the first write to a page with no
block behind it is a SIGBUS. A full ``PROMETHEUS_MULTIPROC_DIR`` killed the gateway, the
Celery workers and the ``sift worker`` supervisor that way (exit 135), leaving their jobs
running or queued. Here the file gets its blocks with ``posix_fallocate`` when it is made and
each time it grows, so a full disk is an ``OSError`` before the map reaches the new pages.
"""

from __future__ import annotations

import logging
import os
from typing import Final

from prometheus_client import values as _prometheus_values
from prometheus_client.mmap_dict import MmapedDict

log = logging.getLogger(__name__)

_INITIAL_SIZE: Final = 1 << 16  # prometheus-client's first size (mmap_dict._INITIAL_MMAP_SIZE)


def _allocate(path: str, size: int) -> None:
    """Give ``path`` real blocks for its first ``size`` bytes (making it, and growing it to
    ``size`` when shorter). Raises OSError (ENOSPC, EDQUOT, EFBIG) with the file as it was.

    Its own descriptor, not the dict's: that one is opened to append, and glibc's
    ``posix_fallocate`` refuses such a file where it writes zeros in place of a filesystem's
    missing ``fallocate``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        before = os.fstat(fd).st_size
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.ftruncate(fd, before)  # what a fallback writing zeros got through, undone
            raise
    finally:
        os.close(fd)


def _record_size(key: str) -> int:
    """The bytes ``MmapedDict._init_value`` adds for ``key``: its length, the key padded to
    8 bytes, the value and the timestamp."""
    encoded = len(key.encode("utf-8"))
    return 4 + encoded + (8 - (encoded + 4) % 8) + 16


class AllocatedMmapedDict(MmapedDict):
    """``MmapedDict`` with every page of its file allocated before it is mapped: a full disk
    raises OSError from the constructor or from the first write of a new key, the file left
    as it was. For the merge of a dead process's files, which must fail whole rather than
    journal a sum it could not write."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        if not read_mode:  # read, a hole is only zeros
            size = os.path.getsize(filename) if os.path.exists(filename) else 0
            _allocate(filename, size or _INITIAL_SIZE)
        super().__init__(filename, read_mode)  # type: ignore[no-untyped-call]

    def _init_value(self, key: str) -> None:
        needed = self._used + _record_size(key)
        if needed > self._capacity:
            capacity = self._capacity
            while needed > capacity:  # as prometheus-client grows it, then remaps
                capacity *= 2
            _allocate(self._fname, capacity)
        super()._init_value(key)  # type: ignore[no-untyped-call]


class RecordingMmapedDict(AllocatedMmapedDict):
    """The value file of a process that records: where the disk has no room, a value is
    dropped (logged once, until the disk has room again), never an error. A metric must not
    fail a search or stop a process; the in-process value goes on counting, and its next
    write once there is room puts its whole total in the file.

    Constructed with no room, it holds no file, and tries again at each value without a place."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        self._fname = filename
        self._mapped = False
        self._positions: dict[str, int] = {}
        self._attach()

    def _attach(self) -> bool:
        """Map the file (allocated): False, the value dropped, where there is no room."""
        if not self._mapped:
            try:
                AllocatedMmapedDict.__init__(self, self._fname)
            except OSError as exc:
                _no_room(self._fname, exc)
                return False
            self._mapped = True
        return True

    def _has(self, key: str) -> bool:
        """``key`` has its place in the file, made now if need be; False: dropped."""
        if key in self._positions:
            return True
        if not self._attach():
            return False
        try:
            self._init_value(key)
        except OSError as exc:
            _no_room(self._fname, exc)
            return False
        _room_again(self._fname)
        return True

    def read_value(self, key: str) -> tuple[float, float]:
        if not self._has(key):
            return 0.0, 0.0
        value: tuple[float, float] = super().read_value(key)  # type: ignore[no-untyped-call]
        return value

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        if self._has(key):
            super().write_value(key, value, timestamp)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        if self._mapped:
            self._mapped = False
            super().close()  # type: ignore[no-untyped-call]


_dropping = False  # this process has said it drops values, and has not had room since


def _no_room(path: str, exc: OSError) -> None:
    global _dropping
    if not _dropping:
        _dropping = True
        log.warning(
            "metrics: no room for %s (%s): dropping new metric values until there is; "
            "give PROMETHEUS_MULTIPROC_DIR more space",
            path,
            exc.strerror or exc,
        )


def _room_again(path: str) -> None:
    global _dropping
    if _dropping:
        _dropping = False
        log.warning("metrics: %s has room again: recording", os.path.dirname(path))


def install() -> None:
    """Have prometheus-client make every value file of this process (and of the processes it
    forks) a :class:`RecordingMmapedDict`: it looks the class up when a process opens its
    file, so this holds for every value not yet opened."""
    _prometheus_values.MmapedDict = RecordingMmapedDict  # type: ignore[attr-defined]

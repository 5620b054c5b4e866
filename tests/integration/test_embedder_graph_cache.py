"""The int8-compute graph's cache folder after what happens to the processes that make it:
one killed half-way leaves its work behind for the next maker to clear, a filesystem that
refuses locks (NFS with no lock daemon: ``ENOLCK``) still gets its graph made, and the graph
reaches the disk before its name does.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from worker.adapters import int8_graph
from worker.adapters.embedder import default_model_path
from worker.adapters.int8_graph import int8_compute_model

MAKE = (
    "import sys; from pathlib import Path; "
    "from worker.adapters.embedder import default_model_path; "
    "from worker.adapters.int8_graph import int8_compute_model; "
    "int8_compute_model(default_model_path(), Path(sys.argv[1]))"
)


def test_a_maker_killed_half_way_leaves_no_work_behind_once_the_graph_is_made(
    tmp_path: Path,
) -> None:
    """A process SIGKILLed while it makes the graph (the OOM killer, a supervisor's last
    resort) runs no clean-up: its temporary folder stayed in the cache for good, the fp32
    graph in it (87 MB), one more for each such kill. Now the next process to make the graph,
    holding the lock, removes what an earlier maker left."""
    maker = subprocess.Popen([sys.executable, "-c", MAKE, str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*/folded.onnx")):  # half-way: the fp32 graph is written
            assert maker.poll() is None, "the maker exited before it was killed"
            assert time.monotonic() < deadline, "the maker never started its work"
            time.sleep(0.02)
    finally:
        maker.kill()
        maker.wait()
    assert [p for p in tmp_path.iterdir() if p.is_dir()], "the kill left nothing to clear"

    made = int8_compute_model(default_model_path(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [made.name, made.name + ".lock"]


def test_a_filesystem_that_refuses_locks_still_gets_its_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``flock`` failing with ENOLCK (an NFS home folder whose server runs no lock manager):
    the graph is made without the lock, as before there was one, with a warning. Before,
    the OSError failed every embedding, so every search and ingest, where Sift had worked.
    No filesystem here refuses locks, so ``flock`` is made to answer as NFS's does."""

    def no_locks(fd: Any, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(int8_graph.fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="worker.adapters.int8_graph"):
        made = int8_compute_model(default_model_path(), tmp_path)
    assert made.is_file()
    assert any("No locks available" in r.getMessage() for r in caplog.records), caplog.text


def test_the_graph_reaches_the_disk_before_its_name_and_the_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph file that is there is taken as whole and never made again, so a power cut
    after the rename but before the bytes were written would leave an empty graph that every
    later embedding fails on. The file is fsynced before ``os.replace`` moves it into place,
    and the cache folder after it (so the new name itself survives)."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(int8_graph.os, "fsync", fsync)
    monkeypatch.setattr(int8_graph.os, "replace", replace)
    made = int8_compute_model(default_model_path(), tmp_path)
    assert made.is_file()
    assert events == ["fsync file", "replace", "fsync folder"]

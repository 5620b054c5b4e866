"""A full ``PROMETHEUS_MULTIPROC_DIR``: metric values are dropped (said once), never a SIGBUS
or an error, and a dead process's merge waits for room with its counts still read."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from worker.observability import metrics
from worker.observability.metrics import _allocated

ROOT = Path(__file__).resolve().parents[2]

# Runs in a mount namespace of its own on a tmpfs of 1 MiB at argv[1]: records, fills the
# tmpfs, records new series (a file grown, a file made) and merges a dead process's files,
# then frees the room and records again.
FULL_DISK_SCRIPT = textwrap.dedent(
    """
    import json, logging, multiprocessing, sys
    from pathlib import Path
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from prometheus_client import Counter
    from tests.full_disk import fill
    from worker.observability import metrics

    mount = Path(sys.argv[1])
    folder = mount / "prom"
    metrics.setup_multiprocess(folder)
    series = Counter("sift_fill", "one series per n", ["n"])

    def delivered(times):
        for _ in range(times):
            metrics.webhook_delivery("delivered")

    ctx = multiprocessing.get_context("fork")
    gone = ctx.Process(target=delivered, args=(3,))
    gone.start()
    gone.join()
    delivered(2)
    metrics.PrometheusRecorder().search_done("hybrid", "ok", 0.2)

    fill(mount)
    for n in range(1500):               # the counter file must grow past its first 64 KiB
        series.labels(str(n)).inc()
    metrics.JOBS_IN_FLIGHT.labels("running").inc()   # a gauge: a file of its own, new
    delivered(1)
    metrics.merge_dead_process(gone.pid)
    full = metrics.snapshot()           # its sweep tries the merge again
    files_while_full = sorted(p.name for p in folder.glob("*.db"))

    (mount / "ballast").unlink()
    series.labels("1499").inc()
    metrics.merge_dead_process(gone.pid)
    after = metrics.snapshot()

    def value(got, name, **labels):
        return got.get((name, tuple(sorted(labels.items()))))

    delivered_total = "sift_webhook_deliveries_total"
    print(json.dumps({
        "gone": gone.pid,
        "delivered_full": value(full, delivered_total, result="delivered"),
        "searches_full": value(full, "sift_search_duration_seconds_count", mode="hybrid",
                               outcome="ok"),
        "files_while_full": files_while_full,
        "delivered_after": value(after, delivered_total, result="delivered"),
        "fill_after": value(after, "sift_fill_total", n="1499"),
        "files_after": sorted(p.name for p in folder.glob("*.db")),
    }))
    """
)


def test_a_full_metrics_folder_drops_values_and_the_process_lives_on(
    small_tmpfs: list[str], tmp_path: Path
) -> None:
    """prometheus-client grew its files sparse and wrote through a map: on a full disk the
    first write to a new page was a SIGBUS (the gateway, the workers and the supervisor died
    with exit 135). A value with no room is now dropped, said once; what was recorded before
    is still read; a dead process's merge leaves its files (still counted) until there is
    room; then values and the merge go on."""
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_SCRIPT)
    run = subprocess.run(
        [*small_tmpfs, sys.executable, str(script), str(tmp_path / "mnt")],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    got = json.loads(run.stdout)
    # 3 of the dead process (unmerged) + 3 of this one: a series with its place in the file
    # records on a full disk, only a new one has no room
    assert got["delivered_full"] == 6
    assert got["searches_full"] == 1
    gone = got["gone"]
    assert f"counter_{gone}.db" in got["files_while_full"]
    assert got["delivered_after"] == 6  # merged: nothing lost, nothing doubled
    assert got["fill_after"] == 2  # its first one counted in-process, written whole now
    assert f"counter_{gone}.db" not in got["files_after"]
    assert "counter_merged.db" in got["files_after"]
    assert run.stderr.count("dropping new metric values") == 1, run.stderr
    assert run.stderr.count("could not merge") == 1, run.stderr
    assert run.stderr.count("has room again") == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_a_value_file_has_every_block_before_a_value_is_written(tmp_path: Path) -> None:
    """Sized by ``truncate``, the file was sparse: the map wrote into pages with no block,
    where a full disk is a SIGBUS. The class prometheus-client uses for a process's values
    allocates the file as it makes it and as it grows it."""
    from prometheus_client import values

    path = tmp_path / "counter_1.db"
    written = values.MmapedDict(str(path))  # type: ignore[no-untyped-call]
    try:
        for n in range(1500):  # past its first 64 KiB
            written.write_value(
                json.dumps(["sift_x", "sift_x_total", {"n": str(n)}, "x"]), 1.0, 0.0
            )
        size = os.stat(path).st_size
        assert size > 1 << 16
        assert os.stat(path).st_blocks * 512 >= size
    finally:
        written.close()


@pytest.fixture
def no_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every allocation of a metrics file fails as on a full disk."""

    def full(path: str, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(_allocated, "_allocate", full)
    monkeypatch.setattr(_allocated, "_dropping", False)


def test_a_value_with_no_room_is_dropped_and_said_once(
    no_room: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client import values

    caplog.set_level(logging.WARNING, logger=_allocated.__name__)
    written = values.MmapedDict(str(tmp_path / "counter_1.db"))  # type: ignore[no-untyped-call]
    for n in range(3):
        written.write_value(f"key{n}", 1.0, 0.0)
        assert written.read_value(f"key{n}") == (0.0, 0.0)
    written.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "dropping new metric values" in said[0], said


def test_a_merge_with_no_room_leaves_the_files_counted_once(
    no_room: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client.mmap_dict import MmapedDict

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    key = json.dumps(["sift_demo", "sift_demo_total", {}, "demo"])
    written = MmapedDict(str(tmp_path / f"counter_{dead}.db"))  # type: ignore[no-untyped-call]
    written.write_value(key, 4.0, 0.0)  # type: ignore[no-untyped-call]
    written.close()  # type: ignore[no-untyped-call]
    metrics.merge_dead_process(dead)
    registry = CollectorRegistry()
    metrics.SweepingCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    assert metrics.snapshot(registry)[("sift_demo_total", ())] == 4.0
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".merge.lock")) == [
        f"counter_{dead}.db"
    ]

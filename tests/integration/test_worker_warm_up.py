"""A worker loads its embedding model when it starts, not on its first search: on a machine's
first start it makes the int8-compute graph then too.

Before, the first search (or ingest) of each worker process paid for it: about a second to
load the model session, and on a fresh machine about 2.8 s more to make the graph
(``sift up`` then ``sift search``: embed 1.26 s against 3 ms for the next). Here a real
worker, given an empty model cache and no job at all, makes the graph and loads the model;
a worker that only delivers webhooks, which never embeds, loads nothing.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.services import celery_worker, free_port, redis_server

LOADED = "loaded embedding model"


def _log_says(log: Path, text: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if log.is_file() and text in log.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def test_a_worker_loads_its_model_at_start_with_no_job_sent(tmp_path: Path) -> None:
    models = tmp_path / "models"  # a fresh machine's: no int8 graph made yet
    with redis_server(tmp_path / "redis") as url:
        env = {
            "SIFT_REDIS_URL": url + "/0",
            "SIFT_DATA_DIR": str(tmp_path / "data"),  # both workers' (one Redis: one folder)
            "SIFT_MODEL_CACHE_DIR": str(models),
            "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
        }
        hooks = {**env, "SIFT_WORKER_METRICS_PORT": str(free_port())}
        searches = {**env, "SIFT_WORKER_METRICS_PORT": str(free_port())}
        with celery_worker(tmp_path / "hooks", hooks, "hooks", queues="sift.webhooks"):
            with celery_worker(tmp_path / "w", searches, "searches", concurrency=4):
                log = tmp_path / "w" / "searches.log"
                assert _log_says(log, LOADED, seconds=90), log.read_text()[-2000:]
            hooks_log = (tmp_path / "hooks" / "hooks.log").read_text()
    assert list(models.glob("minilm-int8-matmul-*.onnx")), "the graph was not made"
    text = log.read_text()
    assert "warm-up failed" not in text, text[-2000:]
    assert "Task sift." not in text  # no job ran: the start did it
    assert LOADED not in hooks_log, hooks_log[-2000:]


def test_a_worker_stopped_while_it_makes_the_graph_finishes_it_and_leaves_nothing_half_way(
    tmp_path: Path,
) -> None:
    """SIGTERM (Ctrl-C on ``sift up``, a rolling restart) while the warm-up makes the graph:
    the worker waits for it, then exits 0, leaving the graph made and no work folder.
    Before, the warm-up's daemon thread was dropped at exit, so the seconds spent were lost
    (the next start made it all again); and the work folder's clean-up ran at exit beside
    the thread still writing into it: some stops logged a traceback ('Directory not
    empty', a log record for each character) and left the folder (87 MB)."""
    models = tmp_path / "models"
    with redis_server(tmp_path / "redis") as url:
        env = {
            "SIFT_REDIS_URL": url + "/0",
            "SIFT_MODEL_CACHE_DIR": str(models),
            "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
            "SIFT_WORKER_METRICS_PORT": str(free_port()),
        }
        with celery_worker(tmp_path / "w", env, "w", concurrency=4) as proc:
            deadline = time.monotonic() + 90
            while not list(models.glob("*.making-*/folded.onnx")):  # half-way through
                assert proc.poll() is None and time.monotonic() < deadline, "no graph made"
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
    text = (tmp_path / "w" / "w.log").read_text(errors="replace")
    assert list(models.glob("minilm-int8-matmul-*.onnx")), text[-2000:]
    assert not list(models.glob("*.making-*")), sorted(p.name for p in models.iterdir())
    assert "Traceback" not in text and "warm-up failed" not in text, text[-3000:]


def test_a_prefork_worker_s_child_loads_its_model_as_it_starts_with_no_job_sent(
    tmp_path: Path,
) -> None:
    """``sift worker --pool prefork``: each child loads the model as it starts, as a
    threads-pool worker does. Before, only a threads-pool worker warmed up: a prefork child
    loaded the model at its first job (a search's ``?wait=20`` answered 202 after a restart
    on a busy 2-core host, its child's load 17-21 s), and so did every child replacing one
    that died."""
    with redis_server(tmp_path / "redis") as url:
        env = {
            "SIFT_REDIS_URL": url + "/0",
            "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
            "SIFT_WORKER_METRICS_PORT": str(free_port()),
        }
        with celery_worker(tmp_path / "w", env, "forks", concurrency=1, pool="prefork"):
            log = tmp_path / "w" / "forks.log"
            assert _log_says(log, LOADED, seconds=90), log.read_text()[-2000:]
    text = log.read_text()
    assert "warm-up failed" not in text, text[-2000:]
    assert "Task sift." not in text  # no job ran: the child's start did it
    loaded = [line for line in text.splitlines() if LOADED in line]
    assert ["ForkPoolWorker-1" in line for line in loaded] == [True], loaded

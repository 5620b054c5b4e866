"""``sift worker`` started again while the one it replaces still holds the metrics port.

A user stops ``sift worker`` (Ctrl-C, SIGTERM) and runs it again at once: the old one is in
its warm shutdown (up to 25 s at the defaults, its items handed back), and its supervisor,
or its one process, still serves ``/metrics`` on ``SIFT_WORKER_METRICS_PORT`` meanwhile. The
new one found the port taken at its start, said ``worker metrics not served`` and never tried
again: it ran with no ``/metrics`` for its whole life, every counter of its jobs unseen. Here
the old one is held where it holds the port (SIGSTOP, so the order is certain), the new one
started, then the old one killed: the new one's ``/metrics`` answers once the port is free.
Real processes at the defaults: redis-server and ``sift worker`` (two processes under their
supervisor, and one process alone, what a one-core machine runs by default).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.support import wait_for
from tests.services import free_port
from worker.processes.stack import child_env, redis_service, running, stop, worker_service

pytestmark = pytest.mark.integration


def _served(port: int) -> dict[str, float]:
    """``sift_worker_processes`` by state as the ``/metrics`` on ``port`` serves it."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        sample.labels["state"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sift_worker_processes"
    }


def _answers(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200


@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes", [2, 1], ids=["supervisor", "one-process"])
def test_a_worker_started_while_the_old_one_holds_the_metrics_port_serves_it_once_free(
    tmp_path: Path, processes: int
) -> None:
    redis_service_, redis_url = redis_service(tmp_path / "redis")
    port = free_port()
    with running(redis_service_):
        env = child_env({"SIFT_REDIS_URL": redis_url + "/0", "SIFT_WORKER_METRICS_PORT": str(port),
                         "SIFT_DATA_DIR": str(tmp_path / "data")}, inherit_sift=False)  # fmt: skip
        old_service = worker_service(tmp_path / "old", env, "old", processes=processes)
        old = old_service.start()
        new = None
        try:
            wait_for(lambda: _answers(port), "the old worker's /metrics", 120)
            os.kill(old.pid, signal.SIGSTOP)  # it holds the port, as in its warm shutdown
            new_service = worker_service(tmp_path / "new", env, "new", processes=processes)
            assert new_service.log is not None
            log = new_service.log
            new = new_service.start()
            wait_for(lambda: " ready." in log.read_text(), "the new worker ready", 120)
            assert "metrics not served" in log.read_text()  # the port was taken at its start
            os.kill(old.pid, signal.SIGKILL)
            old.wait(30)
            wait_for(lambda: _answers(port), "the new worker's /metrics, the port free", 60)
            assert new.poll() is None
            if processes > 1:  # the supervisor's own series: its two processes running
                assert _served(port) == {"running": 2, "expected": 2}
        finally:
            if old.poll() is None:
                old.kill()
                old.wait(10)
            if new is not None:
                stop(new, 40)

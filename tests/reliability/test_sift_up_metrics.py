"""``sift up`` with ``PROMETHEUS_MULTIPROC_DIR`` set (the Docker image sets it; a user may too).

The stack's worker and gateway are two scrape targets. Given one folder, each ``/metrics``
served the other's files too (the worker's carried the gateway's HTTP requests: every count
doubled in a sum over targets), and the worker, which empties its folder when it starts, took
the gateway's live files from under it when ``sift up`` restarted it: the gateway's counters
vanished from its ``/metrics`` for the rest of its life. Each gets a folder of its own, in the
stack's data folder, emptied when the stack starts (the gateway never empties its own).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.reliability.support import wait_for
from tests.reliability.test_sift_up import UP_TIMEOUT, Stack, _env, _worker_pid
from tests.services import free_port, http_get
from worker.processes.stack import stop

pytestmark = pytest.mark.integration


EARLIER_RUN = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from api_gateway.metrics import GatewayMetrics
GatewayMetrics().requests.labels("GET", "/healthz", "200").inc(5)
"""


def _healthz(text: str) -> float:
    found = re.findall(
        r'^sift_http_requests_total\{method="GET",route="/healthz",status="200"\} (\S+)$',
        text,
        re.MULTILINE,
    )
    return sum(float(value) for value in found)


@pytest.mark.timeout(400)
def test_the_worker_and_the_gateway_keep_their_metrics_apart(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    env = {**_env(), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "multiproc")}
    (tmp_path / "multiproc").mkdir()
    # an earlier sift up on this data folder left its gateway's files behind
    earlier = tmp_path / "a" / "metrics" / "gateway"
    earlier.mkdir(parents=True)
    written = subprocess.run([sys.executable, "-c", EARLIER_RUN, str(earlier)], env=env)
    assert written.returncode == 0
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "up", "--port", str(port),
             "--metrics-port", str(metrics_port), "--data-dir", str(tmp_path / "a")],
            cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    stack = Stack(proc, out, tmp_path / "a", port, metrics_port)
    worker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        wait_for(lambda: "Ctrl-C stops everything" in stack.printed(), "sift up", UP_TIMEOUT)
        for _ in range(3):
            assert httpx.get(stack.url + "/healthz", timeout=10).status_code == 200
        gateway = httpx.get(stack.url + "/metrics", timeout=10).text
        assert _healthz(gateway) == 3.0
        # the gateway's requests are the gateway target's alone
        assert _healthz(httpx.get(worker_metrics, timeout=10).text) == 0.0
        os.kill(_worker_pid(stack), signal.SIGKILL)
        wait_for(lambda: "worker restarted" in stack.printed(), "sift up restarted it", 60)
        wait_for(
            lambda: http_get(worker_metrics, timeout=10).status_code == 200,
            "the new worker serves /metrics",
            UP_TIMEOUT,
        )
        # the restarted worker emptied its folder, not the gateway's
        assert _healthz(httpx.get(stack.url + "/metrics", timeout=10).text) == 3.0
    finally:
        stop(proc, timeout=60)
        print(stack.printed())

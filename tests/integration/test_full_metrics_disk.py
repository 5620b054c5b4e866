"""A full ``PROMETHEUS_MULTIPROC_DIR`` under a running stack: the gateway, a ``sift worker``
supervisor and its worker processes go on answering, and no process dies.

prometheus-client wrote its value files through a map of a sparse file, so on a full disk the
first new series killed each process with SIGBUS (exit 135): the gateway stopped answering
and searches stayed queued. Real processes: redis-server, ``sift worker`` with two processes
under its supervisor, the gateway, the fake model; their metrics folders on a tmpfs of 1 MiB
in a mount namespace of their own (``unshare``), filled once the stack serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

STACK_ON_A_FULL_DISK = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import httpx
    from tests.fake_anthropic import FakeAnthropic
    from tests.full_disk import fill
    from tests.keys import ACME
    from tests.reliability.support import INDEX, stack_env
    from tests.services import celery_worker, free_port, gateway, redis_server

    tmp, mount = Path(sys.argv[1]), Path(sys.argv[2])

    def children(pid):
        return sorted(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())

    report = {}
    with redis_server(tmp / "redis") as base_url, FakeAnthropic() as model:
        metrics_port = free_port()
        env = stack_env(base_url + "/0", model.url)
        worker_env = {**env, "SIFT_WORKER_METRICS_PORT": str(metrics_port),
                      "PROMETHEUS_MULTIPROC_DIR": str(mount / "worker")}
        gateway_env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(mount / "gateway")}
        with (
            celery_worker(tmp / "w", worker_env, "w1", concurrency=4, processes=2) as worker,
            gateway(tmp / "g", gateway_env, "g1") as url,
            httpx.Client(base_url=url, timeout=60, headers=ACME) as client,
        ):
            docs = [{"id": f"d{i}", "text": f"green tea number {i}"} for i in range(20)]
            ingested = client.post(f"/v1/indexes/{INDEX}/documents", params={"wait": 30},
                                   json={"documents": docs}).json()
            waited = time.monotonic() + 120  # a worker still warming up on a loaded machine
            while ingested.get("finished_at") is None and time.monotonic() < waited:
                time.sleep(0.2)
                ingested = client.get(f"/v1/ingestions/{ingested['id']}").json()
            report["ingest"] = ingested.get("status")
            before = children(worker.pid)
            fill(mount)
            report["free"] = __import__("shutil").disk_usage(mount).free
            answers = []
            for i, mode in enumerate(["hybrid", "fts", "vector"] * 4):
                got = client.post("/v1/searches", params={"wait": 30},
                                  json={"index": INDEX, "query": f"green tea {i}", "mode": mode})
                answers.append([got.status_code, got.json().get("status")])
            missing = client.post("/v1/searches", params={"wait": 30},
                                  json={"index": "nosuch", "query": "tea"})
            answers.append([missing.status_code, missing.json().get("status")])
            for path in ("/v1/indexes", "/v1/ingestions", "/v1/batches/bat_nope", "/nope"):
                answers.append([client.get(path).status_code, path])
            report["answers"] = answers
            report["gateway_metrics"] = httpx.get(f"{url}/metrics", timeout=30).status_code
            report["worker_metrics"] = httpx.get(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).status_code
            report["readyz"] = httpx.get(f"{url}/readyz", timeout=10).status_code
            report["same_workers"] = children(worker.pid) == before
            report["supervisor_alive"] = worker.poll() is None
    print(json.dumps(report))
    """
)


def test_the_stack_answers_and_no_process_dies_when_the_metrics_disk_fills(
    small_tmpfs: list[str], tmp_path: Path
) -> None:
    script = tmp_path / "stack.py"
    script.write_text(STACK_ON_A_FULL_DISK)
    run = subprocess.run(
        [*small_tmpfs, sys.executable, str(script), str(tmp_path), str(tmp_path / "mnt")],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": os.environ["PATH"], "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["ingest"] == "succeeded", report
    assert report["free"] == 0, report  # the disk was full
    searches, missing, pages = report["answers"][:12], report["answers"][12], report["answers"][13:]
    assert searches == [[200, "succeeded"]] * 12, report
    assert missing == [200, "failed"], report  # index_not_found: a failure told, new series
    assert [code for code, _ in pages] == [200, 200, 404, 404], report
    assert report["gateway_metrics"] == 200, report
    assert report["worker_metrics"] == 200, report
    assert report["readyz"] == 200, report
    assert report["same_workers"] and report["supervisor_alive"], report

"""A prefork worker's children write their metrics to files; its /metrics sums them all."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import KEYS
from tests.services import celery_worker, free_port, gateway, redis_server

pytestmark = pytest.mark.integration

SAMPLE = Path(__file__).resolve().parents[2] / "worker" / "data" / "sample_corpus.jsonl"


def _sum(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _worker_env(tmp_path: Path, redis_url: str, metrics_port: int) -> dict[str, str]:
    """The settings of a worker (and gateway) on this Redis, its metrics on ``metrics_port``."""
    return {
        "SIFT_REDIS_URL": redis_url + "/0",
        "SIFT_API_KEYS": json.dumps(KEYS[:1]),
        "SIFT_DATA_DIR": str(tmp_path / "data"),
        "SIFT_WORKER_METRICS_PORT": str(metrics_port),
        "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
    }


def test_counts_from_every_child_are_summed(tmp_path: Path) -> None:
    port = free_port()
    with redis_server(tmp_path / "redis") as url:
        env = _worker_env(tmp_path, url, port)
        forks = {**env, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}
        with (
            celery_worker(tmp_path / "w", forks, "forks", concurrency=2, pool="prefork") as proc,
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=60) as client,
        ):
            auth = {"Authorization": f"Bearer {KEYS[0]['key']}"}
            documents = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
            ingested = client.post(
                "/v1/indexes/docs/documents", params={"wait": 30}, headers=auth,
                json={"documents": documents},
            )  # fmt: skip
            assert ingested.status_code == 200, ingested.text
            searches = 12
            for i in range(searches):
                job = client.post(
                    "/v1/searches", params={"wait": 30}, headers=auth,
                    json={"index": "docs", "query": f"tea railway volcano {i}"},
                )  # fmt: skip
                assert job.json()["status"] == "succeeded", job.text
            text = ""
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                if _sum(text, "sift_search_duration_seconds_count") >= searches:
                    break
                time.sleep(0.2)
            # the searches ran in the children; only their files can have brought the counts
            assert _sum(text, "sift_search_duration_seconds_count") == searches
            pids = {f.stem.rsplit("_", 1)[-1] for f in (tmp_path / "metrics").glob("*.db")}
            assert pids - {str(proc.pid)}, "no child wrote a metrics file"


STALE_GAUGE = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from worker.observability import metrics
metrics.JOBS_IN_FLIGHT.labels("running").inc(5)   # jobs running when this process was killed
metrics.JOBS_COMPLETED.labels("search", "succeeded").inc(7)
print(os.getpid())
"""


def test_a_single_process_worker_starts_on_a_clean_metrics_folder(tmp_path: Path) -> None:
    """The Docker image sets PROMETHEUS_MULTIPROC_DIR for every container, and deploy/k8s runs
    one worker process per pod (SIFT_WORKER_PROCESSES from requests.cpu: 1) on an emptyDir
    /tmp that outlives a container restart. The restarted worker is PID 1 again, so its
    predecessor's live-gauge files looked alive and were summed in for good:
    sift_jobs_in_flight{state="running"} kept the jobs running at the kill. A worker that
    finds files from an earlier run must start from none (a counter reset, which Prometheus
    takes in its stride)."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "metrics"
    folder.mkdir()
    written = subprocess.run(
        [sys.executable, "-c", STALE_GAUGE, str(folder)], capture_output=True, text=True
    )
    assert written.returncode == 0, written.stderr
    old = int(written.stdout)
    # the predecessor's pid is in use again (PID 1 of the restarted container): here, ours
    for path in folder.glob(f"*_{old}.db"):
        path.rename(folder / path.name.replace(f"_{old}.db", f"_{os.getpid()}.db"))
    port = free_port()
    with redis_server(tmp_path / "redis") as url:
        env = {**_worker_env(tmp_path, url, port), "PROMETHEUS_MULTIPROC_DIR": str(folder)}
        with celery_worker(tmp_path / "w", env, "solo", concurrency=2, processes=1):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    running = [line for line in text.splitlines() if line.startswith("sift_jobs_in_flight{")]
    assert running == ['sift_jobs_in_flight{state="running"} 0.0'], running
    assert 'sift_jobs_completed_total{kind="search",status="succeeded"} 0.0' in text


def test_a_single_process_worker_makes_a_missing_metrics_folder(tmp_path: Path) -> None:
    """deploy/k8s mounts an emptyDir at /tmp, hiding the image's /tmp/sift-metrics: the
    worker's PROMETHEUS_MULTIPROC_DIR names a folder that does not exist yet."""
    folder = tmp_path / "tmp" / "sift-metrics"
    folder.parent.mkdir()
    port = free_port()
    with redis_server(tmp_path / "redis") as url:
        env = {
            "SIFT_REDIS_URL": url + "/0",
            "SIFT_API_KEYS": json.dumps(KEYS[:1]),
            "SIFT_DATA_DIR": str(tmp_path / "data"),
            "SIFT_WORKER_METRICS_PORT": str(port),
            "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
            "PROMETHEUS_MULTIPROC_DIR": str(folder),
        }
        with celery_worker(tmp_path / "w", env, "solo", concurrency=2, processes=1):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'sift_jobs_in_flight{state="running"} 0.0' in text
    assert list(folder.glob("*.db"))


def test_a_celery_worker_on_the_prefork_pool_counts_what_its_children_ran(
    tmp_path: Path,
) -> None:
    """``celery -A worker.queue.celery_app worker`` (docs/queue.md's stack by hand) with
    SIFT_WORKER_POOL=prefork: its children's counts reach its /metrics. The switch to
    multiprocess mode was made only by ``sift worker``, so each child counted in its own
    memory and /metrics served every count at 0."""
    import sys

    from worker.constants import ALL_QUEUES
    from worker.processes.stack import Service, child_env, running

    port = free_port()
    with redis_server(tmp_path / "redis") as url:
        env = _worker_env(tmp_path, url, port)
        forks = {**env, "SIFT_WORKER_POOL": "prefork", "SIFT_WORKER_CONCURRENCY": "2"}
        worker_env = child_env(forks, inherit_sift=False)
        worker_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        command = [sys.executable, "-m", "celery", "-A", "worker.queue.celery_app", "worker",
                   "-Q", ",".join(ALL_QUEUES), "-n", "plain@%h", "-l", "INFO", "--without-gossip",
                   "--without-mingle"]  # fmt: skip
        celery = Service("celery worker", command, tmp_path / "celery.log", worker_env,
                         ready_line=b" ready.")  # fmt: skip
        with (
            running(celery),
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=60) as client,
        ):
            documents = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
            ingested = client.post(
                "/v1/indexes/docs/documents", params={"wait": 30},
                headers={"Authorization": f"Bearer {KEYS[0]['key']}"},
                json={"documents": documents},
            )  # fmt: skip
            assert ingested.status_code == 200, ingested.text
            counted = 'sift_jobs_completed_total{kind="ingest",status="succeeded"} 1.0'
            text = ""
            deadline = time.monotonic() + 30
            while counted not in text and time.monotonic() < deadline:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                time.sleep(0.2)
    assert counted in text, [
        line for line in text.splitlines() if line.startswith("sift_jobs_completed_total")
    ]

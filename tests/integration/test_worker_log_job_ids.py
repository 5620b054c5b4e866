"""Every line a real worker logs for a job carries the job's id in its ``[...]`` slot
(STYLE.md 11), Celery's own lines around a task's run too.

Celery logs a task's end (``Task sift.search[<celery id>] succeeded in 0.39s``, a webhook's
``retry: Retry in 0.3s``, a failure) after the task's call returned, where Sift's job
context had already ended: those lines had ``[-]``, so a search's run time or a webhook's
retries could not be found by its job id."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    INDEX,
    sample_documents,
    sample_queries,
    stack_env,
    submit_batch,
    submit_search,
    wait_for,
)
from tests.services import celery_worker, free_port, gateway, redis_server, webhook_inbox

pytestmark = pytest.mark.integration

TRACE = re.compile(
    r"celery\.app\.trace \[(?P<job>[^\]]*)\] Task (?P<task>sift\.\w+)\[[^\]]*\] (?P<what>.*)"
)


@pytest.mark.timeout(180)
def test_celery_s_lines_for_a_task_carry_its_job_id(tmp_path: Path) -> None:
    with (
        FakeAnthropic(delay=0.05) as model,
        redis_server(tmp_path / "redis") as url,
        webhook_inbox() as (hook, inbox),
    ):
        env = stack_env(url + "/0", model.url)
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w", concurrency=8),
        ):
            loaded = client.post(
                f"/v1/indexes/{INDEX}/documents",
                params={"wait": 30},
                json={"documents": sample_documents()},
                headers=ACME,
            ).json()
            assert loaded["status"] == "succeeded", loaded
            query = sample_queries()[0]
            search = submit_search(client, query, webhook_url=hook)
            batch = submit_batch(client, 2, webhook_url=hook)
            nobody = f"http://127.0.0.1:{free_port()}/hook"  # refused: retried at once
            retried = submit_search(client, query, webhook_url=nobody)
            for _ in range(2):
                inbox.get(timeout=60)

            def retrying() -> bool:
                job = client.get(f"/v1/searches/{retried}", headers=ACME).json()
                return bool(job["webhook"] and job["webhook"]["attempts"] >= 3)

            wait_for(retrying, "the refused webhook's third attempt", 60)
        log = (tmp_path / "w" / "w.log").read_text(errors="replace")
    # (job, task, what) of each of Celery's lines about a task's run
    lines = [(m["job"], m["task"], m["what"]) for m in TRACE.finditer(log)]
    tagged = {(job, task) for job, task, _ in lines}
    assert (loaded["id"], "sift.ingest") in tagged, tagged
    assert (search, "sift.search") in tagged and (search, "sift.webhook") in tagged, tagged
    assert (batch, "sift.batch_chunk") in tagged and (batch, "sift.webhook") in tagged, tagged
    retries = [what for job, task, what in lines if job == retried and task == "sift.webhook"]
    assert sum("retry: Retry in" in what for what in retries) >= 2, retries
    assert all(job != "-" for job, _, _ in lines), [line for line in lines if line[0] == "-"]

"""A worker signs its webhooks with the keys file (``SIFT_API_KEYS_FILE``) it read at its start,
as the gateway serves the keys it read at its own, and refuses to start on one it cannot read.

The worker read the file again at every webhook attempt: a half-written edit (or one with a
typo, or the file gone) made every attempt of every tenant raise ``ConfigError`` out of the
task, the webhook left owed to the re-drive, while the gateway and the searches went on
unharmed; and each attempt parsed and validated every entry again (about 8 ms of CPU at 1,000
entries, 170 ms at 10,000). A worker started with such a file ran, and failed every webhook.
"""

from __future__ import annotations

import json
import queue
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from tests.keys import ACME, ACME_KEY
from tests.services import celery_worker, gateway, redis_server, webhook_inbox
from worker.processes.stack import child_env, sift_command

pytestmark = pytest.mark.integration

KEY = ACME_KEY
AUTH = ACME
INDEX = "docs"
DOCUMENTS = [
    {"id": "d1", "text": "green tea is brewed from the leaves of the tea plant"},
    {"id": "d2", "text": "honey bees make honey from the nectar of flowers"},
]
START_SECONDS = 60.0  # only ever a bound on waiting for the worker to stop on its own


def _env(redis_url: str, keys_file: Path, tmp: Path) -> dict[str, str]:
    return {
        "SIFT_REDIS_URL": redis_url,
        "SIFT_API_KEYS_FILE": str(keys_file),
        "SIFT_DATA_DIR": str(tmp / "data"),
        "SIFT_WORKER_METRICS_PORT": "0",
        "SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS": "true",
    }


@pytest.mark.timeout(180)
def test_a_keys_file_half_written_after_the_worker_started_leaves_its_webhooks_signed(
    tmp_path: Path,
) -> None:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps([KEY]))
    with (
        redis_server(tmp_path / "redis") as redis_url,
        webhook_inbox() as (hook, inbox),
    ):
        env = _env(redis_url, keys_file, tmp_path)
        with (
            celery_worker(tmp_path / "w", env, "w", concurrency=4),
            gateway(tmp_path / "g", env) as url,
            httpx.Client(base_url=url, timeout=60, headers=AUTH) as client,
        ):
            loaded = client.post(
                f"/v1/indexes/{INDEX}/documents",
                params={"wait": 30},
                json={"documents": DOCUMENTS},
            ).json()
            assert loaded["status"] == "succeeded", loaded
            # an edit caught half way (an editor's save, a config tool's copy): not JSON
            text = keys_file.read_text()
            keys_file.write_text(text[: len(text) // 2])
            body = {"index": INDEX, "query": "tea", "webhook_url": hook}
            search: dict[str, Any] = client.post(
                "/v1/searches", params={"wait": 30}, json=body
            ).json()
            assert search["status"] == "succeeded", search
            try:  # before: every attempt raised ConfigError; nothing came (the re-drive's, later)
                payload, headers = inbox.get(timeout=60)
            except queue.Empty:
                pytest.fail("no webhook: the worker read the half-written keys file to sign it")
            event = Webhook(KEY["webhook_secret"]).verify(payload, headers)
            assert event["data"]["id"] == search["id"], event


@pytest.mark.timeout(120)
def test_a_worker_does_not_start_on_a_keys_file_it_cannot_read(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps([KEY])[:40])
    with redis_server(tmp_path / "redis") as redis_url:
        env = child_env(_env(redis_url, keys_file, tmp_path), inherit_sift=False)
        command = sift_command("worker", "--name", "w", "--processes", "1")
        try:  # before: it started, to fail every webhook it was to send
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=START_SECONDS
            )
        except subprocess.TimeoutExpired:
            pytest.fail("the worker started with a keys file it cannot read")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    said = done.stdout + done.stderr
    assert "SIFT_API_KEYS_FILE" in said, said
    assert KEY["webhook_secret"] not in said and KEY["key"] not in said, said

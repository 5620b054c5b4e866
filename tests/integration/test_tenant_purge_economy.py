"""``sift tenant purge`` of a tenant whose economy batch has prompts with the provider: the
purge deleted the economy state that names its provider batches after canceling only the
Sift batch, so nothing could cancel them and they ran to their end, every request billed for
a tenant that was erased. It cancels them at the provider now, and stops, having erased
nothing, when the provider does not answer the cancel (a second run finishes)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_anthropic import FakeAnthropic, status
from tests.integration.test_economy_doubts import _prepared, _submission, context, workers
from worker.adapters.embedded import EmbeddedBackend
from worker.constants import BATCH_KEY, ECONOMY_PROVIDERS_KEY
from worker.processes.stack import child_env
from worker.queue.base import WorkerContext

__all__ = ["context", "workers"]  # fixtures (test_economy_doubts.py's)


@pytest.fixture
def model() -> Iterator[FakeAnthropic]:
    """A provider batch takes an hour: still in progress when the purge comes."""
    with FakeAnthropic(batch_processing_seconds=3600) as fake:
        yield fake


def _purge(redis_url: str, model: FakeAnthropic, data: Path) -> subprocess.CompletedProcess[str]:
    """``sift tenant purge acme`` as its own process, with the workers' model settings."""
    backend = EmbeddedBackend(data)  # the workers' data folder (the purge refuses another)
    backend.indexes("acme")  # made on first use
    backend.close()
    env = {
        "SIFT_REDIS_URL": redis_url,
        "SIFT_DATA_DIR": str(data),
        "SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5",
        "ANTHROPIC_BASE_URL": model.url,
        "ANTHROPIC_API_KEY": "sk-ant-test",
        "COLUMNS": "200",
        "NO_COLOR": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "tenant", "purge", "acme", "--yes"],
        env=child_env(env, inherit_sift=False), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_purge_cancels_the_tenants_provider_batches_and_stops_when_it_cannot(
    context: WorkerContext, model: FakeAnthropic, workers: None, redis_url: str, tmp_path: Path
) -> None:
    store = context.store
    batch, qids = _prepared(context, 3)
    _submission(context, batch, qids, "1")  # its prompts went out: one provider batch
    [made] = model.batches()
    assert made["status"] == "in_progress"

    model.script_batch_calls("cancel", [status(400, message="try later")])
    refused = _purge(redis_url, model, tmp_path / "data")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert made["id"] in refused.stderr and "nothing was erased" in refused.stderr
    assert "Traceback" not in refused.stderr
    [still] = model.batches()
    assert still["status"] == "in_progress"
    assert store.redis.exists(BATCH_KEY + batch.id, ECONOMY_PROVIDERS_KEY + batch.id) == 2

    purged = _purge(redis_url, model, tmp_path / "data")
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert f"batch {batch.id}: provider batch {made['id']} canceled" in purged.stdout
    assert re.search(r"provider batches canceled \(economy lane\)\s*│\s*1\s*│", purged.stdout)
    [canceled] = model.batches()
    assert canceled["status"] != "in_progress"
    assert store.redis.keys("*" + batch.id + "*") == []

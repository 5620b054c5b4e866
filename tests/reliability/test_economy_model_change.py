"""An economy batch's provider batch outlives the worker that sent it: a rolling deploy (or a
restart) with another ``SIFT_GENERATION_MODEL`` has a worker of the new model poll it. Its
answers are priced, traced and labelled in the metrics as the model the requests went to,
which the provider billed, not as the polling worker's.

Before, a Haiku worker's provider batch polled by a Sonnet worker showed each item's
``cost_usd`` (and the batch's, and its webhook's) at Sonnet's price, three times Haiku's, and
``sift_rerank_cost_usd_total{lane="economy",model="claude-sonnet-4-6"}`` counted it.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.economy import economy_stack, finished, submit_economy, worker
from tests.reliability.support import all_results, batch_counts, ingest, wait_for
from tests.services import free_port
from worker.core.cost import cost_usd, price_for
from worker.core.types import TokenUsage
from worker.settings import DEFAULT_PRICES

pytestmark = pytest.mark.integration

HAIKU, SONNET = "claude-haiku-4-5", "claude-sonnet-4-6"
ITEMS = 4
FAST_POLLS = {"SIFT_ECONOMY_POLL_SECONDS": "0.2", "SIFT_ECONOMY_POLL_MAX_SECONDS": "1"}


def economy_metric(url: str, name: str) -> dict[str, float]:
    """``name``'s economy-lane samples by model, from a worker's ``/metrics``."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("lane") == "economy" and sample.value:
                model = sample.labels["model"]
                found[model] = found.get(model, 0.0) + sample.value
    return found


@pytest.mark.timeout(600)
def test_a_provider_batch_polled_by_a_worker_of_another_model_is_priced_as_its_own(
    tmp_path: Path,
) -> None:
    with (
        FakeAnthropic(batch_processing_seconds=6) as model,
        economy_stack(tmp_path, model, **FAST_POLLS) as (env, client),
    ):
        with worker(tmp_path / "w", env, "haiku"):  # prepares and sends, then stops
            ingest(client)
            batch_id = submit_economy(client, ITEMS)
            wait_for(lambda: bool(model.batches()), "the provider batch made", 120)
        port = free_port()
        sonnet = {**env, "SIFT_GENERATION_MODEL": f"anthropic:{SONNET}",
                  "SIFT_WORKER_METRICS_PORT": str(port)}  # fmt: skip
        with worker(tmp_path / "w", sonnet, "sonnet"):
            wait_for(lambda: finished(client, batch_id), "the batch finished", 240)
            time.sleep(0.5)
            metrics_url = f"http://127.0.0.1:{port}/metrics"
            costs = economy_metric(metrics_url, "sift_rerank_cost_usd_total")
            tokens = economy_metric(metrics_url, "sift_rerank_tokens_total")
            durations = economy_metric(metrics_url, "sift_rerank_duration_seconds_count")
        results = all_results(client, batch_id)
        batch = batch_counts(client, batch_id)
        sent = {params["model"] for made in model.batches() for params in made["params"]}
    assert sent == {HAIKU}
    haiku = price_for(HAIKU, DEFAULT_PRICES)
    assert len(results) == ITEMS and {r["status"] for r in results} == {"succeeded"}
    for line in results:
        result = line["result"]
        usage = result["usage"]
        billed = TokenUsage(
            usage["input_tokens"], usage["output_tokens"],
            usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"],
        )  # fmt: skip
        assert usage["requests"] == 1 and billed.input_tokens > 0, usage
        assert usage["cost_usd"] == pytest.approx(cost_usd(billed, haiku, 0.5)), usage
        assert result["trace"]["model"] == HAIKU, result["trace"]
    total = sum(r["result"]["usage"]["cost_usd"] for r in results)
    assert batch["usage"]["cost_usd"] == pytest.approx(total)
    assert set(costs) == {HAIKU} and costs[HAIKU] == pytest.approx(total), costs
    assert set(tokens) == {HAIKU}, tokens
    assert durations == {HAIKU: ITEMS}, durations

"""The two lanes side by side: the same batch, standard then economy, through the real stack.

    python benchmarks/bench_lanes.py [--queries 1000] [--model-delay 1.0]
        [--batch-processing-seconds 60] [--max-requests-per-batch 100000]

Gateway + Redis + one worker process, with the Anthropic SDK pointed at the fake Messages
API on loopback (``tests/fake_anthropic.py``, in its own process). The standard lane's
calls answer after ``--model-delay`` seconds each; the economy lane's provider batches end
``--batch-processing-seconds`` after they were created (the real API takes minutes to
24 hours). Both lanes get the same answers (the fake's default) and the same usage, priced
from the built-in table for ``claude-haiku-4-5``. Printed per lane: cost per 1,000
searches (from the items' own ``usage.cost_usd``), wall time from submission to the last
item final, and the tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_queue import AUTH, INDEX, base_env, ingest, queries  # noqa: E402
from tests.fake_anthropic import fake_process  # noqa: E402
from tests.services import celery_worker, gateway, redis_server  # noqa: E402

MODEL = "claude-haiku-4-5"


def run_lane(client: httpx.Client, qs: list[str], lane: str, timeout: float) -> dict[str, Any]:
    """Submit the batch in ``lane``, wait until every item is final, read every result."""
    items = [{"id": f"q{i}", "query": q, "mode": "fts"} for i, q in enumerate(qs)]
    body = {"index": INDEX, "queries": items, "rerank": True, "lane": lane}
    started = time.perf_counter()
    response = client.post("/v1/batches", json=body, headers=AUTH)
    response.raise_for_status()
    bid = response.json()["id"]
    while True:
        batch = client.get(f"/v1/batches/{bid}", headers=AUTH).json()
        if batch["finished_at"]:
            break
        if time.perf_counter() - started > timeout:
            raise TimeoutError(f"{lane} batch {bid} did not finish: {batch['counts']}")
        time.sleep(0.1)
    seconds = time.perf_counter() - started
    cost, tokens, token = 0.0, 0, None
    while True:
        params: dict[str, Any] = {"page_size": 1000}
        if token:
            params["page_token"] = token
        page = client.get(f"/v1/batches/{bid}/results", params=params, headers=AUTH).json()
        for r in page["results"]:
            assert r["status"] == "succeeded", r
            usage = r["result"]["usage"]
            cost += usage["cost_usd"]
            tokens += usage["input_tokens"] + usage["output_tokens"]
        token = page["next_page_token"]
        if token is None:
            break
    return {
        "seconds": seconds,
        "usd_per_1k": 1000 * cost / len(qs),
        "tokens_per_search": tokens / len(qs),
        "succeeded": batch["counts"]["succeeded"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--model-delay", type=float, default=1.0)
    parser.add_argument("--batch-processing-seconds", type=float, default=60.0)
    parser.add_argument("--max-requests-per-batch", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    qs = queries(args.queries)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with (
            fake_process(
                tmp,
                "--delay",
                str(args.model_delay),
                "--batch-processing-seconds",
                str(args.batch_processing_seconds),
            ) as (model_url, _),
            redis_server(tmp / "redis") as redis_url,
        ):
            env = {
                **base_env(tmp, redis_url, 0),
                "SIFT_GENERATION_MODEL": f"anthropic:{MODEL}",
                "ANTHROPIC_BASE_URL": model_url,
                "ANTHROPIC_API_KEY": "sk-ant-bench",
                "SIFT_ECONOMY_POLL_SECONDS": "1",
                "SIFT_ECONOMY_POLL_MAX_SECONDS": "5",
                "SIFT_ECONOMY_MAX_REQUESTS_PER_BATCH": str(args.max_requests_per_batch),
            }
            with (
                celery_worker(tmp / "w", env, "lanes", concurrency=200),
                gateway(tmp / "g", env) as url,
                httpx.Client(base_url=url, timeout=60) as client,
            ):
                ingest(client)
                run_lane(client, qs[:20], "standard", args.timeout)  # warm the worker up
                standard = run_lane(client, qs, "standard", args.timeout)
                economy = run_lane(client, qs, "economy", args.timeout)
    print(
        f"{args.queries} searches (fts, rerank on, {MODEL} list prices), one worker process; "
        f"model call {args.model_delay:g} s, provider batch {args.batch_processing_seconds:g} s"
    )
    print(f"{'':32}{'standard':>14}{'economy':>14}")
    print(f"{'cost per 1,000 searches (USD)':32}{standard['usd_per_1k']:>14.4f}"
          f"{economy['usd_per_1k']:>14.4f}")  # fmt: skip
    print(f"{'wall time (s)':32}{standard['seconds']:>14.1f}{economy['seconds']:>14.1f}")
    print(f"{'tokens per search':32}{standard['tokens_per_search']:>14.0f}"
          f"{economy['tokens_per_search']:>14.0f}")  # fmt: skip
    print(f"{'economy / standard cost':32}{economy['usd_per_1k'] / standard['usd_per_1k']:>28.3f}")
    print(json.dumps({"standard": standard, "economy": economy}))


if __name__ == "__main__":
    main()

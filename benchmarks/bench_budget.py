"""A reranked batch at the provider's rate limit, with and without the shared rate budget.

    python benchmarks/bench_budget.py [--queries 5000] [--rpm 3000] [--itpm 1000000]

Two worker processes (threads pool) and a gateway on one Redis, the fake Messages API in its
own process answering after 1 s and metering requests and input tokens per minute like the
provider (a bucket of a minute's worth, refilling continuously, 429 with retry-after beyond).
The same batch runs twice: with the shared budget (the limits given in ``SIFT_RATE_LIMITS``)
and without it (``SIFT_RATE_BUDGET_ENABLED=false``: each process on its own, today's
behaviour). For each it prints the model's answered-request rate over the steady part as a
fraction of the binding limit (goal >= 0.95) and the fraction of calls answered 429 (goal
<= 0.005), side by side. The binding limit is the tighter of RPM and ITPM over the prompts'
mean input tokens (as the fake counted them).

The steady part starts once the fake has answered a bucket's worth (a minute at the binding
limit: the initial burst a full bucket allows) and ends when 95% of the answers are in; the
rate is read from the fake's own answer counter, sampled every 0.5 s. The failure policy is
``fail_open``: a search the budget cannot serve within its deadline falls back
(``budget_exhausted``) and the batch goes on.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_queue import AUTH, INDEX, base_env, failures, ingest, queries  # noqa: E402
from tests.fake_anthropic import RemoteFakeAnthropic, fake_process  # noqa: E402
from tests.services import celery_worker, gateway, redis_server  # noqa: E402

MODEL = "claude-haiku-4-5"
THREADS = 300


def sample(fake: RemoteFakeAnthropic, stop: threading.Event, out: list[tuple[float, int]]) -> None:
    while not stop.is_set():
        out.append((time.monotonic(), fake.usage()["responses"]))
        stop.wait(0.5)


def binding_limit(rpm: int, itpm: int, usage: dict[str, int]) -> float:
    """Requests per second the tighter of the two limits allows, at the prompts' mean size
    (the reranked prompt of the sample corpus is ~1,300 tokens: 1,000,000 ITPM is ~770
    requests a minute, tighter than 3,000 RPM)."""
    answered = max(1, usage["responses"])
    per_request = (usage["input_tokens"] + usage["cache_creation_input_tokens"]) / answered
    return min(rpm / 60, itpm / 60 / max(1.0, per_request))


def steady_rate(samples: list[tuple[float, int]], start_at: int, total: int) -> float:
    """Answers per second between the first sample past ``start_at`` answers and the first
    past 95% of ``total``."""
    end_at = int(total * 0.95)
    begin = next(((t, n) for t, n in samples if n >= start_at), None)
    end = next(((t, n) for t, n in samples if n >= end_at), None)
    if begin is None or end is None or end[0] <= begin[0]:
        return float("nan")
    return (end[1] - begin[1]) / (end[0] - begin[0])


def run(
    tmp: Path,
    redis_url: str,
    db: int,
    model_url: str,
    qs: list[str],
    budget: bool,
    rpm: int,
    itpm: int,
) -> dict[str, Any]:
    fake = RemoteFakeAnthropic(model_url)
    env = {
        **base_env(tmp, redis_url, db),
        "SIFT_BATCH_ITEM_CONCURRENCY": str(THREADS),
        "SIFT_RERANK_ENABLED": "true",
        "SIFT_RERANK_FAILURE_POLICY": "fail_open",
        "SIFT_GENERATION_MODEL": f"anthropic:{MODEL}",
        "SIFT_RERANK_MAX_IN_FLIGHT": str(THREADS),
        "SIFT_RATE_BUDGET_ENABLED": "true" if budget else "false",
        "SIFT_RATE_LIMITS": json.dumps({MODEL: {"rpm": rpm, "itpm": itpm}}) if budget else "",
        "ANTHROPIC_BASE_URL": model_url,
        "ANTHROPIC_API_KEY": "sk-ant-fake",
    }
    name = "budget" if budget else "no-budget"
    with (
        celery_worker(tmp / f"{name}-1", env, f"{name}1", concurrency=THREADS),
        celery_worker(tmp / f"{name}-2", env, f"{name}2", concurrency=THREADS),
        gateway(tmp / name, env) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        ingest(client)
        fake.configure(rpm=rpm, itpm=itpm)  # full buckets again: the batch starts on a fresh minute
        fake.reset()
        samples: list[tuple[float, int]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(fake, stop, samples), daemon=True)
        sampler.start()
        items = [{"id": f"q{i}", "query": q} for i, q in enumerate(qs)]
        started = time.monotonic()
        batch = client.post("/v1/batches", json={"index": INDEX, "queries": items}, headers=AUTH)
        batch.raise_for_status()
        bid = batch.json()["id"]
        while True:
            job = client.get(f"/v1/batches/{bid}", headers=AUTH).json()
            counts = job["counts"]
            if counts["queued"] == counts["running"] == 0:
                break
            time.sleep(0.5)
        seconds = time.monotonic() - started
        stop.set()
        sampler.join()
        usage = fake.usage()
        answered = usage["responses"]
        refused = fake.rate_limited()
        errors = failures(client, bid)
    limit = binding_limit(rpm, itpm, usage)
    rate = steady_rate(samples, int(limit * 60), answered)  # after a full bucket's burst
    return {
        "seconds": round(seconds, 1),
        "answered": answered,
        "answered_429": refused,
        "limit_per_s": round(limit, 2),
        "steady_rate_per_s": round(rate, 2),
        "rate_fraction_of_limit": round(rate / limit, 3),
        "fraction_429": round(refused / max(1, answered + refused), 4),
        "items": counts,
        "item_errors": errors,
        "rerank_outcomes": job["rerank_outcomes"],  # a search without a model answer says why
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--queries", type=int, default=5000)
    parser.add_argument("--rpm", type=int, default=3000)
    parser.add_argument("--itpm", type=int, default=1_000_000)
    parser.add_argument("--only", choices=["budget", "no-budget"], default=None)
    args = parser.parse_args()
    qs = queries(args.queries)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with (
            fake_process(tmp, "--delay", "1.0") as (model_url, _),
            redis_server(tmp / "redis") as redis_url,
        ):
            for db, budget in enumerate((True, False)):
                name = "budget" if budget else "no-budget"
                if args.only not in (None, name):
                    continue
                results[name] = run(tmp, redis_url, db, model_url, qs, budget, args.rpm, args.itpm)
                print(name, json.dumps(results[name]), flush=True)
    keys = (
        "rate_fraction_of_limit",
        "fraction_429",
        "steady_rate_per_s",
        "answered_429",
        "seconds",
    )
    print(f"\n{'':28}" + "".join(f"{name:>14}" for name in results))
    for key in keys:
        print(f"{key:28}" + "".join(f"{results[n][key]:>14}" for n in results))


if __name__ == "__main__":
    main()

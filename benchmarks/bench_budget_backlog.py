"""What the rate budget costs a batch item, with backlog() read from Redis every time or at
most every BACKLOG_REFRESH_SECONDS per process (the default).

    python benchmarks/bench_budget_backlog.py [--items 20000] [--threads 32]

Each batch item, once a limit is known, asks the budget's backlog (``SearchPipeline.pace``),
is let start (``started``), then reserves its call and settles it: here exactly that
traffic, from ``--threads`` threads of one process on a real redis-server, against limits
high enough that nothing waits (so only the budget's own cost is measured). The two set-ups
run side by side in one process and print, per item: Redis round trips, this process's CPU
and redis-server's CPU (its ``used_cpu_user + used_cpu_sys``), and the items per second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.services import redis_server  # noqa: E402
from worker.adapters.rate_budget import RedisRateBudget  # noqa: E402
from worker.adapters.rate_budget import _budget as rate_budget  # noqa: E402
from worker.core.types import RerankPrompt, TokenUsage  # noqa: E402
from worker.settings import RateLimit  # noqa: E402

MODEL = "claude-haiku-4-5"
PROMPT = RerankPrompt(
    policy="listwise.v1",
    system="rank them",
    user="Question: q\n" + "\n".join(f"[{i}] Title: text {i}" for i in range(1, 21)),
    output_schema={"type": "object"},
    max_tokens=100,
    candidate_count=20,
    truncated=(False,) * 20,
)
LIMITS = RateLimit(rpm=100_000_000, itpm=1_000_000_000, otpm=1_000_000_000)  # none binds


def redis_cpu(client: redis.Redis) -> float:
    info: Any = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run(url: str, items: int, threads: int, refresh: float) -> dict[str, float]:
    rate_budget.BACKLOG_REFRESH_SECONDS = refresh
    client = redis.Redis(
        connection_pool=redis.BlockingConnectionPool.from_url(url, max_connections=threads + 4)
    )
    client.flushdb()
    budget = RedisRateBudget(client, MODEL, LIMITS)
    usage = TokenUsage(input_tokens=300, output_tokens=40)

    def item(_: int) -> None:
        budget.backlog()
        budget.started()  # let start (ModelCalls.pace): counted until its reservation
        grant = budget.reserve(PROMPT, 60.0)
        budget.settle(grant, usage)

    item(0)  # the script is loaded, the connections opened
    calls, server = budget.script_calls, redis_cpu(client)
    cpu, wall = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(item, range(items)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    result = {
        "round_trips": (budget.script_calls - calls) / items,
        "client_cpu_us": cpu / items * 1e6,
        "redis_cpu_us": (redis_cpu(client) - server) / items * 1e6,
        "items_per_s": items / wall,
    }
    client.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=32)
    args = parser.parse_args()
    default = rate_budget.BACKLOG_REFRESH_SECONDS
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp) / "redis") as url:
        runs = {}
        for label, refresh in (("every time", 0.0), (f"every {default * 1000:g} ms", default)):
            run(url + "/0", 2000, args.threads, refresh)  # warm-up, not counted
            runs[label] = run(url + "/0", args.items, args.threads, refresh)
    print(f"{args.items} batch items, {args.threads} threads, one process; per item:")
    print(f"{'backlog read':>16} {'round trips':>12} {'client CPU µs':>14} "
          f"{'redis CPU µs':>13} {'items/s':>9}")  # fmt: skip
    for label, r in runs.items():
        print(f"{label:>16} {r['round_trips']:>12.3f} {r['client_cpu_us']:>14.0f} "
              f"{r['redis_cpu_us']:>13.1f} {r['items_per_s']:>9.0f}")  # fmt: skip
    old, new = runs["every time"], runs[f"every {default * 1000:g} ms"]
    print(f"saved per item: {old['round_trips'] - new['round_trips']:.3f} round trips, "
          f"{old['client_cpu_us'] - new['client_cpu_us']:.0f} µs client CPU "
          f"({1 - new['client_cpu_us'] / old['client_cpu_us']:.0%}), "
          f"{old['redis_cpu_us'] - new['redis_cpu_us']:.1f} µs redis CPU")  # fmt: skip


if __name__ == "__main__":
    main()

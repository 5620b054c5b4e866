"""What a batch item's run claim costs beside the item's start it follows
(:mod:`worker.queue.jobstore.runs`): a claim and its release, against ``begin_item``, the one
transition per item a runner already makes, on a redis-server of its own.

    python benchmarks/bench_run_claims.py [--items 20000] [--rounds 10]

In rounds of ``--items / --rounds`` items, taking turns, it times one thread making
``begin_item`` calls, then ``claim_item`` + ``release_item`` calls, on the items of one
batch, and prints this process's CPU and Redis's CPU (``INFO cpu``) per item for each, and the
ratio. Round trips are one per call in both (a worker's threads share them through the
store's coalescer; here one thread runs alone, the worst case).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.services import redis_server  # noqa: E402
from worker.constants import WORKER_HEARTBEAT_KEY  # noqa: E402
from worker.contract import SearchSpec  # noqa: E402
from worker.queue.jobstore import JobStore  # noqa: E402


def _redis_cpu(store: JobStore) -> float:
    info = store.redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    per_round = args.items // args.rounds
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as url:
        store = JobStore.from_url(url + "/0")
        store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1")
        spec = SearchSpec(index="docs", query="q")
        batch = store.create_batch("acme", "docs", [(f"q{i}", spec) for i in range(args.items)])
        spent = {"begin": [0.0, 0.0, 0.0], "claim": [0.0, 0.0, 0.0]}  # cpu, redis cpu, wall
        for r in range(args.rounds):
            ids = [f"q{i}" for i in range(r * per_round, (r + 1) * per_round)]
            for name in ("begin", "claim"):
                cpu, redis_cpu, wall = time.process_time(), _redis_cpu(store), time.perf_counter()
                for qid in ids:
                    if name == "begin":
                        store.begin_item(batch.id, qid)
                    else:
                        claim = store.claim_item(batch.id, qid, "w1", lease_seconds=30.0)
                        store.release_item(batch.id, qid, claim)
                spent[name][0] += time.process_time() - cpu
                spent[name][1] += _redis_cpu(store) - redis_cpu
                spent[name][2] += time.perf_counter() - wall
        store.close()
    n = per_round * args.rounds
    for name, label in (("begin", "begin_item"), ("claim", "claim_item + release_item")):
        cpu, redis_cpu, wall = spent[name]
        print(
            f"{label:>26}: {cpu / n * 1e6:7.1f} µs client CPU, {redis_cpu / n * 1e6:6.1f} µs "
            f"Redis CPU per item; {n / wall:8.0f} items/s"
        )
    ratio = (spent["claim"][0] + spent["claim"][1]) / (spent["begin"][0] + spent["begin"][1])
    print(f"claim + release / begin, client + Redis CPU: {ratio:.2f}")


if __name__ == "__main__":
    main()

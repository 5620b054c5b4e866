"""What a batch item's run claim costs beside the item's start it follows
(:mod:`worker.queue.jobstore.runs`): a claim and its release, against ``begin_item``, the one
transition per item a runner already makes, on a redis-server of its own; and what keeping
the model's answer in the claim adds (``dump_run`` of a typical one-call rerank, 10
positions, the digest of the 50 candidates it answered, and the ``keep_answer`` round
trip), the added cost of every reranked search.

    python benchmarks/bench_run_claims.py [--items 20000] [--rounds 10]

In rounds of ``--items / --rounds`` items, taking turns, it times one thread making
``begin_item`` calls, then ``claim_item`` + ``release_item`` calls, then ``claim_item`` + the
answer kept + ``release_item``, on the items of one batch, and prints this process's CPU and
Redis's CPU (``INFO cpu``) per item for each, the ratio, and what keeping the answer added.
Round trips are one per call in each (a worker's threads share them through the store's
coalescer; here one thread runs alone, the worst case).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.services import redis_server  # noqa: E402
from worker.constants import WORKER_HEARTBEAT_KEY  # noqa: E402
from worker.contract import SearchSpec  # noqa: E402
from worker.core.pipeline import RerankRun, dump_run, shown_digest  # noqa: E402
from worker.core.types import Candidate, Document, RerankReply, TokenUsage  # noqa: E402
from worker.queue.jobstore import JobStore  # noqa: E402

POSITIONS = [3, 1, 7, 2, 9, 4, 12, 5, 6, 8]
USAGE = TokenUsage(2412, 38, 0, 0)
ANSWER = RerankRun(  # what one answered call leaves: the answer a search keeps
    attempts=[{"n": 1, "outcome": "ok", "seconds": 0.8123, "budget_wait_seconds": 0.0}],
    usage=USAGE,
    cost_usd=0.002602,
    returned=POSITIONS,
    reply=RerankReply(POSITIONS, USAGE, "claude-haiku-4-5"),
    seconds=0.8124,
)
SHOWN = [  # the candidates it answered, whose digest is kept with it
    Candidate(Document(f"doc-{i}", "", revision=f"{i:016x}"), i, 0.01, {}, {}) for i in range(50)
]


def _kept() -> dict[str, object]:
    """What a run keeps: its answer and the digest of the candidates it was shown."""
    return {**dump_run(ANSWER), "shown": shown_digest(SHOWN)}


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
        # cpu, redis cpu, wall
        spent = {name: [0.0, 0.0, 0.0] for name in ("begin", "claim", "keep")}
        for r in range(args.rounds):
            ids = [f"q{i}" for i in range(r * per_round, (r + 1) * per_round)]
            for name in ("begin", "claim", "keep"):
                cpu, redis_cpu, wall = time.process_time(), _redis_cpu(store), time.perf_counter()
                for qid in ids:
                    if name == "begin":
                        store.begin_item(batch.id, qid)
                    else:
                        claim = store.claim_item(batch.id, qid, "w1", lease_seconds=30.0)
                        # a refused claim writes nothing: its cost is not a claim's
                        assert claim.granted, f"claim of {qid} refused: {claim}"
                        if name == "keep":
                            store.item_answers(batch.id, qid, claim).save(_kept())
                        store.release_item(batch.id, qid, claim)
                spent[name][0] += time.process_time() - cpu
                spent[name][1] += _redis_cpu(store) - redis_cpu
                spent[name][2] += time.perf_counter() - wall
        store.close()
    n = per_round * args.rounds
    labels = {
        "begin": "begin_item",
        "claim": "claim_item + release_item",
        "keep": "claim + answer kept + release",
    }
    for name, label in labels.items():
        cpu, redis_cpu, wall = spent[name]
        print(
            f"{label:>30}: {cpu / n * 1e6:7.1f} µs client CPU, {redis_cpu / n * 1e6:6.1f} µs "
            f"Redis CPU per item; {n / wall:8.0f} items/s"
        )
    ratio = (spent["claim"][0] + spent["claim"][1]) / (spent["begin"][0] + spent["begin"][1])
    print(f"claim + release / begin, client + Redis CPU: {ratio:.2f}")
    added = [(spent["keep"][i] - spent["claim"][i]) / n * 1e6 for i in (0, 1)]
    print(
        f"the answer kept, added per search: {added[0]:.1f} µs client CPU, {added[1]:.1f} µs "
        f"Redis CPU ({len(json.dumps(_kept(), separators=(',', ':')))} B kept)"
    )


if __name__ == "__main__":
    main()

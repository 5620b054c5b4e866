"""What a batch's totals add to an item's finish (:func:`~worker.queue.jobstore.batch_items.
batch_tally`, added by ``_TRANSITION_ITEM`` in the same script: no round trip more): the
finish of a typical reranked result (10 hits, one call's usage, six stages' seconds) with
its tally, against the same finish with none, on a redis-server of its own.

    python benchmarks/bench_batch_totals.py [--items 12000] [--rounds 4]

In rounds, taking turns, one thread finishes started items of a batch without, then with,
the tally, and it prints this process's CPU and Redis's CPU (``INFO cpu``) per finish for
each, and the difference: the totals' cost per item. One round trip per finish (a worker's
threads share them through the store's coalescer; here one thread runs alone).
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
from worker.contract import JobStatus, SearchResult, SearchSpec  # noqa: E402
from worker.queue.jobstore import JobStore  # noqa: E402
from worker.queue.jobstore.batch_items import batch_tally  # noqa: E402
from worker.queue.jobstore.store import NO_CANCEL  # noqa: E402

STAGES = {"queue_wait": 0.0123, "embed": 0.004, "bm25": 0.002, "knn": 0.003, "fuse": 0.001}


def _result() -> SearchResult:
    """A reranked result as a batch item's finish carries it."""
    hits = [
        {
            "id": f"doc-{i}",
            "revision": f"{i:016x}",
            "text": "x" * 300,
            "ranks": {"final": i + 1, "bm25": i + 1, "knn": i + 2, "rerank": i + 1},
            "scores": {"bm25": 1.5, "knn": 0.8, "fused": 0.03},
        }
        for i in range(10)
    ]
    usage = {"requests": 1, "input_tokens": 2412, "output_tokens": 38, "cost_usd": 0.002602}
    result = SearchResult.model_validate(
        {"hits": hits, "rerank": {"applied": True, "policy": "listwise.v1"}, "usage": usage}
    )
    result._stage_seconds = {**STAGES, "rerank": 0.8123}
    return result


def _redis_cpu(store: JobStore) -> float:
    info = store.redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=12_000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    per_round = args.items // args.rounds // 2
    result = _result()
    payload = '{"result":' + result.model_dump_json() + "}"
    done = (JobStatus.SUCCEEDED, "queued,running", payload, NO_CANCEL)
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as url:
        store = JobStore.from_url(url + "/0")
        spec = SearchSpec(index="docs", query="q")
        spent = {name: [0.0, 0.0] for name in ("without", "with")}  # client CPU, Redis CPU
        for _ in range(args.rounds):
            for name in ("without", "with"):
                ids = [f"q{i}" for i in range(per_round)]
                batch = store.create_batch("acme", "docs", [(qid, spec) for qid in ids])
                for qid in ids:
                    store.begin_item(batch.id, qid)
                cpu, redis_cpu = time.process_time(), _redis_cpu(store)
                for qid in ids:
                    # without: the finish_item of the tree before the totals, its payload
                    tally = batch_tally(result) if name == "with" else ()
                    (moved,) = store._items([(batch.id, qid, *done)], tally=tally)
                    # the tally is added only by a move that applies: else nothing was timed
                    assert moved.applied, f"{qid}'s finish did not apply: {moved}"
                spent[name][0] += time.process_time() - cpu
                spent[name][1] += _redis_cpu(store) - redis_cpu
        store.close()
    n = per_round * args.rounds
    for name, (cpu, redis_cpu) in spent.items():
        print(
            f"finish {name:>7} the tally: {cpu / n * 1e6:6.1f} µs client CPU, "
            f"{redis_cpu / n * 1e6:5.1f} µs Redis CPU per item"
        )
    added = [(spent["with"][i] - spent["without"][i]) / n * 1e6 for i in (0, 1)]
    print(f"the totals add per item: {added[0]:.1f} µs client CPU, {added[1]:.1f} µs Redis CPU")


if __name__ == "__main__":
    main()

"""What the per-tenant limit of indexes (``SIFT_MAX_INDEXES_PER_TENANT``) costs the embedded
backend's writes, beside the same writes without it, in one run.

    python benchmarks/bench_index_limit.py [--writes 3000] [--names 1000]

Two data dirs, each with one tenant holding 99 indexes (one document each) and
``--names`` more names it has made and dropped (rows of ``indexes`` the count walks past).
Taking turns in ten rounds, one thread upserts one document at a time into an index the
tenant holds, on a backend with the limit (100) and one without (0): every write with the
limit reads whether the index holds a document (one seek). Then each side makes and drops
a new name ``--writes / 10`` times: the write that makes a name counts the tenant's
indexes. Prints this process's CPU per write for each side and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.adapters.embedded import EmbeddedBackend  # noqa: E402
from worker.core.types import Document  # noqa: E402

TENANT = "acme"
HELD = 99  # one under the default limit: every new name is counted, none refused
VECTOR = np.ones((1, 8), dtype=np.float32) / np.sqrt(8)


def _filled(data: Path, limit: int, dropped: int) -> EmbeddedBackend:
    backend = EmbeddedBackend(data, max_indexes_per_tenant=limit)
    for i in range(HELD):
        backend.upsert(f"held-{i}", TENANT, [Document("d", "words")], VECTOR)
    for i in range(dropped):
        backend.upsert(f"gone-{i}", TENANT, [Document("d", "words")], VECTOR)
        backend.delete_index(f"gone-{i}", TENANT)
    return backend


def _cpu_per_write(write: Callable[[int], None], count: int) -> float:
    started = time.process_time()
    for i in range(count):
        write(i)
    return (time.process_time() - started) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=3000)
    parser.add_argument("--names", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {
            "limit 100": _filled(Path(tmp) / "limited", 100, args.names),
            "no limit": _filled(Path(tmp) / "unlimited", 0, args.names),
        }
        into_held: dict[str, list[float]] = {side: [] for side in sides}
        new_name: dict[str, list[float]] = {side: [] for side in sides}
        rounds = 10
        for _ in range(rounds):
            for side, backend in sides.items():

                def held(i: int, backend: EmbeddedBackend = backend) -> None:
                    doc = Document(f"d{i}", f"words {i}")
                    backend.upsert("held-0", TENANT, [doc], VECTOR)

                def made(i: int, backend: EmbeddedBackend = backend) -> None:
                    backend.upsert("fresh", TENANT, [Document("d", "words")], VECTOR)
                    backend.delete_index("fresh", TENANT)

                into_held[side].append(_cpu_per_write(held, args.writes // rounds))
                new_name[side].append(_cpu_per_write(made, max(1, args.writes // rounds // 10)))
        print(f"one tenant: {HELD} indexes held, {args.names} names made and dropped before")
        print(f"{'':<34}{'limit 100':>12}{'no limit':>12}{'ratio':>8}")
        for what, figures in (
            ("upsert into an index it holds", into_held),
            ("make a name (upsert), drop it", new_name),
        ):
            limited, free = (float(np.median(figures[side])) * 1e6 for side in sides)
            print(f"{what:<34}{limited:>9.1f} µs{free:>9.1f} µs{limited / free:>8.3f}")
        print("(CPU of this process per write, the median of 10 rounds taken in turns)")


if __name__ == "__main__":
    main()

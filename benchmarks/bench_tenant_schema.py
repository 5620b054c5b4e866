"""What one tenant's first write costs a worker's other searches on the embedded backend.

    python benchmarks/bench_tenant_schema.py [--baseline 9eecd80] [--tenants 1000]
                                             [--threads 300] [--rounds 3]
                                             [--sides baseline,today]

Each tenant's index is its own FTS5 table (five ``sqlite_master`` rows with its shadow
tables), so a tenant's first write changes the schema, and every other open connection
parses the whole schema again at its next statement and holds a copy of it. A data dir
gets ``--tenants`` tenant indexes of one document each; then, for ``--baseline``'s
``EmbeddedBackend`` (its ``worker/adapters/embedded.py``, loaded with ``git show``) and
today's, each in a process of its own, side by side on that data dir, in turns:
``--threads`` threads (a worker's Celery and batch-item threads) each search once, holding
a CPU slot as a worker's retrieval does (:func:`worker.runtime.slots.cpu_slots` at its
default); then, ``--rounds`` times, each thread searches once more with no schema change
(``steady``) and once more right after another connection wrote a new tenant's first
document (``after a new tenant``). It prints the process CPU (``time.process_time``) of
those ``--threads`` searches, summed, per round (median), the SQLite connections the
backend holds (``sift.db`` file descriptors of the process), the schema memory they hold
(``SQLITE_DBSTATUS_SCHEMA_USED``, summed) and SQLite's memory in use, and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import apsw  # noqa: E402

from benchmarks.baseline import module_at  # noqa: E402
from worker.adapters.embedded import DB_FILE, EmbeddedBackend  # noqa: E402
from worker.core.types import ChannelQuery, Document, HardFilters  # noqa: E402
from worker.runtime.slots import cpu_slots  # noqa: E402

INDEX = "docs"


def build(data_dir: Path, tenants: int) -> None:
    writer = EmbeddedBackend(data_dir)
    for i in range(tenants):
        writer.upsert(INDEX, f"t{i}", [Document("x", f"hello world {i}")], None)
    writer.close()


def open_files(data_dir: Path) -> int:
    """The process's file descriptors on the database file: one per open connection."""
    target = str(data_dir / DB_FILE)
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # one closed meanwhile
            found += os.readlink(f"/proc/self/fd/{fd}") == target
    return found


def measure(
    side: str, baseline: str, data_dir: Path, tenants: int, threads: int, rounds: int
) -> dict[str, Any]:
    """One side's figures, in this process (run once per side, each in a process of its own)."""
    kind = (
        module_at(
            baseline, "worker/adapters/embedded.py", "bench_baseline_embedded"
        ).EmbeddedBackend
        if side == "baseline"
        else EmbeddedBackend
    )
    backend = kind(data_dir)
    writer = kind(data_dir)
    slots = cpu_slots(0)
    go = [threading.Event() for _ in range(1 + 2 * rounds)]
    done = threading.Semaphore(0)
    failures: list[BaseException] = []

    def run(k: int) -> None:
        rng = random.Random(k)
        for event in go:
            event.wait()
            tenant = f"t{rng.randrange(tenants)}"  # a worker's next search: any tenant's
            query = ChannelQuery(INDEX, HardFilters(tenant), ("bm25",), 10, "hello")
            try:
                with slots:
                    assert backend.retrieve(query).hits["bm25"], "no hit"
            except BaseException as exc:  # counted, and reported
                failures.append(exc)
            done.release()

    workers = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(threads)]
    for thread in workers:
        thread.start()

    def phase(i: int) -> float:
        started = time.process_time()
        go[i].set()
        for _ in range(threads):
            done.acquire()
        return time.process_time() - started

    phase(0)  # every thread has searched once
    steady: list[float] = []
    after: list[float] = []
    for r in range(rounds):
        steady.append(phase(1 + 2 * r))
        writer.upsert(INDEX, f"{side}-new-{r}", [Document("x", "hello")], None)
        after.append(phase(2 + 2 * r))
    connections = backend._connections
    schema = sum(c.status(apsw.SQLITE_DBSTATUS_SCHEMA_USED)[0] for c in connections)
    figures = {
        "steady": statistics.median(steady),
        "after": statistics.median(after),
        "files": open_files(data_dir) - 1,  # less the writer's
        "connections": len(connections),
        "schema": schema,
        "memory": apsw.memory_used(),
        "failures": len(failures),
    }
    backend.close()
    writer.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--baseline",
        default="9eecd80",
        help="the commit to compare with (default: the last with a connection per thread)",
    )
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--sides", default="baseline,today", help="baseline,today or one of them (memory)"
    )
    parser.add_argument("--side", help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        figures = measure(
            args.side, args.baseline, Path(args.data_dir), args.tenants, args.threads, args.rounds
        )
        print(json.dumps(figures))
        return
    with tempfile.TemporaryDirectory(prefix="sift-bench-") as tmp:
        started = time.process_time()
        build(Path(tmp), args.tenants)
        print(
            f"{args.tenants:,} tenant indexes of one document each "
            f"({time.process_time() - started:.1f} s CPU to build); {args.threads} threads, "
            f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
        )
        spoilt: dict[str, int] = {}
        for side in args.sides.split(","):
            child = subprocess.run(
                [
                    *(sys.executable, __file__, "--side", side, "--data-dir", tmp),
                    *("--baseline", args.baseline, "--tenants", str(args.tenants)),
                    *("--threads", str(args.threads), "--rounds", str(args.rounds)),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            f = json.loads(child.stdout.splitlines()[-1])
            n = args.threads
            print(
                f"  {side:8} {n} searches: steady {f['steady']:.3f} s CPU "
                f"({1e3 * f['steady'] / n:.2f} ms each), after a new tenant "
                f"{f['after']:.3f} s CPU ({1e3 * f['after'] / n:.2f} ms each); "
                f"{f['files']} connections, schema {f['schema'] / 1e6:.1f} MB, "
                f"SQLite memory {f['memory'] / 1e6:.1f} MB; failures {f['failures']}; "
                f"load {os.getloadavg()[0]:.2f}"
            )
            if f["failures"]:  # a search that failed (no hit, or raised) is not a search's CPU
                spoilt[side] = f["failures"]
    if spoilt:
        sys.exit(f"not a measure: searches failed on {', '.join(spoilt)}: {spoilt}")


if __name__ == "__main__":
    main()

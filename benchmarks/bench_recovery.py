"""Recovery after kill -9 of the only worker, at default settings: median of N runs.

    python benchmarks/bench_recovery.py [--runs 5] [--items 300] [--model-delay 0.3]

Each run starts its own stack (redis-server, the gateway, one ``sift worker`` at its
defaults: 300 threads, the derived visibility timeout of about 27 minutes, a heartbeat every
2 s that is dead after 10 s) and the fake Messages API answering after ``--model-delay``
seconds. It submits a reranked batch of ``--items`` queries, SIGKILLs the worker once a
tenth of the items succeeded, starts a new worker at once, and times:

- recovery: from the new worker's launch to the batch ``succeeded`` (what
  docs/reliability.md quotes);
- from the kill to the batch ``succeeded``;
- the CPU the new worker used until then (user + system, from ``/proc``), and its share of
  one core over the recovery.

Every run also checks the batch ended with every item ``succeeded`` exactly once.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fake_anthropic import FakeAnthropic  # noqa: E402
from tests.reliability.support import (  # noqa: E402
    assert_batch_exactly_once,
    batch_counts,
    ingest,
    stack_env,
    submit_batch,
    wait_for,
)
from worker.processes.stack import child_env, gateway_process, redis_server, worker_process  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def one_run(directory: Path, model: FakeAnthropic, items: int) -> tuple[float, float, float]:
    """(recovery seconds, kill-to-finished seconds, new worker's CPU seconds)."""
    with redis_server(directory / "redis") as base_url:
        url = base_url + "/0"
        env = stack_env(url, model.url)
        env.pop("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS")
        env = child_env(env, inherit_sift=False)
        with (
            gateway_process(directory / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            with worker_process(directory / "w", env, "a") as worker_a:
                ingest(client)
                batch_id = submit_batch(client, items)
                wait_for(
                    lambda: batch_counts(client, batch_id)["counts"]["succeeded"] >= items // 10,
                    "a tenth of the items done",
                )
                worker_a.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                worker_a.wait(10)
            done = batch_counts(client, batch_id)["counts"]["succeeded"]
            if done >= items:
                raise RuntimeError("the batch finished before the kill; use more --items")
            launched = time.monotonic()
            with worker_process(directory / "w", env, "b") as worker_b:
                wait_for(
                    lambda: batch_counts(client, batch_id)["status"] == "succeeded",
                    "the batch finished",
                    timeout=1800,
                )
                finished = time.monotonic()
                cpu = cpu_seconds(worker_b.pid)
            assert_batch_exactly_once(client, url, batch_id, items)
    return finished - launched, finished - killed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs (the median is reported)")
    parser.add_argument("--items", type=int, default=300, help="queries in the batch")
    parser.add_argument("--model-delay", type=float, default=0.3, help="the model's answer time")
    args = parser.parse_args()
    print(
        f"kill -9 of the only worker during a {args.items}-item reranked batch, "
        f"model answering in {args.model_delay:g} s, default settings\n"
    )
    print(f"{'run':>4}{'recovery s':>12}{'kill->done s':>14}{'worker CPU s':>14}{'CPU %':>8}")
    recoveries: list[float] = []
    cpus: list[float] = []
    with FakeAnthropic(delay=args.model_delay) as model:
        for run in range(1, args.runs + 1):
            with tempfile.TemporaryDirectory() as tmp:
                recovery, total, cpu = one_run(Path(tmp), model, args.items)
            recoveries.append(recovery)
            cpus.append(cpu)
            share = 100 * cpu / recovery
            print(f"{run:>4}{recovery:>12.1f}{total:>14.1f}{cpu:>14.1f}{share:>8.0f}")
    print(
        f"\nmedian recovery {statistics.median(recoveries):.1f} s (new worker's launch to the "
        f"batch succeeded); median CPU of the new worker {statistics.median(cpus):.1f} s"
    )


if __name__ == "__main__":
    main()

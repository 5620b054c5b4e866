"""Does a 100,000-query batch submission hold up the gateway's other requests? (issue 12)

    python benchmarks/bench_submit_latency.py [--queries 100000] [--runs 3] [--baseline 3]

Starts a redis-server and one gateway (``sift gateway``, as ``sift up`` does; no worker),
submits one small batch (the gateway's first submission pays one-off costs), then, side
by side in one run:

* baseline: a client polls ``/healthz`` every 5 ms for ``--baseline`` seconds, nothing else;
* submission: the same client polls ``/healthz`` while another submits a batch of
  ``--queries`` queries (the documented maximum by default), ``--runs`` times, with an
  ``Idempotency-Key`` on every other run (its fingerprint is part of the work).

A second client polls ``/readyz`` the same way: its PING goes through the job store's
Redis, which the submission's writes share. It prints the p50 / p99 / max of each, the
number of polls, and the submission's own time. Goal (issue 12): ``/healthz`` p99 below
50 ms during the submission.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.services import gateway, redis_server  # noqa: E402

KEY = "bench-key-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
KEYS = [{"key": KEY, "tenant": "bench", "webhook_secret": "whsec_YmVuY2gtc2VjcmV0LTAxMjM0NTY3"}]


class Poller(threading.Thread):
    """Polls ``/healthz`` on one keep-alive connection, one request every ``INTERVAL``
    seconds, until stopped. A poll that comes back late also stands for the polls that were
    due meanwhile, each counted from its own due time (wrk2's correction for coordinated
    omission): a gateway frozen for a second shows as a second's worth of slow polls, not one.
    """

    INTERVAL = 0.005

    def __init__(self, url: str, path: str = "/healthz") -> None:
        super().__init__(daemon=True)
        self.url, self.path = url, path
        self.latencies: list[float] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.poll()
        except BaseException as exc:  # kept for stop(): a thread's own would only be printed
            self.error = exc

    def poll(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            due = time.perf_counter()
            while not self.stopping.is_set():
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                client.get(self.path).raise_for_status()
                done = time.perf_counter()
                while due <= done:  # this poll, and those due while it was out
                    self.latencies.append(done - due)
                    due += self.INTERVAL

    def stop(self) -> list[float]:
        self.stopping.set()
        self.join()
        if self.error is not None:  # the polls stopped there: the figures would cover part
            raise SystemExit(f"not a measure: {self.path} polling failed: {self.error!r}")
        return self.latencies


def figures(latencies: list[float]) -> str:
    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return (
        f"p50 {statistics.median(ms):6.1f} ms  p99 {p99:6.1f} ms  max {ms[-1]:6.1f} ms"
        f"  ({len(ms)} polls due)"
    )


def batch_body(n: int, run: int) -> bytes:
    queries = [{"id": f"q{i}", "query": f"green tea leaves {i} run {run}"} for i in range(n)]
    return json.dumps({"index": "bench", "queries": queries}).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", type=float, default=3.0, help="seconds of baseline polls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d, redis_server(Path(d) / "redis") as redis_url:
        env = {"SIFT_REDIS_URL": redis_url + "/0", "SIFT_API_KEYS": json.dumps(KEYS)}
        with gateway(Path(d), env) as url, httpx.Client(base_url=url, timeout=300) as client:
            # one small batch first: the gateway's one-off costs are not what is measured
            client.post(
                "/v1/batches",
                content=batch_body(1_000, -1),
                headers={**AUTH, "content-type": "application/json"},
            ).raise_for_status()
            pollers = [Poller(url), Poller(url, "/readyz")]
            for poller in pollers:
                poller.start()
            time.sleep(args.baseline)
            healthz, readyz = (poller.stop() for poller in pollers)
            print(f"baseline, no submission:  /healthz {figures(healthz)}")
            print(f"                          /readyz  {figures(readyz)}")
            for run in range(args.runs):
                body = batch_body(args.queries, run)
                headers = {**AUTH, "content-type": "application/json"}
                keyed = run % 2 == 1
                if keyed:
                    headers["Idempotency-Key"] = f"bench-{run}"
                pollers = [Poller(url), Poller(url, "/readyz")]
                for poller in pollers:
                    poller.start()
                time.sleep(0.2)  # polls before the submission too
                started = time.perf_counter()
                response = client.post("/v1/batches", content=body, headers=headers)
                took = time.perf_counter() - started
                healthz, readyz = (poller.stop() for poller in pollers)
                response.raise_for_status()
                assert response.json()["counts"]["total"] == args.queries
                label = "with key" if keyed else "no key  "
                print(
                    f"run {run + 1} ({label}): submission {took:5.2f} s ({len(body) / 1e6:.1f} MB)"
                )
                print(f"    meanwhile /healthz {figures(healthz)}")
                print(f"              /readyz  {figures(readyz)}")


if __name__ == "__main__":
    main()

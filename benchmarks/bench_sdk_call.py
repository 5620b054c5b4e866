"""CPU per model call of the Anthropic adapter, today's against a baseline commit's, in one run.

    python benchmarks/bench_sdk_call.py [--baseline c192898] [--calls 2000] [--rounds 6]
                                        [--threads 1 64] [--delay 0] [--floors]
                                        [--shared-client]

Issue 14: the SDK's work per reranked search (request building, httpx2/httpcore2/h11, the
response's parsing). The fake Messages API runs in a process of its own; this process makes
the calls through ``AnthropicReranker`` as the worker builds it (no ``effort``: the model,
Haiku 4.5, takes none; ``effort=None`` on both sides, which a baseline also reads), an
``on_headers`` listener as the rate budget's, each concurrent call on a borrowed client), with
a prompt of 30 candidates built by the real policy. The baseline is the adapter module of
``--baseline`` (``git show``) loaded beside today's; the two share everything else.

Rounds alternate the sides (and, with ``--floors``, the same request bytes sent with the SDK's
HTTP client alone, its transport ``httpcore2`` alone, ``urllib3`` if installed, and the standard
library's ``http.client``: the floors under the SDK, each parsed by today's code):
each round makes ``--calls`` calls over ``N`` threads and reads this process's CPU time
(``time.process_time``: every thread, system time included; the fake's is not). Printed per
thread count: ms of CPU per call per side (mean, min and max over the rounds), the ratio
baseline/today per round, and the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import httpcore2

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.baseline import module_at  # noqa: E402
from benchmarks.bench_pipeline_cpu import candidates, worker_prompt  # noqa: E402
from tests.fake_anthropic import fake_process  # noqa: E402
from worker.adapters import anthropic as today  # noqa: E402
from worker.core.types import RerankPrompt  # noqa: E402

MODEL = "claude-haiku-4-5"
KEY = "sk-ant-bench"


def baseline_module(commit: str) -> ModuleType:
    """``worker/adapters/anthropic.py`` as it was at ``commit``, as a module of its own."""
    return module_at(commit, "worker/adapters/anthropic.py", "bench_baseline_anthropic")


def prompt() -> RerankPrompt:
    """A worker's prompt: 30 candidates of up to 1,200 characters, k=10."""
    return worker_prompt(candidates())


def listener(headers: Any) -> None:
    """The rate budget's work on each response's headers, roughly: read a few of them."""
    headers.get("anthropic-ratelimit-requests-remaining")
    headers.get("anthropic-ratelimit-input-tokens-remaining")


def sides(
    url: str, module: ModuleType | None, floors: bool, shared: int | None
) -> dict[str, Callable[[], object]]:
    """One call of each side, by name."""
    p = prompt()
    calls: dict[str, Callable[[], object]] = {}
    if module is not None:
        old = module.AnthropicReranker(MODEL, effort=None, on_headers=listener)
        calls["baseline"] = lambda: old.rerank(p, 30.0)
    new = today.AnthropicReranker(MODEL, effort=None, on_headers=listener)
    calls["today"] = lambda: new.rerank(p, 30.0)
    if shared is not None:  # one SDK client for every thread, its pool sized for them
        sdk_http = today._http()
        limits = sdk_http.Limits(max_connections=shared, max_keepalive_connections=shared)
        client = today.anthropic.Anthropic(
            max_retries=0,
            open_telemetry=today.sdk_spans(),
            http_client=today.anthropic.DefaultHttpxClient(limits=limits),
        )
        one = today.AnthropicReranker(MODEL, client=client, effort=None, on_headers=listener)
        calls["today, one shared client"] = lambda: one.rerank(p, 30.0)
    if floors:
        body = json.dumps(new.request_params(p)).encode()
        headers = {
            "x-api-key": KEY,
            "anthropic-version": "2026-10-21",
            "content-type": "application/json",
            "accept": "application/json",
        }
        sdk_http = today._http()  # httpx2, the SDK's own HTTP client
        local = threading.local()

        def httpx2_alone() -> object:
            if not hasattr(local, "client"):
                local.client = sdk_http.Client(base_url=url, timeout=30.0)
            response = local.client.post("/v1/messages", content=body, headers=headers)
            listener(response.headers)
            return today.parse_body(response.content)

        def stdlib() -> object:
            if not hasattr(local, "conn"):
                parts = urlsplit(url)
                local.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
            try:
                local.conn.request("POST", "/v1/messages", body=body, headers=headers)
                response = local.conn.getresponse()
            except (ConnectionError, http.client.RemoteDisconnected):  # idle past keep-alive
                local.conn.close()
                local.conn.request("POST", "/v1/messages", body=body, headers=headers)
                response = local.conn.getresponse()
            content = response.read()
            listener(response.headers)
            return today.parse_body(content)

        def httpcore2_alone() -> object:
            if not hasattr(local, "pool"):
                local.pool = httpcore2.ConnectionPool(max_connections=1)
            response = local.pool.request(
                "POST", url + "/v1/messages", content=body, headers=headers
            )
            listener(dict(response.headers))
            return today.parse_body(response.content)

        calls["httpx2 alone"] = httpx2_alone
        calls["httpcore2 alone"] = httpcore2_alone
        calls["http.client"] = stdlib
        with contextlib.suppress(ImportError):  # not a dependency of Sift: only if installed
            import urllib3

            parts = urlsplit(url)

            def urllib3_alone() -> object:
                if not hasattr(local, "urllib3"):
                    local.urllib3 = urllib3.HTTPConnectionPool(
                        parts.hostname, parts.port, maxsize=1, retries=False, timeout=30.0
                    )
                response = local.urllib3.urlopen(
                    "POST", "/v1/messages", body=body, headers=headers, retries=False
                )
                listener(response.headers)
                return today.parse_body(response.data)

            calls["urllib3 alone"] = urllib3_alone
    return calls


def cpu_per_call(
    pool: ThreadPoolExecutor, threads: int, call: Callable[[], object], n: int
) -> float:
    """ms of this process's CPU per call, ``n`` calls over ``threads`` threads."""
    share = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]

    def run(count: int) -> None:
        for _ in range(count):
            call()

    started = time.process_time()
    for future in [pool.submit(run, count) for count in share]:
        future.result()
    return 1000 * (time.process_time() - started) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--baseline", default="c192898", help="the commit to compare with")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--calls", type=int, default=2000, help="calls per side per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--delay", type=float, default=0.0, help="the fake's seconds per answer")
    parser.add_argument("--floors", action="store_true", help="also the HTTP layers alone")
    parser.add_argument(
        "--shared-client", action="store_true", help="also today's adapter on one SDK client"
    )
    args = parser.parse_args()
    module = None if args.no_baseline else baseline_module(args.baseline)
    results: dict[str, Any] = {"load_average_before": os.getloadavg(), "by_threads": {}}
    with (
        tempfile.TemporaryDirectory() as d,
        fake_process(Path(d), "--delay", str(args.delay)) as (
            url,
            _,
        ),
    ):
        os.environ["ANTHROPIC_BASE_URL"] = url
        os.environ["ANTHROPIC_API_KEY"] = KEY
        for threads in args.threads:
            calls = sides(url, module, args.floors, threads if args.shared_client else None)
            samples: dict[str, list[float]] = {name: [] for name in calls}
            with ThreadPoolExecutor(threads) as pool:
                for call in calls.values():  # warm: every thread's client and connection
                    cpu_per_call(pool, threads, call, max(100, 4 * threads))
                for round_ in range(args.rounds):
                    names = list(calls) if round_ % 2 == 0 else list(calls)[::-1]
                    for name in names:
                        samples[name].append(cpu_per_call(pool, threads, calls[name], args.calls))
            row: dict[str, Any] = {
                name: {
                    "cpu_ms_per_call": round(statistics.mean(values), 3),
                    "min": round(min(values), 3),
                    "max": round(max(values), 3),
                }
                for name, values in samples.items()
            }
            if module is not None:
                row["ratio_baseline_over_today"] = [
                    round(b / t, 2)
                    for b, t in zip(samples["baseline"], samples["today"], strict=True)
                ]
            row["load_average"] = os.getloadavg()
            results["by_threads"][str(threads)] = row
            print(threads, json.dumps(row), file=sys.stderr, flush=True)
    results["load_average_after"] = os.getloadavg()
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

"""The queue's benchmarks, each measured side by side in one run (issue 3's acceptance).

    python benchmarks/bench_queue.py throughput [--queries 2000]
    python benchmarks/bench_queue.py rerank [--rerank-queries 1000] [--threads 300] [--processes 2]
    python benchmarks/bench_queue.py gateway [--requests 5000] [--clients 64]
    python benchmarks/bench_queue.py all

* throughput: batch queries/s through gateway + Redis + one worker process, against
  the in-process runtime on the same queries (target ratio >= 0.7). Rerank off.
* rerank: with the fake Messages API answering after 1 s (the real SDK over loopback
  HTTP), the searches/s and the reranks in flight of one worker process on the
  threads pool, against a prefork pool of concurrency 2 (target >= 150/s); with
  ``--processes N``, also ``sift worker --processes N`` (N threads-pool processes under one
  supervisor), its CPU summed over the supervisor and its children.
* gateway: POST /v1/searches per second and the p99 latency on loopback, with no
  worker consuming (target >= 1000/s).

Every service is started here on free ports and stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fake_anthropic import fake_process  # noqa: E402
from tests.services import celery_worker, gateway, redis_server  # noqa: E402
from worker.contract import DocumentIn, SearchSpec  # noqa: E402

KEY = "bench-key-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
KEYS = [{"key": KEY, "tenant": "bench", "webhook_secret": "whsec_YmVuY2gtc2VjcmV0LTAxMjM0NTY3"}]
INDEX = "bench"
DATA = REPO / "worker" / "data"


def corpus() -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (DATA / "sample_corpus.jsonl").read_text().splitlines() if x]
    return [
        {
            "id": r["id"],
            "text": r["text"],
            "title": r.get("title", ""),
            "metadata": r.get("metadata", {}),
        }
        for r in rows
    ]


def queries(n: int) -> list[str]:
    base = [
        json.loads(x)["query"]
        for x in (DATA / "sample_queries.jsonl").read_text().splitlines()
        if x
    ]
    words = " ".join(d["text"] for d in corpus()).split()
    # vary the queries so no cache can flatter either side
    return [f"{base[i % len(base)]} {words[(i * 7) % len(words)]}" for i in range(n)]


def base_env(tmp: Path, redis_url: str, db: int) -> dict[str, str]:
    return {
        "SIFT_REDIS_URL": f"{redis_url}/{db}",
        "SIFT_API_KEYS": json.dumps(KEYS),
        "SIFT_DATA_DIR": str(tmp / f"data{db}"),
        "SIFT_WORKER_METRICS_PORT": "0",
        "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
    }


def run_batch(
    client: httpx.Client, qs: list[str], timeout: float = 900, mode: str = "hybrid"
) -> tuple[float, int]:
    """Submit a batch, wait until every item is final; (seconds, peak running items)."""
    items = [{"id": f"q{i}", "query": q, "mode": mode} for i, q in enumerate(qs)]
    peak = 0
    started = time.perf_counter()
    batch = client.post("/v1/batches", json={"index": INDEX, "queries": items}, headers=AUTH)
    batch.raise_for_status()
    bid = batch.json()["id"]
    while time.perf_counter() - started < timeout:
        counts = client.get(f"/v1/batches/{bid}", headers=AUTH).json()["counts"]
        peak = max(peak, counts["running"])
        if counts["queued"] == counts["running"] == 0:
            elapsed = time.perf_counter() - started
            assert counts["succeeded"] == len(qs), (counts, failures(client, bid))
            return elapsed, peak
        time.sleep(0.05)
    raise TimeoutError(f"batch {bid} did not finish")


def failures(client: httpx.Client, batch_id: str) -> dict[str, int]:
    """How many items failed, by error type and message, and how many fell back to the fused
    order, by reason (to say why a run fell short)."""
    found: dict[str, int] = {}
    token: str | None = None
    while True:
        params = {"page_size": 1000, **({"page_token": token} if token else {})}
        page = client.get(f"/v1/batches/{batch_id}/results", params=params, headers=AUTH).json()
        for item in page["results"]:
            rerank = (item.get("result") or {}).get("rerank") or {}
            if item.get("error"):
                reason = f"{item['error']['type']}: {item['error']['message'][:80]}"
            elif rerank.get("fallback_reason"):
                reason = f"fallback: {rerank['fallback_reason'][:80]}"
            else:
                continue
            found[reason] = found.get(reason, 0) + 1
        token = page["next_page_token"]
        if not token:
            return found


def ingest(client: httpx.Client) -> None:
    r = client.post(
        f"/v1/indexes/{INDEX}/documents",
        params={"wait": 30},
        json={"documents": corpus()},
        headers=AUTH,
    )
    r.raise_for_status()
    assert r.json()["status"] == "succeeded", r.text


def bench_throughput(n: int, concurrency: int) -> dict[str, float]:
    from worker.runtime.inprocess import build_runtime
    from worker.settings import load_settings

    qs = queries(n)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        runtime = build_runtime(load_settings(data_dir=tmp / "inproc"))
        runtime.ingest(INDEX, "bench", [DocumentIn.model_validate(x) for x in corpus()])
        for q in qs[:20]:  # warm up
            runtime.search(SearchSpec(index=INDEX, query=q), "bench")
        started = time.perf_counter()
        for q in qs:
            runtime.search(SearchSpec(index=INDEX, query=q), "bench")
        inproc = n / (time.perf_counter() - started)
        # the same thread count as the worker, for a like-for-like comparison
        with ThreadPoolExecutor(concurrency) as pool:
            started = time.perf_counter()
            list(pool.map(lambda q: runtime.search(SearchSpec(index=INDEX, query=q), "bench"), qs))
            inproc_threads = n / (time.perf_counter() - started)

        with redis_server(tmp / "redis") as redis_url:
            # batch items run on the worker's item pool: the same thread count there too
            env = {
                **base_env(tmp, redis_url, 0),
                "SIFT_BATCH_ITEM_CONCURRENCY": str(concurrency),
            }
            with (
                celery_worker(tmp / "w", env, "tp", concurrency=concurrency),
                gateway(tmp / "g", env) as url,
                httpx.Client(base_url=url, timeout=60) as client,
            ):
                ingest(client)
                run_batch(client, qs[:50])  # warm up the worker's runtime
                seconds, _ = run_batch(client, qs)
        queued = n / seconds
    return {
        "in_process_qps_1_thread": inproc,
        f"in_process_qps_{concurrency}_threads": inproc_threads,
        "queue_qps": queued,
        "ratio_vs_best_in_process": queued / max(inproc, inproc_threads),
    }


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process and its reaped children (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


WARM_UP = 200  # queries run before a threads set-up is measured (8 chunks: every process)


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``, from ``/proc``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def tree_cpu_seconds(pid: int) -> float:
    """:func:`cpu_seconds` of ``pid`` and of its live children (a supervisor's workers)."""
    return cpu_seconds(pid) + sum(cpu_seconds(child) for child in children(pid))


def bench_rerank(
    n: int, threads: int, prefork_n: int, mode: str, processes: int = 1
) -> dict[str, float]:
    qs = queries(n)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with (
            fake_process(tmp, "--delay", "1.0") as (model_url, model),
            redis_server(tmp / "redis") as r,
        ):
            # the baseline is the naive set-up: two processes, one search in flight each
            runs = [("threads", threads, n, 0, threads, 1), ("prefork", 2, prefork_n, 1, 1, 1)]
            if processes > 1:  # the same threads set-up, on `processes` worker processes
                runs.insert(1, ("threads", threads, n, 2, threads, processes))
            for pool, conc, count, db, items, procs in runs:
                label = pool if procs == 1 else f"{pool}_x{procs}"
                env = {
                    **base_env(tmp, r, db),
                    "SIFT_BATCH_ITEM_CONCURRENCY": str(items),
                    # the baseline gets one item per chunk, so both processes stay busy
                    "SIFT_BATCH_CHUNK_SIZE": "25" if pool == "threads" else "1",
                    "SIFT_RERANK_ENABLED": "true",
                    "SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5",
                    "SIFT_RERANK_MAX_IN_FLIGHT": str(max(threads, 2)),
                    "ANTHROPIC_BASE_URL": model_url,
                    "ANTHROPIC_API_KEY": "sk-ant-fake",
                }
                with (
                    celery_worker(
                        tmp / label, env, label, concurrency=conc, pool=pool, processes=procs
                    ) as proc,
                    gateway(tmp / label, env) as url,
                    httpx.Client(base_url=url, timeout=60) as client,
                ):
                    ingest(client)
                    if pool == "threads":  # each process loads its embedding model on its
                        run_batch(client, qs[:WARM_UP], mode=mode)  # first search: not timed
                    cpu, model_cpu = tree_cpu_seconds(proc.pid), cpu_seconds(model.pid)
                    seconds, peak = run_batch(client, qs[:count], mode=mode)
                    cpu = tree_cpu_seconds(proc.pid) - cpu
                    model_cpu = cpu_seconds(model.pid) - model_cpu
                out[f"{label}_searches_per_s"] = count / seconds
                out[f"{label}_peak_running"] = peak
                if pool == "threads":  # prefork children are not reaped yet: not counted
                    # what one search costs the worker, whatever else the machine is doing
                    out[f"{label}_worker_cpu_ms_per_search"] = 1000 * cpu / count
                    # the fake model shares these two cores; a real provider would not
                    out[f"{label}_fake_model_cpu_ms_per_search"] = 1000 * model_cpu / count
    return out


async def _hammer(url: str, total: int, clients: int) -> list[float]:
    """Keep-alive HTTP/1.1 over raw asyncio streams: a load generator light enough that the
    gateway, not the client, is what gets measured (httpx's async pool tops out near 200/s
    here)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"index": INDEX, "query": "gateway load"}).encode()
    request = (
        f"POST /v1/searches HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    latencies: list[float] = []
    counter = iter(range(total))

    async def one_client() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for _ in counter:
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1])
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                assert status == 202, head
        finally:
            writer.close()
            await writer.wait_closed()

    await asyncio.gather(*(one_client() for _ in range(clients)))
    return latencies


def bench_gateway(total: int, clients: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with (
            redis_server(tmp / "redis") as r,
            gateway(tmp / "g", base_env(tmp, r, 0)) as url,
        ):
            asyncio.run(_hammer(url, min(500, total), clients))  # warm up
            started = time.perf_counter()
            latencies = asyncio.run(_hammer(url, total, clients))
            seconds = time.perf_counter() - started
    latencies.sort()
    return {
        "submissions_per_s": total / seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("which", choices=["throughput", "rerank", "gateway", "all"])
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--worker-threads", type=int, default=8)
    parser.add_argument("--rerank-queries", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=300)
    parser.add_argument("--prefork-queries", type=int, default=40)
    parser.add_argument(
        "--processes", type=int, default=1,
        help="rerank: also run the threads set-up on this many worker processes",
    )  # fmt: skip
    parser.add_argument(
        "--rerank-mode",
        choices=["hybrid", "fts"],
        default="hybrid",
        help="fts leaves the query embedding (CPU) out of the rerank run",
    )
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    if args.which in ("throughput", "all"):
        results["throughput"] = bench_throughput(args.queries, args.worker_threads)
    if args.which in ("rerank", "all"):
        results["rerank"] = bench_rerank(
            args.rerank_queries, args.threads, args.prefork_queries, args.rerank_mode,
            args.processes,
        )  # fmt: skip
    if args.which in ("gateway", "all"):
        results["gateway"] = bench_gateway(args.requests, args.clients)
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()

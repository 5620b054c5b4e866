"""Reranked searches at the defaults, today's code against a baseline commit, in one run.

    python benchmarks/bench_rerank_cpu.py [--queries 3000] [--baseline a293bac] [--runs 2]
                                          [--profile] [--no-baseline]

Issue 14's acceptance: a reranked batch through the gateway and ``sift worker`` exactly as a
user starts it (its default processes, threads, chunk size and items in flight), the fake
Messages API answering after 1 s with no rate limit. For each side it prints the searches/s
and the CPU per search of the worker (the supervisor and its children), the fake model, Redis
and the gateway; then the baseline's worker CPU per search over today's. The baseline is the
same benchmark against a checkout of ``--baseline`` (``git archive``), with its own gateway and
worker on that tree, the fake and Redis shared; the sides alternate run by run.

``--profile`` runs the workers under :mod:`benchmarks.stage_probe`, which sums each stage's
thread CPU (embedding, retrieval, the model call, the rest of the search; outside the search:
job store, Celery...) per search, on today's side and on the baseline's when its tree has the
probe; beside it, the raw cost of the same embedding and retrieval calls made in this process.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_queue import (  # noqa: E402
    AUTH,
    INDEX,
    KEYS,
    children,
    corpus,
    cpu_seconds,
    failures,
    ingest,
    queries,
    tree_cpu_seconds,
)
from tests.fake_anthropic import fake_process  # noqa: E402
from worker.processes.stack import gateway_process, redis_service, running, worker_process  # noqa: E402

# A model both sides call alike. The first baseline (a293bac) sends output_config.effort to
# every model; Haiku 4.5 answers that with a 400, as the real API does (the fake mirrors it),
# so with Haiku every baseline search failed at once and did less work than today's.
MODEL = "claude-sonnet-4-6"
WARM_UP = 400  # searches before the measured batch: each process loads its model on its first


def run_batch(client: httpx.Client, qs: list[str]) -> tuple[float, int, dict[str, int]]:
    """Submit a batch and wait until every item is final: (seconds, peak running items,
    the failures by reason: none expected)."""
    items = [{"id": f"q{i}", "query": q} for i, q in enumerate(qs)]
    started, peak = time.perf_counter(), 0
    batch = client.post("/v1/batches", json={"index": INDEX, "queries": items}, headers=AUTH)
    batch.raise_for_status()
    bid = batch.json()["id"]
    while True:
        counts = client.get(f"/v1/batches/{bid}", headers=AUTH).json()["counts"]
        peak = max(peak, counts["running"])
        if counts["queued"] == counts["running"] == 0:
            seconds = time.perf_counter() - started
            return seconds, peak, failures(client, bid) if counts["failed"] else {}
        time.sleep(0.05)


def checkout(commit: str, into: Path) -> Path:
    """The tree of ``commit`` in ``into`` (for its own gateway and worker)."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def env_for(tmp: Path, redis_url: str, db: int, model_url: str, tree: Path) -> dict[str, str]:
    """The defaults, but for what a deployment must say: Redis, keys, the model and where."""
    return {
        "PYTHONPATH": str(tree),
        "SIFT_REDIS_URL": f"{redis_url}/{db}",
        "SIFT_API_KEYS": json.dumps(KEYS),
        "SIFT_DATA_DIR": str(tmp / f"data{db}"),
        "SIFT_WORKER_METRICS_PORT": "0",
        "SIFT_RERANK_ENABLED": "true",
        "SIFT_GENERATION_MODEL": f"anthropic:{MODEL}",
        "ANTHROPIC_BASE_URL": model_url,
        "ANTHROPIC_API_KEY": "sk-ant-fake",
    }


def probed(tree: Path) -> bool:
    """Whether ``tree`` has :mod:`benchmarks.stage_probe` (a293bac, the first baseline, has not)."""
    return (tree / "benchmarks" / "stage_probe.py").exists()


def system_seconds(pid: int) -> float:
    """System CPU time of ``pid`` and its live children (futex hand-offs, sockets)."""
    total = 0.0
    for p in [pid, *children(pid)]:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[12]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    return total


def stage_sums(directory: Path) -> dict[str, float]:
    """The worker processes' stage sums (:mod:`benchmarks.stage_probe`), added up."""
    total: collections.Counter[str] = collections.Counter()
    for path in directory.glob("*.json"):
        sums = json.loads(path.read_text())
        total.update(sums)
        total[f"searches of {path.stem}"] = sums["searches"]
    return dict(total)


def measure(
    tmp: Path, label: str, tree: Path, redis: tuple[str, int], model: tuple[str, int], db: int,
    qs: list[str], profile: bool, extra: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    env = {**env_for(tmp, redis[0], db, model[0], tree), **extra}
    stages = tmp / f"stages-{label}"
    if profile:
        stages.mkdir()
        env |= {"SIFT_RUNTIME_FACTORY": "benchmarks.stage_probe:runtime",
                "BENCH_STAGE_DIR": str(stages)}  # fmt: skip
    with (
        worker_process(tmp / label, env, label, processes=None) as proc,
        gateway_process(tmp / label, env, f"gateway-{label}") as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        ingest(client)
        _, _, warm_failed = run_batch(client, qs[:WARM_UP])
        if warm_failed:  # a side that fails its searches fails the measured ones as well
            sys.exit(f"not a measure: {label}'s warm-up searches failed: {warm_failed}")
        gateway_pid = next(
            p for p in children(os.getpid()) if p not in (proc.pid, redis[1], model[1])
        )
        pids = {
            "worker": lambda: tree_cpu_seconds(proc.pid),
            "worker_system": lambda: system_seconds(proc.pid),
            "fake_model": lambda: cpu_seconds(model[1]),
            "redis": lambda: cpu_seconds(redis[1]),
            "gateway": lambda: tree_cpu_seconds(gateway_pid),
        }
        before = {name: read() for name, read in pids.items()}
        sums = stage_sums(stages)
        seconds, peak, failed = run_batch(client, qs[WARM_UP:])
        cpu = {name: read() - before[name] for name, read in pids.items()}
        time.sleep(1.5)  # each process writes its sums every 50 searches: let them settle
        sums = {k: v - sums.get(k, 0.0) for k, v in stage_sums(stages).items()}
    if os.environ.get("BENCH_KEEP_LOGS"):  # the services' logs, to read after the run
        shutil.copytree(tmp / label, Path(os.environ["BENCH_KEEP_LOGS"]) / label,
                        ignore=shutil.ignore_patterns("data*"), dirs_exist_ok=True)  # fmt: skip
    n = len(qs) - WARM_UP
    row: dict[str, Any] = {
        "load_average_1m": round(os.getloadavg()[0], 1),
        "searches_per_s": round(n / seconds, 1),
        "peak_running": peak,
        "failed": failed,
        **{f"{name}_cpu_ms_per_search": round(1000 * c / n, 3) for name, c in cpu.items()},
    }
    if profile:  # thread CPU per stage in the worker processes, per search
        ms = {k: 1000 * v / n for k, v in sums.items()}
        inner = ms["embed"] + ms["retrieve"] + ms["model_call"]
        row["worker_cpu_ms_per_search_by_stage"] = {
            "embedding": round(ms["embed"], 3),
            "retrieval": round(ms["retrieve"], 3),
            "model call (the SDK's request and response)": round(ms["model_call"], 3),
            "rest of the search (fusion, prompt, result, metrics)": round(ms["search"] - inner, 3),
            "outside the search (job store, Celery, item queue, hand-offs)": round(
                1000 * cpu["worker"] / n - ms["search"], 3),
            "searches counted": sums.get("searches", 0),
        }  # fmt: skip
        # how evenly the batch was shared between the worker processes
        row["searches_per_process"] = sorted(
            int(v) for k, v in sums.items() if k.startswith("searches of ")
        )
    return row


def raw_costs(qs: list[str]) -> dict[str, float]:
    """CPU ms per call of the same embedding and retrieval, in this process, one at a time."""
    from worker.contract import DocumentIn
    from worker.core.query import channel_window, coarse_limit
    from worker.core.types import ChannelQuery, HardFilters
    from worker.runtime.inprocess import build_runtime
    from worker.settings import load_settings

    with tempfile.TemporaryDirectory() as d:
        runtime = build_runtime(load_settings(data_dir=Path(d), redis_url=None))
        runtime.ingest(INDEX, "bench", [DocumentIn.model_validate(x) for x in corpus()])
        pipeline = runtime.pipeline
        embed = pipeline.embedder.embed
        for q in qs[:50]:
            embed([q])
        started = time.process_time()
        vectors = [embed([q])[0] for q in qs]
        embed_ms = 1000 * (time.process_time() - started) / len(qs)
        size = channel_window(coarse_limit(10, pipeline.config.candidate_limit, True))
        asks = [
            ChannelQuery(
                index=INDEX,
                filters=HardFilters(tenant="bench", fields={}),
                channels=("bm25", "knn"),
                size=size,
                text=q,
                vector=v,
            )
            for q, v in zip(qs, vectors, strict=True)
        ]
        started = time.process_time()
        for ask in asks:
            pipeline.backend.retrieve(ask)
        retrieve_ms = 1000 * (time.process_time() - started) / len(qs)
    return {
        "embed_ms_per_query": round(embed_ms, 3),
        "retrieve_ms_per_query": round(retrieve_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--queries", type=int, default=3000, help="measured, after the warm-up")
    parser.add_argument("--baseline", default="a293bac", help="the commit to compare with")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="worker CPU by stage")
    parser.add_argument("--env", action="append", default=[], metavar="SIFT_X=V",
                        help="a setting of today's side (to try one)")  # fmt: skip
    args = parser.parse_args()
    qs = queries(WARM_UP + args.queries)
    extra = dict(item.split("=", 1) for item in args.env)
    results: dict[str, Any] = {"uptime_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.chdir(tmp)  # `python -m` puts the working directory first on a child's path
        sides = {"today": REPO}
        if not args.no_baseline:
            sides = {"baseline": checkout(args.baseline, tmp / "baseline"), **sides}
        service, redis_url = redis_service(tmp / "redis")
        with (
            fake_process(tmp, "--delay", "1.0") as (model_url, model),
            running(service),
        ):
            assert service.proc is not None
            redis = (redis_url, service.proc.pid)
            db = 0
            runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
            for run in range(args.runs):
                order = list(sides) if run % 2 == 0 else list(sides)[::-1]
                for side in order:
                    db += 1
                    row = measure(tmp, f"{side}{run}", sides[side], redis, (model_url, model.pid),
                                  db, qs, args.profile and probed(sides[side]),
                                  extra if side == "today" else {})  # fmt: skip
                    runs[side].append(row)
                    print(side, json.dumps(row), file=sys.stderr, flush=True)
    results["runs"] = runs
    if "baseline" in runs:
        results["worker_cpu_ratio_baseline_over_today"] = [
            round(b["worker_cpu_ms_per_search"] / t["worker_cpu_ms_per_search"], 2)
            for b, t in zip(runs["baseline"], runs["today"], strict=True)
        ]
    results["raw_in_process"] = raw_costs(qs[:1000])
    results["uptime_after"] = os.getloadavg()
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")
    # a side whose searches failed did other work than the one it is compared with
    spoilt = {side: row["failed"] for side, rows in runs.items() for row in rows if row["failed"]}
    if spoilt:
        sys.exit(f"not a measure: searches failed on {', '.join(sorted(spoilt))}: {spoilt}")


if __name__ == "__main__":
    main()

"""A 100,000-query batch through faults, at the default settings: every item accounted for.

    python benchmarks/bench_batch_100k.py [--queries 100000] [--model-delay 1.0] [--seed 7]
        [--corpus PATH] [--no-kill-worker] [--no-restart-redis] [--no-outage]
        [--outage-seconds 20] [--retry-after 2]

The stack as a user runs it: redis-server with AOF ``everysec`` (as ``sift up`` and
``deploy/`` run it), the gateway, and ``sift worker`` with nothing but what a deployment must
say (Redis, the keys, the model, reranking on): its default process count (one per core), its
default threads, every reliability setting at its default. The fake Messages API runs in its
own process, answering after ``--model-delay`` seconds with realistic usage. The corpus is
the bundled sample (or ``--corpus``, a JSONL of ``_id``/``id``, ``title``, ``text``).

One ``POST /v1/batches`` of ``--queries`` distinct queries (a corpus sentence's words with
two other corpus words, drawn with ``--seed``), with a ``webhook_url`` of a receiver of our
own that verifies each delivery's standardwebhooks signature. While it runs, each optional:

- at ~20% of the items final, SIGKILL one of ``sift worker``'s processes (its supervisor
  starts it again; the dead-worker check puts its deliveries back);
- at ~45%, SIGTERM redis-server and start it again on the same port and directory 2 s later;
- at ~70%, a provider outage: every model call answered 529 or 429 (in turn, with
  ``retry-after``) for ``--outage-seconds``. Items whose retries run out fail as the
  default policy (``fail_closed``) says; each must say so truthfully.

At the end it checks, and exits 1 if any check fails: the batch's status is final and
truthful; its counts sum to the queries; its results (every page) hold exactly one final
line per query id and agree with the counts; the webhook arrived, verified, with one
``webhook-id``, saying what the batch says; no message is left in Sift's queues. It prints
the model calls (per item, 429/529 answered, prompts sent more than once), wall time,
items/s, CPU per item of the worker (supervisor and children), the fake, Redis and the
gateway, Redis's peak memory, the worker processes' peak RSS and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any

import httpx
import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from standardwebhooks.webhooks import Webhook

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_queue import children, cpu_seconds, tree_cpu_seconds  # noqa: E402
from tests.fake_anthropic import RemoteFakeAnthropic, fake_process  # noqa: E402
from tests.reliability.support import (  # noqa: E402
    ACME,
    DOWN_SECONDS,
    INDEX,
    KEYS,
    Broker,
    batch_counts,
    broker,
    broker_state,
    ingest,
    iter_results,
    sample_documents,
    stack_env,
)
from tests.services import Received, gateway, webhook_inbox  # noqa: E402
from worker.constants import (  # noqa: E402
    ALL_QUEUES,
    BATCH_COUNTS_KEY,
    BATCH_ITEMS_KEY,
    BATCH_MOVES_KEY,
    BATCH_ORDER_KEY,
    BATCH_RESULTS_KEY,
    BATCH_SPECS_KEY,
    MAX_DOCUMENTS_PER_REQUEST,
    MAX_WAIT_SECONDS,
    REDIS_PREFIX,
)
from worker.processes.stack import child_env, worker_process  # noqa: E402

FINAL = ("succeeded", "failed", "canceled")
console = Console(highlight=False)


# --- the workload ---------------------------------------------------------------------------


def read_corpus(path: Path | None) -> list[dict[str, Any]]:
    """The documents to ingest: the bundled sample, or a JSONL file (SciFact's ``_id``)."""
    if path is None:
        return sample_documents()
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [
        {"id": str(r.get("_id", r.get("id"))), "title": r.get("title", ""), "text": r["text"]}
        for r in rows
    ]


def make_queries(documents: list[dict[str, Any]], n: int, seed: int) -> list[str]:
    """``n`` distinct queries: six to ten consecutive words of a corpus sentence, and two
    more corpus words, drawn with ``seed`` (the same run twice asks the same questions)."""
    sentences = [
        words
        for d in documents
        for s in re.split(r"(?<=[.;!?])\s+", d["text"])
        if len(words := s.split()) >= 6
    ]
    vocabulary = sorted({w.strip(".,;:()") for d in documents for w in d["text"].split()} - {""})
    rng, seen, out = random.Random(seed), set[str](), list[str]()
    while len(out) < n:
        words = rng.choice(sentences)
        size = rng.randint(6, min(10, len(words)))
        start = rng.randint(0, len(words) - size)
        query = " ".join([*words[start : start + size], *rng.sample(vocabulary, 2)])
        if query not in seen:
            seen.add(query)
            out.append(query)
    return out


def ingest_corpus(client: httpx.Client, documents: list[dict[str, Any]], sample: bool) -> None:
    if sample:
        ingest(client)
        return
    for start in range(0, len(documents), MAX_DOCUMENTS_PER_REQUEST):
        # the API waits at most MAX_WAIT_SECONDS (a longer wait is a 422): poll past it
        response = client.post(
            f"/v1/indexes/{INDEX}/documents",
            params={"wait": MAX_WAIT_SECONDS},
            json={"documents": documents[start : start + MAX_DOCUMENTS_PER_REQUEST]},
            headers=ACME,
        )
        response.raise_for_status()
        job = response.json()
        while job["status"] not in FINAL:
            time.sleep(1)
            job = client.get(response.headers["location"], headers=ACME).json()
        if job["status"] != "succeeded":
            raise SystemExit(f"ingest {job['id']} {job['status']}: {job.get('error')}")


# --- what is measured during the run ---------------------------------------------------------


def redis_info(url: str) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    try:
        return dict(client.info())
    finally:
        client.close()


def peak_rss_mb(pid: int) -> float:
    """``VmHWM``: the process's peak resident set so far, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gateway_pid(exclude: set[int]) -> int:
    """Our child running ``sift gateway`` (:func:`tests.services.gateway` yields its URL)."""
    for pid in children(os.getpid()):
        if pid not in exclude and b"gateway" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError("no gateway process found")


@dataclass
class Watch:
    """Figures sampled while the batch runs (Redis's and the workers' restart them)."""

    redis_url: str
    supervisor: int
    redis_cpu_banked: float = 0.0  # CPU of redis-server processes that were stopped
    redis_peak_bytes: int = 0
    worker_peak_mb: dict[int, float] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    progress: list[tuple[float, int]] = field(default_factory=list)  # (seconds, items final)

    def longest_stall(self) -> tuple[float, float, int]:
        """The longest time no item became final: (seconds, from when, items final then)."""
        best = (0.0, 0.0, 0)
        since, held = self.progress[0] if self.progress else (0.0, 0)
        for at, done in self.progress[1:]:
            if done > held:
                best = max(best, (at - since, since, held))
                since, held = at, done
        return best

    def sample(self) -> None:
        try:
            info = redis_info(self.redis_url)
            self.redis_peak_bytes = max(self.redis_peak_bytes, int(info["used_memory_peak"]))
        except (redis.RedisError, OSError):
            pass  # down for its restart
        for pid in [self.supervisor, *children(self.supervisor)]:
            with contextlib.suppress(OSError):  # a process that just exited
                self.worker_peak_mb[pid] = max(self.worker_peak_mb.get(pid, 0), peak_rss_mb(pid))

    def redis_cpu(self) -> float:
        info = redis_info(self.redis_url)
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# --- the faults ------------------------------------------------------------------------------


def kill_a_worker_process(watch: Watch) -> str:
    """SIGKILL one of ``sift worker``'s processes; its supervisor starts another."""
    before = children(watch.supervisor)
    victim = before[0]
    watch.sample()
    os.kill(victim, signal.SIGKILL)
    return f"SIGKILL worker process {victim} (of {len(before)})"


def restart_redis(watch: Watch, redis_broker: Broker) -> str:
    """SIGTERM redis-server, start it again on the same port and directory 2 s later."""
    watch.sample()
    watch.redis_cpu_banked += watch.redis_cpu()
    started = time.monotonic()
    redis_broker.kill(signal.SIGTERM)
    time.sleep(DOWN_SECONDS)
    redis_broker.start_again()  # waits until it answers (the AOF loaded)
    return f"SIGTERM redis-server; serving again {time.monotonic() - started:.1f} s later"


def provider_outage(model_url: str, seconds: float, retry_after: float) -> str:
    RemoteFakeAnthropic(model_url).outage(seconds, (529, 429), retry_after=retry_after)
    return f"provider outage: 529/429 (retry-after {retry_after:g} s) for {seconds:g} s"


# The attempt classes a provider outage of 429s and 529s leads to (a search's deadline or the
# rate budget's pause outlasting it included); a 4xx, a malformed answer or a backend error is
# work that did not happen for another reason, and the items/s would count it as done.
OUTAGE_CLASSES = ("rate_limited", "http_5xx", "timeout", "budget_exhausted", "deadline")


def outage_failure(reason: str) -> bool:
    """Whether a failed item's ``type: message`` is one the provider outage explains.

    >>> outage_failure("rerank_failed: rerank failed (http_5xx): HTTP 529: overloaded")
    True
    >>> outage_failure("rerank_failed: rerank failed (http_4xx): HTTP 400: effort")
    False
    """
    kind, _, message = reason.partition(": ")
    if kind == "deadline_exceeded":
        return True
    return kind == "rerank_failed" and any(f"({c}" in message for c in OUTAGE_CLASSES)


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Checks:
    failed: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str, detail: object = "") -> None:
        mark = "[green]ok[/green]  " if ok else "[red]FAIL[/red]"
        console.print(f"  {mark} {what}" + (f": {detail}" if detail != "" else ""))
        if not ok:
            self.failed.append(what)


def wait_final(
    client: httpx.Client, batch_id: str, n: int, faults: list[tuple[float, Any]],
    watch: Watch, timeout: float,
) -> dict[str, Any]:  # fmt: skip
    """Show the batch's progress until every item is final, firing each fault at its share
    of the items final; answers the batch's last record."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]:>6.0f}/s"), TimeElapsedColumn())  # fmt: skip
    deadline, started = time.monotonic() + timeout, time.monotonic()
    last: dict[str, Any] = {}
    pending = sorted(faults, key=lambda f: f[0])
    next_sample = 0.0
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("items final", total=n, rate=0.0)
        while time.monotonic() < deadline:
            try:
                last = batch_counts(client, batch_id)
            except (httpx.HTTPError, ValueError):
                time.sleep(0.5)  # Redis restarting: 503 for a moment
                continue
            done = sum(last["counts"][s] for s in FINAL)
            watch.progress.append((time.monotonic() - started, done))
            bar.update(task, completed=done, rate=done / max(1e-9, time.monotonic() - started))
            while pending and done >= pending[0][0] * n:
                _, fire = pending.pop(0)
                what = fire()
                watch.events.append(f"{time.monotonic() - started:7.1f} s, {done:>6} final: {what}")
                bar.console.print(f"[yellow]{watch.events[-1]}[/yellow]")
            if time.monotonic() >= next_sample:
                watch.sample()
                next_sample = time.monotonic() + 2.0
            if done >= n and last["status"] in FINAL:
                return last
            time.sleep(0.5)
    raise TimeoutError(f"the batch did not finish within {timeout:g} s: {last}")


def verified_webhooks(inbox: Any, wait: float) -> list[dict[str, Any]]:
    """Every delivery received within ``wait`` s of the first (at least one awaited),
    each verified with the standardwebhooks library: (webhook-id, payload)."""
    secret = KEYS[0]["webhook_secret"]
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            received: Received = inbox.get(timeout=0.5)
        except Empty:
            if out:
                break
            continue
        raw, headers = received
        payload = Webhook(secret).verify(raw, headers)
        out.append({"id": headers["webhook-id"], "payload": payload})
    return out


def read_results(
    client: httpx.Client, batch_id: str
) -> tuple[Counter[str], Counter[str], Counter[str], int]:
    """Every result line, paged: (ids seen how often, statuses, error classes, lines that are
    not final or say nothing of their outcome)."""
    ids: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    bad = 0
    for line in iter_results(client, batch_id):
        ids[line["query_id"]] += 1
        statuses[line["status"]] += 1
        if line.get("error"):
            errors[f"{line['error']['type']}: {line['error'].get('message', '')[:90]}"] += 1
        if line["status"] not in FINAL or (
            (line["status"] == "succeeded") != ("result" in line and line["result"] is not None)
        ):
            bad += 1
    return ids, statuses, errors, bad


def store_tally(url: str, batch_id: str) -> tuple[Counter[str], dict[str, int], int]:
    """What the job store itself holds: the items' states, its counts, and how many result
    fields (one per item, plus a placeholder): a double transition would show here."""
    store = redis.Redis.from_url(url, decode_responses=True)
    try:
        states = Counter(str(v) for v in store.hvals(BATCH_ITEMS_KEY + batch_id))
        raw = store.hgetall(BATCH_COUNTS_KEY + batch_id).items()
        counts = {str(k): int(v) for k, v in raw}
        return states, counts, int(store.hlen(BATCH_RESULTS_KEY + batch_id))
    finally:
        store.close()


def batch_memory(url: str, batch_id: str) -> dict[str, int]:
    """Bytes Redis holds for each of the batch's large keys (``MEMORY USAGE``, every field)."""
    store = redis.Redis.from_url(url)
    try:
        keys = (
            BATCH_RESULTS_KEY,
            BATCH_SPECS_KEY,
            BATCH_ITEMS_KEY,
            BATCH_MOVES_KEY,
            BATCH_ORDER_KEY,
        )
        return {
            key.removeprefix(REDIS_PREFIX).rstrip(":"): int(
                store.memory_usage(key + batch_id, samples=0) or 0
            )
            for key in keys
        }
    finally:
        store.close()


RECOVERY_LINES = ("put back on their queues", "re-driven")  # liveness.py, redrive.py


def recovery_lines(log: Path) -> list[str]:
    """The worker's log lines that say it recovered lost or orphaned work."""
    text = log.read_text(errors="replace").splitlines()
    return [line[:220] for line in text if any(mark in line for mark in RECOVERY_LINES)]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--queries", type=int, default=100_000)
    parser.add_argument("--model-delay", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--corpus", type=Path, default=None, help="JSONL; default: the sample")
    parser.add_argument("--no-kill-worker", action="store_true")
    parser.add_argument("--no-restart-redis", action="store_true")
    parser.add_argument("--no-outage", action="store_true")
    parser.add_argument("--outage-seconds", type=float, default=20.0)
    parser.add_argument("--retry-after", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args()
    n = args.queries
    documents = read_corpus(args.corpus)
    qs = make_queries(documents, n, args.seed)
    console.print(f"before: {uptime()}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.chdir(tmp)  # `python -m` puts the working directory first on a child's path
        with (
            fake_process(tmp, "--delay", str(args.model_delay)) as (model_url, model),
            broker(tmp / "redis") as redis_broker,
            webhook_inbox() as (hook_url, inbox),
        ):
            url = redis_broker.url + "/0"
            env = stack_env(url, model_url, SIFT_DATA_DIR=str(tmp / "data"))
            for default in ("SIFT_WORKER_SOFT_SHUTDOWN_SECONDS", "SIFT_WEBHOOK_RETRY_SCALE"):
                env.pop(default)  # at their defaults: only what a deployment must say is set
            with (
                worker_process(tmp / "w", child_env(env, inherit_sift=False), "bench",
                               processes=None) as supervisor,
                gateway(tmp / "g", env) as base,
                httpx.Client(base_url=base, timeout=300) as client,
            ):  # fmt: skip
                run_and_check(args, client, redis_broker, url, model_url, model.pid,
                              supervisor.pid, hook_url, inbox, documents, qs, tmp)  # fmt: skip


def run_and_check(
    args: argparse.Namespace, client: httpx.Client, redis_broker: Broker, url: str,
    model_url: str, model_pid: int, supervisor: int, hook_url: str, inbox: Any,
    documents: list[dict[str, Any]], qs: list[str], tmp: Path,
) -> None:  # fmt: skip
    n = len(qs)
    ingest_corpus(client, documents, args.corpus is None)
    processes = children(supervisor)
    fake = RemoteFakeAnthropic(model_url)
    watch = Watch(url, supervisor)
    gateway_at = gateway_pid({supervisor, model_pid})
    faults: list[tuple[float, Any]] = []
    if not args.no_kill_worker:
        faults.append((0.20, lambda: kill_a_worker_process(watch)))
    if not args.no_restart_redis:
        faults.append((0.45, lambda: restart_redis(watch, redis_broker)))
    if not args.no_outage:
        faults.append((0.70, lambda: provider_outage(model_url, args.outage_seconds,
                                                     args.retry_after)))  # fmt: skip
    console.print(
        f"{n:,} distinct queries, {len(documents)} documents, model answering in "
        f"{args.model_delay:g} s; sift worker: {len(processes)} processes (pids "
        f"{', '.join(map(str, processes))}), every setting at its default"
    )
    fake.reset()
    cpu_before = {
        "worker": tree_cpu_seconds(supervisor),
        "fake model": cpu_seconds(model_pid),
        "redis": watch.redis_cpu(),
        "gateway": tree_cpu_seconds(gateway_at),
    }
    body = {
        "index": INDEX,
        "webhook_url": hook_url,
        "queries": [{"id": f"q{i:06d}", "query": q} for i, q in enumerate(qs)],
    }
    started = time.monotonic()
    response = client.post("/v1/batches", json=body, headers=ACME)
    submitted = time.monotonic()
    assert response.status_code == 202, response.text[:2000]
    batch_id = response.json()["id"]
    del body
    console.print(f"batch {batch_id} accepted in {submitted - started:.1f} s")
    final = wait_final(client, batch_id, n, faults, watch, args.timeout)
    finished = time.monotonic()
    watch.sample()
    cpu = {
        "worker": tree_cpu_seconds(supervisor) - cpu_before["worker"],
        "fake model": cpu_seconds(model_pid) - cpu_before["fake model"],
        "redis": watch.redis_cpu() + watch.redis_cpu_banked - cpu_before["redis"],
        "gateway": tree_cpu_seconds(gateway_at) - cpu_before["gateway"],
    }
    load = os.getloadavg()
    wall = finished - started

    console.print("\n[bold]checks[/bold]")
    checks = Checks()
    counts = final["counts"]
    canceled = counts["canceled"]
    truthful = "canceled" if canceled else "succeeded"  # a batch is succeeded once all final
    checks.check(final["status"] == truthful and final.get("finished_at") is not None,
                 "the batch is final and says what happened",
                 f"{final['status']}, finished_at {final.get('finished_at')}")  # fmt: skip
    states = sum(counts[s] for s in ("queued", "running", *FINAL))
    checks.check(states == counts["total"] == n and counts["queued"] == counts["running"] == 0,
                 "its counts sum to the queries", counts)  # fmt: skip
    ids, statuses, errors, bad = read_results(client, batch_id)
    expected = {f"q{i:06d}" for i in range(n)}
    missing = len(expected - set(ids))
    extra = len(set(ids) - expected)
    doubled = sum(1 for c in ids.values() if c > 1)
    checks.check(missing == extra == doubled == 0 and sum(ids.values()) == n,
                 "one result per query id", f"{sum(ids.values())} lines, {missing} missing, "
                 f"{doubled} duplicated, {extra} unknown")  # fmt: skip
    checks.check(bad == 0, "every result final, a succeeded one with its result", f"{bad} not")
    unexplained = {
        reason: count
        for reason, count in errors.items()
        if args.no_outage or not outage_failure(reason)
    }
    checks.check(not unexplained, "every failed item failed for the provider's outage",
                 unexplained or "")  # fmt: skip
    checks.check(all(statuses[s] == counts[s] for s in FINAL) and sum(statuses.values()) == n,
                 "the counts agree with the results' statuses", dict(statuses))  # fmt: skip
    states, raw, stored = store_tally(url, batch_id)
    checks.check(dict(states) == dict(statuses) and stored == n + 1
                 and raw == {s: counts[s] for s in ("queued", "running", *FINAL)},
                 "the job store agrees: items' states, its counts, one result field each",
                 f"{dict(states)}, {raw}, {stored} result fields")  # fmt: skip
    hooks = verified_webhooks(inbox, 60)
    hook_ids = {h["id"] for h in hooks}
    said = {(h["payload"]["type"], h["payload"]["data"]["id"], h["payload"]["data"]["status"])
            for h in hooks}  # fmt: skip
    checks.check(len(hooks) >= 1 and len(hook_ids) == 1
                 and said == {("batch.completed", batch_id, final["status"])},
                 "the batch.completed webhook arrived, verified, saying what the batch says",
                 f"{len(hooks)} deliveries, ids {sorted(hook_ids)}, {sorted(said)}")  # fmt: skip
    state = broker_state(url)
    deadline = time.monotonic() + 60
    while any(state[q] for q in ALL_QUEUES) or state["unacked"]:
        if time.monotonic() > deadline:
            break
        time.sleep(1)
        state = broker_state(url)
    checks.check(not any(state[q] for q in ALL_QUEUES) and not state["unacked"],
                 "no message left in Sift's queues (within 60 s)", state)  # fmt: skip
    restarted = children(supervisor)
    if not args.no_kill_worker:
        checks.check(len(restarted) == len(processes) and restarted != processes,
                     "the killed worker process was started again",
                     f"{processes} -> {restarted}")  # fmt: skip

    calls, usage = fake.counts(), fake.usage()
    info = redis_info(url)
    by_key = batch_memory(url, batch_id)
    watch.redis_peak_bytes = max(watch.redis_peak_bytes, int(info["used_memory_peak"]))
    console.print("\n[bold]faults[/bold]")
    for event in watch.events:
        console.print(f"  {event}")
    for line in recovery_lines(tmp / "w" / "bench.log"):
        console.print(f"  worker log: {line}")
    stall, since, at = watch.longest_stall()
    console.print(f"  longest time with no item becoming final: {stall:.1f} s "
                  f"(from {since:.1f} s, at {at} final)")  # fmt: skip
    console.print("\n[bold]outcome[/bold]")
    for name, count in statuses.most_common():
        console.print(f"  {name:>10}: {count}")
    for reason, count in errors.most_common(8):
        console.print(f"  {count:>8}  {reason}")
    console.print("\n[bold]figures[/bold]")
    rows = [
        ("queries", f"{n:,}"),
        ("wall time, submit to all final", f"{wall:.1f} s (submit {submitted - started:.1f} s)"),
        ("items/s over the run", f"{n / wall:.1f}"),
        ("model calls received", f"{calls['received']:,} ({calls['received'] / n:.3f} per item)"),
        ("answered", str(calls["statuses"])),
        ("answered 200 (billed)", f"{usage['responses']:,}"),
        ("prompts sent more than once", f"{calls['prompts_sent_more_than_once']:,}"),
        ("prompts answered 200 more than once", f"{calls['prompts_answered_more_than_once']:,}"),
        ("distinct prompts", f"{calls['prompts']:,}"),
        *((f"{name} CPU per item", f"{1000 * c / n:.2f} ms") for name, c in cpu.items()),
        ("Redis used_memory_peak", f"{watch.redis_peak_bytes / 2**20:.0f} MB "
         f"({watch.redis_peak_bytes / n / 1024:.1f} KB per item); now "
         f"{int(info['used_memory']) / 2**20:.0f} MB"),
        ("Redis memory of the batch's keys, per item",
         ", ".join(f"{k} {v / n:.0f} B" for k, v in by_key.items())),
        ("worker peak RSS (VmHWM) per process",
         ", ".join(f"{pid}: {mb:.0f} MB" for pid, mb in sorted(watch.worker_peak_mb.items()))),
        ("load average at the end", " ".join(f"{x:.2f}" for x in load)),
    ]  # fmt: skip
    for name, value in rows:
        console.print(f"  {name:<40} {value}")
    console.print(f"after: {uptime()}")
    if os.environ.get("BENCH_KEEP_LOGS"):  # the services' logs, to read after the run
        keep = Path(os.environ["BENCH_KEEP_LOGS"])
        keep.mkdir(parents=True, exist_ok=True)
        for log in [*tmp.glob("*/*.log"), *tmp.glob("*.log")]:
            (keep / f"{log.parent.name}-{log.name}").write_bytes(log.read_bytes())
    if checks.failed:
        console.print(f"[red]{len(checks.failed)} check(s) failed:[/red] {checks.failed}")
        sys.exit(1)
    console.print("[green]every check passed[/green]")


if __name__ == "__main__":
    main()

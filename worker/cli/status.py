"""``sift status``: the queue as an operator sees it, what Flower would show, in the terminal.

    SIFT_REDIS_URL=redis://127.0.0.1:6379/0 sift status [--json] [--timeout 1]

It reads Redis directly (``SIFT_REDIS_URL``), not the gateway: an operator's tool, with no
API key and no tenant. What it shows, and where each figure comes from:

- **queues**: each Sift queue's ready messages (kombu's Redis lists: the queue's own and one
  per priority step, :func:`~worker.constants.kombu_queue_keys`) and its taken-but-unacked
  ones (kombu's ``unacked`` hash, by each entry's routing key);
- **workers**: the worker processes with a live heartbeat (``sift:worker-alive:<id>``), the
  deliveries each holds (``sift:deliveries``, with each one's task from ``unacked``), joined
  by host and pid with Celery's own inspection (``inspect().active()`` and ``stats()``, over
  the broker's pidbox, within ``--timeout``): a worker that beats but does not answer is
  stuck in a way its heartbeat thread is not;
- **batches running**: the batches not yet final in the job store's active set
  (``sift:active``: a standard-lane batch, and an economy one while its items are prepared)
  and in the economy lane's watch (``sift:eco-watch``: an economy batch waiting on its
  provider batches, which has left the active set), with their lane, counts, what their
  finished items' model calls cost so far, when their status last moved (known for those
  in the active set) and their failed items by kind (the record's ``failures`` and
  ``rerank_failures``, as ``sift batch`` prints them); and the searches and ingests in the
  active set;
- **webhooks owed**: ``sift:webhooks-owed`` in counts (no job named: all tenants'), those
  waiting out a retry's countdown (due later) and those overdue, due more than
  :data:`WEBHOOK_OVERDUE_SECONDS` ago and not settled, with the oldest's age: a stuck one
  (its message lost, its workers away), which the webhook queue's own figures do not show.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, cast

import redis
import typer
from rich.console import Console
from rich.table import Table

from worker.cli._app import app
from worker.cli._common import STACK_REDIS_FILE, cli_settings, stack_redis_url
from worker.cli._output import cli_console, failure_kinds, plain, print_fitted
from worker.clock import server_seconds
from worker.constants import (
    ACTIVE_JOBS_KEY,
    ALL_QUEUES,
    BATCH_ID_PREFIX,
    DELIVERY_OWNERS_KEY,
    ECONOMY_WATCH_KEY,
    INGEST_ID_PREFIX,
    KOMBU_PRIORITY_STEPS,
    KOMBU_UNACKED_KEY,
    SEARCH_ID_PREFIX,
    WEBHOOKS_OWED_KEY,
    WORKER_HEARTBEAT_KEY,
    kombu_queue_keys,
)
from worker.processes.folder_locks import holds_data_dir
from worker.queue.jobstore import JobStore
from worker.redis_client import CONNECTION_OPTIONS

# a webhook owed whose next message was due longer ago is overdue: its attempt (30 s at most,
# SIFT_WEBHOOK_TOTAL_TIMEOUT_SECONDS) has mostly ended by then, or was never made
WEBHOOK_OVERDUE_SECONDS = 60.0

Inspect = Callable[[float], tuple[dict[str, Any], dict[str, Any]]]  # (active, stats) by node


@dataclass
class QueueRow:
    name: str
    ready: int
    by_priority: dict[str, int]
    unacked: int


@dataclass
class Delivery:
    """A task a worker holds: its delivery tag (Redis's view only), id, name and arguments."""

    tag: str
    task_id: str
    task: str
    args: str


@dataclass
class WorkerRow:
    """One worker process: its liveness id and heartbeat, the deliveries it holds, and what
    Celery's inspection says of it (None where its node did not answer)."""

    worker_id: str
    host: str
    pid: int | None
    beat_age_seconds: float | None
    holds: list[Delivery] = field(default_factory=list)
    node: str | None = None
    active: list[Delivery] | None = None


@dataclass
class BatchRow:
    id: str
    tenant: str
    index: str
    lane: str
    total: int
    counts: dict[str, int]
    age_seconds: float
    idle_seconds: float | None  # None: not in the active set (an economy batch waiting)
    cost_usd: float | None = 0.0  # what its finished items' model calls cost (None: unpriced)
    cost_known: bool = True  # False: a batch an older release made (its totals unknown)
    # its failed items by error type, its rerank_failed ones by class (None: unknown)
    failures: dict[str, int] | None = field(default_factory=dict)
    rerank_failures: dict[str, int] | None = field(default_factory=dict)


@dataclass
class WebhooksOwed:
    owed: int
    waiting_retry: int  # due later: waiting out a retry's countdown
    overdue: int  # due more than WEBHOOK_OVERDUE_SECONDS ago
    oldest_overdue_seconds: float | None  # None: none overdue


@dataclass
class Status:
    queues: list[QueueRow]
    workers: list[WorkerRow]
    unknown_nodes: list[str]  # answered Celery's inspection, no heartbeat matched
    inspect_answered: bool | None  # None: not asked (--no-inspect)
    batches: list[BatchRow]
    active_searches: int
    active_ingests: int
    in_flight: dict[str, int]
    webhooks: WebhooksOwed


def _unacked(client: redis.Redis) -> dict[str, tuple[str, Delivery]]:
    """kombu's unacked deliveries: tag -> (queue, the task and its arguments)."""
    out: dict[str, tuple[str, Delivery]] = {}
    for tag, raw in cast(dict[str, str], client.hgetall(KOMBU_UNACKED_KEY)).items():
        try:
            message, _exchange, routing_key = json.loads(raw)
            headers = message.get("headers") or {}
        except (ValueError, TypeError, AttributeError):
            continue
        task = str(headers.get("task", "?"))
        delivery = Delivery(tag, str(headers.get("id", "")), task, str(headers.get("argsrepr", "")))
        out[tag] = (str(routing_key), delivery)
    return out


def _queues(client: redis.Redis, unacked: dict[str, tuple[str, Delivery]]) -> list[QueueRow]:
    pipe = client.pipeline(transaction=False)
    for queue in ALL_QUEUES:
        for key in kombu_queue_keys(queue):
            pipe.llen(key)
    lengths = iter(cast(list[int], pipe.execute()))
    taken = Counter(queue for queue, _ in unacked.values())
    rows = []
    for queue in ALL_QUEUES:
        by_priority = {str(step): next(lengths) for step in (0, *KOMBU_PRIORITY_STEPS)}
        rows.append(QueueRow(queue, sum(by_priority.values()), by_priority, taken[queue]))
    return rows


def _workers(
    client: redis.Redis, unacked: dict[str, tuple[str, Delivery]], now: float
) -> list[WorkerRow]:
    ids = sorted(
        key.removeprefix(WORKER_HEARTBEAT_KEY)
        for key in cast(list[str], list(client.scan_iter(WORKER_HEARTBEAT_KEY + "*", count=500)))
    )
    beats = (
        cast(list[str | None], client.mget([WORKER_HEARTBEAT_KEY + i for i in ids])) if ids else []
    )
    owners = cast(dict[str, str], client.hgetall(DELIVERY_OWNERS_KEY))
    rows = []
    for worker_id, beat in zip(ids, beats, strict=True):
        host, _, rest = worker_id.partition(":")
        pid_text = rest.partition(":")[0]
        holds = [
            unacked[tag][1] if tag in unacked else Delivery(tag, "", "?", "")
            for tag, owner in sorted(owners.items())
            if owner == worker_id
        ]
        rows.append(
            WorkerRow(
                worker_id=worker_id,
                host=host,
                pid=int(pid_text) if pid_text.isdigit() else None,
                beat_age_seconds=round(now - float(beat), 1) if beat else None,
                holds=holds,
            )
        )
    return rows


def _join_inspection(
    workers: list[WorkerRow], active: dict[str, Any], stats: dict[str, Any]
) -> list[str]:
    """Give each worker its Celery node and active tasks (matched by pid, and host when the
    node's name has one); answers the nodes that matched no heartbeat."""
    unknown = []
    for node in sorted(set(active) | set(stats)):
        pid = (stats.get(node) or {}).get("pid")
        host = node.partition("@")[2]
        match = [w for w in workers if w.pid == pid and (not host or w.host == host)]
        match = match or [w for w in workers if w.pid == pid]
        tasks = [
            Delivery("", str(t.get("id", "")), str(t.get("name") or "?"), str(t.get("args", "")))
            for t in (active.get(node) or [])
        ]
        if match:
            match[0].node, match[0].active = node, tasks
        else:
            unknown.append(node)
    return unknown


def _batches(
    store: JobStore, active: list[tuple[str, float]], economy_watch: list[str], now: float
) -> list[BatchRow]:
    """The batches not final among the active jobs and the economy lane's watched tasks
    (``"<batch id> <provider batch id | submit>"``): an economy batch whose items are all
    prepared leaves the active set and waits on its provider batches, for hours maybe, and
    was left out, so ``Batches running: 0`` was shown while its items ran."""
    moved_at = {job_id: moved for job_id, moved in active if job_id.startswith(BATCH_ID_PREFIX)}
    waiting = [member.partition(" ")[0] for member in economy_watch]
    rows = []
    for job_id in dict.fromkeys([*moved_at, *waiting]):
        batch = store.get_batch(job_id)
        if batch is None or batch.finished_at is not None:
            continue
        moved = moved_at.get(job_id)
        rows.append(
            BatchRow(
                id=batch.id,
                tenant=batch.tenant,
                index=batch.index,
                lane=batch.lane,
                total=batch.total,
                counts=batch.counts,
                age_seconds=round(now - batch.created_at, 1),
                idle_seconds=None if moved is None else round(now - moved, 1),
                cost_usd=None if batch.usage is None else batch.usage.cost_usd,
                cost_known=batch.usage is not None,
                failures=batch.failures,
                rerank_failures=batch.rerank_failures,
            )
        )
    return rows


def _webhooks(client: redis.Redis, now: float) -> WebhooksOwed:
    """The webhooks owed, in counts, read in one ``MULTI`` (ZCARD, ZCOUNT and the lowest
    score: no scan of the set, nor of any job's record)."""
    pipe = client.pipeline()
    pipe.zcard(WEBHOOKS_OWED_KEY)
    pipe.zcount(WEBHOOKS_OWED_KEY, f"({now!r}", "+inf")
    pipe.zcount(WEBHOOKS_OWED_KEY, "-inf", f"({now - WEBHOOK_OVERDUE_SECONDS!r}")
    pipe.zrange(WEBHOOKS_OWED_KEY, 0, 0, withscores=True)
    owed, waiting, overdue, first = cast(
        tuple[int, int, int, list[tuple[str, float]]], pipe.execute()
    )
    oldest = round(now - first[0][1], 1) if overdue else None
    return WebhooksOwed(owed, waiting, overdue, oldest)


def celery_inspect(redis_url: str) -> Inspect:
    """Celery's own inspection of the workers, over the broker's pidbox: ``active`` and
    ``stats``, asked at once, each waiting ``timeout`` seconds for the replies."""

    def ask(timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
        from celery import Celery

        from worker.queue.broker import broker_transport

        celery = Celery("sift", set_as_current=False)
        celery.conf.update(
            broker_url=redis_url,
            broker_transport=broker_transport(redis_url),
            broker_connection_retry_on_startup=False,
            broker_connection_max_retries=1,
        )
        inspect = celery.control.inspect(timeout=timeout)
        with ThreadPoolExecutor(2) as pool:
            active, stats = pool.submit(inspect.active), pool.submit(inspect.stats)
            return active.result() or {}, stats.result() or {}

    return ask


def collect(store: JobStore, inspect: Inspect | None, timeout: float) -> Status:
    """Everything ``sift status`` shows, read once. Its ages are measured on Redis's clock,
    which the times it reads are on (a heartbeat's, a batch's creation and last move): on
    this host's own, a host 6 minutes behind showed a batch made just now as -6 minutes
    old."""
    client = store.redis
    now = server_seconds(client.time())
    unacked = _unacked(client)
    workers = _workers(client, unacked, now)
    active, stats = inspect(timeout) if inspect is not None else ({}, {})
    # not asked is not unanswered: --no-inspect said "no worker answered" of a question it
    # never put
    unknown = _join_inspection(workers, active, stats)
    jobs = cast(list[tuple[str, float]], client.zrange(ACTIVE_JOBS_KEY, 0, -1, withscores=True))
    economy_watch = cast(list[str], client.zrange(ECONOMY_WATCH_KEY, 0, -1))
    # the batches' ages against the clock read after them: against the one read before the
    # inspection's wait (a second at most), a batch that moved meanwhile was "-1 s ago"
    now = server_seconds(client.time())
    return Status(
        queues=_queues(client, unacked),
        workers=workers,
        unknown_nodes=unknown,
        inspect_answered=None if inspect is None else bool(active or stats),
        batches=_batches(store, jobs, economy_watch, now),
        active_searches=sum(1 for j, _ in jobs if j.startswith(SEARCH_ID_PREFIX)),
        active_ingests=sum(1 for j, _ in jobs if j.startswith(INGEST_ID_PREFIX)),
        in_flight=store.in_flight(),
        webhooks=_webhooks(client, now),
    )


def _tasks(deliveries: list[Delivery] | None) -> str:
    if deliveries is None:
        return "[yellow]no answer[/]"
    counts = Counter(d.task for d in deliveries)
    return ", ".join(f"{task} ×{n}" for task, n in sorted(counts.items())) or "–"


_JOB_ID = re.compile(rf"(?:{SEARCH_ID_PREFIX}|{BATCH_ID_PREFIX}|{INGEST_ID_PREFIX})[0-9a-f]{{32}}")
_JOBS_SHOWN = 3


def _jobs(deliveries: list[Delivery]) -> str:
    """The jobs a worker's deliveries are for (a chunk's batch, a search), the first few."""
    ids = list(dict.fromkeys(m.group() for d in deliveries for m in _JOB_ID.finditer(d.args)))
    more = f" (+{len(ids) - _JOBS_SHOWN})" if len(ids) > _JOBS_SHOWN else ""
    return ", ".join(ids[:_JOBS_SHOWN]) + more or "–"


def show(console: Console, status: Status) -> None:
    queues = Table(title="Queues", title_justify="left")
    for name in ("queue", "ready", "by priority (0/3/6/9)", "unacked"):
        queues.add_column(name, justify="left" if name == "queue" else "right")
    for q in status.queues:
        split = "/".join(str(n) for n in q.by_priority.values())
        queues.add_row(q.name, str(q.ready), split, str(q.unacked))
    console.print(queues)

    workers = Table(title=f"Workers alive: {len(status.workers)}", title_justify="left")
    columns = ("worker", "celery node", "last beat", "holds", "held tasks", "for jobs",
               "active (Celery)")  # fmt: skip
    for name in columns:
        workers.add_column(name, overflow="fold")
    for w in status.workers:
        beat = "–" if w.beat_age_seconds is None else f"{w.beat_age_seconds:.1f} s ago"
        workers.add_row(
            plain(w.worker_id), plain(w.node or "–"), beat, str(len(w.holds)),
            _tasks(w.holds), _jobs(w.holds),
            _tasks(w.active) if status.inspect_answered else "–",
        )  # fmt: skip
    console.print(workers)
    if status.inspect_answered is None:
        console.print("Celery's inspection: skipped (--no-inspect)")
    elif not status.inspect_answered:
        console.print(
            "[yellow]Celery's inspection: no worker answered[/] (none running, or remote "
            "control off: workers started with --without-remote-control)"
        )
    for node in status.unknown_nodes:
        console.print(f"[yellow]{plain(node)} answers Celery but has no heartbeat in Redis[/]")

    names = ["batch", "tenant", "index", "lane", "done", "running", "queued", "failed",
             "canceled", "cost", "age", "moved", "failures"]  # fmt: skip
    rows = []
    for b in status.batches:
        done = sum(b.counts.get(s, 0) for s in ("succeeded", "failed", "canceled"))
        rows.append([
            plain(b.id), plain(b.tenant), plain(b.index), plain(b.lane), f"{done}/{b.total}",
            str(b.counts.get("running", 0)),
            str(b.counts.get("queued", 0)), str(b.counts.get("failed", 0)),
            str(b.counts.get("canceled", 0)),
            "unknown" if not b.cost_known
            else "unpriced" if b.cost_usd is None else f"${b.cost_usd:.6f}",
            f"{b.age_seconds:.0f} s",
            "–" if b.idle_seconds is None else f"{b.idle_seconds:.0f} s ago",
            failure_kinds(b.failures, b.rerank_failures) or "–",  # unknown (None) too
        ])  # fmt: skip
    # whole cells, columns left out to fit (named below the table): cut to fit, the batch id
    # was "bat_…" at 80 columns, the width when the output is not a terminal
    print_fitted(
        console,
        f"Batches running: {len(status.batches)}",
        names,
        rows,
        drop_order=[
            "failures",  # the widest: first out, never at the cost of a column shown without it
            "moved",
            "tenant",
            "age",
            "cost",
            "index",
            "canceled",
            "failed",
            "lane",
            "queued",
        ],
        wrapped=("failures",),
        right=("done", "running", "queued", "failed", "canceled", "cost", "age", "moved"),
    )
    console.print(
        f"searches and batch items: {status.in_flight['queued']} queued, "
        f"{status.in_flight['running']} running; unfinished searches {status.active_searches}, "
        f"ingests {status.active_ingests}"
    )
    hooks = status.webhooks
    overdue = f"{hooks.overdue} overdue"
    if hooks.oldest_overdue_seconds is not None:
        overdue = f"[yellow]{overdue} (oldest due {hooks.oldest_overdue_seconds:.0f} s ago)[/]"
    console.print(
        f"webhooks owed {hooks.owed}: {hooks.waiting_retry} waiting for a retry, {overdue}"
    )


def _no_stack(data_dir: Path, why: str) -> str:
    """The error of a ``sift status`` with no Redis to read: none set, no stack on the folder."""
    return (
        "[bold red]error:[/] SIFT_REDIS_URL is not set, and no `sift up` stack runs on "
        f"{data_dir} (SIFT_DATA_DIR): {why}"
    )


@app.command("status")
def status_command(
    json_out: Annotated[bool, typer.Option("--json", help="print it all as JSON")] = False,
    timeout: Annotated[
        float, typer.Option(min=0.1, max=30, help="seconds to wait for Celery's inspection")
    ] = 1.0,
    no_inspect: Annotated[
        bool, typer.Option("--no-inspect", help="skip Celery's inspection (Redis only)")
    ] = False,
) -> None:
    """The queues, the workers alive and their work, the batches running and the webhooks owed
    (SIFT_REDIS_URL, or the sift up stack on SIFT_DATA_DIR)."""
    err = cli_console(stderr=True)
    settings = cli_settings()
    url, source = settings.redis_url, "SIFT_REDIS_URL"
    data_dir, told = settings.data_dir.resolve(), False
    if not url:  # the `sift up` stack running on this data folder, if any
        url, told = stack_redis_url(data_dir), True
        source = f"the `sift up` stack's ({data_dir / STACK_REDIS_FILE})"
    if not url:
        no_stack = "sift status reads Redis (a `sift up` stack prints its URL on its `redis` line)"
        err.print(_no_stack(data_dir, no_stack), soft_wrap=True)
        raise typer.Exit(1)
    client = redis.Redis.from_url(url, **CONNECTION_OPTIONS)
    store = JobStore(client, result_ttl=settings.result_retention_seconds)
    try:
        status = collect(store, None if no_inspect else celery_inspect(url), timeout)
    except (redis.RedisError, OSError) as exc:
        if told and not holds_data_dir(data_dir):  # its stack was killed before removing it
            left = (
                f"its {data_dir / STACK_REDIS_FILE} is left from one that did not stop "
                f"(killed?), whose Redis does not answer ({plain(exc)}); start one with "
                "`sift up`, or set SIFT_REDIS_URL"
            )
            err.print(_no_stack(data_dir, left), soft_wrap=True)
        else:
            err.print(f"[bold red]error:[/] cannot read Redis at {source}: {plain(exc)}")
        raise typer.Exit(1) from None
    finally:
        store.close()
    if json_out:
        typer.echo(json.dumps(asdict(status)))
    else:
        show(cli_console(), status)

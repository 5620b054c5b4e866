"""``sift up`` and ``sift demo``: the whole stack on this machine."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from worker.cli._app import app
from worker.cli._common import (
    DEV_KEY_FILE,
    EXIT_INTERRUPTED,
    EXIT_ITEMS_FAILED,
    SETTING_OPTIONS,
    STACK_REDIS_FILE,
    a_folder,
    cli_settings,
    setting_help,
    stop,
)
from worker.cli._output import plain, print_result, sample_path
from worker.cli._redis_checks import check_redis_at_start
from worker.errors import ConfigError, SiftError
from worker.processes.folder_locks import claim_data_dir
from worker.processes.stack import (
    Service,
    StartInterrupted,
    StartRefused,
    adopt_logs,
    check_port_free,
    child_env,
    free_port,
    gateway_service,
    redis_service,
    require_redis_7,
    running,
    sift_command,
    worker_service,
)
from worker.processes.supervisor import Supervisor
from worker.processes.workers import STOP_DEADLINE_STATUS, supervisor_stop_deadline
from worker.settings import Settings

console = Console(emoji=False)
errors = Console(emoji=False, stderr=True)


def _dev_key(state: Path) -> dict[str, str]:
    """A development API key, kept in ``.sift/dev-api-key.json`` so it survives restarts."""
    path = state / DEV_KEY_FILE
    if path.exists():
        return dict(json.loads(path.read_text()))
    secret = base64.b64encode(secrets.token_bytes(24)).decode()
    key = {"key": f"sift-dev-{secrets.token_hex(12)}", "tenant": "dev",
           "webhook_secret": f"whsec_{secret}"}  # fmt: skip
    state.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(key) + "\n")
    path.chmod(0o600)
    return key


@dataclass(frozen=True)
class LocalStack:
    url: str
    api_key: str
    redis_url: str
    logs: Path
    supervisor: Supervisor | None = None
    workers: Service | None = None


@contextlib.contextmanager
def local_stack(
    settings: Settings,
    report: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    on_refused: Callable[[Service], None] | None = None,
) -> Iterator[LocalStack]:
    """Redis (ours unless SIFT_REDIS_URL is set), one worker and the gateway, on
    ``SIFT_GATEWAY_PORT`` and ``SIFT_WORKER_METRICS_PORT``, keeping their files (the index,
    Redis's AOF, the logs) in ``SIFT_DATA_DIR``.

    It first claims the data folder (a lock file in it) and checks the two ports: another
    stack's are refused before anything is started or any log opened. With ``report``, a
    process that exits is started again (:class:`~worker.processes.supervisor.Supervisor`) and each
    restart is reported through it, but one that refused to start (exit 2) is left down and
    ``on_refused`` called with it, to stop the stack. Once ``cancel`` is set, a wait for a
    process to be ready raises :class:`~worker.processes.stack.StartInterrupted` (what was
    started is stopped)."""
    data_dir = settings.data_dir.resolve()
    gateway_port, metrics_port = settings.gateway_port, settings.worker_metrics_port
    with contextlib.ExitStack() as stack:
        described = f"pid {os.getpid()}, gateway port {gateway_port}"
        if metrics_port:
            described += f", worker metrics port {metrics_port}"
        stack.enter_context(claim_data_dir(data_dir, described))
        check_port_free(gateway_port, "gateway", "--port (SIFT_GATEWAY_PORT)")
        if metrics_port:  # the worker serves it on every interface
            check_port_free(metrics_port, "worker metrics", "--metrics-port "
                            "(SIFT_WORKER_METRICS_PORT)", host="0.0.0.0")  # fmt: skip
        api_key, extra = _api_key(settings, data_dir)
        extra["SIFT_DATA_DIR"] = str(data_dir)
        extra["SIFT_WORKER_METRICS_PORT"] = str(metrics_port)
        logs = data_dir / "logs"
        services: list[Service] = []
        supervisor = None if report is None else Supervisor(report, on_refused=on_refused)
        if supervisor is not None:  # ended last: the thread that starts the processes it
            stack.callback(supervisor.close)  # restarts, which follow it (Service.follow)
        redis_url = settings.redis_url
        if not redis_url:
            # its log with the others (it was in redis/, beside the AOF, the banner and
            # the README naming logs/); one left there by an earlier release moves too
            adopt_logs(data_dir / "redis" / "redis.log", logs / "redis.log")
            redis, url = redis_service(data_dir / "redis", appendonly=True, log=logs / "redis.log")
            redis.follow = True  # each process of the stack stops when sift up dies, even
            # SIGKILLed (it was left running, orphaned, its data folder's lock let go)
            stack.enter_context(running(redis, cancel))
            require_redis_7(redis, url)  # the machine's: apt's may be 6
            services.append(redis)
            redis_url = extra["SIFT_REDIS_URL"] = url + "/0"
        told = data_dir / STACK_REDIS_FILE  # for `sift status` (stack_redis_url)
        told.touch(mode=0o600)
        told.chmod(0o600)  # the URL may hold Redis's password, as the dev key file its secret
        told.write_text(redis_url + "\n")
        stack.callback(told.unlink, missing_ok=True)
        env = child_env(extra)
        worker_env = _own_metrics_folder(env, data_dir / "metrics" / "worker")
        # stopped within its own bound, even on a Redis that never answers (its processes'
        # warm shutdown hung on one, and a SIGKILL of their supervisor left them orphaned)
        workers = worker_service(logs, worker_env, processes=None)
        workers.stop_timeout = supervisor_stop_deadline(settings) + 5.0
        workers.follow = True
        services.append(stack.enter_context(running(workers, cancel)))
        gateway, url = gateway_service(
            logs, _own_metrics_folder(env, data_dir / "metrics" / "gateway"), port=gateway_port
        )
        gateway.follow = True
        services.append(stack.enter_context(running(gateway, cancel)))
        if supervisor is not None:
            for service in services:
                supervisor.watch(service)
            supervisor.start()
            stack.callback(supervisor.stop_watching)  # first: nothing restarts while stopping
        yield LocalStack(url, api_key, redis_url, logs, supervisor, workers)


def _own_metrics_folder(env: dict[str, str], folder: Path) -> dict[str, str]:
    """``env`` with a multiprocess metrics folder of the child's own, if it has one at all,
    emptied: the stack starts from zero, as a worker does (the gateway never empties its
    folder, so every earlier run's files would pile up there, summed in).

    The worker and the gateway are two scrape targets: in one folder each ``/metrics`` summed
    the other's files too (every count twice in a sum over targets), and the worker, which
    empties its folder when it starts, deleted the gateway's live files when restarted."""
    from worker.observability.metrics import MULTIPROC_DIR_ENV

    if not env.get(MULTIPROC_DIR_ENV):
        return env
    shutil.rmtree(folder, ignore_errors=True)  # this stack's: it holds the data folder's lock
    folder.mkdir(parents=True)
    return {**env, MULTIPROC_DIR_ENV: str(folder)}


def _api_key(settings: Settings, data_dir: Path) -> tuple[str, dict[str, str]]:
    """The key the stack is called with, and the children's environment that accepts it."""
    api_key = _given_key(settings)
    if api_key is None:
        dev = _dev_key(data_dir)
        return dev["key"], {"SIFT_API_KEYS": json.dumps([dev])}
    return api_key, {}


def _given_key(settings: Settings) -> str | None:
    """The key of ``SIFT_API_KEYS`` / ``SIFT_API_KEYS_FILE`` the stack is called with, None
    when they give none (the development key serves); a :class:`ConfigError` naming the
    setting when they cannot be read or used."""
    keys = settings.all_api_keys()
    if not keys:
        return None
    # a key given only as its digest cannot be presented: SIFT_API_KEY names one then
    api_key = next((k.key for k in keys if k.key), None) or settings.api_key
    if api_key is None:
        raise ConfigError(
            "the keys in SIFT_API_KEYS / SIFT_API_KEYS_FILE are all digests (key_sha256): "
            "set SIFT_API_KEY to one of the keys so the local stack can call the gateway"
        )
    return api_key


def _start(
    stack: contextlib.ExitStack,
    settings: Settings,
    report: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    on_refused: Callable[[Service], None] | None = None,
) -> LocalStack:
    """Start the stack; a Ctrl-C while it starts (``cancel`` set) stops what was started and
    exits 130 with one line, not the log tail of a process that the Ctrl-C reached too. A
    refusal (a process's exit 2, or its own redis-server too old) is one line, exit 2, as a
    process's refusal once the stack runs: it exited 1 with the process's log tail."""
    try:
        with errors.status("starting redis, a worker and the gateway…"):  # stdout: the report
            return stack.enter_context(local_stack(settings, report, cancel, on_refused))
    except (RuntimeError, SiftError, StartInterrupted) as error:
        if cancel is not None and cancel.is_set():
            errors.print("interrupted while starting; every process stopped")
            raise typer.Exit(EXIT_INTERRUPTED) from error
        if isinstance(error, StartRefused):
            stop(f"{plain(error)}; every process stopped")
        stop(plain(error, lines=True), 1)  # a process's log tail: its lines kept


@app.command("up")
def up(
    port: Annotated[
        int | None, typer.Option(help=setting_help("the gateway's", "SIFT_GATEWAY_PORT"))
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help=setting_help("the worker's /metrics, 0: off", "SIFT_WORKER_METRICS_PORT")
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            parser=a_folder,
            help=setting_help("the index, Redis's AOF and the logs", "SIFT_DATA_DIR"),
        ),
    ] = None,
) -> None:
    """Run Redis, the worker (as `sift worker`: one process per core by default) and the
    gateway in the foreground until Ctrl-C, restarting any of them that exits. Refuses a
    port or data folder another stack uses."""
    overrides: dict[str, Any] = {}
    if port is not None:
        overrides["gateway_port"] = port
    if metrics_port is not None:
        overrides["worker_metrics_port"] = metrics_port
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    settings = cli_settings(options=SETTING_OPTIONS, **overrides)
    if settings.worker_metrics_port and settings.worker_metrics_port == settings.gateway_port:
        # refused before anything starts: the worker's metrics took the port, and the
        # gateway's failure to bind it was the only word of it
        stop(
            f"--port (SIFT_GATEWAY_PORT) and --metrics-port (SIFT_WORKER_METRICS_PORT) are "
            f"both {settings.gateway_port}: the gateway and the worker's /metrics need one each"
        )
    try:  # a setting: exit 2 before anything starts, as for `sift gateway` and `sift worker`
        _given_key(settings)
    except ConfigError as error:
        stop(plain(error))
    # a Redis of its own choosing, waited for as its worker would; sift up's own (no
    # SIFT_REDIS_URL) has db 0, every channel, noeviction and the AOF: nothing to check
    check_redis_at_start(settings, worker=True)
    stopping = threading.Event()
    started: LocalStack | None = None
    refused: list[Service] = []  # a process that refused to start: the stack stops, exit 2

    def on_signal(*_: object) -> None:
        stopping.set()
        if started is not None and started.supervisor is not None:
            started.supervisor.stop_watching()  # Ctrl-C reached the processes too

    def on_refused(service: Service) -> None:
        refused.append(service)
        on_signal()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    with contextlib.ExitStack() as stack:
        started = _start(
            stack,
            settings,
            # a process exited, restarted: status, on stderr with the errors (stdout: the report)
            report=lambda line: errors.print(f"[yellow]{plain(line)}[/]"),
            cancel=stopping,
            on_refused=on_refused,
        )
        console.print(f"gateway  [bold]{started.url}[/]  (OpenAPI at {started.url}/docs)")
        console.print(f"api key  [bold]{started.api_key}[/]")
        console.print(f"webhooks signed with {_webhook_secret_source(settings)}", soft_wrap=True)
        console.print(f"redis    {started.redis_url}")
        console.print(f"logs     {started.logs}")
        # one line however narrow the terminal, so that it pastes as one command; with the
        # data folder, by which `sift status` and `sift tenant purge` find this stack's Redis
        # (without it they read the stack on .sift/data under the shell's folder, another one)
        folder = shlex.quote(str(settings.data_dir.resolve()))
        export = f"export SIFT_URL={started.url} SIFT_API_KEY={started.api_key}"
        export += f" SIFT_DATA_DIR={folder}"
        console.print(f"\n{export}", soft_wrap=True)
        console.print("Ctrl-C stops everything.")
        stopping.wait()
        errors.print("stopping…")
    if refused:  # said once the stack has stopped, as the last line
        why = refused[0].refusal() or "its log's error line"
        stop(f"{refused[0].name} refused to start ({why}); every process stopped")
    _say_cut_short(started)


def _say_cut_short(stopped: LocalStack) -> None:
    """Exit :data:`STOP_DEADLINE_STATUS`, as ``sift worker`` does, with a line saying so,
    when the workers did not all finish their warm shutdown (their supervisor's status, or
    its SIGKILL past its bound): what they held was not handed back and comes back as a
    killed worker's does. The supervisor says which in the worker's log only."""
    proc = stopped.workers.proc if stopped.workers is not None else None
    if proc is None or proc.returncode not in (STOP_DEADLINE_STATUS, -signal.SIGKILL):
        return
    errors.print(
        "the workers did not all finish their warm shutdown: what they held comes back as a "
        f"killed worker's does ({plain(stopped.logs / 'worker.log')} names them); every "
        "process stopped",
        soft_wrap=True,
    )
    raise typer.Exit(STOP_DEADLINE_STATUS)


def _webhook_secret_source(settings: Settings) -> str:
    """Where the secret that signs this stack's webhooks is, to verify them with."""
    if settings.all_api_keys():
        return "the key's webhook_secret in SIFT_API_KEYS / SIFT_API_KEYS_FILE"
    path = settings.data_dir.resolve() / DEV_KEY_FILE
    return f'the "webhook_secret" in {path} (the development key\'s)'


# The SIFT_ variables ``sift demo`` takes from its environment: those that choose the rerank
# and its model, so that it can show one. Every other (the backend and its URL, Redis, the
# data folder, the keys, the ports, ...) places a deployment, and the demo runs on the defaults.
DEMO_KEEPS = ("SIFT_GENERATION_", "SIFT_RERANK_", "SIFT_PRICES")


@contextlib.contextmanager
def _demo_environment() -> Iterator[None]:
    """This process's environment without a deployment's ``SIFT_`` variables (all but
    :data:`DEMO_KEEPS`'s) while the demo runs, for its settings and the stack and steps it
    starts: an operator's shell (a sourced ``deploy/.env``) gave it the deployment's, and its
    worker indexed the sample into the deployment's Elasticsearch, or waited on one that did
    not answer. Put back after, as they were."""
    dropped = {
        name: value
        for name, value in os.environ.items()
        if name.startswith("SIFT_") and not name.startswith(DEMO_KEEPS)
    }
    for name in dropped:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(dropped)


@app.command("demo")
def demo(
    limit: Annotated[int, typer.Option(min=1, max=100, help="hits shown per query")] = 3,
    yes: Annotated[
        bool, typer.Option("--yes", help="rerank at a paid model without asking first")
    ] = False,
) -> None:
    """The whole path on this machine: start the stack, ingest the bundled sample corpus,
    run a batch of searches through the gateway and the queue, print them, stop.

    It runs on the defaults whatever the environment says, never on a deployment: the
    embedded backend in a temporary folder, a Redis, ports and a development key of its
    own. Of the SIFT_ variables it takes only those choosing the rerank and its model
    (SIFT_GENERATION_*, SIFT_RERANK_*, SIFT_PRICES; with ANTHROPIC_API_KEY). When they
    make its searches rerank at a paid model, it says so and asks first (--yes: it does not
    ask)."""
    with _demo_environment():
        _ask_before_paid_calls(sample_path("sample_queries.jsonl"), yes)
        _demo(limit)


def _ask_before_paid_calls(queries: Path, yes: bool) -> None:
    """Say before anything starts that the demo's searches make paid model calls, and ask,
    unless ``yes``. With a model, a key and SIFT_RERANK_ENABLED in the shell (a sourced
    deploy/.env), each search reranked at the provider's cost and nothing said so. No answer
    (stdin at its end: no one to ask) is a no. Calls to this machine (a fake) are not asked."""
    settings = cli_settings()
    model = settings.generation_model_id
    if not settings.rerank_enabled or model is None:
        return
    from worker.adapters.anthropic import paid_destination

    where = paid_destination()
    if where is None:
        return
    searches = sum(1 for line in queries.read_text().splitlines() if line.strip())
    most = searches * settings.generation_max_requests
    retries = f" (up to {most} with retries)" if most > searches else ""
    errors.print(
        f"sift demo reranks each of its {searches} searches with {model} at {where}: "
        f"about {searches} paid calls{retries}",
        soft_wrap=True,
    )
    if yes:
        return
    try:
        confirmed = typer.confirm("Make them?", default=False, err=True)
    except typer.Abort:  # stdin at its end
        confirmed = False
    if not confirmed:
        errors.print("nothing was started; --yes makes them without asking")
        raise typer.Exit(1)


def _demo(limit: int) -> None:
    started = time.monotonic()
    corpus, queries = sample_path("sample_corpus.jsonl"), sample_path("sample_queries.jsonl")
    stopping = threading.Event()
    steps = _Steps(stopping)

    def on_signal(*_: object) -> None:
        stopping.set()  # the step running, then the stack, stop; nothing raised from here
        steps.stop_current()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    failed = total = 0
    try:
        with (
            tempfile.TemporaryDirectory(prefix="sift-demo-") as tmp,
            contextlib.ExitStack() as stack,
        ):
            # a Redis of its own always (SIFT_REDIS_URL is dropped too): on an exported one
            # (an operator's shell) its worker took the deployment's searches, and the
            # deployment's its own
            settings = cli_settings(data_dir=Path(tmp), gateway_port=free_port(),
                                 worker_metrics_port=free_port(), redis_url=None)  # fmt: skip
            local = _start(stack, settings, cancel=stopping)
            console.print(f"stack up at {local.url}")
            env = child_env({"SIFT_URL": local.url, "SIFT_API_KEY": local.api_key})
            out = Path(tmp) / "results.jsonl"
            steps.run("the ingest", sift_command("ingest", str(corpus), "--index", "demo"), env)
            steps.run("the batch", sift_command("batch", str(queries), "--index", "demo",
                                                "--out", str(out), "--limit", str(limit)),
                      env)  # fmt: skip
            failed, total = _print_demo_results(queries, out)
            errors.print("stopping the stack…")  # status, on stderr: stdout holds the hits
    except _Interrupted as interrupted:
        errors.print(f"interrupted during {interrupted.step}: it and the stack were stopped; "
                     "every process stopped")  # fmt: skip
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if stopping.is_set():  # while the results printed or the stack stopped
        errors.print("interrupted; every process stopped")
        raise typer.Exit(EXIT_INTERRUPTED)
    if failed:
        console.print(f"[red]{failed} of {total} queries failed[/]; every process stopped")
        raise typer.Exit(EXIT_ITEMS_FAILED)
    elapsed = time.monotonic() - started
    console.print(f"[green]demo done[/] in {elapsed:.1f} s; every process stopped")


class _Interrupted(Exception):
    def __init__(self, step: str) -> None:
        super().__init__(step)
        self.step = step


class _Steps:
    """``sift demo``'s steps, each a ``sift`` command run to its end. Each runs in a process
    group of its own: the terminal's Ctrl-C reaches only the demo, which stops the step
    (SIGTERM: a Ctrl-C reaching it during its imports printed a traceback) and the stack."""

    def __init__(self, stopping: threading.Event) -> None:
        self.stopping = stopping
        self.current: subprocess.Popen[bytes] | None = None

    def run(self, step: str, command: list[str], env: dict[str, str]) -> None:
        """Run ``command``; raise :class:`_Interrupted` naming ``step`` if the demo is
        stopping, or exit with its status if it failed."""
        if self.stopping.is_set():
            raise _Interrupted(step)
        self.current = proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, process_group=0
        )
        if self.stopping.is_set():  # a signal before ``current`` was set
            self.stop_current()
        returncode = proc.wait()
        self.current = None
        if self.stopping.is_set():
            raise _Interrupted(step)
        if returncode != 0:
            errors.print(f"[red]{' '.join(command[3:5])} failed[/] (exit {returncode})")
            raise typer.Exit(returncode)

    def stop_current(self) -> None:
        proc = self.current
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()


def _print_demo_results(queries: Path, out: Path) -> tuple[int, int]:
    """Print the batch's results; answers how many failed, of how many."""
    lines = queries.read_text().splitlines()
    texts = {row["id"]: row["query"] for row in map(json.loads, lines)}
    items = [json.loads(line) for line in out.read_text().splitlines()]
    for item in items:
        if item["status"] == "succeeded":
            title = f"“{plain(texts.get(item['query_id'], item['query_id']))}”"
            print_result(console, item["result"], title=title)
        else:
            error = item.get("error") or {}
            console.print(f"[red]{plain(item['query_id'])} {item['status']}[/]: "
                          f"{plain(error.get('type'))}: {plain(error.get('message'))}")  # fmt: skip
    return sum(item["status"] != "succeeded" for item in items), len(items)

"""``sift up`` as a user runs it: one stack in the foreground, a second one started beside it,
and a worker killed under it.

Stack A is the real command (``python -m worker.cli up``) at default settings but for its two
ports and its data folder (free ones, so test runs don't collide). Then:

- a second ``sift up`` on A's data folder, A's gateway port or A's worker metrics port exits
  non-zero with a message naming that folder or port, and A's logs are byte for byte what
  they were (nothing truncated, nothing appended), and A still serves;
- SIGKILL of A's worker: ``sift up`` starts another (a line in its output and in the worker's
  log), which then consumes: an ingest with ``?wait=`` succeeds;
- (with no stack A) a data folder that cannot be made is one line naming ``--data-dir``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis as redis_lib

from tests.reliability.support import sample_documents, wait_for
from tests.services import free_port, redis_server
from worker.processes.stack import child_env, redis_service, running, stop
from worker.processes.workers import STOP_DEADLINE_STATUS, STOP_GRACE_SECONDS

pytestmark = pytest.mark.integration

UP_TIMEOUT = 120.0  # a cold start loads the embedding model; the stack waits 60 s per process
SOFT_SHUTDOWN_SECONDS = 10.0  # the default


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    out: Path  # what ``sift up`` printed
    data_dir: Path
    port: int
    metrics_port: int
    err: Path | None = None  # its stderr, when kept apart from its stdout (``out``)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def logs(self) -> Path:
        return self.data_dir / "logs"

    def headers(self) -> dict[str, str]:
        key = json.loads((self.data_dir / "dev-api-key.json").read_text())["key"]
        return {"Authorization": f"Bearer {key}"}

    def printed(self) -> str:
        said = self.err.read_text(errors="replace") if self.err else ""
        return self.out.read_text(errors="replace") + said

    def said(self) -> tuple[str, str]:
        """Its stdout (the report) and its stderr (status lines, errors), apart."""
        assert self.err is not None, "this stack's stderr went to its stdout"
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")


def _env() -> dict[str, str]:
    # the user's shell: no SIFT_* of the test runner's, a wide console for whole lines
    return child_env({"COLUMNS": "200"}, inherit_sift=False)


def _up(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A second ``sift up`` that is expected to refuse: run it to its end."""
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "up", *args],
        cwd=tmp, env=_env(), capture_output=True, text=True, timeout=UP_TIMEOUT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("sift-up")
    port, metrics_port = free_port(), free_port()
    out, err = tmp / "up.out", tmp / "up.err"
    with open(out, "wb") as sink, open(err, "wb") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "up", "--port", str(port),
             "--metrics-port", str(metrics_port), "--data-dir", str(tmp / "a")],
            cwd=tmp, env=_env(), stdout=sink, stderr=errors,
        )  # fmt: skip
    running = Stack(proc, out, tmp / "a", port, metrics_port, err)
    try:
        wait_for(lambda: "Ctrl-C stops everything" in running.printed(), "sift up", UP_TIMEOUT)
        wait_for(lambda: _warmed_up(running.logs), "the worker's warm-up", UP_TIMEOUT)
        yield running
    finally:
        stop(proc, timeout=60)  # SIGTERM: sift up stops its processes in order
        print(running.printed())
    assert proc.returncode == 0, running.printed()
    assert not (running.data_dir / "redis-url").exists()  # sift status finds no stack now
    report, said = running.said()  # a status line, on stderr: stdout is the report
    assert "stopping…" in said and "stopping" not in report, report


def _ready_again(logs: Path) -> bool:
    """A worker process of the last restart said it is ready (Celery's line after the
    restart's in the worker's log)."""
    text = (logs / "worker.log").read_text(errors="replace")
    restarted = text.rfind("sift up: worker restarted")
    return restarted >= 0 and " ready." in text[restarted:]


def _warmed_up(logs: Path) -> bool:
    """Every worker process has loaded its model (it does as it starts, logging a line): the
    stack's logs change no more on their own."""
    text = (logs / "worker.log").read_text(errors="replace")
    started = re.search(r"(\d+) worker processes started", text)
    return text.count("loaded embedding model") >= (int(started[1]) if started else 1)


def test_sift_up_prints_where_the_webhook_secret_is(stack: Stack) -> None:
    printed = " ".join(stack.printed().split())  # rich wraps long lines
    dev_key = stack.data_dir / "dev-api-key.json"
    assert f'webhooks signed with the "webhook_secret" in {dev_key}' in printed, printed
    assert json.loads(dev_key.read_text())["webhook_secret"].startswith("whsec_")


def test_redis_logs_in_the_logs_folder_with_the_others(stack: Stack) -> None:
    """The banner and the README say the logs are in ``logs/``; Redis's was in ``redis/``,
    beside its AOF."""
    assert "Ready to accept connections" in (stack.logs / "redis.log").read_text()
    assert not (stack.data_dir / "redis" / "redis.log").exists()
    assert (stack.data_dir / "redis" / "appendonlydir").is_dir()  # the AOF stays where it was


def _status(tmp: Path, data_dir: Path) -> subprocess.CompletedProcess[str]:
    """``sift status`` in the user's shell, with no SIFT_REDIS_URL."""
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", "--json", "--no-inspect"],
        cwd=tmp, env={**_env(), "SIFT_DATA_DIR": str(data_dir)}, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip


def test_sift_status_finds_the_stack_running_on_its_data_folder(
    stack: Stack, tmp_path: Path
) -> None:
    """No SIFT_REDIS_URL to copy from ``sift up``'s output: ``sift status`` reads the Redis
    of the stack running on SIFT_DATA_DIR, and says what it lacks where none runs."""
    assert (stack.data_dir / "redis-url").stat().st_mode & 0o777 == 0o600  # a password's
    found = _status(tmp_path, stack.data_dir)
    assert found.returncode == 0, found.stderr
    status = json.loads(found.stdout)
    assert {q["name"] for q in status["queues"]} >= {"sift.search", "sift.batch"}
    assert status["workers"], status  # the stack's, by their heartbeats in its Redis
    none = _status(tmp_path, tmp_path / "no-stack")
    assert none.returncode == 1 and "no `sift up` stack runs on" in none.stderr, none.stderr
    assert "SIFT_REDIS_URL is not set" in none.stderr and "Traceback" not in none.stderr


def test_the_printed_export_line_leads_sift_status_to_this_stack(
    stack: Stack, tmp_path: Path
) -> None:
    """The shell the user pastes ``sift up``'s ``export`` line into, in another folder: ``sift
    status`` reads this stack. The line set SIFT_URL and SIFT_API_KEY alone, so ``sift
    status`` (and ``sift tenant purge``) read the stack on ``.sift/data`` under the shell's
    folder: none there (exit 1), or another stack's queues shown as this one's."""
    (line,) = [s for s in stack.printed().splitlines() if s.startswith("export ")]
    exported = dict(shlex.split(word)[0].split("=", 1) for word in line.split()[1:])
    assert exported["SIFT_URL"] == stack.url, line
    status = subprocess.run(
        [sys.executable, "-m", "worker.cli", "status", "--json", "--no-inspect"],
        cwd=tmp_path, env={**_env(), **exported}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["workers"], status.stdout  # this stack's, by their beats


def test_a_purge_refuses_the_running_stacks_own_tenant(stack: Stack, tmp_path: Path) -> None:
    """``sift up`` keeps its development key in the data folder, for its children only: a
    purge that finds the stack's Redis there counts that key too, and refuses its tenant
    (it erased the live tenant's documents and records, with no --force)."""
    ingested = httpx.post(
        f"{stack.url}/v1/indexes/kept/documents", params={"wait": 30},
        json={"documents": sample_documents()[:3]}, headers=stack.headers(), timeout=90,
    )  # fmt: skip
    assert ingested.json()["status"] == "succeeded", ingested.text
    purged = subprocess.run(
        [sys.executable, "-m", "worker.cli", "tenant", "purge", "dev", "--yes"],
        cwd=tmp_path, env={**_env(), "SIFT_DATA_DIR": str(stack.data_dir)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert purged.returncode == 1, purged.stdout + purged.stderr
    assert "'dev' still has a key" in purged.stderr and "dev-api-key.json" in purged.stderr
    shown = httpx.get(f"{stack.url}/v1/indexes/kept", headers=stack.headers(), timeout=30)
    assert shown.status_code == 200 and shown.json()["documents"] == 3, shown.text


def _snapshot(logs: Path) -> dict[str, bytes]:
    return {log.name: log.read_bytes() for log in sorted(logs.glob("*.log"))}


def _settled(logs: Path) -> dict[str, bytes]:
    """The logs once no line has been added for a second: an earlier test's last task may
    still be logging its end (the worker answers before it logs "succeeded")."""
    seen = [_snapshot(logs)]

    def still() -> bool:
        time.sleep(1.0)
        seen.append(_snapshot(logs))
        return seen[-1] == seen[-2]

    wait_for(still, "the first stack's logs to settle", 60)
    return seen[-1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("clash", ["data-dir", "port", "metrics-port"])
def test_a_second_sift_up_refuses_what_another_stack_uses(
    stack: Stack, tmp_path: Path, clash: str
) -> None:
    """Every other setting of the second stack is free, so only ``clash`` can stop it."""
    data_dir = stack.data_dir if clash == "data-dir" else tmp_path / "b"
    port = stack.port if clash == "port" else free_port()
    metrics_port = stack.metrics_port if clash == "metrics-port" else free_port()
    named = {
        "data-dir": f"the data folder {stack.data_dir}",
        "port": f"the gateway port {stack.port}",
        "metrics-port": f"the worker metrics port {stack.metrics_port}",
    }[clash]
    before = _settled(stack.logs)
    assert set(before) == {"redis.log", "worker.log", "gateway.log"}
    second = _up(tmp_path, "--port", str(port), "--metrics-port", str(metrics_port),
                 "--data-dir", str(data_dir))  # fmt: skip
    printed = " ".join((second.stdout + second.stderr).split())  # rich wraps long lines
    assert second.returncode != 0, printed
    assert named in printed and "in use" in printed, printed
    assert "Ctrl-C stops everything" not in printed
    assert _snapshot(stack.logs) == before  # the first stack's logs: not one byte changed
    assert httpx.get(stack.url + "/readyz", timeout=5).status_code == 200
    if clash != "data-dir":  # the second stack started nothing in its own folder either
        assert not list((data_dir / "logs").glob("*.log"))


def _children(pid: int) -> list[tuple[int, str]]:
    """The processes whose parent is ``pid``, with their command lines."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append((int(entry.name), command))
    return found


def _worker_pid(stack: Stack, name: str = "worker") -> int:
    """The pid of the stack's ``sift worker`` (or ``sift gateway``: ``name``)."""
    pids = [pid for pid, command in _children(stack.proc.pid) if f" {name} " in command]
    assert len(pids) == 1, _children(stack.proc.pid)
    return pids[0]


@pytest.mark.timeout(300)
def test_a_killed_worker_is_restarted_and_the_stack_serves_again(stack: Stack) -> None:
    killed = _worker_pid(stack)
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: "worker restarted" in stack.printed(), "sift up restarted the worker", 30)
    printed = stack.printed()
    assert "worker exited with status -9; restarting it in 1 s" in printed, printed
    report, said = stack.said()  # status lines, on stderr: stdout is the report (the URL, key)
    assert "worker restarted" in said and "restart" not in report, report
    log = (stack.logs / "worker.log").read_text(errors="replace")
    assert "sift up: worker exited with status -9" in log
    assert "sift up: worker restarted" in log
    assert _worker_pid(stack) != killed
    # the new worker consumes: an ingest waits for its task to run. Once it is ready: sift up
    # does not wait for a process it restarted, and the ingest's 30 s would count the new
    # worker's start too (10 s from the restart's line to "ready." with two busy cores)
    wait_for(lambda: _ready_again(stack.logs), "the restarted worker ready", UP_TIMEOUT)
    response = httpx.post(
        stack.url + "/v1/indexes/docs/documents",
        params={"wait": 30},
        json={"documents": sample_documents()[:5]},
        headers=stack.headers(),
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded", response.json()


@pytest.mark.parametrize("where", ["under-a-file", "in-proc", "logs", "redis", "metrics"])
def test_sift_up_names_a_data_folder_it_cannot_use(tmp_path: Path, where: str) -> None:
    """A data folder that cannot be made (a path under a file; in /proc, where not even root
    makes one) is one line naming it and ``--data-dir``, exit 1, before anything starts.
    Before, a traceback (NotADirectoryError, FileNotFoundError from the folder's lock). So is
    one whose ``logs/``, ``redis/`` or ``metrics/`` cannot be made or written (a file there;
    root's, after a ``sudo sift up``): the lock taken, its making of them was a traceback."""
    if where == "under-a-file":
        (tmp_path / "file").write_text("")
        data_dir = tmp_path / "file" / "data"
    elif where == "in-proc":
        data_dir = Path("/proc/sift-test-data")
    else:
        data_dir = tmp_path / "data"
        data_dir.mkdir()
        (data_dir / where).write_text("")
    second = _up(tmp_path, "--port", str(free_port()), "--metrics-port", str(free_port()),
                 "--data-dir", str(data_dir))  # fmt: skip
    printed = " ".join((second.stdout + second.stderr).split())  # rich wraps long lines
    assert second.returncode == 1, printed
    assert f"error: the data folder {data_dir} cannot be used" in printed, printed
    assert "--data-dir (SIFT_DATA_DIR)" in printed and "Traceback" not in printed, printed
    if where not in ("under-a-file", "in-proc"):
        assert f"({where}/:" in printed, printed


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (``sift up`` and all it started: the worker's own
    process groups stay in it)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.timeout(180)
def test_ctrl_c_twice_while_the_stack_starts_stops_it_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the terminal's whole process group: ``sift up`` and its processes)
    twice while the worker is still starting: one line, exit 130, every process gone.

    Before, the first Ctrl-C only marked the stack as stopping: ``sift up`` went on waiting
    for the worker, which the Ctrl-C had reached too, then printed ``error: worker exited
    early:`` with its log's tail (a KeyboardInterrupt traceback when it came during imports)
    and exited 1."""
    data_dir = tmp_path / "data"
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with open(out, "wb") as sink, open(err, "wb") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "up", "--port", str(free_port()),
             "--metrics-port", str(free_port()), "--data-dir", str(data_dir)],
            cwd=tmp_path, env=_env(), stdout=sink, stderr=errors,
            start_new_session=True,
        )  # fmt: skip
    try:
        # the worker was just spawned: its imports and model load are still ahead of it
        wait_for(lambda: (data_dir / "logs" / "worker.log").exists(), "the worker's start", 120)
        assert " ready." not in (data_dir / "logs" / "worker.log").read_text(errors="replace")
        os.killpg(proc.pid, signal.SIGINT)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        report, said = out.read_text(errors="replace"), err.read_text(errors="replace")
        printed = report + said
        assert "Ctrl-C stops everything" not in printed, "the stack was up already"
        assert proc.returncode == 130, printed
        # a status line, on stderr (stdout is the report): it was on stdout
        assert "interrupted while starting; every process stopped" in said, printed
        assert "interrupted" not in report, report
        assert "Traceback" not in printed and "error" not in printed, printed
        assert _session(proc.pid) == [], printed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _up_in_a_session(tmp_path: Path) -> Stack:
    """``sift up`` started in a session of its own, as from a terminal: every process it
    starts stays in that session (:func:`_session`), whatever its process group."""
    data_dir, port, out = tmp_path / "data", free_port(), tmp_path / "up.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "up", "--port", str(port),
             "--metrics-port", str(free_port()), "--data-dir", str(data_dir)],
            cwd=tmp_path, env=_env(), stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return Stack(proc, out, data_dir, port, 0)


def _wait_up_and_warm(running: Stack) -> None:
    wait_for(lambda: "Ctrl-C stops everything" in running.printed(), "sift up", UP_TIMEOUT)
    wait_for(lambda: _warmed_up(running.logs), "the worker's warm-up", UP_TIMEOUT)


@pytest.mark.timeout(300)
def test_ctrl_c_while_a_batch_runs_leaves_no_process_behind(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) with a batch's items in the workers:
    every process of the stack is gone once ``sift up`` has exited.

    Before, Redis was in the terminal's group and died of the Ctrl-C at once, while the
    workers' warm shutdown still needed it (putting their unacked messages back): they hung,
    ``sift up`` SIGKILLed their supervisor after its 15 s, and the worker processes were left
    running, orphaned, for good. Redis now has a group of its own and is stopped last."""
    running = _up_in_a_session(tmp_path)
    proc = running.proc
    try:
        _wait_up_and_warm(running)
        with httpx.Client(base_url=running.url, headers=running.headers(), timeout=60) as client:
            ingest = client.post("/v1/indexes/docs/documents", params={"wait": 30},
                                 json={"documents": sample_documents()})  # fmt: skip
            assert ingest.status_code == 200, ingest.text
            assert ingest.json()["status"] == "succeeded", ingest.text
            queries = [{"id": f"q{i}", "query": f"tea {i}"} for i in range(20_000)]
            submitted = client.post("/v1/batches", json={"index": "docs", "queries": queries})
            assert submitted.status_code == 202, submitted.text
            batch = f"/v1/batches/{submitted.json()['id']}"
            wait_for(lambda: client.get(batch).json()["counts"]["succeeded"] > 0,
                     "the batch's first items", UP_TIMEOUT)  # fmt: skip
        assert client_status(running.url, running.headers(), batch) == "running"
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        wait_for(lambda: _session(proc.pid) == [], "every process of the stack gone", 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _session(proc.pid):  # the worker processes have groups of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, running.printed()


@pytest.mark.timeout(300)
def test_a_sigkilled_sift_up_leaves_no_process_behind(tmp_path: Path) -> None:
    """``sift up`` SIGKILLed (``kill -9``, the OOM killer): every process it started stops
    all the same (each follows it: ``PR_SET_PDEATHSIG``). Before, its Redis, its worker
    supervisor with the worker processes and its gateway ran on, orphaned, with the data
    folder's lock let go: the next ``sift up`` stopped at their ports."""
    running = _up_in_a_session(tmp_path)
    proc = running.proc
    try:
        _wait_up_and_warm(running)
        started = _session(proc.pid)
        assert len(started) >= 5, started  # Redis, the gateway, the workers and their supervisor
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: _session(proc.pid) == [], "every process of the stack gone", 120)
    finally:
        for pid in _session(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def client_status(url: str, headers: dict[str, str], path: str) -> str:
    return str(httpx.get(url + path, headers=headers, timeout=30).json()["status"])


@pytest.mark.timeout(300)
def test_stopping_sift_up_on_a_hung_redis_leaves_no_process_behind(tmp_path: Path) -> None:
    """``sift up`` on a Redis of the user's (``SIFT_REDIS_URL``) that hangs, accepting
    connections and never answering (redis-server SIGSTOPped): a Ctrl-C still ends every
    process of the stack, ``sift up`` first among them, each worker process past its stop
    deadline (its soft shutdown and the grace: its warm-up is over) with a line saying so.

    Before, each worker process's warm shutdown waited on Redis for good (closing its queues):
    ``sift up`` SIGKILLed their supervisor after 15 s, and they stayed, orphaned. And with no
    warm-up running, the deadline still counted a warm-up's wait (45 s, not 25). ``sift
    up`` then exits 3, as its worker supervisor does, with a line saying the workers were cut
    short and where their log is; it said only ``stopping…`` and exited 0, as after a clean
    stop, while what the workers held was left to come back as a killed worker's does."""
    redis, redis_url = redis_service(tmp_path / "redis")
    with running(redis):
        assert redis.proc is not None
        data_dir = tmp_path / "data"
        port = free_port()
        out = tmp_path / "up.out"
        env = {**_env(), "SIFT_REDIS_URL": redis_url + "/0"}
        with open(out, "wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker.cli", "up", "--port", str(port),
                 "--metrics-port", str(free_port()), "--data-dir", str(data_dir)],
                cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        running_up = Stack(proc, out, data_dir, port, 0)
        try:
            wait_for(lambda: "Ctrl-C stops everything" in running_up.printed(), "sift up",
                     UP_TIMEOUT)  # fmt: skip
            wait_for(lambda: _warmed_up(running_up.logs), "the worker's warm-up", UP_TIMEOUT)
            redis.proc.send_signal(signal.SIGSTOP)
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
            wait_for(lambda: _session(proc.pid) == [], "every process of the stack gone", 60)
        finally:
            redis.proc.send_signal(signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for pid in _session(proc.pid):  # the worker processes have groups of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    log = (running_up.logs / "worker.log").read_text(errors="replace")
    gave_up = f"not stopped {SOFT_SHUTDOWN_SECONDS + STOP_GRACE_SECONDS:g} s after the stop signal"
    assert gave_up + " (Redis not answering?); exiting now" in log, log[-3000:]
    # said where the user looks, with the supervisor's status: the stop was not clean
    assert proc.returncode == STOP_DEADLINE_STATUS, running_up.printed()
    said = running_up.printed()
    assert "the workers did not all finish their warm shutdown" in said, said
    assert str(running_up.logs / "worker.log") in said and "Traceback" not in said, said


def _commands(sid: int) -> str:
    """The command lines of session ``sid``'s processes, one a line."""
    lines = []
    for pid in _session(sid):
        with contextlib.suppress(OSError):
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return "\n".join(lines)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["starting", "running", "batch"])
def test_ctrl_c_in_sift_demo_says_what_it_stopped(tmp_path: Path, when: str) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) in ``sift demo``, while its stack starts
    (its Redis up, the worker loading), once the stack is up (the ingest or the batch
    running), or once its batch of searches has started (the ingest done): exit 130, one
    line saying it was interrupted and what was stopped (the step it was in), no traceback,
    every process gone.

    Before, it printed nothing but, when the Ctrl-C reached a step's ``sift`` command during
    its imports, that command's KeyboardInterrupt traceback."""
    out, err = tmp_path / "demo.out", tmp_path / "demo.err"
    with open(out, "wb") as sink, open(err, "wb") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "demo"], cwd=tmp_path, env=_env(),
            stdout=sink, stderr=errors, start_new_session=True,
        )  # fmt: skip
    printed = lambda: out.read_text(errors="replace") + err.read_text(errors="replace")  # noqa: E731
    try:
        if when == "starting":
            wait_for(lambda: "redis-server" in _commands(proc.pid), "the demo's Redis", UP_TIMEOUT)
        elif when == "batch":  # the step's `sift batch` is running
            started = lambda: "worker.cli batch " in _commands(proc.pid)  # noqa: E731
            wait_for(started, "the demo's batch", UP_TIMEOUT)
        else:
            wait_for(lambda: "stack up at" in printed(), "the demo's stack", UP_TIMEOUT)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        wait_for(lambda: _session(proc.pid) == [], "every process of the demo gone", 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _session(proc.pid):  # the steps and Redis have groups of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = printed()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "demo done" not in text, text
    if when == "starting":
        assert "stack up at" not in text, "the stack was up already"
        assert "interrupted while starting; every process stopped" in text, text
    else:
        step = "batch" if when == "batch" else "(ingest|batch)"
        assert re.search(
            rf"interrupted during the {step}: it and the stack were stopped; "
            r"every process stopped",
            err.read_text(errors="replace"),
        ), text
    # a status line, on stderr (stdout is the report, the hits): it was on stdout
    assert "interrupted" not in out.read_text(errors="replace"), text


@pytest.mark.timeout(300)
def test_sift_demo_runs_on_its_own_redis_and_fails_when_a_query_failed(tmp_path: Path) -> None:
    """An operator's shell exports the deployment's SIFT_REDIS_URL: the demo's stack joined
    that Redis (its worker took the deployment's searches, the deployment's workers its
    own), and its batch's failed queries still ended in "demo done", exit 0. Here every
    query fails (its rerank's model does not answer: a connection refused, fail_closed):
    the deployment's Redis is left without a key, and the demo exits 3 saying so."""
    with redis_server(tmp_path / "deployment") as base_url:
        deployment = redis_lib.Redis.from_url(base_url + "/0", decode_responses=True)
        env = {**_env(), "SIFT_REDIS_URL": base_url + "/0", "SIFT_RERANK_ENABLED": "true",
               "SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5",
               "SIFT_GENERATION_MAX_REQUESTS": "1", "ANTHROPIC_API_KEY": "sk-ant-test",
               "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{free_port()}"}  # fmt: skip
        demo = subprocess.run(
            [sys.executable, "-m", "worker.cli", "demo"], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=280,
        )  # fmt: skip
        printed = demo.stdout + demo.stderr
        assert list(deployment.scan_iter()) == [], printed
    assert demo.returncode == 3, printed
    assert "demo done" not in printed and "Traceback" not in printed, printed
    assert re.search(r"10 of 10 queries failed", printed), printed


# A shell that reranks with a key: a model at a remote address (``.invalid`` never resolves,
# so nothing is sent, but it is no fake on this machine) and SIFT_RERANK_ENABLED.
PAID = {"SIFT_RERANK_ENABLED": "true", "SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5",
        "SIFT_GENERATION_MAX_REQUESTS": "1", "ANTHROPIC_API_KEY": "sk-ant-test",
        "ANTHROPIC_BASE_URL": "http://api.paid.invalid"}  # fmt: skip
PAID_NOTICE = (
    "sift demo reranks each of its 10 searches with claude-haiku-4-5 at "
    "http://api.paid.invalid: about 10 paid calls"
)


@pytest.mark.parametrize("answer", ["n\n", None])
def test_sift_demo_asks_before_its_paid_model_calls_and_starts_nothing_unless_told(
    tmp_path: Path, answer: str | None
) -> None:
    """With a model, a key and rerank on (a sourced deploy/.env), the demo's ten searches
    each made a paid call, and nothing said so. It says so before anything starts and asks;
    a no (or no terminal to answer: stdin at its end) starts nothing, exit 1, and says that
    ``--yes`` makes them."""
    demo = subprocess.run(
        [sys.executable, "-m", "worker.cli", "demo"], cwd=tmp_path, env={**_env(), **PAID},
        input=answer, stdin=None if answer is not None else subprocess.DEVNULL,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    printed = demo.stdout + demo.stderr
    assert demo.returncode == 1, printed
    assert PAID_NOTICE in " ".join(demo.stderr.split()), printed
    assert "nothing was started; --yes makes them without asking" in printed, printed
    assert "stack up at" not in printed and "Traceback" not in printed, printed


@pytest.mark.timeout(300)
def test_sift_demo_yes_makes_its_paid_model_calls_without_asking(tmp_path: Path) -> None:
    """``--yes``: the notice, then the demo as ever, with no question (stdin is at its end):
    here every search's one call fails (its host does not resolve), so it ends 10 of 10
    failed, exit 3."""
    demo = subprocess.run(
        [sys.executable, "-m", "worker.cli", "demo", "--yes"], cwd=tmp_path,
        env={**_env(), **PAID}, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=280,
    )  # fmt: skip
    printed = demo.stdout + demo.stderr
    assert demo.returncode == 3, printed
    assert PAID_NOTICE in " ".join(demo.stderr.split()), printed
    assert "stack up at" in printed and "10 of 10 queries failed" in printed, printed


@pytest.mark.timeout(300)
def test_sift_demo_runs_on_its_defaults_whatever_the_deployment_exports(tmp_path: Path) -> None:
    """An operator's shell (a sourced deploy/.env) exports the deployment's settings: the
    demo's stack took them, its worker indexing into the deployment's Elasticsearch with the
    deployment's keys. The demo runs on the defaults now (the embedded backend in a
    temporary folder, its own Redis and development key); the Elasticsearch here is a port
    that takes connections and never answers, and none reaches it."""
    keys = tmp_path / "keys.json"
    secret = "whsec_" + "A" * 32
    keys.write_text(json.dumps([{"key": "sk-ops-000000000001", "tenant": "ops",
                                 "webhook_secret": secret}]))  # fmt: skip
    deployment = tmp_path / "deployment"
    with socket.create_server(("127.0.0.1", 0)) as elasticsearch:
        es_url = f"http://127.0.0.1:{elasticsearch.getsockname()[1]}"
        env = {**_env(), "SIFT_SEARCH_BACKEND": "elasticsearch", "SIFT_ELASTICSEARCH_URL": es_url,
               "SIFT_API_KEYS_FILE": str(keys), "SIFT_DATA_DIR": str(deployment)}  # fmt: skip
        demo = subprocess.run(
            [sys.executable, "-m", "worker.cli", "demo"], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        printed = demo.stdout + demo.stderr
        elasticsearch.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection waits to be accepted
            elasticsearch.accept()
    assert demo.returncode == 0 and "demo done" in printed, printed
    assert not deployment.exists(), printed
    # a status line, on stderr (stdout is the report, the hits): it was on stdout
    assert "stopping the stack" in demo.stderr and "stopping" not in demo.stdout, printed


def test_an_early_exit_is_told_on_stderr_line_by_line(tmp_path: Path) -> None:
    """The stack's Redis exits as it starts (its AOF manifest is garbage): ``sift up`` says
    so on stderr, the process's log tail with its own line breaks. It printed the error on
    stdout, every other command's place for results, and the tail on one line with literal
    ``\\n`` between the lines."""
    aof = tmp_path / "d" / "redis" / "appendonlydir"
    aof.mkdir(parents=True)
    (aof / "appendonly.aof.manifest").write_text("garbage line\n")
    failed = _up(tmp_path, "--port", str(free_port()), "--metrics-port", str(free_port()),
                 "--data-dir", str(tmp_path / "d"))  # fmt: skip
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "error" not in failed.stdout, failed.stdout
    lines = failed.stderr.splitlines()
    assert lines[0] == "error: redis-server exited early (exit status 1):", failed.stderr
    assert any(line.endswith("Invalid AOF manifest file format") for line in lines), lines
    assert "\\n" not in failed.stderr, failed.stderr


def test_a_data_folder_of_the_previous_release_has_its_redis_log_moved_to_logs(
    tmp_path: Path,
) -> None:
    """A data folder an earlier ``sift up`` made keeps Redis's log (and its rotated copies)
    in ``redis/``: the next one moves them to ``logs/`` and Redis appends there. Its Redis
    made to exit as it starts (an AOF manifest it cannot read), so no stack need start."""
    old = tmp_path / "d" / "redis"
    (old / "appendonlydir").mkdir(parents=True)
    (old / "appendonlydir" / "appendonly.aof.manifest").write_text("garbage line\n")
    (old / "redis.log").write_text("a line of the earlier release\n")
    (old / "redis.log.1").write_text("an older one\n")
    failed = _up(tmp_path, "--port", str(free_port()), "--metrics-port", str(free_port()),
                 "--data-dir", str(tmp_path / "d"))  # fmt: skip
    assert failed.returncode == 1, failed.stdout + failed.stderr
    logs = tmp_path / "d" / "logs"
    moved = (logs / "redis.log").read_text()
    assert moved.startswith("a line of the earlier release\n"), moved
    assert "Invalid AOF manifest file format" in moved  # this start's lines, appended
    assert (logs / "redis.log.1").read_text() == "an older one\n"
    assert not list(old.glob("redis.log*"))


def test_one_port_for_the_gateway_and_the_worker_metrics_is_a_usage_error(tmp_path: Path) -> None:
    """Refused before anything starts (exit 2, naming both options); it started Redis and the
    worker, whose metrics took the port, then failed on the gateway's log tail."""
    port = free_port()
    refused = _up(tmp_path, "--port", str(port), "--metrics-port", str(port),
                  "--data-dir", str(tmp_path / "d"))  # fmt: skip
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--port" in said and "--metrics-port" in said and str(port) in said, said
    assert not (tmp_path / "d" / "logs").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("child", "named"),
    [("worker", "SIFT_API_KEYS_FILE"), ("gateway", "maxmemory-policy allkeys-lru")],
)
def test_a_process_that_refuses_its_restart_stops_the_stack(
    tmp_path: Path, child: str, named: str
) -> None:
    """``sift up`` on an API keys file broken once it runs (for its worker), or on its Redis
    set to evict once it runs (for its gateway): the process killed (the OOM killer, say) is
    started again and refuses to start (exit 2, one line naming what), which no restart
    changes. ``sift up`` started it again after each back-off for as long as it ran; it now
    stops the stack and exits 2 naming the refusal, no process left behind."""
    keys = tmp_path / "keys.json"
    secret = "whsec_YWNtZS1zZWNyZXQtMDEyMzQ1Njc4OQ=="
    keys.write_text(
        json.dumps([{"key": "acme-key-0001", "tenant": "acme", "webhook_secret": secret}])
    )
    data_dir, out, err = tmp_path / "data", tmp_path / "up.out", tmp_path / "up.err"
    with open(out, "wb") as sink, open(err, "wb") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "up", "--port", str(free_port()),
             "--metrics-port", str(free_port()), "--data-dir", str(data_dir)],
            cwd=tmp_path, env={**_env(), "SIFT_API_KEYS_FILE": str(keys)}, stdout=sink,
            stderr=errors, start_new_session=True,
        )  # fmt: skip
    running = Stack(proc, out, data_dir, 0, 0, err)
    try:
        _wait_up_and_warm(running)
        if child == "worker":
            keys.write_text("[{")  # broken since the start
        else:  # the stack's own Redis, which has a maxmemory, set to evict
            admin = redis_lib.Redis.from_url((data_dir / "redis-url").read_text().strip())
            admin.config_set("maxmemory-policy", "allkeys-lru")
            admin.close()
        os.kill(_worker_pid(running, child), signal.SIGKILL)
        code = proc.wait(timeout=120)
    finally:
        stop(proc, timeout=60)
    _, said = running.said()
    assert code == 2, running.printed()
    assert said.count("restarting it in") == 1, said  # the killed one, once
    assert f"{child} refused to start" in said and named in said, said
    assert _session(proc.pid) == [], _session(proc.pid)  # every process stopped

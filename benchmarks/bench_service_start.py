"""The CPU ``sift gateway`` (or ``sift worker``) spends to start: from its exec to its first
``200`` on ``/healthz`` (the worker: Celery's `` ready.`` line), user + sys of the process.

    python benchmarks/bench_service_start.py [--command gateway|worker] [--warm] [--starts 9]
        [--tree PATH ...]

Starts a redis-server, then the command ``--starts`` times for each ``--tree`` (a checkout,
put first on ``PYTHONPATH``: this one by default; give an older checkout and this one to
compare them), the trees' starts interleaved so that the machine's load falls on each alike.
The gateway is polled every 5 ms; its CPU is read from ``/proc/PID/stat`` at the first
``200``, then it is stopped. The worker runs as one process (``--processes 1``) on a data
folder of its own; with ``--warm`` it is timed to its warm-up's end, the embedding model's
``loaded embedding model`` line, which its warm-up thread logs after `` ready.``. Prints
each tree's median, min and max; a start that exits before it is ready stops the run
(exit 1), so no figure stands for a start that failed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.services import free_port, redis_server  # noqa: E402

KEYS = '[{"key": "bench-key-0001", "tenant": "bench", "webhook_secret": "whsec_YmVuY2gtc2VjcmV0LTAxMjM0NTY3"}]'  # noqa: E501
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + sys CPU of process ``pid`` so far (``/proc/PID/stat``: utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def start_once(command: str, tree: str, redis_url: str, folder: Path, line: bytes) -> float:
    """Start ``sift COMMAND`` from ``tree``, wait until it is ready, answer its CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIFT_")}
    env.update(PYTHONPATH=tree, SIFT_REDIS_URL=redis_url, SIFT_API_KEYS=KEYS)
    env.update(SIFT_DATA_DIR=str(folder / "data"), SIFT_WORKER_METRICS_PORT="0")
    sift = str(Path(sys.executable).with_name("sift"))
    port = free_port()
    args = ["gateway", "--host", "127.0.0.1", "--port", str(port)]
    if command == "worker":
        args = ["worker", "--processes", "1"]
    log = folder / f"{command}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sift, *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while not ready(command, port, log, line):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise SystemExit(f"{tree}: sift {command} exited {proc.returncode}:\n{tail}")
            time.sleep(0.005)
        return cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)


def ready(command: str, port: int, log: Path, line: bytes) -> bool:
    if command == "worker":
        return line in log.read_bytes()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--command", choices=["gateway", "worker"], default="gateway")
    parser.add_argument("--warm", action="store_true", help="the worker: to its model's load")
    parser.add_argument("--starts", type=int, default=9)
    parser.add_argument("--tree", action="append", help="a checkout (default: this one)")
    options = parser.parse_args()
    trees = [str(Path(tree).resolve()) for tree in options.tree or [REPO]]
    line = b"loaded embedding model" if options.warm else b" ready."
    until = "warm" if options.warm and options.command == "worker" else "ready"
    figures: dict[str, list[float]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        folder = Path(tmp)
        with redis_server(folder / "redis", appendonly=True) as url:
            for _ in range(options.starts):
                for tree in trees:
                    figure = start_once(options.command, tree, url + "/0", folder, line)
                    figures[tree].append(figure)
    for tree, values in figures.items():
        median, low, high = statistics.median(values), min(values), max(values)
        print(f"{tree}: sift {options.command} to {until}: median {median:.2f} CPU-s "
              f"(min {low:.2f}, max {high:.2f}, {len(values)} starts)")  # fmt: skip


if __name__ == "__main__":
    main()

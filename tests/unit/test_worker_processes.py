"""How many worker processes ``sift worker`` starts, and the supervisor's exit hook that drops a
dead child's live gauges (the real processes: tests/reliability/test_worker_processes.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from worker.processes.machine import cpu_count
from worker.processes.stack import Service
from worker.processes.supervisor import Supervisor
from worker.processes.workers import resolve_processes
from worker.settings import Settings


def test_the_default_is_one_process_per_core_this_process_may_use() -> None:
    assert Settings(_env_file=None).worker_processes == 0  # type: ignore[call-arg]
    cores = cpu_count()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert resolve_processes(0) == cores
    assert resolve_processes(3) == 3
    assert Settings(_env_file=None, worker_processes=1).worker_processes == 1  # type: ignore[call-arg]


def test_the_exit_hook_sees_the_dead_process_before_its_restart(tmp_path: Path) -> None:
    exited: list[int] = []
    said: list[str] = []
    service = Service("crasher", ["sh", "-c", "exit 3"], None, None)
    first = service.start()
    supervisor = Supervisor(
        said.append, poll_seconds=0.05, on_exit=lambda s: exited.append(s.proc.pid if s.proc else 0)
    )
    supervisor.watch(service)
    with supervisor:
        deadline = time.monotonic() + 30
        while not any("restarted" in line for line in said) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert exited[0] == first.pid, (exited, said)
    assert service.proc is not None and service.proc.pid != first.pid
    service.proc.wait(10)

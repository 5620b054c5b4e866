"""``sift up``'s supervisor (:class:`worker.processes.stack.Supervisor`) over a real process that
exits at once: it is started again after 1 s, then 2 s, then 4 s (a crash loop does not spin), each
exit and restart is said on the console and in the process's log, and a process that stayed
up a minute starts again after 1 s."""

from __future__ import annotations

import re
import time
from pathlib import Path

from worker.processes.stack import RESTART_RESET_AFTER_SECONDS, Service, Supervisor, _Watched


def _crasher(tmp_path: Path) -> Service:
    return Service("crasher", ["sh", "-c", "exit 3"], tmp_path / "crasher.log", None)


def _delays(said: list[str]) -> list[float]:
    return [float(m[1]) for line in said if (m := re.search(r"restarting it in (\S+) s", line))]


def test_a_crash_loop_is_restarted_with_a_doubling_back_off(tmp_path: Path) -> None:
    said: list[str] = []
    service = _crasher(tmp_path)
    started = time.monotonic()
    service.start()
    supervisor = Supervisor(said.append, poll_seconds=0.05)
    supervisor.watch(service)
    with supervisor:
        deadline = started + 60
        while len(_delays(said)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    elapsed = time.monotonic() - started
    assert _delays(said) == [1, 2, 4], said
    assert elapsed >= 3.0  # the third exit came after the two back-offs, not at once
    assert sum("crasher restarted (pid" in line for line in said) == 2, said
    assert said[0] == "crasher exited with status 3; restarting it in 1 s"
    log = service.log.read_text()
    assert log.count("sift up: crasher exited with status 3") == 3
    assert log.count("sift up: crasher restarted") == 2


def test_a_process_that_stayed_up_is_restarted_after_the_first_delay_again(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    service = _crasher(tmp_path)
    supervisor = Supervisor(said.append)
    watched = _Watched(service, failures=5)  # after a crash loop: the next wait would be 30 s
    service.start()
    assert service.proc is not None
    service.proc.wait()
    supervisor._check(watched, service.started_at + RESTART_RESET_AFTER_SECONDS + 1)
    assert _delays(said) == [1], said


def test_nothing_is_restarted_once_the_stack_stops(tmp_path: Path) -> None:
    said: list[str] = []
    service = _crasher(tmp_path)
    service.start()
    assert service.proc is not None
    service.proc.wait()
    supervisor = Supervisor(said.append)
    supervisor.watch(service)
    supervisor.stop_watching()  # Ctrl-C: the processes exit on their own
    supervisor._check(_Watched(service), time.monotonic() + 100)
    assert said == []

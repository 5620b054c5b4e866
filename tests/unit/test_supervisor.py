"""``sift up``'s supervisor (:class:`~worker.processes.supervisor.Supervisor`) over a real process
that exits at once: it is started again after 1 s, then 2 s, then 4 s (a crash loop does not
spin), each exit and restart is said on the console and in the process's log, and a process that
stayed up a minute starts again after 1 s."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from worker.processes.stack import Service
from worker.processes.supervisor import RESTART_RESET_AFTER_SECONDS, Supervisor, _Watched


def _crasher(tmp_path: Path) -> Service:
    return Service("crasher", ["sh", "-c", "exit 3"], tmp_path / "crasher.log", None)


def _delays(said: list[str]) -> list[float]:
    return [float(m[1]) for line in said if (m := re.search(r"restarting it in (\S+) s", line))]


def test_a_crash_loop_is_restarted_with_a_doubling_back_off(tmp_path: Path) -> None:
    said: list[str] = []
    service = _crasher(tmp_path)
    service.start()
    supervisor = Supervisor(said.append, poll_seconds=0.05)
    supervisor.watch(service)
    with supervisor:
        deadline = time.monotonic() + 60
        while len(_delays(said)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _delays(said) == [1, 2, 4], said
    assert sum("crasher restarted (pid" in line for line in said) == 2, said
    assert said[0] == "crasher exited with status 3; restarting it in 1 s"
    log = service.log.read_text()
    assert log.count("sift up: crasher exited with status 3") == 3
    assert log.count("sift up: crasher restarted") == 2


def test_an_exited_process_is_started_again_only_once_its_back_off_is_over(
    tmp_path: Path,
) -> None:
    """The supervisor's checks, at instants the test gives: the process exits at once each
    time; it is started again at the end of its back-off (1 s, then 2 s), never before."""
    said: list[str] = []
    service = _crasher(tmp_path)
    supervisor = Supervisor(said.append)
    watched = _Watched(service)
    now = 0.0

    def check_at(instant: float) -> list[str]:
        assert service.proc is not None
        service.proc.wait()  # it has exited by the time it is checked
        before = len(said)
        supervisor._check(watched, instant)
        return said[before:]

    service.start()
    service.started_at = now  # on the test's clock from here on
    assert check_at(now) == ["crasher exited with status 3; restarting it in 1 s"]
    assert check_at(now + 0.999) == []  # its back-off is not over
    restarted = check_at(now + 1.0)
    assert len(restarted) == 1 and restarted[0].startswith("crasher restarted (pid")
    now += 1.0
    service.started_at = now
    assert check_at(now) == ["crasher exited with status 3; restarting it in 2 s"]
    assert check_at(now + 1.999) == []
    assert check_at(now + 2.0)[0].startswith("crasher restarted (pid")
    assert service.proc is not None
    service.proc.wait()


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


def test_a_failing_exit_hook_neither_stops_the_supervisor_nor_the_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``sift worker``'s exit hook (a dead child's live gauges dropped) once raised, and the
    exception ended the supervisor's thread: nothing was restarted again, and the processes
    it had restarted, which follow that thread, were sent SIGTERM. Logged, and gone past."""
    said: list[str] = []
    hooked: list[int] = []

    def failing_hook(service: Service) -> None:
        assert service.proc is not None
        hooked.append(service.proc.pid)
        raise FileNotFoundError("gone already")

    service = Service("sleeper", ["sleep", "600"], tmp_path / "sleeper.log", None, follow=True)
    supervisor = Supervisor(said.append, poll_seconds=0.05, on_exit=failing_hook)
    supervisor.watch(service)
    with supervisor:
        first = service.start()
        first.kill()
        deadline = time.monotonic() + 60
        while sum("restarted (pid" in line for line in said) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        second = service.proc
        assert second is not None and second is not first, said
        second.kill()  # the thread is still there to see this one exit too
        while sum("restarted (pid" in line for line in said) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor._thread is not None and supervisor._thread.is_alive()
    assert hooked == [first.pid, second.pid], said
    assert "a hook failed for sleeper" in caplog.text
    assert service.proc is not None
    service.proc.kill()
    service.proc.wait()


def _wait_for(path: Path, text: bytes) -> None:
    deadline = time.monotonic() + 30
    while text not in path.read_bytes():
        assert time.monotonic() < deadline, f"{text!r} never reached {path}"
        time.sleep(0.02)


def test_a_log_past_its_size_is_rotated_in_place_and_only_a_few_are_kept(tmp_path: Path) -> None:
    """``sift up``'s logs grew for good (appended to on every run and restart). Each check
    rotates a log past ``log_max_bytes``: its lines to ``NAME.log.1`` (the older ones shifted
    up to ``log_keep``, the oldest dropped) and the log emptied in place, so the process,
    which appends to it, goes on at its start (not past a hole the size of the old lines)."""
    script = (
        "trap 'echo after-the-rotation' USR1; i=0; "
        'while [ $i -lt 2000 ]; do echo "line $i of the first run of the writer"; i=$((i+1)); '
        "done; echo written; while true; do sleep 0.05; done"
    )
    service = Service("writer", ["sh", "-c", script], tmp_path / "writer.log", None)
    supervisor = Supervisor([].append, log_max_bytes=32 * 1024, log_keep=2)
    watched = _Watched(service)
    old = tmp_path / "writer.log.1", tmp_path / "writer.log.2", tmp_path / "writer.log.3"
    service.start()
    try:
        _wait_for(service.log, b"written\n")
        supervisor._check(watched, time.monotonic())
        assert service.log.read_bytes() == b"" and b"line 1999 " in old[0].read_bytes()
        assert service.proc is not None
        service.proc.send_signal(signal.SIGUSR1)
        _wait_for(service.log, b"after-the-rotation")
        assert service.log.read_bytes() == b"after-the-rotation\n"  # at the start, no hole
        for n in range(3):  # three more rotations: the first run's lines are dropped
            with service.log.open("ab") as log:
                log.write(f"filler {n}\n".encode() * 4096)
            supervisor._check(watched, time.monotonic())
        assert old[0].read_bytes().startswith(b"filler 2\n"), old[0].read_bytes()[:20]
        assert old[1].read_bytes().startswith(b"filler 1\n"), old[1].read_bytes()[:20]
        assert not old[2].exists() and service.log.read_bytes() == b""
        supervisor._check(watched, time.monotonic())  # under the size: left as it is
        assert old[0].read_bytes().startswith(b"filler 2\n")
    finally:
        assert service.proc is not None
        service.proc.kill()
        service.proc.wait()


def test_a_log_that_cannot_be_rotated_keeps_no_process_down_and_no_rotated_log_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sift up`` on a full disk: the copy of a log past its size failed (ENOSPC). Each check
    rotated before it looked at the process, so the error (logged at every tick) kept a dead
    process from its restart until there was room; and the rotated logs, shifted before the
    copy, were left as empty files. Now the exit comes first, the rotation fails with every
    log as it was (the part copied removed), said once, and works again once there is room."""
    import errno
    import shutil

    from worker.processes import stack

    def full_disk(source: Path, target: Path) -> None:
        target.write_bytes(b"the part copied before the disk was full")
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    room = shutil.copyfile
    monkeypatch.setattr(stack.shutil, "copyfile", full_disk)
    said: list[str] = []
    service = _crasher(tmp_path)
    assert service.log is not None
    supervisor = Supervisor(said.append, log_max_bytes=1024, log_keep=3)
    watched = _Watched(service)
    rotated = [tmp_path / f"crasher.log.{n}" for n in (1, 2)]
    for n, path in enumerate(rotated, start=1):
        path.write_text(f"rotated {n}\n")
    service.start()
    assert service.proc is not None
    service.proc.wait()
    service.log.write_bytes(b"x" * 2048)  # past its size
    now = service.started_at
    supervisor._check(watched, now)
    assert said[0] == "crasher exited with status 3; restarting it in 1 s", said
    assert said[1] == (
        "crasher's log could not be rotated (No space left on device); it grows until it can be"
    )
    supervisor._check(watched, now + 0.5)
    supervisor._check(watched, now + 1.0)
    assert len(said) == 3 and said[2].startswith("crasher restarted (pid"), said
    assert [p.read_text() for p in rotated] == ["rotated 1\n", "rotated 2\n"]
    assert not (tmp_path / "crasher.log.3").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "crasher.log", "crasher.log.1", "crasher.log.2"
    ]  # fmt: skip
    assert service.log.read_bytes().startswith(b"x" * 2048)

    monkeypatch.setattr(stack.shutil, "copyfile", room)
    assert service.proc is not None
    service.proc.wait()
    supervisor._check(watched, now + 1.0)
    assert service.log.read_bytes() == b""
    assert (tmp_path / "crasher.log.1").read_bytes().startswith(b"x" * 2048)
    assert (tmp_path / "crasher.log.2").read_text() == "rotated 1\n"
    assert (tmp_path / "crasher.log.3").read_text() == "rotated 2\n"
    monkeypatch.setattr(stack.shutil, "copyfile", full_disk)
    service.log.write_bytes(b"y" * 2048)
    supervisor._check(watched, now + 1.0)
    assert sum("could not be rotated" in line for line in said) == 2, said  # said again

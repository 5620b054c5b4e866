"""A stack process is ready once it listens on its port itself, not once whatever listens
there answers; a test's server that lost the port it was given starts again on another.

Two test files picking the same free port at once (:func:`free_port` rules out only its own
process's picks, and ports something listens on already) start two servers on it; the
second cannot bind it and exits. Before, its readiness check (``/readyz`` for a gateway,
``PING`` for Redis) was answered by the first one's server, so the test ran against another
test's gateway or Redis: against a gateway with no ``SIFT_MAX_BACKLOG``, the batch
``test_backpressure.py`` expects refused whole was accepted (its one-off failure in a loaded
run). Real processes on one port, as two test files raced them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.support import stack_env
from tests.services import gateway, redis_server
from worker.processes import stack

pytestmark = pytest.mark.integration


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


@pytest.fixture
def other_gateway(tmp_path: Path) -> Iterator[tuple[dict[str, str], int]]:
    """A gateway already up (its Redis too): the environment of a second one, and its port."""
    with redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", "http://127.0.0.1:9")
        with gateway(tmp_path / "other", env) as other:
            yield env, _port(other)


def _taken_first(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """The next pick of :func:`free_port` is ``port``, as another process's pick at the same
    moment could be; the picks after it are free_port's own."""
    picks, pick = iter([port]), stack.free_port
    monkeypatch.setattr(stack, "free_port", lambda: next(picks, None) or pick())


def test_a_gateway_whose_port_another_gateway_holds_is_not_ready(
    tmp_path: Path, other_gateway: tuple[dict[str, str], int]
) -> None:
    env, taken = other_gateway
    with (
        pytest.raises(RuntimeError, match=r"gateway exited early \(exit status 3\)") as raised,
        gateway(tmp_path / "g", env, port=taken),
    ):
        pass
    assert "address already in use" in str(raised.value), raised.value


def test_a_gateway_that_lost_its_picked_port_starts_on_another(
    tmp_path: Path, other_gateway: tuple[dict[str, str], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    env, taken = other_gateway
    _taken_first(monkeypatch, taken)
    with gateway(tmp_path / "g", env) as url:
        assert _port(url) != taken
    assert "address already in use" in (tmp_path / "g" / "gateway.log").read_text()


def test_a_redis_whose_port_another_redis_holds_is_not_ready(tmp_path: Path) -> None:
    with redis_server(tmp_path / "other") as other:
        with (
            pytest.raises(
                RuntimeError, match=r"redis-server exited early \(exit status 1\)"
            ) as raised,
            redis_server(tmp_path / "redis", port=_port(other)),
        ):
            pass
        assert "Address already in use" in str(raised.value), raised.value


def test_a_redis_that_lost_its_picked_port_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with redis_server(tmp_path / "other") as other:
        _taken_first(monkeypatch, _port(other))
        with redis_server(tmp_path / "redis") as url:
            assert _port(url) != _port(other)
        assert "Address already in use" in (tmp_path / "redis" / "redis.log").read_text()


def test_a_process_killed_by_a_signal_is_said_killed_by_it(tmp_path: Path) -> None:
    """A process that dies of a signal as it starts (a segfault in a library, say) is told
    by the signal's name: its log alone may end with no word of it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    )
    with pytest.raises(RuntimeError, match=r"^crasher exited early \(killed by SIGSEGV\):"):
        stack.wait_until(lambda: False, "crasher", proc, None)

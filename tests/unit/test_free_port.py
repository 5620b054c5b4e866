"""Where :func:`free_port` finds a port for a server about to start: below the kernel's
ephemeral range, so that no outgoing connection can take it before the server binds it."""

from __future__ import annotations

import random
import socket

import pytest

from worker.processes import stack
from worker.processes.stack import FREE_PORTS_FROM, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    ephemeral_low = stack._ephemeral_low()
    if ephemeral_low - 1 - FREE_PORTS_FROM < 1000:  # free_port then binds port 0
        pytest.skip(f"this host's ephemeral range starts at {ephemeral_low}: no room below it")
    ports = [free_port() for _ in range(300)]
    assert all(FREE_PORTS_FROM <= port < ephemeral_low for port in ports), ports
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # free indeed


def test_a_port_something_listens_on_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        pick = random.randint
        offered: list[int] = []  # the listening port first, then the random picks

        def offer(low: int, high: int) -> int:
            offered.append(busy if not offered else pick(low, high))
            return offered[-1]

        monkeypatch.setattr(random, "randint", offer)
        monkeypatch.setattr(stack, "_handed_out", set())
        port = free_port()
    # past it, to the next pick nothing else on this busy machine listens on either
    assert offered[0] == busy and port == offered[-1] and port != busy, offered


def test_with_no_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack, "_ephemeral_low", lambda: FREE_PORTS_FROM + 10)
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))

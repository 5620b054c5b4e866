"""``name_process``: a process's log records name it where Python says ``MainProcess``, and a
pool's child keeps its own name after it (each supervised ``sift worker`` process may run a
prefork pool, whose children are ``ForkPoolWorker-1``, … in every one of them)."""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterator

import pytest

from worker.observability.logcontext import name_process


@pytest.fixture(autouse=True)
def _factory_kept() -> Iterator[None]:
    kept = logging.getLogRecordFactory()
    yield
    logging.setLogRecordFactory(kept)


def _process_name() -> str:
    record = logging.getLogger("t").makeRecord("t", logging.INFO, __file__, 1, "m", (), None)
    return str(record.processName)


def test_the_main_process_s_records_say_its_name() -> None:
    assert _process_name() == "MainProcess"
    name_process("worker-1")
    assert _process_name() == "worker-1"


def test_a_pool_child_s_records_say_its_own_name_after_the_process_s() -> None:
    name_process("worker-1")
    fork = multiprocessing.get_context("fork")
    said = fork.SimpleQueue()
    child = fork.Process(target=lambda: said.put(_process_name()), name="ForkPoolWorker-2")
    child.start()
    child.join(30)
    assert said.get() == "worker-1/ForkPoolWorker-2"

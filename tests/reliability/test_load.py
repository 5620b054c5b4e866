"""The 10 s form of ``benchmarks/bench_load.py``: a steady rate of reranked searches through
the real stack; every accepted job reaches a final state and none is lost. The figures are
printed, never asserted (the machine is shared)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.reliability.load import load_stack, run_load

pytestmark = pytest.mark.integration


def test_a_steady_rate_for_10_seconds_loses_no_job(tmp_path: Path) -> None:
    with load_stack(tmp_path, model_delay=0.2, concurrency=32) as url:
        report = asyncio.run(run_load(url, rate=10, duration=10, give_up=60))
    print("\n" + report.summary())
    assert report.submitted == 100 and report.refused == 0
    assert report.lost == 0
    assert report.statuses == {"succeeded": 100}

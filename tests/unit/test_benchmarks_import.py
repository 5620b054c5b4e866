"""Every benchmark script imports: a rename in ``worker/`` that breaks one fails here, not
in the next session that tries to measure with it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted(
    p.stem for p in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py")
)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_imports(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__, f"benchmarks/{name}.py says what it measures and how to run it"

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


def test_a_baseline_loads_an_earlier_package_with_its_own_modules(tmp_path: Path) -> None:
    """``module_at`` on a path that had become a package (the embedded backend's, at HEAD)
    loads that commit's modules under the baseline's name, not today's beside them."""
    from benchmarks.baseline import module_at
    from worker.adapters.embedded import EmbeddedBackend
    from worker.core.types import Document

    old = module_at("HEAD", "worker/adapters/embedded.py", "bench_test_baseline_embedded")
    assert old.EmbeddedBackend is not EmbeddedBackend
    assert {c.__module__ for c in old.EmbeddedBackend.__mro__[1:-1]} <= {
        f"bench_test_baseline_embedded._{part}"
        for part in ("search", "caches", "pool", "writes", "listing", "settings")
    }
    backend = old.EmbeddedBackend(tmp_path)
    assert backend.upsert("sci", "acme", [Document("a", "alpha")], None) == 1
    backend.close()
    today = EmbeddedBackend(tmp_path)
    assert today.count("sci", "acme") == 1  # the same data dir, read by today's code
    today.close()

"""The shared backend contract, run against the in-memory fake and the embedded backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes import InMemoryBackend
from tests.integration.backend_contract import BackendContract, LifecycleContract
from worker.adapters.embedded import EmbeddedBackend
from worker.core.ports import SearchBackend

pytestmark = pytest.mark.integration


@pytest.fixture
def index() -> str:
    return "contract"


class TestInMemoryBackendContract(BackendContract):
    """The fake the unit tests lean on keeps the same contract as the real backends."""

    @pytest.fixture
    def backend(self) -> SearchBackend:
        return InMemoryBackend()


class TestEmbeddedBackendContract(LifecycleContract):
    counts_first_run = True

    @pytest.fixture
    def backend(self, tmp_path: Path) -> SearchBackend:
        return EmbeddedBackend(tmp_path / "data")

    @pytest.fixture
    def another(self, tmp_path: Path) -> SearchBackend:
        return EmbeddedBackend(tmp_path / "data")

"""A runtime whose process dies on the query "die": a worker lost mid-task, on demand."""

from __future__ import annotations

import os

from tests.fakes import EmptyRuntime
from worker.contract import SearchResult, SearchSpec
from worker.core.pipeline import BeforeModel
from worker.settings import Settings


class DyingRuntime(EmptyRuntime):
    def search(
        self,
        spec: SearchSpec,
        tenant: str,
        before_model: BeforeModel | None = None,
        *,
        spent: float = 0.0,
        answers: object = None,
    ) -> SearchResult:
        if spec.query == "die":
            os._exit(17)  # no cleanup, no ack: as an OOM kill would
        return super().search(spec, tenant, before_model)


def build_runtime(settings: Settings) -> DyingRuntime:
    return DyingRuntime()

"""A runtime whose process dies on the query "die": a worker lost mid-task, on demand."""

from __future__ import annotations

import os
from collections.abc import Callable

from worker.contract import DocumentIn, RerankInfo, SearchResult, SearchSpec
from worker.settings import Settings


class DyingRuntime:
    def search(
        self, spec: SearchSpec, tenant: str, before_model: Callable[[], None] | None = None
    ) -> SearchResult:
        if spec.query == "die":
            os._exit(17)  # no cleanup, no ack: as an OOM kill would
        return SearchResult(hits=[], rerank=RerankInfo(applied=False))

    def ingest(
        self,
        index: str,
        tenant: str,
        documents: list[DocumentIn],
        progress: Callable[[int], None] | None = None,
        *,
        version: int | None = None,
    ) -> int:
        return len(documents)


def build_runtime(settings: Settings) -> DyingRuntime:
    return DyingRuntime()

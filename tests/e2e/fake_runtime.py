"""A runtime for e2e tests: the real pipeline over the in-memory backend and the fake embedder.

Selected with ``SIFT_RUNTIME_FACTORY=tests.e2e.fake_runtime:build_runtime`` while
the embedded backend is not on main; one worker process holds the whole corpus.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tests.fakes import FakeEmbedder, InMemoryBackend
from worker.contract import Channel
from worker.core.types import ChannelQuery, ChannelResults, Document
from worker.runtime import Runtime
from worker.runtime import build_runtime as real_build_runtime
from worker.settings import Settings


class LockedBackend(InMemoryBackend):
    """The in-memory backend, made safe for the worker's threads."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def channels(self, index: str) -> frozenset[Channel]:
        with self._lock:
            return super().channels(index)

    def upsert(
        self,
        index: str,
        tenant: str,
        documents: Sequence[Document],
        vectors: Sequence[Sequence[float]] | None,
    ) -> int:
        with self._lock:
            return super().upsert(index, tenant, documents, vectors)

    def retrieve(self, query: ChannelQuery) -> ChannelResults:
        with self._lock:
            self.calls.clear()
            return super().retrieve(query)


def build_runtime(settings: Settings) -> Runtime:
    return real_build_runtime(settings, backend=LockedBackend(), embedder=FakeEmbedder())

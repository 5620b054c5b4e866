"""CPU slots: how many threads of a process run a search's CPU-bound stages at once.

A worker keeps hundreds of searches in flight on threads, because most of a search is
waiting on the model. The query embedding and the embedded backend's retrieval are CPU
work, and past about one thread per core more threads in them only queue for the GIL: each
hand-off is a futex wake and a context switch, which perf put at a quarter of the worker's
CPU. So a search holds a slot through its first half (embedding, retrieval, fusion, the
prompt; not a retry's back-off), and when every slot is taken it waits for one off the GIL.
Elasticsearch's retrieval waits on the network, so there only the embedding holds one
(:func:`worker.runtime.bootstrap.build_pipeline` decides).

    slots = cpu_slots(settings.cpu_slots)  # SIFT_CPU_SLOTS; 0 is one per core, plus one
    SearchPipeline(EmbeddedBackend(data_dir), embedder, cpu_slots=slots)  # the first half
    SearchPipeline(elasticsearch, SlottedEmbedder(embedder, slots))  # the embedding alone
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from worker.core.ports import Embedder
from worker.processes.machine import cpu_count

Slots = AbstractContextManager[Any]


def cpu_slots(slots: int) -> threading.BoundedSemaphore:
    """``slots`` CPU slots to share between the stages; 0 is one per core and one more, so
    a core need not idle while a slot's holder waits on a read (measured best for a worker:
    532 batch queries/s with 3 slots on 2 cores, against 488 with 2)."""
    return threading.BoundedSemaphore(slots or cpu_count() + 1)


class SlottedEmbedder:
    """An :class:`~worker.core.ports.Embedder` whose model calls each hold a CPU slot."""

    def __init__(self, inner: Embedder, slots: Slots) -> None:
        self.inner = inner
        self.slots = slots
        self.model_id: str = inner.model_id
        self.dimension: int = inner.dimension

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        with self.slots:
            return self.inner.embed(texts)

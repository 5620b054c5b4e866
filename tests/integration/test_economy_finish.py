"""An economy item's end against the embedded backend, a real redis-server and the fake
Messages API (the real SDK over loopback HTTP), its steps driven directly (no worker
process): the read of its candidates as stored at its finish, and the figures it counts in
the real Prometheus registry."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.fakes import FakeEmbedder
from tests.integration.test_economy_doubts import _mapping, _submission, _Task, workers
from worker.adapters.anthropic import AnthropicReranker
from worker.adapters.anthropic_batches import AnthropicMessageBatches
from worker.adapters.embedded import EmbeddedBackend
from worker.constants import ECONOMY_PREPARED_KEY, LANE_ECONOMY
from worker.contract import DocumentIn, SearchSpec
from worker.core.pipeline import load_prepared
from worker.observability.metrics import PrometheusRecorder
from worker.queue import economy
from worker.queue.base import WorkerContext
from worker.queue.economy import finish
from worker.queue.jobstore import BatchJob, JobStore
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.runtime.ratelimit import ProviderLimiter
from worker.settings import load_settings

pytestmark = pytest.mark.integration

__all__ = ["workers"]  # a fixture of these tests too

MODEL = "claude-haiku-4-5"
TOPICS = ["apple orchard harvest", "river delta flooding", "volcano eruption ash"]


class Counted:
    """A real backend, its reads of stored documents (and of whether an index exists)
    counted on their way to it."""

    COUNTED = ("stored_documents", "holds", "channels")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.inner, name)
        if name not in self.COUNTED:
            return found

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return found(*args, **kwargs)

        return counted


@pytest.fixture
def model() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as fake:
        yield fake


@pytest.fixture
def backend(tmp_path: Path) -> Counted:
    return Counted(EmbeddedBackend(tmp_path / "data"))


@pytest.fixture
def context(store: JobStore, model: FakeAnthropic, redis_url: str, backend: Any) -> WorkerContext:
    """A worker's context whose economy pipeline runs on the embedded backend (its index
    ``docs``, acme's, of 18 documents), reports to the Prometheus registry, and sends its
    prompts to the fake Messages API."""
    settings = load_settings(
        redis_url=redis_url,
        rerank_enabled=True,
        generation_model=f"anthropic:{MODEL}",
    )
    sdk = anthropic.Anthropic(base_url=model.url, api_key="sk-ant-test", max_retries=0)
    reranker = AnthropicReranker(MODEL, client=sdk)
    pipeline = build_pipeline(
        settings,
        backend=backend,
        embedder=FakeEmbedder(),
        reranker=reranker,
        recorder=PrometheusRecorder(LANE_ECONOMY),
    )
    docs = [
        DocumentIn(id=f"d{i}", text=f"{topic} notes number {i}")
        for i, topic in enumerate(TOPICS * 6)
    ]
    Runtime(pipeline).ingest("docs", "acme", docs)
    return WorkerContext(
        settings=settings,
        store=store,
        limiter=ProviderLimiter(4),
        _runtime=SimpleNamespace(economy=pipeline),  # type: ignore[arg-type]
        _batches=AnthropicMessageBatches(reranker),
    )


def _prepared(context: WorkerContext, n: int) -> tuple[BatchJob, list[str]]:
    """A batch of ``n`` items, each prepared (its prompt waiting to go), none sent yet."""
    store = context.store
    items = [
        (f"q{i}", SearchSpec(index="docs", query=TOPICS[i % 3], limit=3, include_trace=True))
        for i in range(n)
    ]
    batch = store.create_batch("acme", "docs", items, lane="economy")
    pipeline = economy.economy_pipeline(_Task(context, "chunk"))  # type: ignore[arg-type]
    for position, (qid, spec) in enumerate(items):
        store.start_item(batch.id, qid)
        economy.save_prepared(store, batch.id, qid, position, pipeline.prepare(spec, "acme"))
    return batch, [qid for qid, _ in items]


def _candidates(context: WorkerContext, batch: BatchJob, qids: list[str]) -> list[set[str]]:
    """Each item's candidates' ids, as kept when it was prepared."""
    pipeline = context.runtime.economy
    raws = context.store.economy_get(batch.id, ECONOMY_PREPARED_KEY, qids)
    return [
        {c.document.id for c in load_prepared(pipeline, json.loads(str(raw))).candidates}
        for raw in raws
    ]


@pytest.mark.parametrize("ids_per_read", [None, 5])
def test_a_page_s_candidates_are_read_together_and_deletes_still_show(
    context: WorkerContext,
    model: FakeAnthropic,
    backend: Counted,
    workers: None,
    monkeypatch: pytest.MonkeyPatch,
    ids_per_read: int | None,
) -> None:
    """Each item's candidates are read as stored when it finishes. They were read one item
    at a time: a call to the backend per item, up to 100,000 for one provider batch, in the
    poll. A page of results now reads the ids of all its items on one index together, in
    slices of ``STORED_READ_IDS``; a document deleted since the items were prepared is still
    in none of their hits."""
    if ids_per_read is not None:
        monkeypatch.setattr(finish, "STORED_READ_IDS", ids_per_read)
    batch, qids = _prepared(context, 12)
    candidates = _candidates(context, batch, qids)
    deleted = sorted(candidates[0])[0]
    assert backend.inner.delete_documents("docs", "acme", [deleted]) == 1
    _submission(context, batch, qids, "1")
    [first] = model.batches()
    backend.calls.clear()
    _mapping(context, batch, first["id"])
    distinct = len(set().union(*candidates))
    slices = 1 if ids_per_read is None else math.ceil(distinct / ids_per_read)
    assert ids_per_read is None or slices > 1  # the test reads more than one slice
    assert backend.calls["stored_documents"] == slices, backend.calls
    results = context.store.batch_results(batch.id, 0, 12)
    assert [r.status for r in results] == ["succeeded"] * 12, results
    shown = [r.payload or "" for r in results]
    holding = [text for text, ids in zip(shown, candidates, strict=True) if deleted in ids]
    assert holding  # an item had it among its candidates, as prepared
    assert all(f'"deleted_since_retrieval":["{deleted}"]' in text for text in holding), holding
    assert all(f'"id":"{deleted}"' not in text for text in shown)

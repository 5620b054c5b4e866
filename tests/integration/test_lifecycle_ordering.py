"""Upserts and deletes of the same ids are ordered by acceptance, not by execution.

A property test over the real ordering layer (the job store hands each accepted write its
version from Redis) and the real embedded backend: any interleaving of ingest, delete and
index-drop jobs, accepted in one order and run in any other, leaves exactly the documents
the last accepted operation per id implies, in both channels (BM25 and kNN), with the text
of the last accepted upsert.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes import FakeEmbedder
from worker.adapters.embedded import EmbeddedBackend
from worker.contract import DocumentIn
from worker.core.pipeline import PipelineConfig, SearchPipeline
from worker.core.types import ChannelQuery, Document, HardFilters
from worker.errors import EmbeddingModelMismatch
from worker.queue import lifecycle
from worker.queue.jobstore import IngestJob, JobStore
from worker.runtime.inprocess import Runtime

IDS = ["a", "b", "c", "d"]
TENANT = "acme"
EMBEDDER = FakeEmbedder()
_names = itertools.count()

# one operation: ("upsert", ids), ("delete", ids) or ("drop", ())
operation = st.one_of(
    st.tuples(
        st.just("upsert"), st.lists(st.sampled_from(IDS), min_size=1, max_size=4, unique=True)
    ),
    st.tuples(
        st.just("delete"), st.lists(st.sampled_from(IDS), min_size=1, max_size=4, unique=True)
    ),
    st.tuples(st.just("drop"), st.just([])),
)


def _text(doc_id: str, step: int) -> str:
    return f"word{doc_id} step{step} common"


def _accept(store: JobStore, index: str, ops: list[tuple[str, list[str]]]) -> list[IngestJob]:
    """Each operation accepted as its job, in list order (the gateway's writes)."""
    jobs = []
    for step, (kind, ids) in enumerate(ops):
        if kind == "upsert":
            docs = [DocumentIn(id=i, text=_text(i, step)) for i in ids]
            jobs.append(store.create_ingest(TENANT, index, docs))
        else:
            jobs.append(store.create_deletion(TENANT, index, ids if kind == "delete" else None))
    return jobs


def _run(backend: EmbeddedBackend, store: JobStore, job: IngestJob) -> None:
    """What the ingest task does with one job (``worker/queue/tasks/ingests.py``, ``_ingest``), on a
    worker: the same calls, on the worker's own ``Runtime`` over this backend."""
    runtime = Runtime(SearchPipeline(backend, EMBEDDER, config=PipelineConfig()))
    if job.operation == "upsert":
        runtime.ingest(
            job.index, job.tenant, store.ingest_documents(job.id) or [], version=job.version
        )
    else:
        ids = store.deletion_ids(job.id) if job.operation == "delete" else None
        lifecycle.delete(runtime, job, ids, jobs=store)


def _expected(ops: list[tuple[str, list[str]]]) -> dict[str, str]:
    """id -> text the last accepted operation per id leaves (absent: deleted or dropped)."""
    present: dict[str, str] = {}
    for step, (kind, ids) in enumerate(ops):
        if kind == "upsert":
            present.update({i: _text(i, step) for i in ids})
        elif kind == "delete":
            for i in ids:
                present.pop(i, None)
        else:
            present.clear()
    return present


def _channel_ids(backend: EmbeddedBackend, index: str) -> tuple[set[str], set[str]]:
    if not backend.channels(index, TENANT):
        return set(), set()
    query = ChannelQuery(
        index=index,
        filters=HardFilters(TENANT),
        channels=("bm25", "knn"),
        size=50,
        text=" ".join(f"word{i}" for i in IDS),
        vector=EMBEDDER.embed(["common"])[0],
    )
    hits = backend.retrieve(query).hits
    return ({h.document.id for h in hits["bm25"]}, {h.document.id for h in hits["knn"]})


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedBackend:
    return EmbeddedBackend(Path(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def jobs_store(redis_url: str) -> JobStore:
    return JobStore.from_url(redis_url)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(operation, min_size=1, max_size=8), data=st.data())
def test_the_last_accepted_write_per_id_wins_in_any_run_order(
    backend: EmbeddedBackend, jobs_store: JobStore, ops: list[tuple[str, list[str]]], data: Any
) -> None:
    index = f"order-{next(_names)}"
    jobs = _accept(jobs_store, index, ops)
    for job in data.draw(st.permutations(jobs), label="run order"):
        _run(backend, jobs_store, job)
    expected = _expected(ops)
    bm25, knn = _channel_ids(backend, index)
    assert bm25 == set(expected) and knn == set(expected)
    for doc_id in IDS:
        stored = backend.document(index, TENANT, doc_id)
        assert (stored.text if stored else None) == expected.get(doc_id)
    info = backend.index_info(index, TENANT)
    assert (info.documents if info else 0) == len(expected)
    # a redelivered job changes nothing: every write is applied at most once by version
    for job in jobs:
        _run(backend, jobs_store, job)
    assert _channel_ids(backend, index) == (set(expected), set(expected))


def test_an_unversioned_write_still_applies(backend: EmbeddedBackend) -> None:
    """Writes without a version (sift eval's in-process ingest) are applied as before."""
    docs = [Document(id="u", text="plain words", revision="")]
    assert backend.upsert("plain", TENANT, docs, EMBEDDER.embed(["plain words"])) == 1
    assert backend.delete_documents("plain", TENANT, ["u"]) == 1
    assert backend.upsert("plain", TENANT, docs, EMBEDDER.embed(["plain words"])) == 1
    assert backend.delete_index("plain", TENANT) == 1
    assert backend.index_info("plain", TENANT) is None


def _vectors(rows: int, width: int) -> list[list[float]]:
    return [[1.0 if j == i % width else 0.1 for j in range(width)] for i in range(rows)]


def test_a_stale_write_run_after_a_drop_claims_nothing_the_drop_freed(
    backend: EmbeddedBackend,
) -> None:
    """An ingest accepted before a drop and run after it (a retry, a redelivery) writes no row,
    so it must not claim the vector dimension back either: the re-ingest with another model,
    of another width, which the drop was for, goes in."""
    docs = [Document(id=f"d{i}", text=f"text {i}", revision="") for i in range(3)]
    assert backend.upsert("stale", TENANT, docs, _vectors(3, 8), version=1, model="old") == 3
    assert backend.delete_index("stale", TENANT, version=3) == 3
    assert backend.upsert("stale", TENANT, docs, _vectors(3, 8), version=2, model="old") == 0
    assert backend.upsert("stale", TENANT, docs, _vectors(3, 4), version=4, model="new") == 3
    info = backend.index_info("stale", TENANT)
    assert info is not None and info.documents == 3 and info.dimension == 4


def test_another_models_vectors_of_another_width_are_a_model_mismatch(
    backend: EmbeddedBackend,
) -> None:
    """A model change usually changes the width too: the error names the models (the job's
    `embedding_model_mismatch`), not the width of the vectors."""
    docs = [Document(id="m", text="text", revision="")]
    assert backend.upsert("models", TENANT, docs, _vectors(1, 8), version=1, model="old") == 1
    with pytest.raises(EmbeddingModelMismatch):
        backend.upsert("models", TENANT, docs, _vectors(1, 4), version=2, model="new")
    assert backend.index_info("models", TENANT).documents == 1  # type: ignore[union-attr]

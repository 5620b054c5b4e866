"""The in-process runtime: ingest and search through the pipeline, with no queue.

The Celery tasks, the evaluation harness and the benchmarks all drive this.

    runtime = build_runtime(load_settings())
    runtime.ingest("docs", tenant="acme", documents=[DocumentIn(id="1", text="...")])
    result = runtime.search(SearchSpec(index="docs", query="..."), tenant="acme")
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from worker.constants import ECONOMY_PRICE_DISCOUNT
from worker.contract import DocumentIn, SearchResult, SearchSpec
from worker.core.pipeline import BeforeModel, SearchPipeline
from worker.core.ports import AnswerKeeper
from worker.core.types import Document
from worker.runtime.bootstrap import build_pipeline
from worker.settings import Settings

# Texts per embed call: the progress a caller sees. Within a call the embedder keeps every
# core busy, so only the last few texts of each call leave a core idle (about 1% at 256).
EMBED_BATCH = 256


def revision_of(document: DocumentIn) -> str:
    """The caller's revision, or a stable digest of the content, so a re-upsert keeps it."""
    if document.revision:
        return document.revision
    content = json.dumps([document.title, document.text, document.metadata], sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def embedding_text(title: str, text: str) -> str:
    return f"{title}. {text}" if title else text


class Runtime:
    """Ingest and search for a tenant, in this process.

    ``economy`` is the same pipeline at the Message Batches price (the economy lane's two
    halves run on it); by default it reports to the standard pipeline's recorder.
    """

    def __init__(self, pipeline: SearchPipeline, economy: SearchPipeline | None = None) -> None:
        self.pipeline = pipeline
        self.economy = economy or pipeline.variant(
            config=replace(pipeline.config, price_discount=ECONOMY_PRICE_DISCOUNT),
            recorder=pipeline.recorder,
        )

    def search(
        self,
        spec: SearchSpec,
        tenant: str,
        before_model: BeforeModel | None = None,
        *,
        spent: float = 0.0,
        answers: AnswerKeeper | None = None,
    ) -> SearchResult:
        """One search; ``before_model``, ``spent`` and ``answers`` as
        :meth:`SearchPipeline.search` takes them."""
        return self.pipeline.search(spec, tenant, before_model, spent=spent, answers=answers)

    def warm_up(self) -> None:
        """Load the embedding model by embedding one text (on a machine's first start, the
        int8 graph is made here), so the first query does not wait for it."""
        self.pipeline.embedder.embed(["warm up"])

    def pace(
        self,
        stopping: Callable[[], bool] | None = None,
        canceled: Callable[[], bool] | None = None,
    ) -> None:
        """A batch item waits here for the rate budget, until ``stopping`` says the worker
        is, or ``canceled`` that its batch is (:meth:`SearchPipeline.pace`)."""
        self.pipeline.pace(stopping, canceled)

    def reranks(self, spec: SearchSpec) -> bool:
        """Whether ``spec``'s search asks the model (:meth:`SearchPipeline.reranks`)."""
        return self.pipeline.reranks(spec)

    def unpace(self) -> None:
        """A batch item paced that runs no search (:meth:`SearchPipeline.unpace`)."""
        self.pipeline.unpace()

    def ingest(
        self,
        index: str,
        tenant: str,
        documents: Sequence[DocumentIn],
        progress: Callable[[int], None] | None = None,
        *,
        version: int | None = None,
    ) -> int:
        """Embed and upsert by id; both channels change together, for the whole call in one
        write (one transaction on the embedded backend). Answers how many were written (with
        a ``version``, an id whose newer write the backend holds is skipped).

        ``progress`` hears of each embedded chunk; the write follows the last one.
        """
        if not documents:
            return 0
        vectors: list[list[float]] = []
        for start in range(0, len(documents), EMBED_BATCH):
            chunk = documents[start : start + EMBED_BATCH]
            vectors += self.pipeline.embedder.embed(
                [embedding_text(d.title, d.text) for d in chunk]
            )
            if progress is not None:
                progress(len(chunk))
        docs = [
            Document(
                id=d.id,
                text=d.text,
                title=d.title,
                revision=revision_of(d),
                metadata=dict(d.metadata),
            )
            for d in documents
        ]
        return self.pipeline.backend.upsert(
            index, tenant, docs, vectors, version=version, model=self.pipeline.embedder.model_id
        )


def build_runtime(settings: Settings, **overrides: Any) -> Runtime:
    """A runtime over real adapters; ``overrides`` pass fakes to :func:`build_pipeline`."""
    return Runtime(build_pipeline(settings, **overrides))

"""A real pipeline (the Anthropic SDK against the fake Messages API, an in-memory index) in a
worker whose process dies once, on demand, just after the model answered and before the
search's result is saved: when the file named by ``DIE_AFTER_MODEL_FLAG`` exists, the first
run to keep its model's answer (in its run claim) deletes it and exits; if the file says
``cancel``, a batch item's batch is canceled first (a cancel landing between the death and
the redelivered run). When the file named by ``CANCEL_BEFORE_MODEL_FLAG`` exists, the next
batch item to reach its check before the model call deletes it and cancels its batch first
(a cancel landing between the item's retrieval and its model call).
Every model usage the pipeline counts is appended to ``MODEL_USAGE_LOG``, one line each
(counted as the call returns, before its job can be final). Every search it counts done is
appended to ``SEARCH_DONE_LOG`` (``<job id> <outcome>``), every rerank outcome to
``RERANK_OUTCOME_LOG`` (``<job id> <outcome>``) and every retrieval figure to
``RETRIEVAL_LOG`` (``<job id> seconds bm25``, ``<job id> hits fuse``...), a batch item's id
being ``<batch id>/<query id>``, so a test reads what the metrics were told across the
worker's processes. A search's figures are counted after its result is saved, so one may
land after its test saw it final: a test reads its own job's lines (:func:`counted`). When
the file named by ``DIE_AFTER_DONE_FLAG`` exists, the first ``search_done`` of a job whose id
starts with the file's text (any job's when it is empty) deletes it and exits once it is
counted; likewise ``DIE_AFTER_OUTCOME_FLAG`` and the first ``rerank_outcome``, and
``DIE_AFTER_RETRIEVAL_FLAG`` and the first count of the candidates fusion kept (retrieval's
last figure). A test names its own job, so that an earlier test's search counted late does
not trip it. Tenant "zeta" has the same documents, and one more once the file named by
``EXTRA_DOCUMENT_FLAG`` exists (read when a process builds its runtime: an ingest that landed
between two runs of a search).

The retrieval of a process's first searches fails (``BackendUnavailable``) as many times as
the file named by ``FAIL_RETRIEVAL_FLAG`` says, if it exists when the process builds its
runtime (it is then deleted): a redelivered run whose search is retried.

``EXTRA_DOCUMENT`` is that document: it matches the queries best, so it leads the candidates."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fakes import FakeEmbedder, InMemoryBackend
from worker.contract import DocumentIn, SearchResult, SearchSpec, Usage
from worker.core.pipeline import BeforeModel
from worker.core.ports import AnswerKeeper
from worker.observability import metrics
from worker.observability.logcontext import JobIdFilter
from worker.queue.items import CANCEL_MARK_MAX_AGE_SECONDS
from worker.queue.jobstore import JobStore
from worker.runtime.bootstrap import build_reranker
from worker.runtime.inprocess import Runtime, build_runtime
from worker.settings import Settings

DOCUMENTS = [
    DocumentIn(id=f"d{i}", text=f"{word} is a word about {word} and more {word}")
    for i, word in enumerate(["alpha", "beta", "gamma", "delta", "epsilon"])
]
EXTRA_DOCUMENT = DocumentIn(id="new", text="gamma gamma gamma delta delta delta, newly ingested")


class DyingRecorder(metrics.PrometheusRecorder):
    def rerank_outcome(self, policy: str, outcome: str) -> None:
        super().rerank_outcome(policy, outcome)
        _count("RERANK_OUTCOME_LOG", "DIE_AFTER_OUTCOME_FLAG", outcome)

    def retrieval(self, backend: str, channel: str, seconds: float) -> None:
        super().retrieval(backend, channel, seconds)
        _count("RETRIEVAL_LOG", None, "seconds " + channel)

    def retrieval_hits(self, backend: str, channel: str, hits: int) -> None:
        super().retrieval_hits(backend, channel, hits)
        die = "DIE_AFTER_RETRIEVAL_FLAG" if channel == "fuse" else None  # retrieval's last
        _count("RETRIEVAL_LOG", die, "hits " + channel)

    def rerank_usage(self, model: str, usage: dict[str, int], cost_usd: float | None) -> None:
        super().rerank_usage(model, usage, cost_usd)
        with Path(os.environ["MODEL_USAGE_LOG"]).open("a") as log:
            log.write(json.dumps(usage) + "\n")

    def search_done(self, mode: str, outcome: str, seconds: float) -> None:
        super().search_done(mode, outcome, seconds)
        _count("SEARCH_DONE_LOG", "DIE_AFTER_DONE_FLAG", outcome)


def _count(log: str, die: str | None, figure: str) -> None:
    """Append ``<job id> <figure>`` to the file the variable ``log`` names; then exit if the
    file the variable ``die`` names is armed for this job (it is deleted first)."""
    job_id = _job_id()
    with Path(os.environ[log]).open("a") as out:
        out.write(f"{job_id} {figure}\n")
    if die is None:
        return
    flag = Path(os.environ[die])
    try:
        armed = job_id.startswith(flag.read_text())
    except FileNotFoundError:  # not armed, or another thread's search took it
        armed = False
    if armed:
        flag.unlink()
        os._exit(17)


def counted(log: Path, job_id: str) -> list[str]:
    """The figures ``log`` (``SEARCH_DONE_LOG``...) holds for the job ``job_id``, in order
    (none before the worker's first)."""
    text = log.read_text() if log.exists() else ""
    lines = (line.partition(" ") for line in text.splitlines())
    return [figure for job, _, figure in lines if job == job_id]


def _job_id() -> str:
    """The job this thread works on, as its log records name it ("-" outside one)."""
    record = logging.makeLogRecord({})
    JobIdFilter().filter(record)
    return str(record.job_id)


@dataclass(frozen=True)
class DyingKeeper:
    """The run claim's keeper, dying once just after it kept the model's answer. Its run's
    figures are recorded as the worker records them, so each is the job the worker's log
    names as it is recorded (a batch item's once the item is finished)."""

    inner: AnswerKeeper

    def saved(self) -> Mapping[str, Any] | None:
        return self.inner.saved()

    def slot_held(self, waited: float, ran: float = 0.0) -> None:
        self.inner.slot_held(waited, ran)

    def later(self, figures: Sequence[Callable[[], None]]) -> None:
        self.inner.later(figures)

    def save(self, answer: Mapping[str, Any]) -> None:
        self.inner.save(answer)
        flag = Path(os.environ["DIE_AFTER_MODEL_FLAG"])
        if flag.exists():
            if flag.read_text() == "cancel":
                _cancel_running_batch()
            flag.unlink()
            os._exit(17)  # no cleanup, no ack: as an OOM kill would


class DyingRuntime(Runtime):
    def search(
        self,
        spec: SearchSpec,
        tenant: str,
        before_model: BeforeModel | None = None,
        *,
        spent: float = 0.0,
        answers: AnswerKeeper | None = None,
    ) -> SearchResult:
        keeper = DyingKeeper(answers) if answers is not None else None
        check = before_model
        if check is not None:

            def before_model(billed: Usage | None) -> None:
                flag = Path(os.environ["CANCEL_BEFORE_MODEL_FLAG"])
                if flag.exists():
                    flag.unlink()
                    _cancel_running_batch()
                    time.sleep(2 * CANCEL_MARK_MAX_AGE_SECONDS)  # past the process's view
                check(billed)

        return super().search(spec, tenant, before_model, spent=spent, answers=keeper)


def _cancel_running_batch() -> None:
    """Cancel the batch of the item this thread runs."""
    store = JobStore.from_url(os.environ["SIFT_REDIS_URL"])
    assert store.cancel_batch(_job_id().split("/")[0]) == (0, False)  # "batch id/query id"


def build(settings: Settings) -> Runtime:
    backend = InMemoryBackend()
    failing = os.environ.get("FAIL_RETRIEVAL_FLAG")
    if failing is not None and Path(failing).exists():
        backend.fail_next = int(Path(failing).read_text())
        Path(failing).unlink()
    built = build_runtime(
        settings,
        backend=backend,
        embedder=FakeEmbedder(),
        reranker=build_reranker(settings),
        recorder=DyingRecorder(),
    )
    runtime = DyingRuntime(built.pipeline, built.economy)
    runtime.ingest("docs", "acme", DOCUMENTS)
    extra = os.environ.get("EXTRA_DOCUMENT_FLAG")
    changed = extra is not None and Path(extra).exists()
    runtime.ingest("docs", "zeta", [*DOCUMENTS, *([EXTRA_DOCUMENT] if changed else [])])
    return runtime

"""A search's retrieval (:class:`Retrieval`): the index probe and its settings, the channels
asked under the deadline, then admission and fusion into the candidates, with its figures
and the trace's retrieval part."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from worker.constants import POLICY_ID
from worker.contract import Channel, SearchSpec
from worker.core.budget import MIN_ATTEMPT_SECONDS, Deadline, call_within_budget
from worker.core.catalog import SearchSettings
from worker.core.fusion import Fusion, FusionOverride, admit, fuse, fusion_levels, resolve_fusion
from worker.core.pipeline._config import PipelineConfig
from worker.core.ports import (
    AnswerKeeper,
    Embedder,
    IndexSettingsSource,
    Recorder,
    SearchBackend,
)
from worker.core.query import (
    bm25_cut,
    channel_window,
    check_model,
    coarse_limit,
    select_channels,
)
from worker.core.types import Candidate, ChannelQuery, ChannelResults, HardFilters, IndexProbe
from worker.errors import DeadlineExceeded, SiftError


@dataclass(frozen=True, slots=True)
class Retrieval:
    """A search's retrieval over the pipeline's ports as they are when it is made
    (:meth:`SearchPipeline._retrieval`: one made for each search, so a port swapped on the
    pipeline in place is the one asked). ``cpu_slots`` are the slots the first half holds
    one of, on ``held`` (its ``with``): a retry's back-off lets it go."""

    backend: SearchBackend
    embedder: Embedder
    index_settings: IndexSettingsSource | None
    config: PipelineConfig
    recorder: Recorder
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    cpu_slots: AbstractContextManager[Any]
    held: ExitStack
    answers: AnswerKeeper | None = None  # told when a retry holds the slot again

    def run(
        self,
        spec: SearchSpec,
        tenant: str,
        query: str,
        reranking: bool,
        deadline: Deadline,
        figures: list[Callable[[], None]],
    ) -> tuple[list[Candidate], dict[str, Any]]:
        """The candidates for the normalised ``query`` (as many as a rerank, if ``reranking``,
        or the result needs) and the trace so far; the figures retrieval makes (each stage's
        duration and hits) are appended to ``figures``, for the caller to record."""
        probe = self._probe(spec.index, tenant, deadline)
        available = probe.channels
        stored = SearchSettings()
        if available and self.index_settings is not None:  # a missing index has none
            stored = self.index_settings.get(spec.index, tenant)
        asked = FusionOverride.from_spec(spec.fusion)
        fusion = resolve_fusion(self.config.fusion, asked, stored.fusion)
        channels = select_channels(spec.mode, spec.index, available, fusion)
        check_model(spec.index, channels, probe.model, self.embedder.model_id)
        limit_from, candidate_limit = chosen_limit(
            spec.candidate_limit, stored.candidate_limit, self.config.candidate_limit
        )
        coarse = coarse_limit(spec.limit, candidate_limit, reranking)
        vector = None
        seconds: dict[str, float] = {}
        if "knn" in channels:
            started = self.clock()
            vector = self.embedder.embed([query])[0]
            seconds["embed"] = self.clock() - started
            figures.append(
                partial(self.recorder.retrieval, self.backend.name, "embed", seconds["embed"])
            )
        bm25 = bm25_cut(query)  # its first words: the BM25 channels read no more
        channel_query = ChannelQuery(
            index=spec.index,
            filters=HardFilters(tenant=tenant, fields=dict(spec.filters)),
            channels=channels,
            size=channel_window(coarse),
            text=bm25.text,  # its first words: the BM25 channels read no more
            vector=vector,
            weights={c: fusion.weight(c) for c in channels},
            rank_constant=fusion.rank_constant,
            method=fusion.method,
        )
        results = self._retrieve(channel_query, deadline)
        seconds.update(results.seconds)
        candidates = self._candidates(results, coarse, fusion, channels, seconds)
        self._count_retrieval(results, seconds, len(candidates), figures)
        trace: dict[str, Any] = {
            "policy": POLICY_ID if reranking else None,
            "query": query,
            "mode": spec.mode,
            "fusion": {
                **fusion.as_dict(),
                "channels": list(channels),
                "from": fusion_levels(asked, stored.fusion),
            },
            "candidate_limit": {"value": candidate_limit, "from": limit_from},
            "coarse_limit": coarse,
            "channel_window": channel_query.size,
            "channel_counts": {channel: len(hits) for channel, hits in results.hits.items()},
            # the words the BM25 channel searched, and whether the query had more (None: the
            # search had no BM25 channel)
            "bm25_words": bm25.words if "bm25" in channels else None,
            "bm25_query_truncated": bm25.truncated if "bm25" in channels else None,
            "fused_by_backend": results.fused is not None,
            "retrieval_seconds": seconds,  # embed, each channel, fuse: in the order they ran
        }
        return candidates, trace

    def _probe(self, index: str, tenant: str, deadline: Deadline) -> IndexProbe:
        """The index's channels, asked within what is left of the deadline, as retrieval is
        (a run after a task retry or a lost worker may have little left): a probe that
        runs out of it is the deadline's failure, not the backend's."""
        try:
            return self.backend.probe(
                index, tenant, timeout_seconds=max(MIN_ATTEMPT_SECONDS, deadline.remaining())
            )
        except SiftError as error:
            if error.retryable and deadline.remaining() < MIN_ATTEMPT_SECONDS:
                raise DeadlineExceeded(
                    f"the search deadline of {deadline.seconds:g}s ran out during the "
                    f"index probe: {error.message}"
                ) from error
            raise

    def _candidates(
        self,
        results: ChannelResults,
        coarse: int,
        fusion: Fusion,
        channels: Sequence[Channel],
        seconds: dict[str, float],
    ) -> list[Candidate]:
        """The ``coarse`` first candidates of the channels' ``results``: in the backend's own
        order when it fused them, else admitted and fused here with ``fusion`` over
        ``channels``, a stage timed on its own (``fuse``, added to ``seconds``)."""
        if results.fused is not None:  # the backend fused by itself: keep its order
            candidates = [
                Candidate(hit.document, rank, hit.score, {}, {})
                for rank, hit in enumerate(results.fused[:coarse], start=1)
            ]
        else:
            started = self.clock()
            admitted = admit(results.hits, self.config.vector_min_similarity)
            candidates = fuse(admitted, limit=coarse, fusion=fusion.over(channels))
            seconds["fuse"] = self.clock() - started
        return candidates

    def _count_retrieval(
        self,
        results: ChannelResults,
        seconds: Mapping[str, float],
        kept: int,
        figures: list[Callable[[], None]],
    ) -> None:
        """Retrieval's figures, appended to ``figures``: each channel's and the fusion's
        ``seconds`` (the embedding's are counted as it ends), each channel's hits and the
        ``kept`` candidates, so the metrics show what each stage gave the next."""
        backend, recorder = self.backend.name, self.recorder
        for stage, took in seconds.items():
            if stage != "embed":
                figures.append(partial(recorder.retrieval, backend, stage, took))
        for channel, hits in results.hits.items():
            figures.append(partial(recorder.retrieval_hits, backend, channel, len(hits)))
        figures.append(partial(recorder.retrieval_hits, backend, "fuse", kept))

    def _retrieve(self, query: ChannelQuery, deadline: Deadline) -> ChannelResults:
        def attempt(timeout: float) -> ChannelResults:
            return self.backend.retrieve(replace(query, timeout_seconds=timeout))

        return call_within_budget(
            attempt,
            deadline=deadline,
            max_attempts=self.config.backend_max_attempts,
            attempt_timeout=deadline.remaining(),
            sleep=partial(self._sleep_off_slot, deadline),
            initial_backoff=0.05,
            max_backoff=1.0,
        )

    def _sleep_off_slot(self, deadline: Deadline, seconds: float) -> None:
        """A retrieval retry's back-off: the first half's CPU slot is let go while it waits.
        The wait to hold one again is left out of ``deadline``, as the first one is
        (:meth:`SearchPipeline.prepare`): the slot's queue is the item pool's, where hundreds
        of a batch's items may wait; charged, a retry (an embedded backend's ``SQLITE_BUSY``)
        failed ``deadline_exceeded`` behind them before any model was asked. So does the run's
        claim (``answers``), as it does the first wait's, or a copy of the search's message
        took the claim over past its lease, and made a second model call. Held again on the
        first half's ``held``: a wait to hold it ended by an exception (a Ctrl-C in ``sift
        eval``) holds none, and the first half's end lets go of none, where it let go of a slot
        another thread held (counted free under it; that thread's release then raised)."""
        self.held.close()
        try:
            self.sleep(seconds)
        finally:
            asked = self.clock()
            self.held.enter_context(self.cpu_slots)
            waited = self.clock() - asked
            deadline.leave_out(waited)
        if self.answers is not None:  # its run claim leaves the wait out too
            self.answers.slot_held(waited, deadline.run_elapsed())


def chosen_limit(request: int | None, index: int | None, default: int) -> tuple[str, int]:
    """The candidate window a search uses and where it comes from: the request's own, else
    the index's stored one, else the deployment's default.

    >>> chosen_limit(None, 50, 30), chosen_limit(10, 50, 30), chosen_limit(None, None, 30)
    (('index', 50), ('request', 10), ('default', 30))
    """
    return next(
        (level, value)
        for level, value in (("request", request), ("index", index), ("default", default))
        if value is not None
    )

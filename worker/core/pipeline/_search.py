""":class:`SearchPipeline`: one search end to end under one deadline, over the ports."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any

from worker.constants import POLICY_ID
from worker.contract import Channel, RerankInfo, SearchResult, SearchSpec, Usage
from worker.core.budget import (
    DEFAULT_429_PAUSE_SECONDS,
    MIN_ATTEMPT_SECONDS,
    Deadline,
    call_within_budget,
)
from worker.core.catalog import SearchSettings
from worker.core.cost import price_for
from worker.core.fusion import Fusion, FusionOverride, admit, fuse, fusion_levels, resolve_fusion
from worker.core.pipeline._config import PipelineConfig
from worker.core.pipeline._hits import _hit, _trace_candidates, stage_seconds
from worker.core.pipeline._prepared import Prepared, shown_digest
from worker.core.pipeline._run import RerankRun, dump_run, load_run, usage_by_type
from worker.core.policy import build_prompt
from worker.core.ports import (
    AnswerKeeper,
    Embedder,
    IndexSettingsSource,
    NullRecorder,
    RateBudget,
    Recorder,
    Reranker,
    SearchBackend,
)
from worker.core.query import (
    channel_window,
    check_model,
    coarse_limit,
    normalise_query,
    select_channels,
)
from worker.core.ranks import normalise_positions
from worker.core.types import (
    BudgetGrant,
    Candidate,
    ChannelQuery,
    ChannelResults,
    HardFilters,
    IndexProbe,
    RerankPrompt,
    RerankReply,
    TokenUsage,
)
from worker.errors import (
    AttemptOutcome,
    Canceled,
    DeadlineExceeded,
    InvalidRequest,
    RerankAttemptError,
    RerankFailed,
    SiftError,
)


class SearchPipeline:
    """Runs one search end to end under one deadline.

    >>> pipeline = SearchPipeline(backend, embedder, reranker, PipelineConfig())  # doctest: +SKIP
    >>> pipeline.search(SearchSpec(index="docs", query="who won"), tenant="acme")  # doctest: +SKIP

    The two halves are public for a lane that defers the model call (the economy lane sends
    the prompts as a provider batch): :meth:`prepare` retrieves, fuses and builds the prompt;
    :meth:`finish` applies the same normalisation, fallback and failure rules to whatever the
    model answered. :meth:`search` is exactly ``prepare`` + the model call + ``finish``.
    """

    def __init__(
        self,
        backend: SearchBackend,
        embedder: Embedder,
        reranker: Reranker | None = None,
        config: PipelineConfig | None = None,
        recorder: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        cpu_slots: AbstractContextManager[Any] | None = None,
        rate_budget: RateBudget | None = None,
        index_settings: IndexSettingsSource | None = None,
    ) -> None:
        """``cpu_slots``: one is held through each first half (:mod:`worker.queue.slots`).
        ``rate_budget``: the provider's limits shared by every process; each attempt of the
        standard lane waits for its share first (:mod:`worker.adapters.rate_budget`).
        ``index_settings``: where each search reads its index's own fusion and candidate
        window (none: the config's defaults, under the request's own)."""
        self.backend = backend
        self.embedder = embedder
        self.reranker = reranker
        self.config = config or PipelineConfig()
        self.recorder: Recorder = recorder or NullRecorder()
        self._clock = clock
        self._sleep = sleep
        self._cpu_slots = cpu_slots or nullcontext()
        self.rate_budget = rate_budget
        self.index_settings = index_settings
        self._call_seconds = 0.0  # an average of answered calls' time, with the budget on

    def variant(self, *, config: PipelineConfig, recorder: Recorder | None) -> SearchPipeline:
        """The same ports with another config and recorder (the economy lane's price and lane)."""
        return SearchPipeline(
            self.backend,
            self.embedder,
            self.reranker,
            config,
            recorder,
            clock=self._clock,
            sleep=self._sleep,
            cpu_slots=self._cpu_slots,
            rate_budget=self.rate_budget,
            index_settings=self.index_settings,
        )

    # -- the algorithm ------------------------------------------------------------

    def search(
        self,
        spec: SearchSpec,
        tenant: str,
        before_model: Callable[[], None] | None = None,
        *,
        spent: float = 0.0,
        answers: AnswerKeeper | None = None,
    ) -> SearchResult:
        """``before_model`` runs after the first half, just before the model call (not when
        none is needed); it may raise :class:`~worker.errors.Canceled` to stop there (a batch
        item whose batch was canceled meanwhile), and the search is then not counted as done.
        ``spent``: the deadline's seconds earlier runs of this search used (a retry runs in
        what is left of the one deadline). ``answers``: where the model's answer is kept as
        soon as the call returns; one an earlier run kept (its process died before the result
        was saved) is finished instead of calling the model again: the call was paid for and
        counted once, by the run that made it (no attempt, token or cost is counted here;
        ``before_model`` is not run either: the call it guards was made). Only if it answered
        these very candidates (:func:`shown_digest`): its positions number the ones it was
        shown, and an index changed between the two runs gives others (then it is called
        again, and the run shows both calls, the first billed too:
        :meth:`RerankRun.billed_with`). With ``answers``, the search's own figures (its
        retrieval's, its outcome and duration, the model answer's) are handed to it to record
        once the result is saved (:meth:`AnswerKeeper.later`)."""
        deadline = Deadline(self.config.deadline_seconds, self._clock, spent)
        outcome: str | None = "error"
        figures: list[Callable[[], None]] = []
        try:
            with self._cpu_slots:
                prepared = self._prepare(spec, tenant, deadline, figures)
            if prepared.result is not None:
                result = prepared.result
                if prepared.skipped:  # counted with the search's other figures: once
                    figures.append(partial(self.recorder.rerank_outcome, POLICY_ID, "skipped"))
            else:
                kept = answers.saved() if answers is not None else None
                shown = shown_digest(prepared.candidates)
                if kept is not None and kept.get("shown") == shown:
                    run = load_run(kept)
                else:  # none kept, or kept for other candidates (the index changed meanwhile)
                    if before_model is not None:
                        try:
                            before_model()
                        except Canceled:
                            outcome = None
                            raise
                    run = self._call_model(prepared, deadline)
                    if kept is not None:  # for other candidates, and paid for too
                        run = run.billed_with(load_run(kept))
                    if answers is not None and run.job_usage().requests:  # a call was billed
                        answers.save({**dump_run(run), "shown": shown})
                result = self._finish(prepared, run, figures)
            outcome = "fallback" if result.rerank.fallback_reason else "ok"
            return result
        finally:
            if outcome is not None:
                seconds = deadline.run_elapsed()
                figures.append(partial(self.recorder.search_done, spec.mode, outcome, seconds))
            if answers is not None:
                answers.later(figures)
            else:
                _record(figures)

    def pace(self) -> None:
        """Wait, before a search starts, until the rate budget's queue is short enough for it
        to be served well within its deadline (a third of it). For a batch item, which no
        caller waits on: without it, a batch larger than the budget serves in a deadline
        would run its surplus through as ``budget_exhausted`` fallbacks. Not for interactive
        searches: their wait counts against their deadline."""
        if self.rate_budget is None:
            return
        room = self.config.deadline_seconds / 3
        while (excess := self.rate_budget.backlog() - room) > 0:
            # spread the re-checks: the queue frees at the limit's rate, not all at once
            self._sleep(min(excess, 1.0) + random.uniform(0.0, 0.5))

    def prepare(
        self, spec: SearchSpec, tenant: str, *, later: list[Callable[[], None]] | None = None
    ) -> Prepared:
        """The first half: retrieval and fusion under the search deadline, then the prompt.

        A search that needs no model call comes back final (``result`` set, and counted as
        done); otherwise hand ``prompt`` to the model and the answer to :meth:`finish`.
        ``later``: where the first half's figures (its retrieval's, and a final result's: the
        search done, a ``skipped`` outcome) go instead, for the caller to record once the
        result, or the prepared search, is saved (a run again after a crash before the save
        then counts them once).
        """
        deadline = Deadline(self.config.deadline_seconds, self._clock)
        figures: list[Callable[[], None]] = []
        try:
            with self._cpu_slots:
                prepared = self._prepare(spec, tenant, deadline, figures)
        except BaseException:
            _record(figures)
            self.recorder.search_done(spec.mode, "error", deadline.elapsed())
            raise
        prepared.seconds = deadline.elapsed()
        if prepared.skipped:
            figures.append(partial(self.recorder.rerank_outcome, POLICY_ID, "skipped"))
        if prepared.result is not None:
            figures.append(partial(self.recorder.search_done, spec.mode, "ok", prepared.seconds))
        if later is None:
            _record(figures)
        else:
            later.extend(figures)
        return prepared

    def finish(
        self,
        prepared: Prepared,
        run: RerankRun,
        *,
        later: list[Callable[[], None]] | None = None,
    ) -> SearchResult:
        """The second half: normalise the model's positions, or apply the failure policy.

        Raises RerankFailed under ``fail_closed`` when ``run`` ended in a failure.
        ``later``: where its figures (the search done, the model answer's) go instead, for
        the caller to record once the result is saved (a finish run again after a crash
        before the save then counts them once).
        """
        started = self._clock()
        outcome = "error"
        figures: list[Callable[[], None]] = []
        try:
            result = self._finish(prepared, run, figures)
            outcome = "fallback" if result.rerank.fallback_reason else "ok"
            return result
        finally:
            seconds = prepared.seconds + self._clock() - started
            figures.append(partial(self.recorder.search_done, prepared.spec.mode, outcome, seconds))
            if later is None:
                _record(figures)
            else:
                later.extend(figures)

    def _prepare(
        self,
        spec: SearchSpec,
        tenant: str,
        deadline: Deadline,
        figures: list[Callable[[], None]],
    ) -> Prepared:
        """Retrieval and fusion, then the prompt; the figures they make (each stage's
        duration and hits) are appended to ``figures``, for the caller to record."""
        query = normalise_query(spec.query)
        reranking = self._reranking(spec)
        probe = self._probe(spec.index, tenant, deadline)
        available = probe.channels
        stored = SearchSettings()
        if available and self.index_settings is not None:  # a missing index has none
            stored = self.index_settings.get(spec.index, tenant)
        asked = FusionOverride.from_spec(spec.fusion)
        fusion = resolve_fusion(self.config.fusion, asked, stored.fusion)
        channels = select_channels(spec.mode, spec.index, available, fusion)
        check_model(spec.index, channels, probe.model, self.embedder.model_id)
        limit_from, candidate_limit = next(
            (level, value)
            for level, value in (
                ("request", spec.candidate_limit),
                ("index", stored.candidate_limit),
                ("default", self.config.candidate_limit),
            )
            if value is not None
        )
        coarse = coarse_limit(spec.limit, candidate_limit, reranking)

        vector = None
        seconds: dict[str, float] = {}
        if "knn" in channels:
            started = self._clock()
            vector = self.embedder.embed([query])[0]
            seconds["embed"] = self._clock() - started
            figures.append(
                partial(self.recorder.retrieval, self.backend.name, "embed", seconds["embed"])
            )
        channel_query = ChannelQuery(
            index=spec.index,
            filters=HardFilters(tenant=tenant, fields=dict(spec.filters)),
            channels=channels,
            size=channel_window(coarse),
            text=query,
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
            "fused_by_backend": results.fused is not None,
            "retrieval_seconds": seconds,  # embed, each channel, fuse: in the order they ran
        }

        if not reranking or not candidates:
            info = RerankInfo(applied=False, policy=None, fallback_reason=None)
            if spec.include_trace:
                trace["candidates"] = _trace_candidates(candidates, None)
            result = self._result(candidates[: spec.limit], info, Usage(), spec, trace)
            return Prepared(spec, candidates, trace, result=result, skipped=reranking)
        assert self.reranker is not None
        prompt = self.build_prompt(query, spec, candidates)
        if spec.include_trace:  # a dict per candidate: built only for a trace that is shown
            trace["candidates"] = _trace_candidates(candidates, prompt)
        trace["model"] = self.reranker.model
        trace["effort"] = self.reranker.effort  # as sent: None when the model takes none
        return Prepared(spec, candidates, trace, prompt=prompt)

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
            started = self._clock()
            admitted = admit(results.hits, self.config.vector_min_similarity)
            candidates = fuse(admitted, limit=coarse, fusion=fusion.over(channels))
            seconds["fuse"] = self._clock() - started
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

    def build_prompt(
        self, query: str, spec: SearchSpec, candidates: Sequence[Candidate]
    ) -> RerankPrompt:
        """The ``listwise.v1`` prompt for fused ``candidates``; a pure function of its inputs."""
        return build_prompt(
            query,
            [(c.document.title, c.document.text) for c in candidates],
            k=spec.limit,
            max_chars=self.config.candidate_max_chars,
            thinking_tokens=self.config.thinking_tokens,
            tokens_per_position=self.config.tokens_per_position,
        )

    def _reranking(self, spec: SearchSpec) -> bool:
        wanted = self.config.rerank_enabled if spec.rerank is None else spec.rerank
        if wanted and self.reranker is None:
            if spec.rerank:
                raise InvalidRequest(
                    "rerank", "this deployment has no generation model (SIFT_GENERATION_MODEL)"
                )
            return False
        return wanted

    def _retrieve(self, query: ChannelQuery, deadline: Deadline) -> ChannelResults:
        def attempt(timeout: float) -> ChannelResults:
            return self.backend.retrieve(replace(query, timeout_seconds=timeout))

        results = call_within_budget(
            attempt,
            deadline=deadline,
            max_attempts=self.config.backend_max_attempts,
            attempt_timeout=deadline.remaining(),
            sleep=self._sleep_off_slot,
            initial_backoff=0.05,
            max_backoff=1.0,
        )
        return results

    def _sleep_off_slot(self, seconds: float) -> None:
        """A retrieval retry's back-off: the first half's CPU slot is let go while it waits."""
        self._cpu_slots.__exit__(None, None, None)
        try:
            self._sleep(seconds)
        finally:
            self._cpu_slots.__enter__()

    def _call_model(self, prepared: Prepared, deadline: Deadline) -> RerankRun:
        """The standard lane's model call: attempts under the retry budget and the deadline."""
        assert self.reranker is not None and prepared.prompt is not None
        prompt = prepared.prompt
        run = RerankRun()
        started = self._clock()
        try:
            run.reply = call_within_budget(
                lambda timeout: self._attempt(prompt, timeout, run, deadline),
                deadline=deadline,
                max_attempts=self.config.max_requests,
                attempt_timeout=self.config.attempt_timeout_seconds,
                sleep=self._sleep,
            )
        except (RerankAttemptError, DeadlineExceeded) as error:
            run.failure = error
        run.seconds = self._clock() - started
        return run

    def _finish(
        self, prepared: Prepared, run: RerankRun, figures: list[Callable[[], None]]
    ) -> SearchResult:
        """The result of ``run``; the figures it makes (the model answer's duration and
        outcome) are appended to ``figures``, for the caller to record."""
        assert self.reranker is not None
        model, recorder = self.reranker.model, self.recorder
        spec, candidates, trace = prepared.spec, prepared.candidates, prepared.trace
        usage = run.job_usage()
        trace.update(attempts=run.attempts, rerank_seconds=run.seconds)
        if spec.include_trace:  # the trace's parts built per candidate or model: only if shown
            trace["usage"] = usage.model_dump()
        trace["returned_positions"] = list(run.returned) if run.returned is not None else None
        reply = run.reply
        if reply is None:
            failure = run.failure
            assert failure is not None
            reason = (
                failure.outcome.value if isinstance(failure, RerankAttemptError) else "deadline"
            )
            trace["fallback_reason"] = f"error:{reason}"
            figures.append(partial(recorder.rerank_done, model, reason, run.seconds))
            if self.config.failure_policy == "fail_closed":
                figures.append(partial(recorder.rerank_outcome, POLICY_ID, "failed"))
                raise RerankFailed(reason, failure.message, usage) from failure
            figures.append(partial(recorder.rerank_outcome, POLICY_ID, "fallback_error"))
            info = RerankInfo(applied=False, policy=POLICY_ID, fallback_reason=f"error:{reason}")
            return self._result(candidates[: spec.limit], info, usage, spec, trace)

        figures.append(partial(recorder.rerank_done, model, "ok", run.seconds))
        normalised = normalise_positions(reply.positions, len(candidates), spec.limit)
        trace["kept_positions"] = list(normalised.kept)
        trace["dropped_positions"] = [
            {"value": d.value, "reason": d.reason} for d in normalised.dropped
        ]
        if not normalised.kept:
            trace["fallback_reason"] = "no_valid_ranks"
            figures.append(partial(recorder.rerank_outcome, POLICY_ID, "fallback_no_valid_ranks"))
            info = RerankInfo(applied=False, policy=POLICY_ID, fallback_reason="no_valid_ranks")
            return self._result(candidates[: spec.limit], info, usage, spec, trace)

        figures.append(partial(recorder.rerank_outcome, POLICY_ID, "applied"))
        trace["fallback_reason"] = None
        chosen = [candidates[position - 1] for position in normalised.kept]
        info = RerankInfo(applied=True, policy=POLICY_ID, fallback_reason=None)
        return self._result(chosen, info, usage, spec, trace)

    def _attempt(
        self, prompt: RerankPrompt, timeout: float, run: RerankRun, deadline: Deadline
    ) -> RerankReply:
        assert self.reranker is not None
        started = self._clock()
        grant: BudgetGrant | None = None
        detail: dict[str, Any] = {}
        if self.rate_budget is not None:
            grant = self._wait_for_budget(prompt, run, deadline)
            timeout = min(timeout, deadline.remaining())
            detail["budget_wait_seconds"] = grant.wait
        sent = self._clock()
        try:
            reply = self.reranker.rerank(prompt, timeout)
        except RerankAttemptError as error:
            usage = getattr(error, "usage", None)
            usage = usage if isinstance(usage, TokenUsage) else None
            if grant is not None:
                self._settle_failed(grant, error, usage)
            if not error.sent:
                detail["sent"] = False
            self.record_attempt(run, error.outcome, usage, self._clock() - started, **detail)
            raise
        if grant is not None and self.rate_budget is not None:
            self.rate_budget.settle(grant, reply.usage)
            self._call_seconds += 0.1 * (self._clock() - sent - self._call_seconds)
        run.returned = reply.positions
        self.record_attempt(run, AttemptOutcome.OK, reply.usage, self._clock() - started, **detail)
        return reply

    def _settle_failed(
        self, grant: BudgetGrant, error: RerankAttemptError, usage: TokenUsage | None
    ) -> None:
        """Settle a failed attempt's reservation with the rate budget. One refused before any
        token was read (a 429, or never sent) gives its tokens back, and its request too when
        the provider never saw it; the provider's 429 pauses every worker, a local hold no
        one. Any other failure is settled on the ``usage`` it reported."""
        assert self.rate_budget is not None
        if error.outcome is AttemptOutcome.RATE_LIMITED or not error.sent:
            self.rate_budget.settle(grant, TokenUsage(), sent=error.sent)
            if error.sent:
                self.rate_budget.pause(error.retry_after or DEFAULT_429_PAUSE_SECONDS)
        else:
            self.rate_budget.settle(grant, usage)

    def _wait_for_budget(
        self, prompt: RerankPrompt, run: RerankRun, deadline: Deadline
    ) -> BudgetGrant:
        """Reserve the attempt's share of the rate budget and wait until it may be sent. When
        the budget frees it too late for the call to fit in the search's deadline (twice the
        answered calls' average time), nothing is reserved and nothing sent: the attempt is
        ``budget_exhausted``, which the failure policy takes from there. A call sent with
        less time than it takes would be charged by the provider and time out."""
        assert self.rate_budget is not None
        # the call must still fit after the wait: twice what answered calls took, on average
        needed = max(MIN_ATTEMPT_SECONDS, 2 * self._call_seconds)
        max_wait = max(0.0, deadline.remaining() - needed)
        grant = self.rate_budget.reserve(prompt, max_wait)
        if not grant.admitted:
            self.record_attempt(
                run, AttemptOutcome.BUDGET_EXHAUSTED, None, 0.0, budget_wait_seconds=grant.wait
            )
            raise RerankAttemptError(
                AttemptOutcome.BUDGET_EXHAUSTED,
                f"the provider's rate budget frees this call in {grant.wait:.1f}s, "
                f"past the search deadline ({max(0.0, deadline.remaining()):.1f}s left)",
            )
        if grant.wait > 0:
            self._sleep(grant.wait)
        return grant

    def record_attempt(
        self,
        run: RerankRun,
        outcome: AttemptOutcome,
        usage: TokenUsage | None,
        seconds: float,
        **detail: Any,
    ) -> None:
        """Count one model attempt in ``run``: its class, its usage priced at this pipeline's
        price (and discount), its metrics. ``detail`` goes into the attempt's trace entry. A
        call that reported usage for a model with no price is also counted as unpriced. The
        usage goes to the metrics here, not when the rerank ends: it was billed whatever
        becomes of the search."""
        cost = self.add_attempt(run, outcome, usage, seconds, **detail)
        self.count_attempt(outcome, usage, cost)

    def add_attempt(
        self,
        run: RerankRun,
        outcome: AttemptOutcome,
        usage: TokenUsage | None,
        seconds: float,
        **detail: Any,
    ) -> float | None:
        """:meth:`record_attempt`'s part in ``run`` alone; answers the call's cost. A lane that
        must save the run before the metrics count it (so that a task run again after a
        crash between the two does not count it twice) calls :meth:`count_attempt` after."""
        assert self.reranker is not None
        cost: float | None = 0.0
        if usage is not None:
            price = price_for(self.reranker.model, self.config.prices)
            cost = run.add_usage(usage, price, self.config.price_discount)
        run.attempts.append(
            {"n": len(run.attempts) + 1, "outcome": outcome.value, "seconds": seconds, **detail}
        )
        return cost

    def count_attempt(
        self, outcome: AttemptOutcome, usage: TokenUsage | None, cost: float | None
    ) -> None:
        """:meth:`record_attempt`'s part in the metrics: the attempt, its tokens and ``cost``
        (None: the model has no price, counted as unpriced)."""
        assert self.reranker is not None
        if usage is not None:
            self.recorder.rerank_usage(self.reranker.model, usage_by_type(usage), cost)
            if cost is None:
                self.recorder.rerank_unpriced(self.reranker.model)
        self.recorder.rerank_attempt(self.reranker.model, outcome.value)

    @staticmethod
    def _result(
        chosen: Sequence[Candidate],
        info: RerankInfo,
        usage: Usage,
        spec: SearchSpec,
        trace: dict[str, Any],
    ) -> SearchResult:
        # one validation of the whole result, its hits as plain data: the same checks as a
        # Hit, Ranks and Scores built one by one (three model inits a hit), a third of the CPU
        result = SearchResult.model_validate(
            {
                "hits": [_hit(candidate, final) for final, candidate in enumerate(chosen, start=1)],
                "rerank": info,
                "usage": usage,
                "trace": trace if spec.include_trace else None,
            }
        )
        result._stage_seconds = stage_seconds(trace)
        return result


def _record(figures: Sequence[Callable[[], None]]) -> None:
    for record in figures:
        record()

""":class:`SearchPipeline`: one search end to end under one deadline, over the ports."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from functools import partial
from typing import Any

from worker.constants import POLICY_ID
from worker.contract import RerankInfo, SearchResult, SearchSpec, Usage
from worker.core.budget import Deadline
from worker.core.pipeline._config import PipelineConfig
from worker.core.pipeline._hits import _trace_candidates
from worker.core.pipeline._model_calls import BeforeModel, CallTime, ModelCalls
from worker.core.pipeline._prepared import Prepared, shown_digest
from worker.core.pipeline._result import (
    answer_outcome,
    build_result,
    no_model_result,
    rerank_result,
)
from worker.core.pipeline._retrieval import Retrieval
from worker.core.pipeline._run import RerankRun, dump_run, load_run
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
from worker.core.query import normalise_query
from worker.core.types import Candidate, RerankPrompt, TokenUsage
from worker.errors import AttemptOutcome, Canceled, HandedBack, RunTakenOver

# a paced batch item's checks (SearchPipeline.pace): is its worker stopping, its batch canceled
PaceChecks = tuple[Callable[[], bool] | None, Callable[[], bool] | None]


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
        """``cpu_slots``: one is held through each first half (:mod:`worker.runtime.slots`).
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
        self._call_time = CallTime()  # an average of answered calls' time, with the budget on
        # per thread: the stop and cancel checks of the batch item it paced (pace), whose
        # search, once its CPU slot is held, waits again while the breaker is shut
        self._paced = threading.local()

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

    def _model_calls(self) -> ModelCalls:
        """The standard lane's model calls and their accounting, over the ports as they are
        now (a test or a benchmark may swap one in place), with this pipeline's call time."""
        return ModelCalls(
            self.reranker,
            self.config,
            self.recorder,
            self.rate_budget,
            self._clock,
            self._sleep,
            self._call_time,
        )

    def _retrieval(self, held: ExitStack, answers: AnswerKeeper | None = None) -> Retrieval:
        """A search's retrieval, over the ports as they are now (as :meth:`_model_calls`);
        ``held``: the first half's CPU slot, which a retry's back-off lets go; ``answers``:
        the run's keeper, told when a retry holds its CPU slot again."""
        return Retrieval(
            self.backend,
            self.embedder,
            self.index_settings,
            self.config,
            self.recorder,
            self._clock,
            self._sleep,
            self._cpu_slots,
            held,
            answers,
        )

    # -- the algorithm ------------------------------------------------------------

    def search(
        self,
        spec: SearchSpec,
        tenant: str,
        before_model: BeforeModel | None = None,
        *,
        spent: float = 0.0,
        answers: AnswerKeeper | None = None,
    ) -> SearchResult:
        """``before_model`` runs after the first half, just before the model call (not when
        none is needed), and again before each later attempt and after each wait for the
        rate budget (:meth:`ModelCalls.call`); it may raise :class:`~worker.errors.Canceled`
        to stop there (a batch item whose batch was canceled meanwhile, even while it waited
        out a 429), or :class:`~worker.errors.HandedBack` (its worker is stopping, and it was
        billed nothing), and the search is then not counted as done.
        ``spent``: the deadline's seconds earlier runs of this search used (a retry runs in
        what is left of the one deadline). ``answers``: told when the run holds its CPU slot,
        where its deadline starts (:meth:`AnswerKeeper.slot_held`, which raises
        :class:`~worker.errors.RunTakenOver` to stop the run there); where the model's answer
        is kept as soon as the call returns; one an earlier run kept (its process died before
        the result was saved) is finished instead of calling the model again: the call was
        paid for and counted once, by the run that made it (no attempt, token or cost is
        counted here; ``before_model`` is not run either: the call it guards was made). Only
        if it answered these very candidates (:func:`shown_digest`): its positions number the
        ones it was shown, and an index changed between the two runs gives others (then it is
        called again, and the run shows both calls, the first billed too:
        :meth:`RerankRun.billed_with`). A run that died between a billed attempt and its
        retry's answer kept that attempt as if for other candidates: the run after it calls
        the model and shows the attempt billed too (:func:`_keep_billed`). With ``answers``,
        the search's own figures (its retrieval's, its outcome and duration, the model
        answer's) are handed to it to record once the result is saved
        (:meth:`AnswerKeeper.later`)."""
        outcome: str | None = "error"
        figures: list[Callable[[], None]] = []
        deadline: Deadline | None = None
        try:
            paced = self._take_paced()
            asked = self._clock()
            with ExitStack() as held:  # the first half's CPU slot (a retry's back-off lets it go)
                held.enter_context(self._cpu_slots)  # the deadline starts once held (see prepare)
                while paced is not None and self._held_by_breaker(paced):
                    held.close()  # its search has not begun: the slot goes to another
                    self._model_calls().pace(*paced)
                    asked = self._clock()
                    held.enter_context(self._cpu_slots)
                waited = self._clock() - asked
                if answers is not None:  # and so does the run's claim (its time, its lease)
                    answers.slot_held(waited)
                deadline = Deadline(self.config.deadline_seconds, self._clock, spent)
                prepared = self._prepare(spec, tenant, deadline, figures, held, answers, waited)
            if prepared.result is not None:
                result = prepared.result
                if prepared.skipped:  # counted with the search's other figures: once
                    figures.append(partial(self.recorder.rerank_outcome, POLICY_ID, "skipped"))
            else:
                kept = answers.saved() if answers is not None else None
                shown = shown_digest(prepared.candidates)
                if kept is not None and kept.get("shown") == shown:
                    run = load_run(kept)
                else:  # none kept, kept for other candidates (the index changed meanwhile),
                    # or only the billed attempts of a run that died before its call ended
                    if before_model is not None:
                        before_model(None)
                    assert self.reranker is not None and prepared.prompt is not None
                    earlier = load_run(kept) if kept is not None else None
                    keep = _keep_billed(answers, earlier, shown)
                    run = self._model_calls().call(prepared.prompt, deadline, before_model, keep)
                    if earlier is not None:  # paid for too
                        run = run.billed_with(earlier)
                    if answers is not None and run.job_usage().requests:  # a call was billed
                        answers.save({**dump_run(run), "shown": shown})
                result = self._finish(prepared, run, figures)
            outcome = "fallback" if result.rerank.fallback_reason else "ok"
            return result
        except (Canceled, HandedBack, RunTakenOver):  # stopped before its model call (its
            # batch was canceled, its worker is stopping, or its claim taken over while it
            # waited for its slot): no search done
            outcome = None
            raise
        finally:
            if self.rate_budget is not None:  # a batch item paced (pace) counts no more
                self.rate_budget.ended()
            if outcome is not None:
                seconds = deadline.run_elapsed() if deadline is not None else 0.0
                figures.append(partial(self.recorder.search_done, spec.mode, outcome, seconds))
            if answers is not None:
                answers.later(figures)
            else:
                _record(figures)

    def pace(
        self,
        stopping: Callable[[], bool] | None = None,
        canceled: Callable[[], bool] | None = None,
    ) -> None:
        """Wait, before a batch item's search starts, until the rate budget's queue is short
        enough for it, or until ``stopping`` says the worker is, or ``canceled`` that the
        item's batch is (:meth:`ModelCalls.pace`)."""
        self._model_calls().pace(stopping, canceled)
        self._paced.checks = (stopping, canceled)

    def reranks(self, spec: SearchSpec) -> bool:
        """Whether ``spec``'s search asks the model (:meth:`_reranking`): a batch item that
        does not is not paced on the rate budget (:meth:`pace`), which meters model calls
        only. Paced, while no limit is known, it waited for the call out learning them."""
        return self._reranking(spec)

    def unpace(self) -> None:
        """The batch item this thread paced runs no search (another run holds it): it counts
        no more in the rate budget's readings, as a search's end would have it."""
        self._paced.checks = None
        if self.rate_budget is not None:
            self.rate_budget.ended()

    def _take_paced(self) -> PaceChecks | None:
        """The checks this thread's batch item was paced with (:meth:`pace`), taken: None for
        a search that was not paced."""
        paced: PaceChecks | None = getattr(self._paced, "checks", None)
        self._paced.checks = None
        return paced

    def _held_by_breaker(self, paced: PaceChecks) -> bool:
        """Whether a paced batch item, its CPU slot just held, is to wait again before its
        search and deadline begin: the breaker opened while it waited for the slot (its
        pacing let it start before the provider failed), so it would wait on the breaker
        within its deadline, and fail ``budget_exhausted`` in an outage longer than that,
        never having sent a call. Not once its batch is canceled: its search goes on to the
        check before the model call, which cancels it."""
        if self.rate_budget is None or not self.rate_budget.shut():
            return False
        canceled = paced[1]
        return not (canceled is not None and canceled())

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

        The deadline starts once the first half holds its CPU slot (in :meth:`search`
        too). A batch's chunks put every item on the process's item pool at once (300
        threads at the defaults) and they queue for the slots (one per core and one more):
        that wait is a queue's, as the wait before the task is, not the search's. Charged to the
        deadline, a few items of a 3,000-item batch on a busy host failed
        ``deadline_exceeded`` ("ran out before the call") before any model was asked, each
        one's own retrieval well under a second.
        """
        figures: list[Callable[[], None]] = []
        asked = self._clock()
        with ExitStack() as held:
            held.enter_context(self._cpu_slots)
            waited = self._clock() - asked
            deadline = Deadline(self.config.deadline_seconds, self._clock)
            try:
                prepared = self._prepare(spec, tenant, deadline, figures, held, slot_wait=waited)
            except BaseException:
                _record(figures)
                self.recorder.search_done(spec.mode, "error", deadline.elapsed())
                raise
        prepared.seconds = deadline.elapsed()
        if prepared.skipped:
            figures.append(partial(self.recorder.rerank_outcome, POLICY_ID, "skipped"))
        if prepared.result is not None:
            outcome = "fallback" if prepared.result.rerank.fallback_reason else "ok"
            figures.append(partial(self.recorder.search_done, spec.mode, outcome, prepared.seconds))
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
        return self._second_half(prepared, partial(self._finish, prepared, run), later)

    def finish_without_model(
        self,
        prepared: Prepared,
        billed: RerankRun,
        *,
        later: list[Callable[[], None]] | None = None,
    ) -> SearchResult:
        """The second half of a prepared search no model can answer here: an economy item
        never sent, its deadline past, on a worker with no generation model (none of the
        pool's may have one any more). The failure policy, as the standard lane answers a
        rerank asked of such a worker (:func:`no_model_result`), on the candidates still
        stored; nothing is called, so nothing is billed but what ``billed``'s earlier calls
        were, shown as :meth:`finish` shows a run's. Raises RerankFailed under
        ``fail_closed``; ``later`` as :meth:`finish` takes it."""
        gone = prepared.gone
        live = [c for c in prepared.candidates if c.document.id not in gone]

        def answer(figures: list[Callable[[], None]]) -> SearchResult:
            return no_model_result(
                prepared.spec,
                live,
                prepared.trace,
                figures,
                recorder=self.recorder,
                failure_policy=self.config.failure_policy,
                billed=billed.job_usage(),
            )

        return self._second_half(prepared, answer, later)

    def _second_half(
        self,
        prepared: Prepared,
        answer: Callable[[list[Callable[[], None]]], SearchResult],
        later: list[Callable[[], None]] | None,
    ) -> SearchResult:
        """The result ``answer`` makes of ``prepared`` (appending its figures to the list it
        is given), with the search counted done, ``error`` if it raised."""
        started = self._clock()
        outcome = "error"
        figures: list[Callable[[], None]] = []
        try:
            result = answer(figures)
            outcome = "fallback" if result.rerank.fallback_reason else "ok"
            return result
        finally:
            seconds = prepared.seconds + self._clock() - started
            figures.append(partial(self.recorder.search_done, prepared.spec.mode, outcome, seconds))
            if later is None:
                _record(figures)
            else:
                later.extend(figures)

    def unfinished(
        self,
        prepared: Prepared,
        run: RerankRun | None,
        *,
        later: list[Callable[[], None]] | None = None,
    ) -> None:
        """The figures of a search whose model call ended (answered, or failed) but which
        cannot be finished: an economy item whose index is gone since its retrieval, or
        whose candidates the backend failed to read. What the standard lane counts for a
        search failing after its model call: the model answer's duration and outcome, and
        the search done ``error`` (no policy outcome: no policy was applied). ``run`` None:
        no model call was made (an economy item never sent, ended on a worker with no model,
        :meth:`finish_without_model`), the search done alone. ``later`` as :meth:`finish`
        takes it."""
        figures: list[Callable[[], None]] = []
        if run is not None:
            model, outcome = self._model_of(prepared), answer_outcome(run)
            figures.append(partial(self.recorder.rerank_done, model, outcome, run.seconds))
        figures.append(
            partial(self.recorder.search_done, prepared.spec.mode, "error", prepared.seconds)
        )
        if later is None:
            _record(figures)
        else:
            later.extend(figures)

    def _model_of(self, prepared: Prepared) -> str:
        """The model a prepared search's figures are labelled with: the one its trace names
        (an economy item's: the one its request went to, which a worker of another model may
        poll)."""
        assert self.reranker is not None
        return str(prepared.trace.get("model") or self.reranker.model)

    def _prepare(
        self,
        spec: SearchSpec,
        tenant: str,
        deadline: Deadline,
        figures: list[Callable[[], None]],
        held: ExitStack,
        answers: AnswerKeeper | None = None,
        slot_wait: float = 0.0,
    ) -> Prepared:
        """Retrieval and fusion, then the prompt; the figures they make (each stage's
        duration and hits) are appended to ``figures``, for the caller to record.
        ``held``: the ``with`` holding the CPU slot, which a retrieval retry's back-off lets
        go and takes again (:meth:`Retrieval._sleep_off_slot`). ``answers``: told when a
        retrieval retry holds its CPU slot again. ``slot_wait``: the seconds the run waited
        for its CPU slot; the trace tells them with the waits to hold it again after a retry's
        back-off (none of them the deadline's)."""
        query = normalise_query(spec.query)
        reranking = self._reranking(spec)
        retrieval = self._retrieval(held, answers)
        candidates, trace = retrieval.run(spec, tenant, query, reranking, deadline, figures)
        trace["slot_wait_seconds"] = max(0.0, slot_wait) + deadline.left_out
        trace["candidate_max_chars"] = chars = self.config.candidate_max_chars

        if not reranking or not candidates:
            info = RerankInfo(applied=False, policy=None, fallback_reason=None)
            if spec.include_trace:
                trace["candidates"] = _trace_candidates(candidates, None, chars)
            result = build_result(candidates[: spec.limit], info, Usage(), spec, trace)
            return Prepared(spec, candidates, trace, result=result, skipped=reranking)
        if self.reranker is None:
            if spec.include_trace:
                trace["candidates"] = _trace_candidates(candidates, None, chars)
            result = no_model_result(
                spec,
                candidates,
                trace,
                figures,
                recorder=self.recorder,
                failure_policy=self.config.failure_policy,
            )
            return Prepared(spec, candidates, trace, result=result)
        prompt = self.build_prompt(query, spec, candidates)
        if spec.include_trace:  # a dict per candidate: built only for a trace that is shown
            trace["candidates"] = _trace_candidates(candidates, prompt, chars)
        trace["model"] = self.reranker.model
        trace["effort"] = self.reranker.effort  # as sent: None when the model takes none
        return Prepared(spec, candidates, trace, prompt=prompt)

    def build_prompt(
        self,
        query: str,
        spec: SearchSpec,
        candidates: Sequence[Candidate],
        max_chars: int | None = None,
    ) -> RerankPrompt:
        """The ``listwise.v1`` prompt for fused ``candidates``; a pure function of its inputs.
        Each candidate's line is cut to ``max_chars`` characters, by default this worker's
        ``SIFT_RERANK_CANDIDATE_MAX_CHARS``."""
        return build_prompt(
            query,
            [(c.document.title, c.document.text) for c in candidates],
            k=spec.limit,
            max_chars=max_chars or self.config.candidate_max_chars,
            thinking_tokens=self.config.thinking_tokens,
            tokens_per_position=self.config.tokens_per_position,
        )

    def _reranking(self, spec: SearchSpec) -> bool:
        """Whether the search reranks: as it asks. The gateway writes the answer into every
        job it stores, its own default where the request left ``rerank`` out (the worker's
        could differ, and the gateway is the one that accepted the request); only a job
        stored without it, by a gateway before that, goes by this worker's default, so the
        jobs queued across an upgrade in place run as they would have. One asking for it
        (``rerank: true``) on a worker with no model reranks all the same, to fail or fall
        back as the failure policy says (:func:`no_model_result`); the default is off without
        a model (the settings check)."""
        wanted = self.config.rerank_enabled if spec.rerank is None else spec.rerank
        return wanted and (self.reranker is not None or spec.rerank is True)

    def _finish(
        self, prepared: Prepared, run: RerankRun, figures: list[Callable[[], None]]
    ) -> SearchResult:
        """The result of ``run`` (:func:`rerank_result`); the figures it makes (the model
        answer's duration and outcome) are appended to ``figures``, for the caller to record,
        labelled with the model the trace names (:meth:`_model_of`)."""
        return rerank_result(
            prepared,
            run,
            figures,
            model=self._model_of(prepared),
            recorder=self.recorder,
            failure_policy=self.config.failure_policy,
        )

    # -- the model calls' accounting, for the economy lane (:class:`ModelCalls`) ----------

    def record_attempt(
        self,
        run: RerankRun,
        outcome: AttemptOutcome,
        usage: TokenUsage | None,
        seconds: float,
        **detail: Any,
    ) -> None:
        """Count one model attempt in ``run`` and in the metrics
        (:meth:`ModelCalls.record_attempt`)."""
        self._model_calls().record_attempt(run, outcome, usage, seconds, **detail)

    def add_attempt(
        self,
        run: RerankRun,
        outcome: AttemptOutcome,
        usage: TokenUsage | None,
        seconds: float,
        *,
        model: str | None = None,
        **detail: Any,
    ) -> float | None:
        """:meth:`record_attempt`'s part in ``run`` alone (:meth:`ModelCalls.add_attempt`)."""
        return self._model_calls().add_attempt(run, outcome, usage, seconds, model=model, **detail)

    def count_attempt(
        self,
        outcome: AttemptOutcome,
        usage: TokenUsage | None,
        cost: float | None,
        model: str | None = None,
    ) -> None:
        """:meth:`record_attempt`'s part in the metrics (:meth:`ModelCalls.count_attempt`)."""
        self._model_calls().count_attempt(outcome, usage, cost, model)


def _keep_billed(
    answers: AnswerKeeper | None, earlier: RerankRun | None, shown: str
) -> Callable[[RerankRun], None] | None:
    """Where a run keeps its billed attempts as they are made, before its call ends (with
    ``earlier``'s, a dead run's kept): a run after its process dies shows them billed. Kept
    with no candidates' digest (its ``"shown"`` null, never ``shown``), so that run, of this
    release or an earlier one, calls the model itself, as for an answer to other candidates.
    None without ``answers``."""
    if answers is None:
        return None

    def keep(so_far: RerankRun) -> None:
        whole = so_far if earlier is None else so_far.billed_with(earlier)
        answers.save({**dump_run(whole), "shown": None})

    return keep


def _record(figures: Sequence[Callable[[], None]]) -> None:
    for record in figures:
        record()

"""The standard lane's model calls (:class:`ModelCalls`): attempts under the retry budget, the
deadline and the provider's shared rate budget, each counted in the run and the metrics."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from worker.contract import Usage
from worker.core.budget import (
    DEFAULT_429_PAUSE_SECONDS,
    MIN_ATTEMPT_SECONDS,
    Deadline,
    call_within_budget,
)
from worker.core.cost import price_for
from worker.core.pipeline._config import PipelineConfig
from worker.core.pipeline._run import RerankRun, usage_by_type
from worker.core.ports import SEND_CHECK, RateBudget, Recorder, Reranker
from worker.core.tokens import prompt_tokens
from worker.core.types import BudgetGrant, RerankPrompt, RerankReply, TokenUsage
from worker.errors import (
    AttemptOutcome,
    Canceled,
    DeadlineExceeded,
    HandedBack,
    RerankAttemptError,
)

# the attempts that end with no answer from the provider (nor a 5xx: the breaker's signal)
NO_ANSWER = frozenset({AttemptOutcome.TIMEOUT, AttemptOutcome.CONNECTION})


def _transient_4xx(error: RerankAttemptError) -> bool:
    """A 4xx counted ``http_5xx`` and retried as one, as the SDK's own policy does: a 409 (its
    "lock timeout") or one sent ``x-should-retry: true``. It is no outage: the provider
    answered, refusing this one request before reading a token. It opened the breaker as a
    5xx does, and every process stopped sending for a second or more."""
    status = error.status
    return error.outcome is AttemptOutcome.HTTP_5XX and status is not None and status < 500


# A batch item's check before its model calls (``SearchPipeline.search``'s ``before_model``),
# handed what the search was billed so far (None: nothing); raises Canceled (or HandedBack)
# to stop there.
BeforeModel = Callable[[Usage | None], None]

# How often a batch item's wait before a model call (its pacing, its reservation, the
# provider's outage, a 429's pause, the back-off between attempts) asks whether to go on
# waiting: a cancel, or the worker's stop, ends it this much later at most, where it waited
# out the whole wait (up to the search's deadline) first.
WAIT_CHECK_SECONDS = 1.0


def _billed(run: RerankRun) -> Usage | None:
    """What ``run`` was billed so far, for a check: None when it sent no request."""
    usage = run.job_usage()
    return usage if usage.requests else None


def _paused(run: RerankRun) -> float:
    """The part of the back-off before the next attempt that was the provider's hold on every
    process (:func:`_holds_everyone`): all of it after a 429 the provider sent, or a 5xx that
    named its retry-after (at least that retry-after, for which the rate budget held every
    process's calls too, counted there as their wait for the budget: a 429's pause, the
    breaker), none after any other failure (the retry policy's own back-off, not the budget's).

    >>> _paused(RerankRun(backed_off=2.0, held=True))
    2.0
    >>> _paused(RerankRun(backed_off=0.2))
    0.0
    """
    return run.backed_off if run.held else 0.0


def _holds_everyone(error: RerankAttemptError) -> bool:
    """Whether the provider's answer to an attempt sent holds every process's calls for the
    back-off after it: a 429 (its pause) or a 5xx naming its retry-after (the breaker opened
    that long; one without it opens for a second or more, waited at the reservation). A 409
    or a 4xx the provider says to retry opens no breaker; a call the process's own limiter
    held back, unsent, pauses no one.

    >>> from worker.errors import AttemptOutcome as A
    >>> _holds_everyone(RerankAttemptError(A.RATE_LIMITED, "429", retry_after=2.0))
    True
    >>> _holds_everyone(RerankAttemptError(A.RATE_LIMITED, "held", sent=False))
    False
    >>> _holds_everyone(RerankAttemptError(A.HTTP_5XX, "529", retry_after=3.0))
    True
    >>> _holds_everyone(RerankAttemptError(A.HTTP_5XX, "529"))
    False
    """
    if not error.sent:
        return False
    if error.outcome is AttemptOutcome.RATE_LIMITED:
        return True
    return (
        error.outcome is AttemptOutcome.HTTP_5XX
        and not _transient_4xx(error)
        and error.retry_after is not None
    )


@dataclass(slots=True)
class CallTime:
    """An average of answered calls' time, with the budget on: what a call must still have
    after its wait for the rate budget. One per pipeline, kept across its searches."""

    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        """Count one answered call's ``seconds`` into the average (a tenth of its weight).

        >>> took = CallTime()
        >>> took.needed()
        0.05
        >>> took.add(2.0); took.add(2.0)
        >>> round(took.seconds, 2), round(took.needed(), 2)
        (0.38, 0.76)
        """
        self.seconds += 0.1 * (seconds - self.seconds)

    def needed(self) -> float:
        """What a call must still have after its wait: twice what answered calls took, on
        average, and never less than an attempt's floor (:data:`MIN_ATTEMPT_SECONDS`)."""
        return max(MIN_ATTEMPT_SECONDS, 2 * self.seconds)


@dataclass(frozen=True, slots=True)
class ModelCalls:
    """The standard lane's model calls and their accounting, over the pipeline's ports as they
    are when it is made (:meth:`SearchPipeline._model_calls`: one made for each use, so a port
    swapped on the pipeline in place is the one called). ``call_time`` is the pipeline's."""

    reranker: Reranker | None
    config: PipelineConfig
    recorder: Recorder
    rate_budget: RateBudget | None
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    call_time: CallTime

    def pace(
        self,
        stopping: Callable[[], bool] | None = None,
        canceled: Callable[[], bool] | None = None,
    ) -> None:
        """Wait, before a search starts, until the rate budget's queue is short enough for it
        to be served well within its deadline (a third of it). For a batch item, which no
        caller waits on: without it, a batch larger than the budget serves in a deadline
        would run its surplus through as ``budget_exhausted`` fallbacks. Not for interactive
        searches: their wait counts against their deadline.

        ``stopping`` is asked before each wait: once it says so (the worker is stopping), the
        item waits no more and :class:`~worker.errors.HandedBack` is raised, the item not
        counted as started. It waited through the stop deadline, and the worker exited as
        after a crash. ``canceled`` is asked there too: once it says so (the item's batch was
        canceled), the item waits no more and goes on to its search, whose check before the
        model call cancels it. It waited for as long as the budget was shut (a breaker open
        for a 529's minute-long ``retry-after``, a 429's pause), the batch ``running``."""
        if self.rate_budget is None:
            return
        room = self.config.deadline_seconds / 3
        while (excess := self.rate_budget.backlog() - room) > 0:
            if stopping is not None and stopping():
                raise HandedBack("the worker is stopping: the item waits no more for the budget")
            if canceled is not None and canceled():
                break
            # spread the re-checks: the queue frees at the limit's rate, not all at once
            self.sleep(min(excess, 1.0) + random.uniform(0.0, 0.5))
        self.rate_budget.started()  # counted by every process until its call is reserved

    def call(
        self,
        prompt: RerankPrompt,
        deadline: Deadline,
        check: BeforeModel | None = None,
        on_billed: Callable[[RerankRun], None] | None = None,
    ) -> RerankRun:
        """The standard lane's model call: attempts under the retry budget and the deadline.
        ``check`` runs before each attempt after the first (a back-off lies between) and
        every :data:`WAIT_CHECK_SECONDS` of each wait before one (:meth:`_wait`), with what
        the run was billed so far; it may raise :class:`~worker.errors.Canceled` or
        :class:`~worker.errors.HandedBack`, which end the call there (a budget reservation
        not used is given back). ``on_billed`` hears the run so far after each failed
        attempt that reported usage (billed, to be retried): where a run keeps it past its
        process; and, the call handed back, its attempts that read no token, for the run
        that takes the item on to show."""
        assert self.reranker is not None
        run = RerankRun()
        started = self.clock()
        try:
            run.reply = call_within_budget(
                lambda timeout: self._attempt(prompt, timeout, run, deadline, check, on_billed),
                deadline=deadline,
                max_attempts=self.config.max_requests,
                attempt_timeout=self.config.attempt_timeout_seconds,
                sleep=lambda seconds: self._back_off(seconds, run, check),
            )
        except (RerankAttemptError, DeadlineExceeded) as error:
            run.failure = error
        except HandedBack:  # its attempts so far read no token: the next run shows them
            if on_billed is not None and _billed(run) is not None:
                on_billed(run)
            raise
        run.seconds = self.clock() - started
        return run

    def _attempt(
        self,
        prompt: RerankPrompt,
        timeout: float,
        run: RerankRun,
        deadline: Deadline,
        check: BeforeModel | None,
        on_billed: Callable[[RerankRun], None] | None = None,
    ) -> RerankReply:
        assert self.reranker is not None
        if check is not None and run.attempts:  # a back-off since the last attempt
            check(_billed(run))
        paused = _paused(run)
        grant: BudgetGrant | None = None
        detail: dict[str, Any] = {"backoff_wait_seconds": run.backed_off}
        if self.rate_budget is not None:
            # kept on ``run`` through the wait: a budget_exhausted entry (:meth:`_exhausted`)
            # shows the back-off before it too
            grant, waited = self._wait_for_budget(prompt, run, deadline, check)
            if check is not None and grant.wait > 0:
                try:
                    check(_billed(run))
                except BaseException:  # not sent: the reservation goes back whole
                    self.rate_budget.settle(grant, TokenUsage(), sent=False)
                    raise
            timeout = min(timeout, deadline.remaining())
            # no wait, but a slow check or reservation spent the deadline (not a short
            # attempt timeout the settings chose: that one is sent as set)
            if deadline.remaining() < MIN_ATTEMPT_SECONDS:
                self._give_back(grant, run, deadline, waited, "its checks before the send overran")
            detail["budget_wait_seconds"] = waited
        run.backed_off = 0.0
        sent = self.clock()
        # asked again while the call waits for one of its process's places in flight
        billed = _billed(run)
        sending = SEND_CHECK.set(None if check is None else lambda: check(billed))
        try:
            reply = self.reranker.rerank(prompt, timeout)
        except (Canceled, HandedBack):  # stopped there, unsent: the reservation goes back whole
            if grant is not None and self.rate_budget is not None:
                self.rate_budget.settle(grant, TokenUsage(), sent=False)
            raise
        except RerankAttemptError as error:
            usage = getattr(error, "usage", None)
            usage = usage if isinstance(usage, TokenUsage) else None
            if not error.sent:
                detail["sent"] = False
            # counted, and kept if billed, before the budget's bookkeeping: a 429's pause or
            # the breaker's write that meets Redis gone raises, and the run is left for the
            # outage's re-drive, but the call was made
            self.record_attempt(run, error.outcome, usage, self.clock() - sent, **detail)
            if error.sent and usage is None and error.outcome in NO_ANSWER and error.status is None:
                self._count_unread(prompt, grant)
            if on_billed is not None and usage is not None:
                on_billed(run)
            run.held = _holds_everyone(error)
            if grant is not None and grant.probe:  # an attempt spent, sent or refused
                run.probe_failed = True  # the provider still failing: the next probe another's
            if grant is not None:
                self._settle_failed(grant, error, usage, detail["budget_wait_seconds"] + paused)
            raise
        finally:
            SEND_CHECK.reset(sending)
        if grant is not None and self.rate_budget is not None:
            self.rate_budget.sent(detail["budget_wait_seconds"] + paused)
            self.rate_budget.settle(grant, reply.usage)
            self.call_time.add(self.clock() - sent)
        run.returned = reply.positions
        self.record_attempt(run, AttemptOutcome.OK, reply.usage, self.clock() - sent, **detail)
        return reply

    def _count_unread(self, prompt: RerankPrompt, grant: BudgetGrant | None) -> None:
        """An attempt sent that got no answer read: the provider may have finished and billed
        it, and no usage will ever say so (docs/observability.md). A 408, counted with the
        timeouts, is no such attempt: the provider answered that it stopped the call. Counted
        with its input tokens as the rate budget estimated them when it reserved them
        (corrected by what the provider reported), else the prompt's uncorrected estimate
        (the budget off): what its input may have cost, at most about that."""
        assert self.reranker is not None
        reserved = grant.input_tokens if grant is not None else 0
        estimate = reserved or max(1, round(prompt_tokens(prompt)))
        self.recorder.rerank_unread(self.reranker.model, estimate)

    def _settle_failed(
        self, grant: BudgetGrant, error: RerankAttemptError, usage: TokenUsage | None, waited: float
    ) -> None:
        """Settle a failed attempt's reservation with the rate budget. One refused before any
        token was read (a 429, a 4xx, or never sent) gives its tokens back, and its request
        too when the provider never saw it; the provider's 429 pauses every worker, a local
        hold no one, and neither closes the breaker. A 4xx closes it, a 409 or one the provider
        says to retry too (retried as a 5xx, but an answer of a provider that is up). Any other
        failure is settled on the
        ``usage`` it reported (none reported: the reservation stands); a 5xx opens the breaker;
        any other answer closes it, billed or not; one that got no answer ends the breaker's
        probe if it was that. A connection never made for want of the provider (refused, its
        host not found: the SDK's connection error before any byte was sent, not a timeout)
        opens the breaker as a 5xx does: the provider is unreachable, for every process alike.

        The settlement of an attempt to be retried raises when Redis fails, as these writes
        do: the run, having spent the client's retries (30 s, the default deadline), is left
        for the outage's re-drive, where going on charged the outage to the job. A final one
        (a 4xx, a refusal) stands, as an answer does: its settlement is dropped."""
        budget = self.rate_budget
        assert budget is not None
        quiet = not error.retryable
        if error.sent:
            budget.sent(waited)
        if error.outcome is AttemptOutcome.RATE_LIMITED or not error.sent:
            budget.settle(grant, TokenUsage(), sent=error.sent, closes=False, quiet=quiet)
            if error.sent:
                budget.pause(error.retry_after or DEFAULT_429_PAUSE_SECONDS)
            elif error.outcome is AttemptOutcome.CONNECTION:  # refused, no such host: down
                budget.trip(None)
                return
        elif error.outcome is AttemptOutcome.HTTP_4XX or _transient_4xx(error):
            budget.settle(grant, TokenUsage(), quiet=quiet)  # refused at once: no token read
        else:
            budget.settle(grant, usage, quiet=quiet)
            if error.outcome is AttemptOutcome.HTTP_5XX:  # the provider is failing: the breaker
                budget.trip(error.retry_after)
            elif usage is None and error.outcome not in NO_ANSWER:
                budget.answered(grant)  # an answer all the same (a body that is not a message)
        if not error.sent or (usage is None and error.outcome in NO_ANSWER):
            budget.unanswered(grant)

    def _wait_for_budget(
        self, prompt: RerankPrompt, run: RerankRun, deadline: Deadline, check: BeforeModel | None
    ) -> tuple[BudgetGrant, float]:
        """Reserve the attempt's share of the rate budget and wait until it may be sent;
        answers the grant and the seconds waited in all. When
        the budget frees it too late for the call to fit in the search's deadline (twice the
        answered calls' average time), nothing is reserved and nothing sent: the attempt is
        ``budget_exhausted``, which the failure policy takes from there. A call sent with
        less time than it takes would be charged by the provider and time out. A call
        granted with a wait looks again before it is sent: a 429 another process met
        meanwhile pauses it too (sent now, it would meet the provider's 429 itself), and a
        breaker a 5xx opened meanwhile has it give its grant back unsent and wait as the
        others do (sent now, it went into the outage, or beside the breaker's probe)."""
        budget = self.rate_budget
        assert budget is not None
        waited = 0.0
        while True:
            grant, waited = self._reserve(prompt, run, deadline, check, waited)
            if grant.wait <= 0:
                return self._in_time(grant, run, deadline, waited)
            self._wait_reserved(grant, grant.wait, run, check)
            held = budget.paused_for()
            if held > max(0.0, deadline.remaining() - self.call_time.needed()):
                budget.settle(grant, TokenUsage(), sent=False, closes=False)
                self._exhausted(run, deadline, waited + held, f"a 429's pause ends in {held:.1f}s")
            if held > 0:
                self._wait_reserved(grant, held, run, check)
                waited += held
            if not budget.breaker_shut(grant):
                return self._in_time(grant, run, deadline, waited)
            budget.settle(grant, TokenUsage(), sent=False, closes=False)

    def _in_time(
        self, grant: BudgetGrant, run: RerankRun, deadline: Deadline, waited: float
    ) -> tuple[BudgetGrant, float]:
        """``grant`` and ``waited``, if what the waits left of the deadline still holds the
        call; else the grant goes back unsent and the attempt is ``budget_exhausted``. Each
        wait was sized to leave the call its time, but a loaded host's threads wake late:
        a wait on the breaker that overslept sent its probe with 0.7 ms left, a request
        that timed out at once, counted as sent and possibly billed."""
        if waited > 0 and deadline.remaining() < self.call_time.needed():
            self._give_back(grant, run, deadline, waited, "its wait for the rate budget overran")
        return grant, waited

    def _give_back(
        self, grant: BudgetGrant, run: RerankRun, deadline: Deadline, waited: float, why: str
    ) -> NoReturn:
        """The deadline no longer holds the call: ``grant`` goes back unsent (the breaker
        neither opened nor closed by it) and the attempt is ``budget_exhausted``."""
        assert self.rate_budget is not None
        self.rate_budget.settle(grant, TokenUsage(), sent=False, closes=False)
        self._exhausted(run, deadline, waited, why)

    def _reserve(
        self,
        prompt: RerankPrompt,
        run: RerankRun,
        deadline: Deadline,
        check: BeforeModel | None,
        waited: float,
    ) -> tuple[BudgetGrant, float]:
        """Reserve the attempt's share (``waited``: the seconds waited for it so far); answers
        the grant, admitted, and the seconds waited once its wait is over. While the provider
        fails (the budget's breaker: a 5xx opened it, or its one probe is out), or another
        call is out learning the provider's limits (none known yet), the attempt waits and
        asks again, as long as the deadline allows: it sends nothing, so it spends none of
        the retry budget on a provider that is down (``check`` runs after each such wait)."""
        assert self.rate_budget is not None
        # a probe that fails costs this search its last attempt, or another of its own on the
        # outage: another search waiting goes as the next probe, if one asks in time
        last = len(run.attempts) + 1 >= self.config.max_requests
        while True:
            max_wait = max(0.0, deadline.remaining() - self.call_time.needed())
            grant = self.rate_budget.reserve(
                prompt, max_wait, yields_probe=run.probe_failed or last
            )
            if grant.admitted or not grant.shut or grant.wait > max_wait:
                break
            self._wait(grant.wait, run, check)
            waited += grant.wait
            if check is not None:
                check(_billed(run))
        if not grant.admitted:
            what = "the provider's rate budget frees this call"
            if grant.learning:
                what = "another call is out learning the provider's limits: this one asks again"
            elif grant.shut:
                what = "the provider is failing: it takes a call again"
            self._exhausted(run, deadline, waited + grant.wait, f"{what} in {grant.wait:.1f}s")
        return grant, waited + grant.wait

    def _wait_reserved(
        self, grant: BudgetGrant, seconds: float, run: RerankRun, check: BeforeModel | None
    ) -> None:
        """:meth:`_wait` for ``seconds`` holding ``grant``: a cancel, or the worker's stop,
        that ends the wait gives the reservation back whole (nothing was sent), the breaker's
        probe with it when the grant was that (the budget's settlement ends it)."""
        try:
            self._wait(seconds, run, check)
        except BaseException:
            assert self.rate_budget is not None
            self.rate_budget.settle(grant, TokenUsage(), sent=False, closes=False)
            raise

    def _back_off(self, seconds: float, run: RerankRun, check: BeforeModel | None) -> None:
        """:meth:`_wait` for the back-off between attempts (a 429's retry-after, when longer),
        kept on ``run`` as slept for the next attempt's entry (``backoff_wait_seconds``). It
        went into the next attempt's own ``seconds``, or nowhere: a 429's 2 s retry-after was
        in no figure of the trace, its retry shown as sent at once."""
        started = self.clock()
        try:
            self._wait(seconds, run, check)
        finally:
            run.backed_off += self.clock() - started

    def _wait(self, seconds: float, run: RerankRun, check: BeforeModel | None) -> None:
        """Wait ``seconds`` before an attempt (for the rate budget, the provider's outage, a
        429's pause, the back-off between attempts), asking ``check`` every
        :data:`WAIT_CHECK_SECONDS` (the caller asks it once more at the end): a cancel, or the
        worker's stop, that comes meanwhile ends the wait then. Slept in one piece, a cancel
        was seen only at its end and a stopping worker's items held its stop up to their
        deadline, cut off there as after a crash. A search with no check (an interactive one)
        sleeps it in one piece."""
        left = seconds
        while check is not None and left > WAIT_CHECK_SECONDS:
            self.sleep(WAIT_CHECK_SECONDS)
            left -= WAIT_CHECK_SECONDS
            check(_billed(run))
        self.sleep(left)

    def _exhausted(self, run: RerankRun, deadline: Deadline, waited: float, why: str) -> NoReturn:
        """The attempt cannot be sent within the search's deadline: ``budget_exhausted``,
        nothing sent, which the failure policy takes from there. Its message says the time
        left and what of it a call needs (twice the answered calls' average): a wait shorter
        than the time left can still leave the call too little."""
        self.record_attempt(
            run,
            AttemptOutcome.BUDGET_EXHAUSTED,
            None,
            0.0,
            backoff_wait_seconds=run.backed_off,
            budget_wait_seconds=waited,
        )
        run.backed_off = 0.0
        left, needed = max(0.0, deadline.remaining()), self.call_time.needed()
        raise RerankAttemptError(
            AttemptOutcome.BUDGET_EXHAUSTED,
            f"{why}, past the search deadline ({left:.1f}s left, of which a call needs "
            f"{needed:.1f}s)",
        )

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
        *,
        model: str | None = None,
        **detail: Any,
    ) -> float | None:
        """:meth:`record_attempt`'s part in ``run`` alone; answers the call's cost, at the
        price of ``model``, the one the call went to (None: this pipeline's; a provider batch
        another worker sent may have gone to another). A lane that must save the run before
        the metrics count it (so that a task run again after a crash between the two does
        not count it twice) calls :meth:`count_attempt` after."""
        assert self.reranker is not None
        cost: float | None = 0.0
        if usage is not None:
            price = price_for(model or self.reranker.model, self.config.prices)
            cost = run.add_usage(usage, price, self.config.price_discount)
        run.attempts.append(
            {"n": len(run.attempts) + 1, "outcome": outcome.value, "seconds": seconds, **detail}
        )
        return cost

    def count_attempt(
        self,
        outcome: AttemptOutcome,
        usage: TokenUsage | None,
        cost: float | None,
        model: str | None = None,
    ) -> None:
        """:meth:`record_attempt`'s part in the metrics: the attempt, its tokens and ``cost``
        (None: the model has no price, counted as unpriced), labelled with ``model`` (None:
        this pipeline's), as :meth:`add_attempt` priced it."""
        assert self.reranker is not None
        label = model or self.reranker.model
        if usage is not None:
            self.recorder.rerank_usage(label, usage_by_type(usage), cost)
            if cost is None:
                self.recorder.rerank_unpriced(label)
        self.recorder.rerank_attempt(label, outcome.value)

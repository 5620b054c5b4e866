"""What the rerank stage did (:class:`RerankRun`), its usage by token type, and the run as
JSON (:func:`dump_run`, :func:`load_run`: a kept answer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from worker.contract import Usage
from worker.core.cost import add_costs, cost_usd
from worker.core.types import RerankReply, TokenUsage
from worker.errors import AttemptOutcome, DeadlineExceeded, RerankAttemptError, SiftError
from worker.prices import Price


@dataclass(slots=True)
class RerankRun:
    """What the rerank stage did, whichever lane ran it: the attempts, the usage and its cost,
    and either the model's reply or the failure that ended it."""

    attempts: list[dict[str, Any]] = field(default_factory=list)
    usage: TokenUsage = field(default_factory=TokenUsage)
    cost_usd: float | None = 0.0  # None once a call had no price: the cost is unknown
    returned: Sequence[object] | None = None
    reply: RerankReply | None = None
    failure: SiftError | None = None
    seconds: float = 0.0
    # the back-off slept since the last attempt (a 429's retry-after in it), for the next
    # attempt's entry to tell apart from its own seconds
    backed_off: float = 0.0
    # whether the last attempt's answer held every process's calls for that back-off: a
    # 429's pause, or the breaker a 5xx opened for its retry-after (a wait for the budget)
    held: bool = False
    # whether an attempt went as the rate budget's breaker probe and failed: the next probe
    # is another search's, if one is waiting (RateBudget.reserve)
    probe_failed: bool = False

    def add_usage(self, usage: TokenUsage, price: Price | None, discount: float) -> float | None:
        """Add one call's ``usage`` and its cost; answers that call's cost (None: unpriced)."""
        self.usage = TokenUsage(
            self.usage.input_tokens + usage.input_tokens,
            self.usage.output_tokens + usage.output_tokens,
            self.usage.cache_read_input_tokens + usage.cache_read_input_tokens,
            self.usage.cache_creation_input_tokens + usage.cache_creation_input_tokens,
        )
        cost = cost_usd(usage, price, discount)
        self.cost_usd = add_costs(self.cost_usd, cost)
        return cost

    def billed_with(self, earlier: RerankRun) -> RerankRun:
        """This run after ``earlier``'s calls: both's attempts, usage and cost (``earlier``
        billed, its answer not applied), this run's reply or failure and seconds.

        >>> one = RerankRun(attempts=[{"outcome": "ok"}], usage=TokenUsage(5, 1, 0, 0),
        ...                 cost_usd=0.5)
        >>> both = one.billed_with(one)
        >>> (both.job_usage().requests, both.usage.input_tokens, both.cost_usd)
        (2, 10, 1.0)
        """
        mine, theirs = self.usage, earlier.usage
        return replace(
            self,
            attempts=[*earlier.attempts, *self.attempts],
            usage=TokenUsage(
                mine.input_tokens + theirs.input_tokens,
                mine.output_tokens + theirs.output_tokens,
                mine.cache_read_input_tokens + theirs.cache_read_input_tokens,
                mine.cache_creation_input_tokens + theirs.cache_creation_input_tokens,
            ),
            cost_usd=add_costs(earlier.cost_usd, self.cost_usd),
        )

    def job_usage(self) -> Usage:
        """The run's usage as a job record shows it: the calls sent (an attempt the rate
        budget refused, or one never sent, is no request) and their tokens and cost.

        >>> run = RerankRun(attempts=[{"outcome": "ok"}, {"outcome": "budget_exhausted"}],
        ...                 usage=TokenUsage(5, 1, 0, 0), cost_usd=0.5)
        >>> (run.job_usage().requests, run.job_usage().input_tokens)
        (1, 5)
        """
        unsent = AttemptOutcome.BUDGET_EXHAUSTED.value
        return Usage(
            requests=sum(
                1
                for attempt in self.attempts
                if attempt["outcome"] != unsent and attempt.get("sent", True)
            ),
            input_tokens=self.usage.input_tokens,
            output_tokens=self.usage.output_tokens,
            cache_read_input_tokens=self.usage.cache_read_input_tokens,
            cache_creation_input_tokens=self.usage.cache_creation_input_tokens,
            cost_usd=self.cost_usd,
        )


def usage_by_type(usage: TokenUsage) -> dict[str, int]:
    """A call's usage keyed by the metrics' token types (disjoint: they sum to the bill).

    >>> usage_by_type(TokenUsage(10, 2, 30, 4))
    {'input': 10, 'output': 2, 'cache_read': 30, 'cache_creation': 4}
    """
    return {
        "input": usage.input_tokens,
        "output": usage.output_tokens,
        "cache_read": usage.cache_read_input_tokens,
        "cache_creation": usage.cache_creation_input_tokens,
    }


def dump_run(run: RerankRun) -> dict[str, Any]:
    """What :meth:`SearchPipeline.finish` needs of a standard-lane rerank, as small JSON-able
    data (no prompt, no candidate): the attempts, the usage and cost, the positions the
    model returned, and its reply or the failure that ended it. :func:`load_run` inverts it.

    >>> run = RerankRun(attempts=[{"n": 1, "outcome": "ok", "seconds": 0.5}],
    ...                 usage=TokenUsage(90, 7, 0, 0), cost_usd=0.0001, returned=[2, 1],
    ...                 reply=RerankReply([2, 1], TokenUsage(90, 7, 0, 0), "m"), seconds=0.5)
    >>> load_run(dump_run(run)) == run
    True
    >>> failed = RerankRun(failure=RerankAttemptError(AttemptOutcome.TIMEOUT, "no answer"))
    >>> back = load_run(dump_run(failed)).failure
    >>> (type(back).__name__, back.message)
    ('RerankAttemptError', 'timeout: no answer')
    """
    reply, failure = run.reply, run.failure
    data: dict[str, Any] = {
        "attempts": run.attempts,
        "usage": run.usage.counts(),
        "cost": run.cost_usd,
        "returned": list(run.returned) if run.returned is not None else None,
        "seconds": run.seconds,
    }
    if reply is not None:
        data["reply"] = {
            "positions": list(reply.positions),
            "usage": reply.usage.counts(),
            "model": reply.model,
        }
    if isinstance(failure, RerankAttemptError):
        prefix = f"{failure.outcome.value}: "
        data["failure"] = [failure.outcome.value, failure.message.removeprefix(prefix)]
    elif failure is not None:  # the deadline ran out
        data["failure"] = [None, failure.message]
    return data


def load_run(data: Mapping[str, Any]) -> RerankRun:
    """The inverse of :func:`dump_run`."""
    reply = data.get("reply")
    failure: SiftError | None = None
    if (kept := data.get("failure")) is not None:
        outcome, message = kept
        failure = (
            DeadlineExceeded(message)
            if outcome is None
            else RerankAttemptError(AttemptOutcome(outcome), message)
        )
    returned = data["returned"]
    return RerankRun(
        attempts=[dict(attempt) for attempt in data["attempts"]],
        usage=TokenUsage(*data["usage"]),
        cost_usd=None if data["cost"] is None else float(data["cost"]),
        returned=list(returned) if returned is not None else None,
        reply=(
            RerankReply(list(reply["positions"]), TokenUsage(*reply["usage"]), reply["model"])
            if reply is not None
            else None
        ),
        failure=failure,
        seconds=float(data["seconds"]),
    )

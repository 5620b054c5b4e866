"""A search's result: of what the model answered (:func:`rerank_result`: its positions
normalised, or the failure policy), or of candidates as they stand (:func:`build_result`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from worker.constants import POLICY_ID
from worker.contract import RerankInfo, SearchResult, SearchSpec, Usage
from worker.core.pipeline._config import FailurePolicy
from worker.core.pipeline._hits import _hit, stage_seconds
from worker.core.pipeline._prepared import Prepared
from worker.core.pipeline._run import RerankRun
from worker.core.ports import Recorder
from worker.core.ranks import normalise_positions
from worker.core.types import Candidate
from worker.errors import RerankAttemptError, RerankFailed


def rerank_result(
    prepared: Prepared,
    run: RerankRun,
    figures: list[Callable[[], None]],
    *,
    model: str,
    recorder: Recorder,
    failure_policy: FailurePolicy,
) -> SearchResult:
    """The result of ``run``; the figures it makes (the model answer's duration and
    outcome) are appended to ``figures``, for the caller to record."""
    spec, candidates, trace = prepared.spec, prepared.candidates, prepared.trace
    # the policy of the prompt answered, in the trace too: an economy item's may be an
    # older release's (:attr:`Prepared.policy`)
    policy = trace["policy"] = prepared.policy
    gone = prepared.gone  # deleted since their retrieval: in no hit
    live = [c for c in candidates if c.document.id not in gone] if gone else candidates
    usage = run.job_usage()
    trace.update(attempts=run.attempts, rerank_seconds=run.seconds)
    if spec.include_trace:  # the trace's parts built per candidate or model: only if shown
        trace["usage"] = usage.model_dump()
    trace["returned_positions"] = list(run.returned) if run.returned is not None else None
    reply = run.reply
    if reply is None:
        failure = run.failure
        assert failure is not None
        reason = answer_outcome(run)
        figures.append(partial(recorder.rerank_done, model, reason, run.seconds))
        failed = RerankFailed(reason, failure.message, usage)
        return _failure_policy(
            failed, failure, live, spec, trace, figures, recorder, failure_policy, policy
        )

    figures.append(partial(recorder.rerank_done, model, "ok", run.seconds))
    out = prepared.filtered_out
    dropped = {
        i: "filtered_out" if c.document.id in out else "deleted"
        for i, c in enumerate(candidates, 1)
        if c.document.id in gone
    }
    normalised = normalise_positions(reply.positions, len(candidates), spec.limit, dropped)
    trace["kept_positions"] = list(normalised.kept)
    trace["dropped_positions"] = [
        {"value": d.value, "reason": d.reason} for d in normalised.dropped
    ]
    if not normalised.kept:
        trace["fallback_reason"] = "no_valid_ranks"
        figures.append(partial(recorder.rerank_outcome, policy, "fallback_no_valid_ranks"))
        info = RerankInfo(applied=False, policy=policy, fallback_reason="no_valid_ranks")
        return build_result(live[: spec.limit], info, usage, spec, trace)

    figures.append(partial(recorder.rerank_outcome, policy, "applied"))
    trace["fallback_reason"] = None
    chosen = [candidates[position - 1] for position in normalised.kept]
    info = RerankInfo(applied=True, policy=policy, fallback_reason=None)
    return build_result(chosen, info, usage, spec, trace)


def answer_outcome(run: RerankRun) -> str:
    """What became of ``run``'s model call, as ``sift_rerank_duration_seconds`` labels it:
    ``ok`` (answered), else its last failure's class (``deadline``: the search's deadline
    ran out first).

    >>> from worker.errors import AttemptOutcome
    >>> answer_outcome(RerankRun(failure=RerankAttemptError(AttemptOutcome.TIMEOUT, "late")))
    'timeout'
    """
    if run.reply is not None:
        return "ok"
    failure = run.failure
    return failure.outcome.value if isinstance(failure, RerankAttemptError) else "deadline"


#: The failure class of a rerank asked of a worker with no generation model.
NO_MODEL = "no_generation_model"


def no_model_result(
    spec: SearchSpec,
    candidates: Sequence[Candidate],
    trace: dict[str, Any],
    figures: list[Callable[[], None]],
    *,
    recorder: Recorder,
    failure_policy: FailurePolicy,
    billed: Usage | None = None,
) -> SearchResult:
    """A rerank asked (``rerank: true``) of a worker with no generation model: the failure
    policy, as for a rerank that failed for good, with the class :data:`NO_MODEL`. The
    gateway that accepted it has a model (it refuses the request without one), so the
    request was valid: the deployment's workers and gateways disagree, which is no fault of
    the client (it was ``invalid_request``). Raises RerankFailed under ``fail_closed``; no
    model is called here, so nothing is billed but ``billed``, what earlier calls of the
    search were (an economy item's earlier rounds), shown as the result's usage or the
    error's."""
    message = (
        "this worker has no generation model (SIFT_GENERATION_MODEL) to rerank with, "
        "though the gateway that accepted the request has one: the deployment's gateways "
        "and workers must be given the same SIFT_GENERATION_MODEL"
    )
    failed = RerankFailed(NO_MODEL, message, billed or Usage())
    return _failure_policy(
        failed, None, candidates, spec, trace, figures, recorder, failure_policy, POLICY_ID
    )


def _failure_policy(
    failed: RerankFailed,
    cause: BaseException | None,
    live: Sequence[Candidate],
    spec: SearchSpec,
    trace: dict[str, Any],
    figures: list[Callable[[], None]],
    recorder: Recorder,
    failure_policy: FailurePolicy,
    policy: str,
) -> SearchResult:
    """A rerank failed for good (its class ``failed.reason``): under ``fail_closed`` raise
    ``failed`` (the trace names the failure, no fallback reason; shown as the failed job's
    ``error.trace`` when asked for; ``cause``, the last attempt's error, if any); under
    ``fail_open`` the ``live`` candidates in their fused order, with ``fallback_reason``
    ``error:<class>``, its usage ``failed``'s."""
    reason = failed.reason
    if failure_policy == "fail_closed":
        trace.update(fallback_reason=None, failure=reason)
        figures.append(partial(recorder.rerank_outcome, policy, "failed"))
        failed.job_trace = trace if spec.include_trace else None
        failed.job_seconds = stage_seconds(trace)
        raise failed from cause
    trace["fallback_reason"] = f"error:{reason}"
    figures.append(partial(recorder.rerank_outcome, policy, "fallback_error"))
    info = RerankInfo(applied=False, policy=policy, fallback_reason=f"error:{reason}")
    return build_result(live[: spec.limit], info, failed.job_usage or Usage(), spec, trace)


def build_result(
    chosen: Sequence[Candidate],
    info: RerankInfo,
    usage: Usage,
    spec: SearchSpec,
    trace: dict[str, Any],
) -> SearchResult:
    """The result of the ``chosen`` candidates, in their order, with the trace if it is shown."""
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

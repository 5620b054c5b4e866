"""The error a job record shows for a failure (``error_info``), a search's and a batch
item's alike: its ``usage`` is what the failed search's model calls were billed, ``null``
when it made none (docs/queue.md)."""

from __future__ import annotations

from worker.contract import Usage
from worker.errors import RerankFailed
from worker.queue.base import error_info


def test_a_rerank_that_sent_no_call_shows_no_usage() -> None:
    """Its only attempt ``budget_exhausted`` (or no model on the worker): nothing was sent,
    so nothing was billed: its usage is ``null``, not 0 requests at $0.0."""
    failed = RerankFailed("budget_exhausted", "the rate budget frees it too late", Usage())
    assert error_info(failed).usage is None


def test_a_rerank_that_failed_after_billed_calls_shows_them() -> None:
    billed = Usage(requests=2, input_tokens=2600, output_tokens=3, cost_usd=0.002615)
    failed = RerankFailed("malformed", "answer is not JSON", billed)
    assert error_info(failed).usage == billed

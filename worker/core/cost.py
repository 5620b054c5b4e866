"""The cost estimate of a model call, from the usage the provider reported and a price table."""

from __future__ import annotations

import re
from collections.abc import Mapping

from worker.core.types import TokenUsage
from worker.prices import Price

# a dated snapshot of a model: its alias and ``-YYYYMMDD`` (claude-haiku-4-5-20251001)
_SNAPSHOT = re.compile(r"(?P<alias>.+)-\d{8}")


def price_for(model: str, prices: Mapping[str, Price]) -> Price | None:
    """The price of ``model``: its exact entry, else, for a dated snapshot id, its alias's.

    Another model whose id merely starts with an entry is not that entry's: claude-opus-5-5
    is not claude-opus-5 (it costs $4/$20 where Opus 5 costs $5/$25), nor claude-fable-5-2
    claude-fable-5. It has no price, which the worker says, rather than a wrong one.

    >>> haiku = Price(input=1, output=5, cache_read=0.1, cache_creation=1.25)
    >>> price_for("claude-haiku-4-5-20251001", {"claude-haiku-4-5": haiku}).output
    5.0
    >>> price_for("claude-opus-5-5", {"claude-opus-5": haiku}) is None
    True
    """
    if model in prices:
        return prices[model]
    snapshot = _SNAPSHOT.fullmatch(model)
    return prices.get(snapshot["alias"]) if snapshot else None


def cost_usd(usage: TokenUsage, price: Price | None, discount: float = 1.0) -> float | None:
    """Dollars for one response: each disjoint token type at its own price per million.

    ``None`` when the model has no price: an unknown cost, which ``0.0`` would misreport as
    free (the job shows ``null``, and ``sift_rerank_unpriced_calls_total`` counts the call).
    """
    if price is None:
        return None
    total = (
        usage.input_tokens * price.input
        + usage.output_tokens * price.output
        + usage.cache_read_input_tokens * price.cache_read
        + usage.cache_creation_input_tokens * price.cache_creation
    )
    return total * discount / 1_000_000


def add_costs(a: float | None, b: float | None) -> float | None:
    """The sum of two costs, unknown (``None``) if either is.

    >>> add_costs(0.5, 0.25), add_costs(0.5, None)
    (0.75, None)
    """
    return None if a is None or b is None else a + b

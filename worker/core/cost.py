"""The cost estimate of a model call, from the usage the provider reported and a price table."""

from __future__ import annotations

from collections.abc import Mapping

from worker.core.types import TokenUsage
from worker.settings import Price


def price_for(model: str, prices: Mapping[str, Price]) -> Price | None:
    """The price of ``model``: an exact entry, else the longest entry it starts with.

    >>> price_for("claude-haiku-4-5-20251001", {"claude-haiku-4-5": Price(
    ...     input=1, output=5, cache_read=0.1, cache_write=1.25)}).output
    5.0
    """
    if model in prices:
        return prices[model]
    matches = [name for name in prices if model.startswith(name)]
    return prices[max(matches, key=len)] if matches else None


def cost_usd(usage: TokenUsage, price: Price | None, discount: float = 1.0) -> float:
    """Dollars for one response: each disjoint token type at its own price per million."""
    if price is None:
        return 0.0
    total = (
        usage.input_tokens * price.input
        + usage.output_tokens * price.output
        + usage.cache_read_input_tokens * price.cache_read
        + usage.cache_creation_input_tokens * price.cache_write
    )
    return total * discount / 1_000_000

"""``SIFT_PRICES``: a model's price per million tokens, by the provider's usage fields."""

from __future__ import annotations

import json

import pytest

from worker.core.cost import cost_usd, price_for
from worker.core.types import TokenUsage
from worker.errors import ConfigError
from worker.settings import Price, load_settings

PRICE = {"input": 1, "output": 5, "cache_read": 0.1}
USAGE = TokenUsage(
    input_tokens=1_000_000,
    output_tokens=0,
    cache_read_input_tokens=0,
    cache_creation_input_tokens=1_000_000,
)


def _prices(monkeypatch: pytest.MonkeyPatch, price: dict[str, float]) -> None:
    monkeypatch.setenv("SIFT_PRICES", json.dumps({"claude-haiku-4-5": price}))


def test_the_cache_creation_price_is_named_as_the_provider_names_its_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The usage field is ``cache_creation_input_tokens``: its price is ``cache_creation``."""
    _prices(monkeypatch, {**PRICE, "cache_creation": 1.25})
    price = load_settings().prices["claude-haiku-4-5"]
    assert price.cache_creation == 1.25
    assert cost_usd(USAGE, price) == pytest.approx(1 + 1.25)


def test_the_old_name_cache_write_is_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    _prices(monkeypatch, {**PRICE, "cache_write": 1.25})
    assert load_settings().prices["claude-haiku-4-5"].cache_creation == 1.25


def test_both_names_at_once_is_an_error_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    _prices(monkeypatch, {**PRICE, "cache_creation": 1.25, "cache_write": 2.5})
    with pytest.raises(ConfigError, match=r"SIFT_PRICES.*cache_creation.*cache_write"):
        load_settings()


HAIKU = Price(input=1, output=5, cache_read=0.1, cache_creation=1.25)


@pytest.mark.parametrize(
    ("model", "entries", "expected"),
    [
        ("claude-haiku-4-5", ["claude-haiku-4-5"], "claude-haiku-4-5"),
        ("claude-haiku-4-5-20251001", ["claude-haiku-4-5"], "claude-haiku-4-5"),
        ("claude-opus-4-5-20251101", ["claude-opus-4-5", "claude-opus-4"], "claude-opus-4-5"),
        # another model whose id starts with an entry's: Claude 5 ids have no date suffix,
        # and claude-opus-5-5 ($4/$20) is not claude-opus-5 ($5/$25), nor Fable 5.2 Fable 5
        ("claude-opus-5-5", ["claude-opus-5"], None),
        ("claude-fable-5-2", ["claude-fable-5"], None),
        ("claude-sonnet-4-6", ["claude-sonnet-4"], None),
    ],
)
def test_a_price_is_the_models_own_or_its_dated_snapshots_alias(
    model: str, entries: list[str], expected: str | None
) -> None:
    prices = {name: HAIKU.model_copy(update={"input": float(i)}) for i, name in enumerate(entries)}
    found = price_for(model, prices)
    assert found == (prices[expected] if expected else None)

"""``SIFT_PRICES``: a model's price per million tokens, by the provider's usage fields."""

from __future__ import annotations

import json

import pytest

from worker.core.cost import cost_usd
from worker.core.types import TokenUsage
from worker.errors import ConfigError
from worker.settings import load_settings

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

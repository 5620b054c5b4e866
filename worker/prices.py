"""Model prices: US dollars per million tokens by token type, and the built-in table.

The settings read ``SIFT_PRICES`` into these types; the core prices a call with them without
importing the settings (and pydantic-settings and standardwebhooks with them).
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator


class Price(BaseModel):
    """US dollars per million tokens, by token type: the provider's usage fields
    (``cache_creation`` prices ``cache_creation_input_tokens``). ``cache_write``, Sift's
    older name for ``cache_creation``, is still read; both at once is an error.

    >>> Price.model_validate({"input": 1, "output": 5, "cache_read": 0.1, "cache_write": 1.25})
    Price(input=1.0, output=5.0, cache_read=0.1, cache_creation=1.25)
    """

    # an infinite price (1e400 is one) made every request's cost inf, and its metric too
    model_config = ConfigDict(allow_inf_nan=False)

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cache_read: float = Field(ge=0)
    cache_creation: float = Field(
        ge=0, validation_alias=AliasChoices("cache_creation", "cache_write")
    )

    @model_validator(mode="before")
    @classmethod
    def _one_name_for_cache_creation(cls, data: Any) -> Any:
        if isinstance(data, dict) and "cache_creation" in data and "cache_write" in data:
            raise ValueError(
                "cache_creation: given twice, also as cache_write (its old name); give one"
            )
        return data


DEFAULT_PRICES: dict[str, Price] = {
    # Published list prices per million tokens; override with SIFT_PRICES.
    "claude-haiku-4-5": Price(input=1.0, output=5.0, cache_read=0.10, cache_creation=1.25),
    "claude-sonnet-4-6": Price(input=3.0, output=15.0, cache_read=0.30, cache_creation=3.75),
    "claude-opus-4-6": Price(input=5.0, output=25.0, cache_read=0.50, cache_creation=6.25),
}

"""The metadata and filter keys the gateway takes are exactly those both backends filter on:
``worker.contract.METADATA_KEY_PATTERN`` against each backend's own ``_FILTER_KEY``, so the
check at the gateway cannot drift from the one a job would fail later."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import TypeAdapter, ValidationError

from worker.adapters.elasticsearch import _bodies
from worker.adapters.embedded import _schema
from worker.contract import INT64_MAX, INT64_MIN, METADATA_KEY_PATTERN, Metadata

METADATA = TypeAdapter(Metadata)


def test_the_key_pattern_is_each_backends() -> None:
    for backend in (_schema, _bodies):
        assert backend._FILTER_KEY.pattern == METADATA_KEY_PATTERN, backend.__name__


@pytest.mark.parametrize(
    "value", ["", "a\x00b", "\U0001f600", True, False, 0, INT64_MIN, INT64_MAX, 1.5, -0.0, 5e-324]
)
def test_what_every_backend_holds_is_taken_as_it_is(value: object) -> None:
    taken = METADATA.validate_python({"k": value})["k"]
    assert taken == value and type(taken) is type(value)


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), INT64_MAX + 1, INT64_MIN - 1, "\ud800", None, [1], {"a": 1}],
)
def test_what_a_backend_cannot_hold_is_refused(value: object) -> None:
    with pytest.raises(ValidationError):
        METADATA.validate_python({"k": value})


def test_the_openapi_document_refuses_what_the_gateway_refuses() -> None:
    """A client generated from ``/openapi.json`` (or a validator run on its bodies) learns
    the key rule there: ``patternProperties`` alone lets every other key through. (An integer
    past 64 bits it cannot tell from a number, which JSON Schema lets integers be.)"""
    schema = TypeAdapter(Metadata).json_schema()
    for refused in ({"a b": 1}, {"": 1}, {"k" * 129: 1}, {"k": None}, {"k": [1]}):
        assert not jsonschema.Draft202012Validator(schema).is_valid(refused), refused
    for taken in ({"a.b:c-d_e": INT64_MAX}, {"k": INT64_MIN}, {"k": 1.5}, {"k": "x"}, {}):
        assert jsonschema.Draft202012Validator(schema).is_valid(taken), taken

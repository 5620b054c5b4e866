"""A number in a query parameter is read as strictly as one in a body: written plainly or a
``422`` naming the parameter, on every route that takes one, through the real gateways.

Pydantic converts a query string laxly (a JSON body's integers are strict,
:mod:`worker.contract`): ``page_size=+5`` (a ``+`` in a query is a space), ``%205``,
``%2B5``, ``1_0`` (read as 10) and ``5.0`` were each taken as a page size, and ``wait=.5``
or ``0_0`` as a wait. A wait is a number as JSON writes one, an exponent included
(``1e-9``). The routes are read from the gateway's own OpenAPI document, so a route or a
number parameter added later is checked too. The waits here are all read as 0 (or a
nanosecond) by a lax parser, so a wait taken answers at once instead of waiting.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ACME, Stack
from tests.security.test_limits import names_the_field

INDEX = "query-forms"
FORMS = {
    "page_size": {
        "a plus (a space once decoded)": "+5",
        "a leading space": "%205",
        "a trailing space": "5%20",
        "a tab": "%095",
        "a line break": "5%0A",
        "a sign": "%2B5",
        "an underscore": "1_0",
        "a point": "5.0",
        "an exponent": "5e0",
    },
    "wait": {
        "a plus (a space once decoded)": "+0",
        "a leading space": "%200",
        "a line break": "0%0A",
        "a sign": "%2B0",
        "an underscore": "0_0",
        "an exponent of no digit": "0e",
        "an exponent with a point": "0e0.5",
        "no digit before the point": ".0",
        "no digit after the point": "0.",
    },
}
# a wait in any form a JSON number is written in (the OpenAPI document says it is a number):
# `0e0` and `1e-9` were refused, though Python and JavaScript write small floats so
TAKEN = {
    "page_size": ["5", "1000", "0005"],
    "wait": ["0", "0.0", "00.000", "0e0", "0E%2B3", "0.0e-1", "1e-9"],
}
BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/v1/searches"): {"index": INDEX, "query": "green tea"},
    ("POST", "/v1/indexes/{index}/documents"): {"documents": [{"id": "d1", "text": "tea"}]},
    ("POST", "/v1/indexes/{index}/documents/delete"): {"ids": ["d1"]},
}
# each path parameter's value; a batch's id is a made-up one (its results a 404 once read)
PATH_VALUES = {"{index}": INDEX, "{id}": "d1"}
BATCH_RESULTS = "/v1/batches/{id}/results"


def number_parameters(stack: Stack) -> list[tuple[str, str, str]]:
    """Each (method, path, parameter) of the gateway whose query parameter is a number."""
    spec = stack.live.get("/openapi.json").json()
    found = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "query" and parameter["schema"].get("type") in (
                    "integer",
                    "number",
                ):
                    found.append((method.upper(), path, parameter["name"]))
    return found


def send(stack: Stack, method: str, path: str, name: str, value: str) -> httpx.Response:
    """``value`` written into the URL as it is (httpx would escape a ``+``). A read goes to
    the live gateway (an index read needs its worker); a write to the idle one (no worker:
    a job a lax parse let through stays queued, its index untouched)."""
    url = path.replace("{id}", "bat_" + "0" * 32) if path == BATCH_RESULTS else path
    for placeholder, filled in PATH_VALUES.items():
        url = url.replace(placeholder, filled)
    client = stack.live if method == "GET" else stack.idle
    body = BODIES.get((method, path))
    return client.request(method, f"{url}?{name}={value}", json=body, headers=ACME)


def test_the_number_parameters_are_page_size_and_wait(stack: Stack) -> None:
    """The cases below cover each: a new number parameter needs its forms here."""
    assert {name for _, _, name in number_parameters(stack)} == set(FORMS)
    assert len(number_parameters(stack)) == 11  # 6 lists' page_size, 5 jobs' wait


@pytest.mark.parametrize(
    ("name", "value"),
    [(name, value) for name, forms in FORMS.items() for value in forms.values()],
    ids=[f"{name}: {why}" for name, forms in FORMS.items() for why in forms],
)
def test_a_number_not_written_plainly_is_422_naming_it_on_every_route(
    stack: Stack, name: str, value: str
) -> None:
    for method, path, parameter in number_parameters(stack):
        if parameter == name:
            response = send(stack, method, path, name, value)
            error = names_the_field(response, 422, name)
            assert "written in the digits 0-9" in error["message"], (method, path, error)


@pytest.mark.parametrize(
    ("name", "value"), [(name, value) for name, values in TAKEN.items() for value in values]
)
def test_a_number_written_plainly_is_still_taken(stack: Stack, name: str, value: str) -> None:
    for method, path, parameter in number_parameters(stack):
        if parameter == name:
            response = send(stack, method, path, name, value)
            assert response.status_code != 422, (method, path, response.text)


def test_the_wait_is_the_number_the_openapi_document_says(stack: Stack) -> None:
    """Served as a number from 0 to 30: a number past 30 in an exponent's form is refused
    for its size, as 31 is, not for its form."""
    for method, path, parameter in number_parameters(stack):
        if parameter == "wait":
            operation = stack.live.get("/openapi.json").json()["paths"][path][method.lower()]
            (schema,) = [p["schema"] for p in operation["parameters"] if p["name"] == "wait"]
            assert (schema["type"], schema["minimum"], schema["maximum"]) == ("number", 0, 30)
            for over in ("31", "3.1e1", "1e309"):
                error = names_the_field(send(stack, method, path, "wait", over), 422, "wait")
                assert "less than or equal to 30" in error["message"], (method, path, error)

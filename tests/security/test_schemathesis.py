"""schemathesis against the live gateway's ``/openapi.json``: no operation answers a 5xx.

The gateway is the real one (uvicorn, Redis, a worker behind it), called with a valid key,
so generated bodies reach validation, the job store and the queue. ``wait`` is capped at a
fraction of a second so a generated ``wait=30`` does not hold the run; everything else is
as generated. A longer run: ``python benchmarks/bench_schemathesis.py``.
"""

from __future__ import annotations

from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from api_gateway.app import create_app
from tests.e2e.conftest import ACME, Stack
from worker.settings import Settings

MAX_EXAMPLES = 30  # per operation, in CI
MAX_WAIT = 0.2


def openapi_document() -> dict[str, Any]:
    """The gateway's OpenAPI document, built in this process (no I/O: the lifespan does not
    run), so the operations are known at collection. ``test_the_document_is_the_live_one``
    checks that the live gateway serves exactly this document."""
    document: dict[str, Any] = create_app(Settings()).openapi()
    return document


# (schemathesis.pytest.from_fixture would load /openapi.json from the live gateway directly,
# but its lazy loader fails under pytest 9: "'Function' object has no attribute '_nodeid'")
schema = schemathesis.openapi.from_dict(openapi_document())


def test_the_document_is_the_live_one(stack: Stack) -> None:
    live = httpx.get(stack.live_url + "/openapi.json", timeout=10)
    assert live.status_code == 200
    assert live.json() == openapi_document()


def call_and_check(case: Any, base_url: str) -> Any:
    """Send one generated case with a valid key and fail on any 5xx."""
    if case.query and isinstance(case.query.get("wait"), int | float):
        case.query["wait"] = min(case.query["wait"], MAX_WAIT)
    response = case.call(base_url=base_url, headers=ACME, timeout=30)
    case.validate_response(response, checks=[not_a_server_error])
    return response


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_operation_answers_a_server_error(case: Any, stack: Stack) -> None:
    call_and_check(case, stack.live_url)

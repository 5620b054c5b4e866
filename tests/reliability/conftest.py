"""Fixtures of the reliability suite: the fake Messages API and a webhook receiver."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import Receiver, webhook_receiver


@pytest.fixture(scope="module")
def model() -> Iterator[FakeAnthropic]:
    """The fake model, answering well after 50 ms: batches take a few seconds, not less."""
    with FakeAnthropic(delay=0.05) as fake:
        yield fake


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    yield from webhook_receiver()

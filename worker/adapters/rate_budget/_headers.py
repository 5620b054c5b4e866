"""What the provider's response headers say: its limits, and what its buckets held when it
answered (pure functions)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime

from worker import clock
from worker.core.budget import answer_date
from worker.settings import RateLimit

HEADER_BUCKETS = {"rpm": "requests", "itpm": "input-tokens", "otpm": "output-tokens"}
HEADER_LIMITS = {name: f"anthropic-ratelimit-{b}-limit" for name, b in HEADER_BUCKETS.items()}


NOT_STATED = -1.0  # a bucket the response says nothing about


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def remaining_from_headers(
    headers: Mapping[str, str], now: float | None = None
) -> tuple[float, float, float]:
    """What the provider's request, input-token and output-token buckets held when it answered
    (:data:`NOT_STATED` for one the headers leave out): ``-remaining``, or else what
    ``-reset`` (RFC 3339, when the bucket is full again) and ``-limit`` imply at the refill
    rate of a minute's worth a minute. A reset is on the provider's clock: it is read
    against ``now``, by default the answer's ``Date`` (on that clock too), else the shared
    clock; against this host's own, a host 5 minutes behind the provider learned every
    bucket empty, one ahead every bucket full.

    >>> remaining_from_headers({"anthropic-ratelimit-requests-remaining": "7"})
    (7.0, -1.0, -1.0)
    >>> remaining_from_headers({"anthropic-ratelimit-requests-limit": "60",
    ...     "anthropic-ratelimit-requests-reset": "2026-01-01T00:00:30Z"},
    ...     now=datetime.fromisoformat("2026-01-01T00:00:00+00:00").timestamp())
    (30.0, -1.0, -1.0)
    """
    if now is None:
        date = answer_date(headers.get("date"))
        now = clock.now() if date is None else date.timestamp()
    found: list[float] = []
    for bucket in HEADER_BUCKETS.values():
        prefix = f"anthropic-ratelimit-{bucket}-"
        remaining = _number(headers.get(prefix + "remaining"))
        if remaining is None:
            remaining = _from_reset(headers.get(prefix + "reset"),
                                    _number(headers.get(prefix + "limit")), now)  # fmt: skip
        found.append(NOT_STATED if remaining is None else remaining)
    return found[0], found[1], found[2]


def _from_reset(reset: str | None, limit: float | None, now: float) -> float | None:
    if reset is None or not limit:
        return None
    try:
        full_at = datetime.fromisoformat(reset.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
    seconds = max(0.0, full_at - now)
    return max(0.0, limit - seconds * limit / 60.0)


def limits_from_headers(headers: Mapping[str, str]) -> RateLimit | None:
    """The limits a provider response states (``anthropic-ratelimit-*-limit``), or None.
    A value that is no number, or not a finite one of at least 1, is left out: the others
    are still learned.

    >>> limits_from_headers({"anthropic-ratelimit-requests-limit": "inf",
    ...                      "anthropic-ratelimit-input-tokens-limit": "400000"})
    RateLimit(rpm=None, itpm=400000, otpm=None, economy=None)
    """
    found: dict[str, int] = {}
    for name, header in HEADER_LIMITS.items():
        value = headers.get(header)
        if value is None:
            continue
        try:
            number = int(float(value))
        except (ValueError, OverflowError):  # OverflowError: "inf", "1e999"
            continue
        if number >= 1:
            found[name] = number
    if not found:
        return None
    return RateLimit(rpm=found.get("rpm"), itpm=found.get("itpm"), otpm=found.get("otpm"))

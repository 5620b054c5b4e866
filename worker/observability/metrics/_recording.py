"""How a metric function records: it never raises, its label values come from closed sets, and
each labelled child is looked up once.

Every helper and the recorder in this package go through these three, so a metric cannot break
a search, and no label grows without bound (DESIGN.md §9: never a job id, a tenant or query
text).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final, ParamSpec

from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

OTHER: Final = (
    "other"  # what an unexpected label value is recorded as, so cardinality stays bounded
)

P = ParamSpec("P")


def never_raises(method: Callable[P, None]) -> Callable[P, None]:
    """Metrics must not break a search: log what went wrong and carry on."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            log.exception("recording a metric failed in %s", method.__qualname__)

    return wrapper


_children: dict[tuple[object, tuple[str, ...]], Any] = {}


def child(metric: Counter | Gauge | Histogram, *values: str) -> Any:
    """``metric.labels(*values)``, kept after its first call. prometheus-client checks the
    values and takes its lock at every ``labels`` (a search makes some fifteen such calls, a
    tenth of the pipeline's own CPU); the child it answers is the same object every time,
    since nothing here removes one, so the kept one is the one it would answer."""
    key = (metric, values)
    kept = _children.get(key)
    if kept is None:
        kept = _children[key] = metric.labels(*values)
    return kept


_warned: set[tuple[str, str]] = set()


def closed(value: str, allowed: Sequence[str], label: str) -> str:
    """``value`` if it belongs to the label's closed set, else ``other`` (warned once)."""
    if value in allowed:
        return value
    if (label, value) not in _warned:
        _warned.add((label, value))
        log.warning("unexpected %s label value %r recorded as %r", label, value, OTHER)
    return OTHER

"""The real worker runtime, its economy lane's metrics written down, and SIGKILLed once there.

Every token count the economy pipeline hands its metrics recorder (``rerank_usage``) is also
appended to ``$CRASH_ONCE_DIR/counted`` (one JSON line: the tokens by type), so that a test
reads what the worker counted even across a SIGKILL (a killed process's counters are gone
with it). The first attempt counted (``rerank_attempt``, after its usage) kills the process
(SIGKILL, no cleanup, no ack): a poll killed just after it counted a result line, and run
again by the next worker, must not count that line a second time. Every attempt counted is
also appended to ``$CRASH_ONCE_DIR/attempts`` (its class, a line), before the kill.

``$CRASH_AFTER_OUTCOME`` (``malformed``, say) kills it after the first attempt of that
outcome only: a poll whose file's lines all succeeded dies as it counts the requests the
file left out (each a ``malformed`` result), their runs saved, before it resubmits them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.reliability.crashing_runtime import die_once
from worker.queue.base import load_runtime
from worker.runtime.inprocess import Runtime
from worker.settings import Settings


class _CountingRecorder:
    """The economy pipeline's recorder, its usage counts also written to a file."""

    def __init__(self, inner: Any, path: Path) -> None:
        self._inner, self._path = inner, path

    def rerank_usage(self, model: str, tokens: dict[str, int], cost: float | None) -> None:
        self._inner.rerank_usage(model, tokens, cost)
        with self._path.open("a") as out:
            out.write(json.dumps(tokens) + "\n")

    def rerank_attempt(self, model: str, outcome: str) -> None:
        self._inner.rerank_attempt(model, outcome)
        with (self._path.parent / "attempts").open("a") as out:
            out.write(outcome + "\n")
        if os.environ.get("CRASH_AFTER_OUTCOME", outcome) == outcome:
            die_once("die-after-count")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def build_runtime(settings: Settings) -> Runtime:
    """The worker's real runtime (as without ``SIFT_RUNTIME_FACTORY``), its economy lane's
    recorder writing its counts down and killing the worker after the first."""
    loaded: Any = load_runtime(settings.model_copy(update={"runtime_factory": None}))
    runtime: Runtime = loaded
    economy: Any = runtime.economy
    counted = Path(os.environ["CRASH_ONCE_DIR"]) / "counted"
    economy.recorder = _CountingRecorder(economy.recorder, counted)
    return runtime

"""The coalescing embedder: concurrent callers share model calls, each gets its own vectors."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from worker.adapters.embedder import CoalescingEmbedder


class SlowEmbedder:
    """Vectors that spell out the text; the first call blocks until released, so the
    callers that come meanwhile must wait and then go together."""

    model_id = "fake"
    dimension = 1

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.fail_on: str | None = None

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        self.entered.set()
        self.release.wait(10)
        if self.fail_on in texts:
            raise RuntimeError(f"cannot embed {self.fail_on}")
        return [[float(t.removeprefix("q"))] for t in texts]


def test_a_lone_caller_runs_at_once_with_only_its_texts() -> None:
    inner = SlowEmbedder()
    inner.release.set()
    embedder = CoalescingEmbedder(inner)
    assert embedder.embed(["q1", "q2"]) == [[1.0], [2.0]]
    assert embedder.embed([]) == []
    assert inner.calls == [["q1", "q2"]]
    assert (embedder.model_id, embedder.dimension) == ("fake", 1)


def test_callers_arriving_during_a_call_share_the_next_one() -> None:
    inner = SlowEmbedder()
    embedder = CoalescingEmbedder(inner)
    with ThreadPoolExecutor(9) as pool:
        first = pool.submit(embedder.embed, ["q0"])
        assert inner.entered.wait(10)
        rest = [pool.submit(embedder.embed, [f"q{i}"]) for i in range(1, 9)]
        while embedder._calls.waiting < 8:  # all eight queued behind the running call
            threading.Event().wait(0.001)
        inner.release.set()
        assert first.result(10) == [[0.0]]
        assert [f.result(10) for f in rest] == [[[float(i)]] for i in range(1, 9)]
    assert inner.calls[0] == ["q0"]
    assert sorted(inner.calls[1]) == [f"q{i}" for i in range(1, 9)]  # one call for all eight
    assert len(inner.calls) == 2


def test_max_texts_splits_calls_but_never_a_caller() -> None:
    inner = SlowEmbedder()
    embedder = CoalescingEmbedder(inner, max_texts=3)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(embedder.embed, ["q0"])
        assert inner.entered.wait(10)
        big = pool.submit(embedder.embed, ["q1", "q2", "q3", "q4"])  # more than max_texts
        while embedder._calls.waiting < 1:
            threading.Event().wait(0.001)
        small = pool.submit(embedder.embed, ["q5"])
        while embedder._calls.waiting < 2:
            threading.Event().wait(0.001)
        inner.release.set()
        assert big.result(10) == [[1.0], [2.0], [3.0], [4.0]]
        assert small.result(10) == [[5.0]]
        assert first.result(10) == [[0.0]]
    assert inner.calls == [["q0"], ["q1", "q2", "q3", "q4"], ["q5"]]


def test_an_error_reaches_every_caller_of_that_call_and_no_other() -> None:
    inner = SlowEmbedder()
    inner.fail_on = "q2"
    embedder = CoalescingEmbedder(inner)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(embedder.embed, ["q0"])
        assert inner.entered.wait(10)
        failing = [pool.submit(embedder.embed, [f"q{i}"]) for i in (1, 2)]
        while embedder._calls.waiting < 2:
            threading.Event().wait(0.001)
        inner.release.set()
        assert first.result(10) == [[0.0]]
        for future in failing:  # q1 shared the call that failed on q2
            with pytest.raises(RuntimeError, match="cannot embed q2"):
                future.result(10)
    inner.fail_on = None
    assert embedder.embed(["q7"]) == [[7.0]]  # the embedder is not stuck after an error

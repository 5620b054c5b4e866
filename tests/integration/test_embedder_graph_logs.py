"""Making the int8-compute graph (once per machine, on its first embedding) logs Sift's own
two lines, not onnxruntime's quantizer.

Before, the quantizer's records went to the root logger: a WARNING advising its
pre-processing script (on the stderr of a command with no logging set up, such as
``sift eval --corpus``) and an INFO for each of 24 tensors it left in fp32, in the worker's
log, the first time a fresh machine embedded anything.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from worker.adapters.embedder import default_model_path
from worker.adapters.int8_graph import int8_compute_model


def test_making_the_int8_graph_logs_only_its_own_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):  # the root logger and its handlers: everything
        made = int8_compute_model(default_model_path(), tmp_path)
    assert made.is_file()
    # the quantizer's records went to the root logger (and onnx's); another library's, such
    # as an HTTP client closing an earlier test's connections as it is collected, are not
    # the graph's
    foreign = [f"{r.name} {r.levelname} {r.getMessage()}" for r in caplog.records
               if r.name == "root" or r.name.startswith("onnx")]  # fmt: skip
    assert foreign == [], foreign[:3]
    ours = [r.getMessage() for r in caplog.records]
    assert any("making the int8-compute embedding graph" in m for m in ours), ours
    assert any("made the int8-compute embedding graph" in m for m in ours), ours
    logging.getLogger().warning("a root record after it")  # the filter is gone: it is kept
    assert caplog.records[-1].getMessage() == "a root record after it"


def test_two_callers_at_once_make_the_graph_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's processes all warm up as they start, so on a fresh machine they all asked
    for the graph at once and each made it (seconds of a core each). Now one makes it and the
    other waits for it under the lock file. Two threads stand for the processes: flock locks
    each open file apart, in one process as in two."""
    start = threading.Barrier(2)
    made: list[Path] = []

    def make() -> None:
        start.wait()
        made.append(int8_compute_model(default_model_path(), tmp_path))

    with caplog.at_level(logging.INFO, logger="worker.adapters.int8_graph"):
        threads = [threading.Thread(target=make) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert len(made) == 2 and made[0] == made[1] and made[0].is_file()
    making = [r for r in caplog.records if r.getMessage().startswith("making the int8")]
    assert len(making) == 1, [r.getMessage() for r in caplog.records]
